"""Positions that rotate the queries and keys (the `rotate_queries`/`rotate_keys` seams):
rotary and xPos, with RoPE's context-extension scalings and partial rotation.

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

Partial rotation (`rotated_fraction` f, `partial`): n = ⌊f·d⌋ // 2 pairs of a head of d
dimensions turn, the rest pass unchanged:
  * neox: GPT-NeoX's rotary_pct, x-transformers' rotary_emb_dim, Hugging Face's
    partial_rotary_factor: the first D = 2n dimensions turn among themselves (pairs i and
    i + n) with the whole frequency range over them, θ_i = b^(−2i/2n); dimensions 2n..d pass.
  * p_rope: p-RoPE (Barbero et al. 2024, "Round and Round We Go! What makes Rotary
    Positional Encodings useful?"; Hugging Face's "proportional" RoPE of Gemma): the pairs
    of the whole head (i and i + d/2, D = d) keep their frequencies θ_i = b^(−2i/d) and only
    the n highest turn: the d/2 − n lowest-frequency pairs, which the paper finds act as
    position-free semantic channels, are not rotated. So neox compresses the whole spectrum
    into its first 2n dimensions; p-RoPE keeps the high end of the spectrum and drops the rest.
A scaling acts on the turning pairs' frequencies, over their D.

Roles (core/fields.py): the scaling's fields are execution fields, since they change no
parameter: a trained run is evaluated under them (eval.py --config.model.position_settings.
rotary.scaling=yarn ...) as the same run. `base`, `rotated_fraction` and `partial` are its
identity: the parameters were trained for those rotations. A model trained with a quarter of
its dimensions rotated has put position-free content in the other three quarters, and
rotating them at evaluation is not a way of reading longer sequences (as a scaling is) but
another model, the way `model.position` is.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import (AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, check,
                                     check_ranges, execution)
from transformer.model.positions.base import PositionalEncoding

ABOVE_1 = Range(1, lo_open=True)
PARTIAL = ("neox", "p_rope")  # which pairs turn under partial rotation (module docstring)


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
    check(self.scaling in SCALINGS, "scaling", self.scaling, f"one of {', '.join(SCALINGS)}")
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


def rotate_pairs(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
                 scale: float = 1.0) -> jax.Array:
  """Rotates feature pairs (x_i, x_{i+k}) of x [b, t, h, 2k] by p·inv_freq_i at position p,
  and multiplies them by `scale`.

  Args:
    x: [b, t, h, 2k].
    positions: [b, t].
    inv_freq: [k] float32.
  Returns:
    [b, t, h, 2k] of x's dtype.
  """
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [b, t, 1, k]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if scale != 1.0:  # YaRN's scaled cos/sin tables
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def rotate_half_pairs(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """RoPE (Su et al. 2021): rotates feature pairs (x_i, x_{i+d/2}) by angle p·base^(-2i/d).

  Args:
    x: [b, t, h, d] with d even.
    positions: [b, t].
  Returns:
    [b, t, h, d], so that <rot(q, m), rot(k, n)> depends on m - n only.
  """
  return rotate_pairs(x, positions, frequencies(x.shape[-1], base))


def rotated_pairs(head_dim: int, fraction: float) -> int:
  """n = ⌊fraction·head_dim⌋ // 2, the pairs that turn; a ConfigError if none does."""
  pairs = int(fraction * head_dim) // 2
  if pairs < 1:
    raise ConfigError(f"rotary rotated_fraction={fraction} rotates no pair of the head's "
                      f"{head_dim} dimensions (⌊{fraction}·{head_dim}⌋ // 2 = 0); it must be "
                      f"at least {2 / head_dim:g}")
  return pairs


