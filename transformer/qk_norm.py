"""QK-norm: each attention head's queries and keys normalised over head_dim, with a learned
scale (and, for `layer`, a bias), before the positional rotation and the scorer, as OLMo-2,
Gemma 3 and MaxText do, to keep the attention logits from growing without bound.

QK_NORMS maps `model.attention.qk_norm` to a maker `(head_dim, *, dtype, rngs) -> norm`, the
norm a function of x [b, t, h, head_dim] to the same shape; one set of parameters [head_dim]
is shared by the heads, one for the queries and another for the keys. `none` is the identity
function (no parameter, no operation), so the default model is unchanged.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.layers import LayerNorm
from transformer.registry import lookup

EPSILON = 1e-6  # added to the mean square (rms) or the variance (layer), as Gemma 3 does


def no_norm(x: jax.Array) -> jax.Array:
  return x


def rms_norm(head_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.RMSNorm:
  """x / √(mean over head_dim of x² + ε) · g, g [head_dim] learned from 1; statistics in
  float32."""
  return nnx.RMSNorm(head_dim, epsilon=EPSILON, dtype=dtype, rngs=rngs)


def layer_norm(head_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs) -> LayerNorm:
  """(x − mean) / √(var + ε) · g + β over head_dim, g from 1 and β from 0; statistics in
  float32."""
  return LayerNorm(head_dim, epsilon=EPSILON, dtype=dtype, rngs=rngs)


QK_NORMS: dict[str, Callable] = {
    "none": lambda head_dim, *, dtype=jnp.float32, rngs: no_norm,
    "rms": rms_norm,
    "layer": layer_norm,
}


def make_qk_norm(name: str, head_dim: int, *, dtype=jnp.float32,
                 rngs: nnx.Rngs) -> Callable[[jax.Array], jax.Array]:
  """The norm `name` of QK_NORMS for heads of head_dim features."""
  return lookup(QK_NORMS, name, "attention qk_norm")(head_dim, dtype=dtype, rngs=rngs)
