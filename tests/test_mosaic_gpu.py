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

from transformer.model.kernels.pallas import mosaic_bias, mosaic_gpu_attention, mosaic_gpu_forward
from transformer.model.positions import POSITIONS, spec_bias
from transformer.model.positions.relative import Fire, T5Bias

L, D = 128, 64
# T5 saturating within a block; FIRE's MLP small, its kinks at 0.35 (w1 > 0) and 0 (w1 < 0:
# a tie at the diagonal's input 0)
SETTINGS = {"t5": T5Bias.Settings(num_buckets=8, max_distance=12),
            "fire": Fire.Settings(width=2, init_threshold=6.0)}
# XLA's backend at optimisation level 0 compiles the interpreted kernels faster
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _spec(position, heads, causal, settings=SETTINGS):
  """The BiasSpec of encoding `position` (None: none) for `heads` heads."""
  if position is None:
    return None
  enc = POSITIONS[position](16, heads, 256, causal=causal, settings=settings.get(position),
                            rngs=nnx.Rngs(1))
  if position == "fire":
    enc.hidden.bias[...] = jnp.resize(jnp.array([-0.2, 0.0]), enc.hidden.bias.shape)
  return enc.bias_spec()


def _dense(q, k, v, seg, pos, causal, window, spec=None, per_head=False):
  """Softmax in base 2 over the unmasked keys: out [b, t, h, d], lse [b, h, t] (−inf, out 0
  where a query sees no key). per_head: the bias by spec.fn mapped over the heads (each
  head's row of parameters its own, as the kernels read them), else by its dense form."""
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2).astype(jnp.float32) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k)
  if spec is not None:
    s = s + spec_bias(spec, pos, pos, blockwise=per_head) / math.log(2)
  qs, ks = seg[:, None, :, None], seg[:, None, None, :]
  qp, kp = pos[:, None, :, None], pos[:, None, None, :]
  keep = (qs == ks) & (ks != 0)
  keep &= (kp <= qp) if causal else True
  keep &= (jnp.abs(qp - kp) <= window) if window else True
  lse = jax.nn.logsumexp(jnp.where(keep, s * math.log(2), -jnp.inf), axis=-1) / math.log(2)
  p = jnp.where(keep, jnp.exp2(s - jnp.where(jnp.isinf(lse), 0, lse)[..., None]), 0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


# name: (segments, causal, window, heads, kv heads, positional bias, a gap in the positions
# from token 64 on). T5's gap puts the off-diagonal blocks wholly beyond its saturation
# (max_distance 12), on both sides: read as its constants
CASES = {
    "causal": ([1] * L, True, None, 1, 1, None, 0),
    "padded-alibi": ([1] * 100 + [0] * 28, False, 40, 2, 1, "alibi", 0),
    "packed-t5": ([1] * 30 + [2] * 98, False, None, 2, 1, "t5", 100),
    "packed-kerple": ([1] * 50 + [2] * 60 + [0] * 18, True, 24, 2, 2, "kerple", 0),
    "packed-fire": ([1] * 70 + [2] * 40 + [0] * 18, False, None, 2, 2, "fire", 0),
}


def _inputs(segments, heads, kv_heads, gap=0):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, L, heads, D)), jnp.float16)
  k, v = (jnp.asarray(rng.standard_normal((1, L, kv_heads, D)), jnp.float16) for _ in "kv")
  seg = jnp.asarray([segments], jnp.int32)
  starts = np.r_[0, np.flatnonzero(np.diff(segments)) + 1]
  pos = np.arange(L) - starts[np.searchsorted(starts, np.arange(L), "right") - 1]
  pos = jnp.asarray([pos + gap * (np.arange(L) >= 64)], jnp.int32)
  return q, k, v, seg, pos


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpret_equals_the_dense_formula(name):
  segments, causal, window, heads, kv_heads, position, gap = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads, gap)
  spec = _spec(position, heads, causal)
  out, lse = mosaic_gpu_forward(q, k, v, seg, seg, pos, pos, causal=causal, window=window,
                                bias_spec=spec, interpret=True)
  want, want_lse = _dense(q, k, v, seg, pos, causal, window, spec)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


