"""Positions that rotate the queries and keys (the `rotate_queries`/`rotate_keys` seams):
rotary and xPos."""

import dataclasses

import jax
import jax.numpy as jnp

from transformer.core.errors import ConfigError
from transformer.core.fields import POSITIVE, Range, check_ranges
from transformer.model.positions.base import PositionalEncoding

ABOVE_1 = Range(1, lo_open=True)


def rotate_half_pairs(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """RoPE (Su et al. 2021): rotates feature pairs (x_i, x_{i+d/2}) by angle p·base^(-2i/d).

  Args:
    x: [b, t, h, d] with d even.
    positions: [b, t].
  Returns:
    [b, t, h, d], so that <rot(q, m), rot(k, n)> depends on m - n only.
  """
  d = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [d/2]
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [b, t, 1, d/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Rotary(PositionalEncoding):
  """Rotary position embedding applied to q and k in every self-attention layer."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    base: float = 10000.0  # pair i turns by angle p · base^(-2i/d)

    def __post_init__(self):
      check_ranges(self, base=ABOVE_1)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    head_dim = d_model // num_heads
    if head_dim % 2:
      raise ConfigError(f"rotary positions need an even head dimension, got {head_dim}")
    self.base = (settings or self.Settings()).base

  def rotate_queries(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)

  def rotate_keys(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)


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
  (the paper trains causal models only)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    base: float = 10000.0  # the rotary angles', as `rotary`
    scale_base: float = 512.0  # the decay's length scale: ζ^(distance / scale_base)
    gamma: float = 0.4  # ζ_i = (2i/d + γ)/(1 + γ)

    def __post_init__(self):
      check_ranges(self, base=ABOVE_1, scale_base=POSITIVE, gamma=POSITIVE)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    settings = settings or self.Settings()
    super().__init__(d_model, num_heads, max_len, causal=causal, settings=settings, rngs=rngs)
    self.scale_base, self.gamma, self.offset = settings.scale_base, settings.gamma, max_len // 2

  def _rotate(self, x, positions, sign: float):
    rotated = rotate_half_pairs(x.astype(jnp.float32), positions, self.base)
    scale = xpos_scale(sign * (positions - self.offset), x.shape[-1], gamma=self.gamma,
                       scale_base=self.scale_base)
    return (rotated * scale).astype(x.dtype)

  def rotate_queries(self, x, positions):
    return self._rotate(x, positions, 1.0)

  def rotate_keys(self, x, positions):
    return self._rotate(x, positions, -1.0)


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"rotary": Rotary, "xpos": XPos}
