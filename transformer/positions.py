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


import jax
import jax.numpy as jnp
from flax import nnx

from transformer.registry import ConfigError, lookup


class PositionalEncoding(nnx.Module):
  """No positional information: the identity at every seam."""

  def __init__(self, d_model: int, num_heads: int, max_len: int, *, rngs: nnx.Rngs):
    del d_model, num_heads, max_len, rngs

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

  def __init__(self, d_model, num_heads, max_len, *, rngs):
    if d_model % 2:
      raise ConfigError(f"sinusoidal positions need an even d_model, got {d_model}")
    self.d_model = d_model

  def embed(self, x, positions):
    return x + sinusoid(positions, self.d_model).astype(x.dtype)


class Learned(PositionalEncoding):
  """A learned absolute embedding per position 0..max_len-1."""

  def __init__(self, d_model, num_heads, max_len, *, rngs):
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

  def __init__(self, d_model, num_heads, max_len, *, rngs):
    head_dim = d_model // num_heads
    if head_dim % 2:
      raise ConfigError(f"rotary positions need an even head dimension, got {head_dim}")

  def rotate(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)


POSITIONS: dict[str, type[PositionalEncoding]] = {
    "none": PositionalEncoding,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rotary": Rotary,
}


def make_positional_encoding(name: str, d_model: int, num_heads: int, max_len: int, *, rngs):
  return lookup(POSITIONS, name, "position")(d_model, num_heads, max_len, rngs=rngs)


