"""Output gates of attention: a sigmoid gate on each head's output, computed from the
layer's input, after the kernel and before the output projection W_O (Qiu et al.,
NeurIPS 2025, "Gated Attention for Large Language Models"; their code,
qiuzh20/gated_attention: `attn_output * sigmoid(gate_score)` before `o_proj`, the gate
score from the same hidden states as the queries).

GATES: `model.attention.gate`. A gate maps the layer's input x_q [b, tq, d_model] and the
heads' outputs [b, tq, h·d] (h chunks of d, head-major) to the gated outputs, the same
shape: `gate(x_q, heads)`. `none` is the identity (no parameter, no operation).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import lookup
from transformer.model.layers import Dense


class NoGate(nnx.Module):
  """The heads' outputs as they are."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int, *, dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    del d_model, num_heads, head_dim, dtype, rngs

  def __call__(self, x: jax.Array, heads: jax.Array) -> jax.Array:
    del x
    return heads


class HeadwiseGate(nnx.Module):
  """heads_i · σ(x W_g)_i: one score per head (W_g [d_model, h]), shared by its d outputs."""

  elementwise = False  # a score per output feature, not per head

  def __init__(self, d_model, num_heads, head_dim, *, dtype=jnp.float32, rngs):
    self.num_heads = num_heads
    width = num_heads * (head_dim if self.elementwise else 1)
    self.gate = Dense(d_model, width, use_bias=False, kernel_axes=("fsdp", "tensor"),
                      dtype=dtype, rngs=rngs)

  def __call__(self, x, heads):
    score = self.gate(x).reshape(*x.shape[:2], self.num_heads, -1)  # [b, t, h, 1 or d]
    gated = heads.reshape(*heads.shape[:2], self.num_heads, -1) * jax.nn.sigmoid(score)
    return gated.reshape(heads.shape)


class ElementwiseGate(HeadwiseGate):
  """heads · σ(x W_g): a score per output feature (W_g [d_model, h·d])."""

  elementwise = True


GATES: dict[str, type[nnx.Module]] = {
    "none": NoGate,
    "headwise": HeadwiseGate,
    "elementwise": ElementwiseGate,
}


def make_gate(name: str, d_model: int, num_heads: int, head_dim: int, *, dtype=jnp.float32,
              rngs: nnx.Rngs) -> nnx.Module:
  """The gate `name` of GATES for num_heads heads of head_dim outputs."""
  return lookup(GATES, name, "attention gate")(d_model, num_heads, head_dim, dtype=dtype,
                                               rngs=rngs)