@pytest.mark.parametrize("causal,window,dtype,position", [
    (True, None, jnp.bfloat16, None), (False, 32, jnp.float16, "t5"),
    (True, None, jnp.bfloat16, "fire")])
def test_lowers_for_cuda_to_a_mosaic_gpu_call(causal, window, dtype, position):
  shape = jax.ShapeDtypeStruct
  args = ([shape((2, 256, 4, 128), dtype)] + [shape((2, 256, 2, 128), dtype)] * 2
          + [shape((2, 256), jnp.int32)] * 4)
  spec = _spec(position, 4, causal, settings={})  # default settings: FIRE's 32 units
  f = jax.jit(lambda *a: mosaic_gpu_forward(*a, causal=causal, window=window, bias_spec=spec))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu" in text
  assert "triton" not in text


def _gradient_kernel(spec, heads, interpret):
  """A one-block kernel per head: (q positions [64], k positions [64], dS [h, 64, 64]) ->
  mosaic_bias.block_gradient packed as the parameter rows [h, width]."""
  rows, packing = mosaic_bias.pack(spec)
  tiled = () if interpret else (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

  def kernel(qp_ref, kp_ref, par_ref, ds_ref, out_ref, qp_smem, kp_smem, par_smem, ds_smem,
             out_smem, bar):
    head = lax.axis_index("heads")
    copies = [(qp_ref, qp_smem), (kp_ref, kp_smem), (par_ref.at[head], par_smem),
              (ds_ref.at[head], ds_smem)]
    for i, (src, dst) in enumerate(copies):
      plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
      plgpu.barrier_wait(bar.at[i])

    def load(ref, layout):
      return ref[...] if interpret else plgpu.load(ref, (), layout=layout)
    grads = mosaic_bias.block_gradient(
        spec, mosaic_bias.theta(par_smem, packing),
        load(qp_smem, plgpu.Layout.WGMMA.reduce(1)), load(kp_smem, plgpu.Layout.WGMMA.reduce(0)),
        load(ds_smem, plgpu.Layout.WGMMA))
    mosaic_bias.store(out_smem, packing, grads)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[head])
    plgpu.wait_smem_to_gmem(0)

  ids, row = plgpu.SMEM((64,), jnp.int32), plgpu.SMEM(rows.shape[1:], jnp.float32)
  call = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(rows.shape, jnp.float32),
      scratch_types=[ids, ids, row, plgpu.SMEM((64, 64), jnp.float32, transforms=tiled), row,
                     plgpu.Barrier(num_barriers=4)],
      grid=(heads,), grid_names=("heads",),
      interpret=_interpret_params() if interpret else None)
  return lambda qp, kp, ds: mosaic_bias.unpack(packing, call(qp, kp, rows, ds))


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


@pytest.mark.parametrize("position", ["t5", "kerple", "fire"])
def test_block_gradient_is_the_vjp_of_the_dense_bias(position):
  """Per head, against the vjp of the dense formula (spec.dense where it has one) of that
  head alone; positions restarting in both blocks, so k − q runs over both signs, beyond
  T5's saturation and onto FIRE's kink at 0."""
  heads, spec = 2, _spec(position, 2, causal=False)
  qp = jnp.asarray(np.r_[np.arange(30), np.arange(34)], jnp.int32)
  kp = jnp.asarray(np.r_[np.arange(50), np.arange(14)] + 3, jnp.int32)
  ds = jnp.asarray(np.random.default_rng(0).standard_normal((heads, 64, 64)), jnp.float32)
  got = _gradient_kernel(spec, heads, interpret=True)(qp, kp, ds)
  for head in range(heads):
    def bias(params):
      return spec_bias(dataclasses.replace(spec, params=params), qp[None], kp[None])[0, 0]
    own = {name: value[head:head + 1] for name, value in spec.params.items()}
    want = jax.vjp(bias, own)[1](ds[head])[0]
    for name in spec.params:  # float32 rounding: FIRE's vjp of c is 3e-5 off a float64 one
      scale = np.abs(np.asarray(want[name])).max()
      np.testing.assert_allclose(np.asarray(got[name][head]), np.asarray(want[name][0]),
                                 atol=1e-4 * scale + 1e-6, err_msg=f"{position} {name}")


