"""Positions that rotate the queries and keys (the `rotate_queries`/`rotate_keys` seams):
rotary and xPos, with RoPE's context-extension scalings (the frequencies they turn pairs
by: transformer/model/positions/rope_scaling.py) and partial rotation.

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

import jax
import jax.numpy as jnp

from transformer.core.errors import ConfigError
from transformer.core.fields import POSITIVE, Range, check, check_ranges
from transformer.core.registry import one_of
from transformer.model.positions.base import PositionalEncoding
from transformer.model.positions.rope_scaling import Frequencies, frequencies

PARTIAL = ("neox", "p_rope")  # which pairs turn under partial rotation (module docstring)


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
  docstring: partial rotation; rope_scaling.py: frequencies and scalings)."""

  @dataclasses.dataclass(frozen=True)
  class Settings(Frequencies):
    rotated_fraction: float = 1.0  # of each head's dimensions that turn (partial RoPE)
    partial: str = "neox"  # which turn: neox (the first) | p_rope (the highest frequencies)

    def __post_init__(self):
      super().__post_init__()
      check_ranges(self, rotated_fraction=Range(0, 1, lo_open=True))
      check(self.partial in PARTIAL, "partial", self.partial, one_of(PARTIAL))

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

  def rotated_dims(self, head_dim):
    whole = self.pairs == head_dim // 2
    return 2 * self.pairs if whole or self.partial == "neox" else None


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
  (the paper trains causal models only). A scaling (rope_scaling.py) changes the rotation's
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
