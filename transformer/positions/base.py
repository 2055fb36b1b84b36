"""The positional-encoding interface (transformer/positions/__init__.py): the identity at
every seam."""

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.registry import NoSettings


class PositionalEncoding(nnx.Module):
  """No positional information: the identity at every seam."""

  Settings = NoSettings
  biases = False  # bias() is not zero: the attention kernel must add it
  learned_bias = False  # bias() has parameters: the kernel must give their gradient
  content_biases = False  # content_bias() is not zero: only a kernel declaring content_bias adds it
  causal_only = False  # defined only for causal self-attention: no encoder stack may use it
  takes_positions = True  # its seams read the positions (model.random_positions may sample them)

  def embed(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [b, t, d_model], positions: [b, t] -> [b, t, d_model]."""
    del positions
    return x

  def rotate_queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def rotate_keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Keys x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """-> a logit bias broadcastable to [b, h, tq, tk]."""
    del q_positions, k_positions
    return jnp.zeros((), jnp.float32)

  def content_bias(self, q: jax.Array, logits: jax.Array) -> jax.Array:
    """A logit bias that depends on content, added after bias().

    Args:
      q: the per-head queries as the scorer saw them (rotated), [b, tq, h, d].
      logits: the scorer's logits plus bias(), float32 [b, h, tq, tk], −inf at masked keys.
    Returns:
      a logit bias broadcastable to [b, h, tq, tk].
    """
    del q, logits
    return jnp.zeros((), jnp.float32)


class NoPosition(PositionalEncoding):
  """`none`: the identity encoding, built like every registry entry."""

  takes_positions = False

  def __init__(self, d_model: int, num_heads: int, max_len: int, *, causal: bool = False,
               settings=None, rngs: nnx.Rngs | None = None):
    del d_model, num_heads, max_len, causal, settings, rngs


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"none": NoPosition}
