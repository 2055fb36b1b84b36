"""QK-norm: each attention head's queries and keys normalised over head_dim, with a learned
scale (and, for `layernorm`, a bias), before the positional rotation and the scorer, as
Gemma 3 and MaxText do, to keep the attention logits from growing without bound.

QK_NORMS: `model.attention.qk_norm` is `none` or a key of layers.NORMS, the norms of the
residual blocks (`model.norm_type`), so the two axes name and compute their norms alike.
The norm maps x [b, t, h, head_dim] to the same shape; one set of parameters [head_dim] is
shared by the heads, one for the queries and another for the keys. `none` is the identity
function (no parameter, no operation), so the default model is unchanged.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import lookup
from transformer.model.layers import NORMS

EPSILON = 1e-6  # added to the mean square (rmsnorm) or the variance (layernorm), as Gemma 3

QK_NORMS: dict[str, type[nnx.Module] | None] = {"none": None, **NORMS}


def make_qk_norm(name: str, head_dim: int, *, dtype=jnp.float32,
                 rngs: nnx.Rngs) -> Callable[[jax.Array], jax.Array]:
  """The norm `name` of QK_NORMS for heads of head_dim features (`none`: the identity)."""
  norm = lookup(QK_NORMS, name, "attention qk_norm")
  if norm is None:
    return lambda x: x
  return norm(head_dim, epsilon=EPSILON, dtype=dtype, rngs=rngs)
