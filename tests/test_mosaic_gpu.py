"""The Mosaic GPU (Hopper) forward (transformer/model/kernels/pallas/mosaic_gpu.py): it lowers
for cuda to a `mosaic_gpu` custom call from abstract shapes, and in Mosaic GPU interpret mode
on this CPU its output and base-2 logsumexp equal the dense formula for causal, padded and
packed segments, with a local window and grouped K/V heads, with more visited key blocks than
K/V slots (with no data race between the copies and the reads, by the interpreter's race
detector), and a block declared full is added unmasked; warp-specialised (the compiled
default) and through one warpgroup (interpret mode's)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax._src.pallas.mosaic_gpu.interpret.params import (InterpretGPUParams,
                                                          force_gpu_interpret_mode)

from transformer.model.kernels.pallas import mosaic_gpu_forward, sparsity

L, D = 128, 64


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
    "padded": ([1] * 50 + [0] * 14, False, 40, 2, 1),  # queries padded to 128 inside
    "packed": ([1] * 50 + [2] * 60 + [0] * 18, True, 24, 2, 2),
    # 4 key blocks, asked for its last 128 queries only (one block of queries, 4 visits
    # through 2 slots: 3 partial, then 1 full)
    "packed_long": ([1] * 40 + [2] * 216, True, None, 1, 1),
}
FIRST_QUERY = {"packed_long": 128}  # the queries asked for start there (the keys: at 0)


def _inputs(segments, heads, kv_heads):
  rng, t = np.random.default_rng(0), len(segments)
  q = jnp.asarray(rng.standard_normal((1, t, heads, D)), jnp.float16)
  k, v = (jnp.asarray(rng.standard_normal((1, t, kv_heads, D)), jnp.float16) for _ in "kv")
  seg = jnp.asarray([segments], jnp.int32)
  starts = np.r_[0, np.flatnonzero(np.diff(segments)) + 1]
  pos = jnp.asarray([np.arange(t) - starts[np.searchsorted(starts, np.arange(t), "right") - 1]],
                    jnp.int32)
  return q, k, v, seg, pos


# (case, warp-specialised): each case once, packed_long in both schedules. Interpreting the
# warp-specialised kernel costs a few seconds per block of 128 queries, one warpgroup ~1 s.
SCHEDULES = [("causal", False), ("padded", False), ("packed", False), ("packed_long", False),
             ("packed_long", True)]


@pytest.mark.parametrize("name,specialised", SCHEDULES)
def test_interpret_equals_the_dense_formula(name, specialised):
  """packed_long also under the interpreter's race detector: no read of a K/V slot while a
  copy into it may be in flight (and, warp-specialised, no slot handed back early)."""
  segments, causal, window, heads, kv_heads = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads)
  detect, first = name == "packed_long", FIRST_QUERY.get(name, 0)
  with force_gpu_interpret_mode(InterpretGPUParams(detect_races=detect)):
    out, lse = mosaic_gpu_forward(q[:, first:], k, v, seg[:, first:], seg, pos[:, first:], pos,
                                  causal=causal, window=window, interpret=True,
                                  specialised=specialised)
  assert not (detect and get_races().races_found)
  want, want_lse = _dense(q, k, v, seg, pos, causal, window)
  want, want_lse = want[:, first:], want_lse[..., first:]
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


def test_blocks_declared_full_are_added_unmasked(monkeypatch):
  """With every block declared full, the padded, windowed call attends to every key: the
  full blocks' loop applies no mask (and waits for no segment or position rows). Warp-
  specialised, its 64 queries padded to 128; the loop is the same code through one
  warpgroup."""
  segments, causal, window, _, _ = CASES["padded"]
  q, k, v, seg, pos = _inputs(segments, 1, 1)
  monkeypatch.setattr(sparsity, "classify", lambda *a, block_q, block_k, lq, lk, **kw: jnp.full(
      (q.shape[0], lq // block_q, lk // block_k), sparsity.FULL, jnp.int32))
  out, lse = mosaic_gpu_forward(q, k, v, seg, seg, pos, pos, causal=causal, window=window,
                                interpret=True, specialised=True)
  want, want_lse = _dense(q, k, v, jnp.ones_like(seg), pos, False, None)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


@pytest.mark.parametrize("causal,window,dtype,length,dim,specialised", [
    (True, None, jnp.bfloat16, 256, 128, None), (False, 32, jnp.float16, 192, 64, None),
    (True, 32, jnp.bfloat16, 192, 64, False)])
def test_lowers_for_cuda_to_a_mosaic_gpu_call(causal, window, dtype, length, dim, specialised):
  """Warp-specialised (compiled's default): lengths of 256 and of 192 (its queries padded to
  128s), head dims 128 and 64; and through one warpgroup."""
  shape = jax.ShapeDtypeStruct
  args = ([shape((2, length, 4, dim), dtype)] + [shape((2, length, 2, dim), dtype)] * 2
          + [shape((2, length), jnp.int32)] * 4)
  f = jax.jit(lambda *a: mosaic_gpu_forward(*a, causal=causal, window=window,
                                            specialised=specialised))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu" in text
  assert "triton" not in text


def test_refuses_head_dims_beyond_shared_memory():
  shape = jax.ShapeDtypeStruct
  args = [shape((1, 64, 1, 320), jnp.bfloat16)] * 3 + [shape((1, 64), jnp.int32)] * 4
  with pytest.raises(ValueError, match="head dim 320 must be at most 256"):
    jax.eval_shape(lambda *a: mosaic_gpu_forward(*a, causal=True, window=None), *args)
