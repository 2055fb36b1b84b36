"""Absolute positions, added to the embeddings (the `embed` seam): the paper's sinusoids
and a learned table."""

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model.positions.base import PositionalEncoding


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

  embeds = True

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    if d_model % 2:
      raise ConfigError(f"sinusoidal positions need an even d_model, got {d_model}")
    self.d_model = d_model

  def embed(self, x, positions):
    return x + sinusoid(positions, self.d_model).astype(x.dtype)


class Learned(PositionalEncoding):
  """A learned absolute embedding per position 0..max_len-1."""

  embeds = True

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs):
    self.max_len = max_len
    self.table = nnx.Embed(max_len, d_model, embedding_init=nnx.initializers.normal(0.02),
                           rngs=rngs)

  def check_length(self, length):
    if length > self.max_len:
      raise ConfigError(
          f"sequence length {length} exceeds the learned position table "
          f"(model.max_len={self.max_len}); raise model.max_len or use another position")

  def embed(self, x, positions):
    self.check_length(x.shape[1])
    return x + self.table(positions).astype(x.dtype)


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"sinusoidal": Sinusoidal, "learned": Learned}