@pytest.mark.parametrize("position", ["t5", "kerple", "fire"])
def test_block_gradient_lowers_for_cuda(position):
  spec = _spec(position, 4, causal=False, settings={})
  shape = jax.ShapeDtypeStruct
  args = [shape((64,), jnp.int32)] * 2 + [shape((4, 64, 64), jnp.float32)]
  text = jax.jit(_gradient_kernel(spec, 4, interpret=False)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu" in text
  assert "triton" not in text


def _loss(attend, spec, q, k, v, w):
  """Σ out·w and its gradient in q, k, v and the bias parameters, attend(q, k, v, spec)."""
  def loss(q, k, v, params):
    out = attend(q, k, v, dataclasses.replace(spec, params=params))
    return jnp.sum(out.astype(jnp.float32) * w)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, spec.params)


def test_attention_gradients_with_a_bias_equal_the_dense_formula():
  """mosaic_gpu_attention (interpret mode: forward, dk/dv and dq kernels with the bias and
  its parameters' block gradients) against the dense formula in float32, values and
  gradients in q, k, v and every bias parameter; T5 with its constants on the off-diagonal
  blocks (keys × queries in the dk/dv kernel). FIRE's and KERPLE's block gradients are
  test_block_gradient_is_the_vjp_of_the_dense_bias's."""
  segments, causal, window, _, _, position, gap = CASES["packed-t5"]
  heads = 1  # the interpreter runs each program in turn: one head halves the time
  q, k, v, seg, pos = _inputs(segments, heads, heads, gap)
  spec = _spec(position, heads, causal)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  ids = dict(q_segments=seg, k_segments=seg, q_positions=pos, k_positions=pos)

  def both(q, k, v):
    return (_loss(lambda q, k, v, spec: mosaic_gpu_attention(
                q, k, v, **ids, causal=causal, window=window, scale=0.5, bias_spec=spec,
                interpret=True), spec, q, k, v, w),
            _loss(lambda q, k, v, spec: _dense(
                q * 0.5 / math.log(2), k, v, seg, pos, causal, window, spec, per_head=True)[0],
                  spec, *(x.astype(jnp.float32) for x in (q, k, v)), w))
  got, want = jax.jit(both, compiler_options=FAST_COMPILE)(q, k, v)
  np.testing.assert_allclose(got[0], want[0], rtol=2e-3)
  for g, x in zip(got[1][:3], want[1][:3]):
    np.testing.assert_allclose(np.asarray(g, np.float32), x, atol=1e-2 * np.abs(x).max())
  # the parameters' within 1% of the largest: each is a sum of dS, whose rounding (out in
  # float16, in delta = Σ dO·out) is absolute, not relative to each sum
  scale = max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(want[1][3]))
  for name in spec.params:
    np.testing.assert_allclose(got[1][3][name], want[1][3][name], atol=1e-2 * scale,
                               err_msg=name)


@pytest.mark.parametrize("position", ["t5", "fire"])
def test_attention_gradients_with_a_bias_lower_for_cuda(position):
  """The gradient of mosaic_gpu_attention in q, k, v and the parameters (FIRE's default 32
  units) lowers to three mosaic_gpu calls (forward, dk/dv, dq) and no Triton."""
  spec = _spec(position, 4, causal=True, settings={})
  shape = jax.ShapeDtypeStruct
  ids = [shape((2, 256), jnp.int32)] * 4

  def loss(q, k, v, params, *ids):
    out = mosaic_gpu_attention(
        q, k, v, **dict(zip(("q_segments", "k_segments", "q_positions", "k_positions"), ids)),
        causal=True, bias_spec=dataclasses.replace(spec, params=params), interpret=False)
    return jnp.sum(out.astype(jnp.float32))
  args = ([shape((2, 256, 4, 64), jnp.bfloat16)] * 3
          + [jax.tree.map(lambda x: shape(x.shape, x.dtype), spec.params)] + ids)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  assert "triton" not in text
