"""The Mosaic GPU (Hopper) kernels (transformer/model/kernels/pallas/mosaic_gpu.py): in Mosaic
GPU interpret mode on this CPU the forward's output and base-2 logsumexp, and the gradients
of q, k, v through the backward kernels, equal the dense formula's for causal, padded and
packed segments, with a local window and grouped K/V heads; the gradient lowers for cuda to
`mosaic_gpu` custom calls only, from abstract shapes; kernel `mosaic_gpu` is never `auto`'s.
(Its refusals: tests/test_kernel_choice.py, tests/test_bad_input.py; its values and
gradients through the registry: tests/test_kernel_conformance.py.)"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer.model.kernels import Needs, Target, choose
from transformer.model.kernels.pallas import mosaic_gpu_attention, mosaic_gpu_forward

L, D = 128, 64
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # the interpreter's program compiles faster


def _dense(q, k, v, seg, pos, causal, window):
  """Softmax in base 2 over the unmasked keys: out [b, t, h, d], lse [b, h, t] (−inf, out 0
  where a query sees no key)."""
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2).astype(jnp.float32) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k)
  qs, ks = seg[:, None, :, None], seg[:, None, None, :]
  qp, kp = pos[:, None, :, None], pos[:, None, None, :]
  keep = (qs == ks) & (ks != 0)
  keep &= (kp <= qp) if causal else True
  keep &= (jnp.abs(qp - kp) <= window) if window else True
  lse = jax.nn.logsumexp(jnp.where(keep, s * math.log(2), -jnp.inf), axis=-1) / math.log(2)
  p = jnp.where(keep, jnp.exp2(s - jnp.where(jnp.isinf(lse), 0, lse)[..., None]), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


CASES = {  # name: (segments, causal, window, heads, kv heads)
    "causal": ([1] * L, True, None, 1, 1),
    "padded": ([1] * 100 + [0] * 28, False, 40, 2, 1),
    "packed": ([1] * 50 + [2] * 60 + [0] * 18, True, 24, 2, 2),
}


def _inputs(segments, heads, kv_heads):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, L, heads, D)), jnp.float16)
  k, v = (jnp.asarray(rng.standard_normal((1, L, kv_heads, D)), jnp.float16) for _ in "kv")
  seg = jnp.asarray([segments], jnp.int32)
  starts = np.r_[0, np.flatnonzero(np.diff(segments)) + 1]
  pos = jnp.asarray([np.arange(L) - starts[np.searchsorted(starts, np.arange(L), "right") - 1]],
                    jnp.int32)
  return q, k, v, seg, pos


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpret_equals_the_dense_formula(name):
  segments, causal, window, heads, kv_heads = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads)
  out, lse = mosaic_gpu_forward(q, k, v, seg, seg, pos, pos, causal=causal, window=window,
                                interpret=True)
  want, want_lse = _dense(q, k, v, seg, pos, causal, window)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


SCALE = 0.3


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_the_dense_formulas(name):
  """jax.grad through attention (q unscaled, scale given; head dim 48 and length 120 padded
  to 64 and 128 inside) against jax.grad of the dense formula, on the queries that see a
  key, in float32 from the same float16 inputs."""
  segments, causal, window, heads, kv_heads = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads)
  q, k, v = (x[:, :120, :, :48] for x in (q, k, v))
  seg, pos = seg[:, :120], pos[:, :120]
  weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  weights = weights * (seg > 0)[..., None, None]

  def kernel(q, k, v):
    out = mosaic_gpu_attention(q, k, v, q_segments=seg, k_segments=seg, q_positions=pos,
                               k_positions=pos, causal=causal, window=window, scale=SCALE,
                               interpret=True)
    return jnp.sum(out.astype(jnp.float32) * weights)

  def dense(q, k, v):
    out = _dense(q * SCALE / math.log(2), k, v, seg, pos, causal, window)[0]
    return jnp.sum(out * weights)

  got = jax.jit(jax.grad(kernel, argnums=(0, 1, 2)), compiler_options=FAST_COMPILE)(q, k, v)
  want = jax.grad(dense, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
  for g, w in zip(got, want, strict=True):
    assert g.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=4e-3 * np.abs(w).max())


@pytest.mark.parametrize("causal,window,dtype", [(True, None, jnp.bfloat16),
                                                 (False, 32, jnp.float16)])
def test_the_gradient_lowers_for_cuda_to_mosaic_gpu_calls_only(causal, window, dtype):
  """jax.grad of attention (grouped K/V heads, lengths and head dim 80 padded inside):
  forward, dk/dv and dq kernels, three Mosaic GPU custom calls and nothing of Triton."""
  shape = jax.ShapeDtypeStruct
  args = ([shape((2, 200, 4, 80), dtype)] + [shape((2, 200, 2, 80), dtype)] * 2
          + [shape((2, 200), jnp.int32)] * 4)

  def loss(q, k, v, *ids):
    out = mosaic_gpu_attention(q, k, v, q_segments=ids[0], k_segments=ids[1],
                               q_positions=ids[2], k_positions=ids[3], causal=causal,
                               window=window, scale=0.1, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  assert text.count("stablehlo.custom_call @") == 3
  assert "triton" not in text


def test_auto_never_takes_it():
  """Unmeasured, so in no AUTO_ORDER: on a GPU, auto takes another kernel for a bf16 layer
  it could run, and does not consider it."""
  choice, _ = choose("auto", Needs({"grouped_query"}, dtype="bfloat16"), Target("gpu"))
  assert choice.name != "mosaic_gpu"
  assert "mosaic_gpu" not in dict(choice.passed_over)
