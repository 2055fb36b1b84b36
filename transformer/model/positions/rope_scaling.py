"""RoPE's frequencies and their context-extension scalings (the rotations that use them:
transformer/model/positions/rotary.py).

Frequencies. Of the D rotated dimensions of a head, pair i (features i and i + D/2, as
GPT-NeoX and Llama pair them) turns by p·θ_i at position p, θ_i = base^(−2i/D) (Su et al.
2021). `scaling` (with the factor s) changes the θ_i of a trained model, so that it reads
sequences longer than it was trained on; no parameter changes:
  * none: θ_i.
  * linear, position interpolation (Chen et al. 2023): θ_i / s, i.e. positions p / s
    (x-transformers' interpolation_factor; Hugging Face's "linear").
  * ntk, NTK-aware scaling (bloc97 2023; eq. 16 of the YaRN paper): the base rescaled,
    b' = b·s^(D/(D−2)), so the highest frequency is kept and the lowest divided by exactly
    s (x-transformers' base_rescale_factor; Hugging Face's dynamic NTK at its longest length).
  * yarn (Peng et al. 2023), as its authors' code computes it (jquesnelle/yarn,
    LlamaYaRNScaledRotaryEmbedding; Hugging Face's _compute_yarn_parameters is the same):
    with L the length trained on (`original_length`), c(r) = D·ln(L / (2πr)) / (2·ln b)
    is the pair that turns r times over L; lo = max(⌊c(β)⌋, 0), hi = min(⌈c(α)⌉, D − 1),
    and pair i is interpolated by the weight γ_i = clip((i − lo)/(hi − lo), 0, 1):
    θ'_i = (1 − γ_i)·θ_i + γ_i·θ_i/s. Pairs turning more than β times over L keep θ_i, those
    turning fewer than α times are interpolated as by `linear`, and a ramp joins them. The
    paper writes the ramp linear in the rotations r; the code (followed here) is linear in
    i, i.e. in log r, with lo and hi rounded outward. With it, the attention temperature:
    the logits times m² with m = 0.1·ln s + 1 (the paper's √(1/t)), applied as the code
    does, by multiplying the queries and the keys by m (its cos/sin tables). Here m
    multiplies the whole head, rotated dimensions or not, so that the logits are divided by
    t as the paper says also with partial rotation (Hugging Face scales only the rotated
    dimensions).

Roles (core/fields.py): the scaling's fields are execution fields, since they change no
parameter (a trained run is evaluated under them as the same run); `base` is the run's
identity (rotary.py's docstring).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import (AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, check,
                                     check_ranges, execution)
from transformer.core.registry import one_of

ABOVE_1 = Range(1, lo_open=True)


def frequencies(dim: int, base: float) -> jax.Array:
  """θ_i = base^(−2i/dim) of the dim/2 pairs: float32 [dim/2]."""
  return base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def yarn_interpolation(dim: int, base: float, length: int, alpha: float, beta: float
                       ) -> np.ndarray:
  """YaRN's weight γ_i of the interpolated frequency θ_i/s in pair i (module docstring):
  float64 [dim/2], 0 for the pairs turning more than β times over `length`, 1 for those
  turning fewer than α times. Where the clamping to [0, dim − 1] leaves hi ≤ lo, a step
  at lo (the reference code divides by hi − lo, +0.001 only when they are equal)."""
  def pair(rotations):  # the pair that turns `rotations` times over `length` positions
    return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

  lo, hi = max(math.floor(pair(beta)), 0), min(math.ceil(pair(alpha)), dim - 1)
  hi = max(hi, lo + 0.001)
  return np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0.0, 1.0)


def _none(theta, dim, f):
  del dim, f
  return theta


def _linear(theta, dim, f):
  del dim
  return theta / f.factor


def _ntk(theta, dim, f):
  del theta
  return frequencies(dim, f.base * f.factor ** (dim / (dim - 2)))


def _yarn(theta, dim, f):
  weight = jnp.asarray(yarn_interpolation(dim, f.base, f.original_length, f.yarn_alpha,
                                          f.yarn_beta), jnp.float32)
  return theta / f.factor * weight + theta * (1 - weight)


# scaling name -> (θ [D/2], D, Frequencies) -> the scaled θ [D/2] (module docstring).
SCALINGS = {"none": _none, "linear": _linear, "ntk": _ntk, "yarn": _yarn}


@dataclasses.dataclass(frozen=True)
class Frequencies:
  """The rotation's frequencies: `base` (identity) and their scaling (execution fields;
  module docstring)."""

  base: float = 10000.0  # pair i turns by angle p · base^(-2i/D)
  scaling: str = execution("none")  # none | linear | ntk | yarn (SCALINGS)
  factor: float = execution(1.0)  # s: the context is extended s times (1 with scaling none)
  original_length: int = execution(0)  # yarn: L, the length trained on (0: not given)
  yarn_alpha: float = execution(1.0)  # yarn: pairs turning fewer times over L: interpolated
  yarn_beta: float = execution(32.0)  # yarn: pairs turning more times over L: kept

  def __post_init__(self):
    check(self.scaling in SCALINGS, "scaling", self.scaling, one_of(SCALINGS))
    check_ranges(self, base=ABOVE_1, factor=AT_LEAST_1, original_length=AT_LEAST_0,
                 yarn_alpha=POSITIVE)
    check(isinstance(self.yarn_beta, (int, float)) and math.isfinite(self.yarn_beta)
          and self.yarn_beta > self.yarn_alpha, "yarn_beta", self.yarn_beta,
          f"> yarn_alpha ({self.yarn_alpha})")
    check(self.scaling != "none" or self.factor == 1, "factor", self.factor,
          "1 with scaling 'none' (scaling linear, ntk or yarn scales by it)")
    check(self.scaling != "yarn" or self.original_length >= 1, "original_length",
          self.original_length, "≥ 1 with scaling 'yarn': the sequence length the model was "
          "trained on (YaRN's L)")

  @property
  def temperature(self) -> float:
    """m, by which the queries and the keys are multiplied (YaRN's; 1 otherwise)."""
    return 0.1 * math.log(self.factor) + 1.0 if self.scaling == "yarn" else 1.0

  def check_dim(self, dim: int) -> None:
    """A ConfigError if the scaling is not defined for `dim` rotated dimensions."""
    if self.scaling == "ntk" and dim <= 2:
      raise ConfigError(f"rotary scaling 'ntk' rescales the base by s^(D/(D−2)): it needs "
                        f"more than one rotated pair, and D = {dim} here")

  def scaled(self, dim: int) -> jax.Array:
    """The frequencies of `dim` rotated dimensions under the scaling: float32 [dim/2]."""
    self.check_dim(dim)
    return SCALINGS[self.scaling](frequencies(dim, self.base), dim, self)
