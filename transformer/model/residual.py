"""Residual placement (`model.norm`): post-LN, Norm(x + f(x)) as in the paper, or pre-LN,
x + f(Norm(x)) with a final norm on the stack; the norm is an entry of layers.NORMS
(`model.norm_type`)."""


import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import lookup
from transformer.model.layers import NORMS, Dropout


class PostNorm(nnx.Module):
  """Norm(x + Dropout(sublayer(x))), as in the paper; Norm an entry of layers.NORMS
  (model.norm_type)."""

  final_norm = False  # the stack output is already normalised

  def __init__(self, d_model: int, dropout: float, *, norm: str = "layernorm",
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.norm = make_norm(norm, d_model, dtype=dtype, rngs=rngs)
    self.dropout = Dropout(dropout)

  def __call__(self, x, sublayer, rngs):
    return self.norm(x + self.dropout(sublayer(x), deterministic=rngs is None, rngs=rngs))

class PreNorm(PostNorm):
  """x + Dropout(sublayer(Norm(x))); the stack ends with a Norm."""

  final_norm = True

  def __call__(self, x, sublayer, rngs):
    return x + self.dropout(sublayer(self.norm(x)), deterministic=rngs is None, rngs=rngs)

RESIDUALS: dict[str, type[PostNorm]] = {"post": PostNorm, "pre": PreNorm}

def make_norm(norm_type: str, d_model: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
  """The norm NORMS[norm_type] over d_model features (ε = 1e-6)."""
  return lookup(NORMS, norm_type, "norm_type")(d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
