"""How the heads' attention outputs combine: each on its own (`plain`), or in pairs as
differential attention (Ye et al., ICLR 2025, "Differential Transformer"; their code,
microsoft/unilm Diff-Transformer/multihead_diffattn.py).

HEADS: `model.attention.heads`. An entry is made with `(num_heads, num_kv_heads, head_dim,
*, depth, dtype, rngs)`, depth the layer's index in its stack, and has two seams around
the kernel: `values(v)` maps the values [b, tk, kv_heads, d] to those the kernel reads,
[b, tk, kv_heads, d_v], and `combine(out)` the kernel's output [b, tq, h, d_v] to the
heads' outputs [b, tq, h·d] that W_O projects. The queries, keys, the KV cache and every
parameter shape of the layer are the same under each entry.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.layers import NORMS

LAMBDA_STD = 0.1  # their λ vectors' initial normal draws
SUBLN_EPSILON = 1e-5  # their per-head RMSNorm's ε


def lambda_init(depth: int) -> float:
  """λ_init = 0.8 − 0.6·exp(−0.3·depth), depth the layer's index from 0 (their
  lambda_init_fn)."""
  return 0.8 - 0.6 * math.exp(-0.3 * depth)


class PlainHeads(nnx.Module):
  """Each head's output as the kernel gives it."""

  def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *, depth: int = 0,
               dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del num_heads, num_kv_heads, head_dim, depth, dtype, rngs

  def values(self, v: jax.Array) -> jax.Array:
    return v

  def combine(self, out: jax.Array) -> jax.Array:
    return out.reshape(*out.shape[:2], -1)


class Differential(nnx.Module):
  """softmax(A₁) − λ·softmax(A₂) per pair of heads. The layer's h query heads of d are h/2
  differential heads, each a pair (2i, 2i+1) of sub-heads of d (their q.view(2·heads, d));
  the kv_heads key heads likewise pair up, and the values, the same [d_model, kv_heads·d]
  projection, are read as kv_heads/2 heads of 2d (their v.view(kv_heads, 2·d)), each seen by
  both sub-heads of its pairs. So the kernel attends h heads of d over values of 2d, and a
  pair's outputs o₁, o₂ [2d] give RMSNorm(o₁ − λ·o₂)·(1 − λ_init) (their subln, ε 1e-5,
  a learned scale). λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, four learned [d] vectors
  of the layer drawn from N(0, 0.1²), λ_init = lambda_init(depth), a constant kept as a
  parameter that never moves (so that layers scanned together keep their own)."""

  def __init__(self, num_heads, num_kv_heads, head_dim, *, depth=0, dtype=jnp.float32, rngs):
    if num_heads % 2 or num_kv_heads % 2:
      raise ConfigError(
          f"model.attention.heads='differential' pairs the heads: num_heads ({num_heads}) "
          f"and num_kv_heads ({num_kv_heads}) must be even (a differential head is two "
          "query heads; its value two key heads' width)")
    draw = lambda: nnx.Param(LAMBDA_STD * jax.random.normal(rngs.params(), (head_dim,)))  # noqa: E731
    self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (draw() for _ in range(4))
    self.lambda_init = nnx.Param(jnp.asarray(lambda_init(depth), jnp.float32))
    self.subln = NORMS["rmsnorm"](2 * head_dim, epsilon=SUBLN_EPSILON, dtype=dtype, rngs=rngs)

  def weight(self) -> tuple[jax.Array, jax.Array]:
    """(λ, λ_init), scalars."""
    dot = lambda a, b: jnp.exp(jnp.sum(a[...] * b[...]))  # noqa: E731
    init = jax.lax.stop_gradient(self.lambda_init[...])
    return dot(self.lambda_q1, self.lambda_k1) - dot(self.lambda_q2, self.lambda_k2) + init, init

  def values(self, v):  # [b, t, kv, d] -> kv/2 heads of 2d, each repeated for its two key heads
    b, t, kv, d = v.shape
    return jnp.repeat(v.reshape(b, t, kv // 2, 2 * d), 2, axis=2)

  def combine(self, out):  # [b, t, h, 2d] -> [b, t, h·d]
    b, t, h, width = out.shape
    pairs = out.reshape(b, t, h // 2, 2, width)
    lam, init = self.weight()
    diff = pairs[:, :, :, 0] - lam.astype(out.dtype) * pairs[:, :, :, 1]
    return (self.subln(diff) * (1 - init).astype(out.dtype)).reshape(b, t, -1)


HEADS: dict[str, type[nnx.Module]] = {"plain": PlainHeads, "differential": Differential}


def make_heads(name: str, num_heads: int, num_kv_heads: int, head_dim: int, *, depth: int,
               dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
  """The entry `name` of HEADS for a layer of these heads at index `depth` of its stack."""
  return lookup(HEADS, name, "attention heads")(num_heads, num_kv_heads, head_dim, depth=depth,
                                                dtype=dtype, rngs=rngs)
