"""Positional encodings, keyed by config string.

An encoding acts at up to three seams, and the layers call all three on every encoding:
  * `embed(x, positions)`: added to the scaled token embeddings (sinusoidal, learned);
  * `rotate(x, positions)`: applied to the queries and to the keys in every self-attention
    layer (rotary);
  * `bias(q_positions, k_positions)`: added to the attention logits (ALiBi, T5 buckets).
The base class is the identity at each seam, so `none` is the base class itself.

Positions are explicit int arrays [batch, length] (0-based within each packed segment),
never inferred from array indices, so packing and cached decoding see the right positions.
"""


import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.registry import ConfigError, lookup


class PositionalEncoding(nnx.Module):
  """No positional information: the identity at every seam."""

  def __init__(self, d_model: int, num_heads: int, max_len: int, *, causal: bool = False,
               rngs: nnx.Rngs):
    """causal: the encoding serves a decoder (keys never follow the query)."""
    del d_model, num_heads, max_len, causal, rngs

  def embed(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [b, t, d_model], positions: [b, t] -> [b, t, d_model]."""
    del positions
    return x

  def rotate(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries or keys x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """-> a logit bias broadcastable to [b, h, tq, tk]."""
    del q_positions, k_positions
    return jnp.zeros((), jnp.float32)


def sinusoid(positions: jax.Array, dim: int) -> jax.Array:
  """The paper's table: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same).

  Args:
    positions: int or float array of any shape [...].
    dim: even feature size d.
  Returns:
    [..., dim] float32, sin and cos interleaved.
  """
  inv_freq = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [d/2]
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


class Sinusoidal(PositionalEncoding):
  """Fixed sinusoids added to the embeddings ("Attention Is All You Need", 3.5)."""

  def __init__(self, d_model, num_heads, max_len, *, causal=False, rngs):
    if d_model % 2:
      raise ConfigError(f"sinusoidal positions need an even d_model, got {d_model}")
    self.d_model = d_model

  def embed(self, x, positions):
    return x + sinusoid(positions, self.d_model).astype(x.dtype)


class Learned(PositionalEncoding):
  """A learned absolute embedding per position 0..max_len-1."""

  def __init__(self, d_model, num_heads, max_len, *, causal=False, rngs):
    self.max_len = max_len
    self.table = nnx.Embed(max_len, d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

  def check_length(self, length):
    if length > self.max_len:
      raise ConfigError(
          f"sequence length {length} exceeds the learned position table "
          f"(model.max_len={self.max_len}); raise model.max_len or use another position")

  def embed(self, x, positions):
    self.check_length(x.shape[1])
    return x + self.table(positions).astype(x.dtype)


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

  base = 10000.0

  def __init__(self, d_model, num_heads, max_len, *, causal=False, rngs):
    head_dim = d_model // num_heads
    if head_dim % 2:
      raise ConfigError(f"rotary positions need an even head dimension, got {head_dim}")

  def rotate(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)


def alibi_slopes(num_heads: int) -> list[float]:
  """ALiBi's head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power of
  two; otherwise those of the next lower power of two, then every other slope of the next
  higher one (Press et al. 2022)."""
  if num_heads & (num_heads - 1) == 0:
    return [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
  lower = 2 ** int(math.floor(math.log2(num_heads)))
  return alibi_slopes(lower) + alibi_slopes(2 * lower)[0::2][:num_heads - lower]


class ALiBi(PositionalEncoding):
  """Attention with linear biases: logits − m_h·|i − j| per head, no position embedding."""

  def __init__(self, d_model, num_heads, max_len, *, causal=False, rngs):
    self.slopes = tuple(alibi_slopes(num_heads))

  def bias(self, q_positions, k_positions):
    distance = jnp.abs(q_positions[:, None, :, None] - k_positions[:, None, None, :])
    return -jnp.asarray(self.slopes, jnp.float32)[None, :, None, None] * distance


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool,
                             num_buckets: int = 32, max_distance: int = 128) -> jax.Array:
  """T5's buckets of relative_position = key − query: exact for small distances, then
  logarithmic up to max_distance, beyond which all share the last bucket. Bidirectional
  buckets give half the range to keys after the query."""
  n = -relative_position
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket += (n < 0).astype(n.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
      max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(n.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


class T5Bias(PositionalEncoding):
  """T5's learned relative position bias: one scalar per (bucket, head), shared by the
  layers of a stack; bidirectional in the encoder, causal in the decoder."""

  num_buckets = 32
  max_distance = 128

  def __init__(self, d_model, num_heads, max_len, *, causal=False, rngs):
    self.bidirectional = not causal
    self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                         (self.num_buckets, num_heads)))

  def bias(self, q_positions, k_positions):
    relative = k_positions[:, None, :] - q_positions[:, :, None]  # [b, q, k]
    buckets = relative_position_bucket(relative, bidirectional=self.bidirectional,
                                       num_buckets=self.num_buckets,
                                       max_distance=self.max_distance)
    return jnp.transpose(self.table[...][buckets], (0, 3, 1, 2))  # [b, h, q, k]


POSITIONS: dict[str, type[PositionalEncoding]] = {
    "none": PositionalEncoding,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rotary": Rotary,
    "alibi": ALiBi,
    "t5": T5Bias,
}


def make_positional_encoding(name: str, d_model: int, num_heads: int, max_len: int, *,
                             causal: bool = False, rngs):
  return lookup(POSITIONS, name, "position")(d_model, num_heads, max_len, causal=causal,
                                             rngs=rngs)