def rope(x: jax.Array, positions: jax.Array, freq: Frequencies, pairs: int | None = None,
         partial: str = "neox") -> jax.Array:
  """RoPE of x [b, t, h, d] at positions [b, t] under freq's scaling and temperature, with
  `pairs` of the d/2 pairs turning (None: all) as `partial` says (module docstring).
  Scaling none with every pair turning is rotate_half_pairs, bit for bit."""
  d = x.shape[-1]
  pairs = d // 2 if pairs is None else pairs
  m = freq.temperature
  if pairs == d // 2 or partial == "p_rope":
    inv_freq = freq.scaled(d)
    if pairs < d // 2:  # p-RoPE: the lowest frequencies turn by 0
      inv_freq = jnp.where(jnp.arange(d // 2) < pairs, inv_freq, 0.0)
    return rotate_pairs(x, positions, inv_freq, m)
  dim = 2 * pairs  # neox: the first 2n dimensions turn among themselves
  rotated = rotate_pairs(x[..., :dim], positions, freq.scaled(dim), m)
  passed = x[..., dim:] if m == 1.0 else (x[..., dim:].astype(jnp.float32) * m).astype(x.dtype)
  return jnp.concatenate([rotated, passed], axis=-1)


class Rotary(PositionalEncoding):
  """Rotary position embedding applied to q and k in every self-attention layer (module
  docstring: frequencies, scalings, partial rotation)."""

  @dataclasses.dataclass(frozen=True)
  class Settings(Frequencies):
    rotated_fraction: float = 1.0  # of each head's dimensions that turn (partial RoPE)
    partial: str = "neox"  # which turn: neox (the first) | p_rope (the highest frequencies)

    def __post_init__(self):
      super().__post_init__()
      check_ranges(self, rotated_fraction=Range(0, 1, lo_open=True))
      check(self.partial in PARTIAL, "partial", self.partial, f"one of {', '.join(PARTIAL)}")

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    settings = settings or self.Settings()
    self._turn(d_model // num_heads, settings, settings.rotated_fraction, settings.partial)

  def _turn(self, head_dim: int, settings: Frequencies, fraction: float, partial: str) -> None:
    """Sets what _rope turns, checked at construction (a ConfigError names the problem)."""
    if head_dim % 2:
      raise ConfigError(f"rotary positions need an even head dimension, got {head_dim}")
    self.settings, self.partial = settings, partial
    self.pairs = rotated_pairs(head_dim, fraction)
    settings.check_dim(head_dim if self.pairs == head_dim // 2 or partial == "p_rope"
                       else 2 * self.pairs)

  def _rope(self, x, positions):
    return rope(x, positions, self.settings, self.pairs, self.partial)

  def rotate_queries(self, x, positions):
    return self._rope(x, positions)

  def rotate_keys(self, x, positions):
    return self._rope(x, positions)


def xpos_scale(positions: jax.Array, dim: int, *, gamma: float, scale_base: float) -> jax.Array:
  """xPos's factor ζ_i^(p / scale_base) of feature pair i at position p, with
  ζ_i = (2i/d + γ)/(1 + γ), laid out as rotate_half_pairs pairs features (i and i + d/2).

  Args:
    positions: [b, t] (int or float; may be shifted or negated).
    dim: the even head dimension d.
  Returns:
    [b, t, 1, d] float32.
  """
  zeta = (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim + gamma) / (1.0 + gamma)  # [d/2]
  power = positions[:, :, None, None].astype(jnp.float32) / scale_base  # [b, t, 1, 1]
  scale = jnp.exp(power * jnp.log(zeta))  # [b, t, 1, d/2]
  return jnp.concatenate([scale, scale], axis=-1)


class XPos(Rotary):
  """xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): rotary, with the query
  at position n scaled by ζ_i^((n − o)/scale_base) and the key at m by ζ_i^(−(m − o)/scale_base)
  per feature pair i, so each pair's term of q·k carries ζ_i^((n − m)/scale_base): an
  exponential decay with distance (keys before the query), fastest for the high-frequency
  pairs (ζ_0 = γ/(1 + γ)). The offset o = max_len // 2 cancels in every q·k, so scores
  depend on n − m only; it centres the exponents (as torchscale centres them on the block)
  so that both factors stay finite in float32 for |p − o| up to about 36,000 positions.
  Bidirectional (encoder) the same formula: keys after the query get the inverse factor
  (the paper trains causal models only). A scaling (module docstring) changes the rotation's
  frequencies and multiplies by YaRN's temperature; the decay keeps its positions. Every
  pair turns (xPos's decay is defined per pair of the whole head)."""

  @dataclasses.dataclass(frozen=True)
  class Settings(Frequencies):
    scale_base: float = 512.0  # the decay's length scale: ζ^(distance / scale_base)
    gamma: float = 0.4  # ζ_i = (2i/d + γ)/(1 + γ)

    def __post_init__(self):
      super().__post_init__()
      check_ranges(self, scale_base=POSITIVE, gamma=POSITIVE)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    settings = settings or self.Settings()
    self._turn(d_model // num_heads, settings, 1.0, "neox")
    self.scale_base, self.gamma, self.offset = settings.scale_base, settings.gamma, max_len // 2

  def _rotate(self, x, positions, sign: float):
    rotated = self._rope(x.astype(jnp.float32), positions)
    scale = xpos_scale(sign * (positions - self.offset), x.shape[-1], gamma=self.gamma,
                       scale_base=self.scale_base)
    return (rotated * scale).astype(x.dtype)

  def rotate_queries(self, x, positions):
    return self._rotate(x, positions, 1.0)

  def rotate_keys(self, x, positions):
    return self._rotate(x, positions, -1.0)


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"rotary": Rotary, "xpos": XPos}
