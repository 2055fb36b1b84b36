"""The position-wise feed-forward layers, one per config.model.ffn (FFNS).

d_ff convention: d_ff is the hidden width of every variant, as given. The plain layers have
two matrices (2·d_model·d_ff weights and d_ff + d_model biases); the gated ones three
(3·d_model·d_ff weights, no biases), so at the same d_ff a GLU variant has 1.5× the weights.
Shazeer (2020) compares at equal parameters by scaling the gated layers' d_ff by 2/3: set
model.d_ff = ⌊2/3·d_ff⌋ for a parameter-matched comparison.

GELU is the exact x·Φ(x) (erf), not the tanh approximation (jax.nn.gelu's default).
"""

import jax
from flax import nnx

from transformer.model.layers import Dense, project


def gelu(x: jax.Array) -> jax.Array:
  """x·Φ(x), Φ the standard normal CDF (Hendrycks & Gimpel 2016), exact."""
  return jax.nn.gelu(x, approximate=False)


class FeedForward(nnx.Module):
  """act(x W_1 + b_1) W_2 + b_2 with act = ReLU (the paper's): parameters `wi`, `wo`."""

  activation = staticmethod(jax.nn.relu)

  def __init__(self, d_model: int, d_ff: int, *, dtype=jax.numpy.float32, rngs: nnx.Rngs):
    # The hidden units split over the mesh's tensor axis (wo's bias stays replicated).
    self.wi = Dense(d_model, d_ff, kernel_axes=("fsdp", "tensor"), bias_axes=("tensor",),
                    dtype=dtype, rngs=rngs)
    self.wo = Dense(d_ff, d_model, kernel_axes=("tensor", "fsdp"), dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d_model] -> [..., d_model]."""
    return self.wo(self.activation(self.wi(x)))


class GeluFeedForward(FeedForward):
  """GELU(x W_1 + b_1) W_2 + b_2 (exact GELU; module docstring)."""

  activation = staticmethod(gelu)


class GatedFeedForward(nnx.Module):
  """(act(x W) ⊙ x V) W_2 (Shazeer 2020, "GLU Variants Improve Transformer"), without biases
  as in the paper and T5 v1.1: parameters `wi_0` (W, the activated one), `wi_1` (V) and
  `wo` (W_2), t5x's names. act = Swish_1 = SiLU (SwiGLU)."""

  activation = staticmethod(jax.nn.silu)

  def __init__(self, d_model: int, d_ff: int, *, dtype=jax.numpy.float32, rngs: nnx.Rngs):
    hidden = lambda: Dense(d_model, d_ff, use_bias=False, kernel_axes=("fsdp", "tensor"),  # noqa: E731
                           dtype=dtype, rngs=rngs)
    self.wi_0, self.wi_1 = hidden(), hidden()
    self.wo = Dense(d_ff, d_model, use_bias=False, kernel_axes=("tensor", "fsdp"), dtype=dtype,
                    rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d_model] -> [..., d_model]. W and V are one [d_model, 2·d_ff] matmul, faster
    on XLA:CPU than two; interleaved column by column (groups = d_ff), so a tensor-parallel
    split of the hidden units keeps each device's gate and value columns together."""
    gate, value = project(x, self.wi_0, self.wi_1, groups=self.wi_0.out_features)
    return self.wo(self.activation(gate) * value)


class GegluFeedForward(GatedFeedForward):
  """(GELU(x W) ⊙ x V) W_2 (GEGLU; exact GELU)."""

  activation = staticmethod(gelu)


# config.model.ffn; each is built as FFNS[name](d_model, d_ff, dtype=..., rngs=...).
FFNS: dict[str, type[nnx.Module]] = {
    "relu": FeedForward,
    "gelu": GeluFeedForward,
    "swiglu": GatedFeedForward,
    "geglu": GegluFeedForward,
}
