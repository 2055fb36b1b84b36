"""The Mosaic GPU (Hopper) forward (transformer/model/kernels/pallas/mosaic_gpu.py): it lowers
for cuda to a `mosaic_gpu` custom call from abstract shapes, and in Mosaic GPU interpret mode
on this CPU its output and base-2 logsumexp equal the dense formula for causal, padded and
packed segments, with a local window, grouped K/V heads and each positional bias. The bias's
block gradient (mosaic_bias.py) in a one-block kernel equals the vjp of the dense bias and
lowers for cuda."""

import math

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels.pallas import mosaic_bias, mosaic_gpu_forward
from transformer.model.positions import POSITIONS, spec_bias
from transformer.model.positions.relative import Fire, T5Bias

L, D = 128, 64
# T5 saturating within a block; FIRE's MLP small, its kinks at 0.35 (w1 > 0) and 0 (w1 < 0:
# a tie at the diagonal's input 0)
SETTINGS = {"t5": T5Bias.Settings(num_buckets=8, max_distance=12),
            "fire": Fire.Settings(width=2, init_threshold=6.0)}


def _spec(position, heads, causal):
  """The BiasSpec of encoding `position` (None: none) for `heads` heads."""
  if position is None:
    return None
  enc = POSITIONS[position](16, heads, 256, causal=causal, settings=SETTINGS.get(position),
                            rngs=nnx.Rngs(1))
  if position == "fire":
    enc.hidden.bias[...] = jnp.array([-0.2, 0.0])
  return enc.bias_spec()


def _dense(q, k, v, seg, pos, causal, window, spec=None):
  """Softmax in base 2 over the unmasked keys: out [b, t, h, d], lse [b, h, t] (−inf, out 0
  where a query sees no key)."""
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2).astype(jnp.float32) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k)
  if spec is not None:
    s = s + spec_bias(spec, pos, pos) / math.log(2)
  qs, ks = seg[:, None, :, None], seg[:, None, None, :]
  qp, kp = pos[:, None, :, None], pos[:, None, None, :]
  keep = (qs == ks) & (ks != 0)
  keep &= (kp <= qp) if causal else True
  keep &= (jnp.abs(qp - kp) <= window) if window else True
  lse = jax.nn.logsumexp(jnp.where(keep, s * math.log(2), -jnp.inf), axis=-1) / math.log(2)
  p = jnp.where(keep, jnp.exp2(s - jnp.where(jnp.isinf(lse), 0, lse)[..., None]), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


CASES = {  # name: (segments, causal, window, heads, kv heads, positional bias)
    "causal": ([1] * L, True, None, 1, 1, None),
    "padded-alibi": ([1] * 100 + [0] * 28, False, 40, 2, 1, "alibi"),
    "packed-t5": ([1] * 50 + [2] * 60 + [0] * 18, True, 24, 2, 2, "t5"),
    "packed-kerple": ([1] * 30 + [2] * 98, False, None, 2, 1, "kerple"),
    "packed-fire": ([1] * 70 + [2] * 40 + [0] * 18, False, None, 2, 2, "fire"),
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
  segments, causal, window, heads, kv_heads, position = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads)
  spec = _spec(position, heads, causal)
  out, lse = mosaic_gpu_forward(q, k, v, seg, seg, pos, pos, causal=causal, window=window,
                                bias_spec=spec, interpret=True)
  want, want_lse = _dense(q, k, v, seg, pos, causal, window, spec)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


@pytest.mark.parametrize("causal,window,dtype", [(True, None, jnp.bfloat16),
                                                 (False, 32, jnp.float16)])
def test_lowers_for_cuda_to_a_mosaic_gpu_call(causal, window, dtype):
  shape = jax.ShapeDtypeStruct
  args = ([shape((2, 256, 4, 128), dtype)] + [shape((2, 256, 2, 128), dtype)] * 2
          + [shape((2, 256), jnp.int32)] * 4)
  f = jax.jit(lambda *a: mosaic_gpu_forward(*a, causal=causal, window=window))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu" in text
  assert "triton" not in text
