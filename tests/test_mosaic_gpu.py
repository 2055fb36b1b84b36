"""The Mosaic GPU (Hopper) kernels (transformer/model/kernels/pallas/mosaic_gpu.py, the
forward; mosaic_gpu_backward.py): in Mosaic GPU interpret mode on this CPU the forward's
output and base-2 logsumexp, and the gradients of q, k, v (and of a learned bias's
parameters) through the backward kernels, equal the dense formula's for causal, padded and
packed segments, with a local window, grouped K/V heads and each positional bias; the
forward with more visited key blocks than K/V slots, with and without a bias, warp-
specialised (the compiled default) and through one warpgroup (interpret mode's), with no
data race between the copies and the reads (the interpreter's race detector); a block
declared full is added unmasked. The forward (with a bias, warp-specialised) and the
gradient lower for cuda to `mosaic_gpu` custom calls only, from abstract shapes; head dims
beyond shared memory are refused; kernel `mosaic_gpu` is never `auto`'s. The bias's block
gradient (mosaic_bias.py) in a one-block kernel equals the vjp of the dense bias and lowers
for cuda. (Its refusals: tests/test_kernel_choice.py, tests/test_bad_input.py; its values
and gradients through the registry: tests/test_kernel_conformance.py.)"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax._src.pallas.mosaic_gpu.interpret.params import (InterpretGPUParams,
                                                          force_gpu_interpret_mode)
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels import Needs, Target, choose
from transformer.model.kernels.pallas import (mosaic_bias, mosaic_gpu_attention,
                                              mosaic_gpu_forward, sparsity)
from transformer.model.positions import POSITIONS, spec_bias
from transformer.model.positions.relative import Fire, T5Bias

D = 64
# T5 saturating within a block; FIRE's MLP small, its kinks at 0.35 (w1 > 0) and 0 (w1 < 0:
# a tie at the diagonal's input 0)
SETTINGS = {"t5": T5Bias.Settings(num_buckets=8, max_distance=12),
            "fire": Fire.Settings(width=2, init_threshold=6.0)}
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # the interpreter's program compiles faster


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


# name: (segments (their length the sequence's), causal, window, heads, kv heads, positional
# bias, a gap in the positions from token 64 on). What each adds: causal: no bias, the second
# query block's first key block full, visited unmasked without id rows; padded-alibi: padding
# keys and queries, a window, grouped K/V heads; packed-t5: T5's gap puts the off-diagonal
# blocks wholly beyond its saturation (max_distance 12), on both sides: read as its
# constants; packed-kerple: causal, a window and packing with K/V heads per query head;
# packed-fire: FIRE's MLP; packed_long: 4 key blocks, asked for its last 128 queries only
# (one block of queries, 4 visits through 2 slots: 3 partial, then 1 full, ALiBi on both,
# the full one reading its key positions for the bias only).
CASES = {
    "causal": ([1] * 128, True, None, 1, 1, None, 0),
    "padded-alibi": ([1] * 100 + [0] * 28, False, 40, 2, 1, "alibi", 0),
    "packed-t5": ([1] * 30 + [2] * 98, False, None, 2, 1, "t5", 100),
    "packed-kerple": ([1] * 50 + [2] * 60 + [0] * 18, True, 24, 2, 2, "kerple", 0),
    "packed-fire": ([1] * 70 + [2] * 40 + [0] * 18, False, None, 2, 2, "fire", 0),
    "packed_long": ([1] * 40 + [2] * 216, True, None, 1, 1, "alibi", 0),
}
FIRST_QUERY = {"packed_long": 128}  # the queries asked for start there (the keys: at 0)


def _inputs(segments, heads, kv_heads, gap=0):
  rng, t = np.random.default_rng(0), len(segments)
  q = jnp.asarray(rng.standard_normal((1, t, heads, D)), jnp.float16)
  k, v = (jnp.asarray(rng.standard_normal((1, t, kv_heads, D)), jnp.float16) for _ in "kv")
  seg = jnp.asarray([segments], jnp.int32)
  starts = np.r_[0, np.flatnonzero(np.diff(segments)) + 1]
  pos = np.arange(t) - starts[np.searchsorted(starts, np.arange(t), "right") - 1]
  pos = jnp.asarray([pos + gap * (np.arange(t) >= 64)], jnp.int32)
  return q, k, v, seg, pos


# (case, warp-specialised): each case once through one warpgroup, packed_long in both
# schedules. Interpreting the warp-specialised kernel costs a few seconds per block of 128
# queries, one warpgroup ~1 s.
SCHEDULES = [(name, False) for name in CASES] + [("packed_long", True)]


@pytest.mark.parametrize("name,specialised", SCHEDULES)
def test_interpret_equals_the_dense_formula(name, specialised):
  """packed_long also under the interpreter's race detector: no read of a K/V slot (or of
  its position row, read by the bias on the full visit too) while a copy into it may be in
  flight (and, warp-specialised, no slot handed back early)."""
  segments, causal, window, heads, kv_heads, position, gap = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads, gap)
  spec = _spec(position, heads, causal)
  detect, first = name == "packed_long", FIRST_QUERY.get(name, 0)
  with force_gpu_interpret_mode(InterpretGPUParams(detect_races=detect)):
    out, lse = mosaic_gpu_forward(q[:, first:], k, v, seg[:, first:], seg, pos[:, first:], pos,
                                  causal=causal, window=window, bias_spec=spec,
                                  interpret=True, specialised=specialised)
  assert not (detect and get_races().races_found)
  want, want_lse = _dense(q, k, v, seg, pos, causal, window, spec)
  want, want_lse = want[:, first:], want_lse[..., first:]
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


def test_blocks_declared_full_are_added_unmasked(monkeypatch):
  """With every block declared full, a padded, windowed call of 64 queries attends to every
  key: the full blocks' loop applies no mask (and, with no bias, waits for no segment or
  position rows). Warp-specialised, its 64 queries padded to 128; the loop is the same code
  through one warpgroup."""
  segments, causal, window = [1] * 50 + [0] * 14, False, 40
  q, k, v, seg, pos = _inputs(segments, 1, 1)
  monkeypatch.setattr(sparsity, "classify", lambda *a, block_q, block_k, lq, lk, **kw: jnp.full(
      (q.shape[0], lq // block_q, lk // block_k), sparsity.FULL, jnp.int32))
  out, lse = mosaic_gpu_forward(q, k, v, seg, seg, pos, pos, causal=causal, window=window,
                                interpret=True, specialised=True)
  want, want_lse = _dense(q, k, v, jnp.ones_like(seg), pos, False, None)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=4e-3)
  np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4)


@pytest.mark.parametrize("causal,window,dtype,length,dim,specialised,position", [
    (True, None, jnp.bfloat16, 256, 128, None, "t5"),
    (False, 32, jnp.float16, 192, 64, None, None),
    (True, 32, jnp.bfloat16, 192, 64, False, None)])
def test_the_forward_lowers_for_cuda_to_a_mosaic_gpu_call(causal, window, dtype, length, dim,
                                                          specialised, position):
  """Warp-specialised (compiled's default): lengths of 256 with T5's bias (its saturated
  blocks' cond) and of 192 (its queries padded to 128s), head dims 128 and 64; and through
  one warpgroup."""
  shape = jax.ShapeDtypeStruct
  spec = _spec(position, 4, causal, settings={})
  args = ([shape((2, length, 4, dim), dtype)] + [shape((2, length, 2, dim), dtype)] * 2
          + [shape((2, length), jnp.int32)] * 4)
  f = jax.jit(lambda *a: mosaic_gpu_forward(*a, causal=causal, window=window, bias_spec=spec,
                                            specialised=specialised))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.custom_call @mosaic_gpu" in text
  assert "triton" not in text


def test_refuses_head_dims_beyond_shared_memory():
  shape = jax.ShapeDtypeStruct
  args = [shape((1, 64, 1, 320), jnp.bfloat16)] * 3 + [shape((1, 64), jnp.int32)] * 4
  with pytest.raises(ValueError, match="head dim 320 must be at most 256"):
    jax.eval_shape(lambda *a: mosaic_gpu_forward(*a, causal=True, window=None), *args)


SCALE = 0.3


@pytest.mark.parametrize("name", ["packed-kerple", "packed-t5"])
def test_gradients_equal_the_dense_formulas(name):
  """jax.grad through attention (q unscaled, scale given; head dim 48 and length 120 padded
  to 64 and 128 inside) against jax.grad of the dense formula, on the queries that see a
  key, in float32 from the same float16 inputs: q, k, v and a learned bias's parameters
  (KERPLE's closed form, with causal, a window and packing; T5's per-bucket sums, its
  constants on the off-diagonal blocks, keys × queries in the dk/dv kernel, with grouped
  K/V heads). FIRE's block gradients: test_block_gradient_is_the_vjp_of_the_dense_bias;
  the gradients without a bias (every mask, K/V heads 4/2/1, bf16 and fp16):
  tests/test_kernel_conformance.py."""
  segments, causal, window, heads, kv_heads, position, gap = CASES[name]
  q, k, v, seg, pos = _inputs(segments, heads, kv_heads, gap)
  q, k, v = (x[:, :120, :, :48] for x in (q, k, v))
  seg, pos = seg[:, :120], pos[:, :120]
  spec = _spec(position, heads, causal)
  params = {} if spec is None else spec.params
  weights = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  weights = weights * (seg > 0)[..., None, None]

  def with_params(params):
    return None if spec is None else dataclasses.replace(spec, params=params)

  def kernel(q, k, v, params):
    out = mosaic_gpu_attention(q, k, v, q_segments=seg, k_segments=seg, q_positions=pos,
                               k_positions=pos, causal=causal, window=window, scale=SCALE,
                               bias_spec=with_params(params), interpret=True)
    return jnp.sum(out.astype(jnp.float32) * weights)

  def dense(q, k, v, params):  # each head's row of parameters its own, as the kernels read
    out = _dense(q * SCALE / math.log(2), k, v, seg, pos, causal, window,
                 with_params(params), per_head=True)[0]
    return jnp.sum(out * weights)

  argnums = (0, 1, 2, 3)
  got = jax.jit(jax.grad(kernel, argnums), compiler_options=FAST_COMPILE)(q, k, v, params)
  want = jax.grad(dense, argnums)(*(x.astype(jnp.float32) for x in (q, k, v)), params)
  for g, w in zip(got[:3], want[:3], strict=True):
    assert g.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=4e-3 * np.abs(w).max())
  if spec is not None and spec.learned:  # within 1% of the largest: each is a sum of dS,
    # whose rounding (out in float16, in delta = Σ dO·out) is absolute, not per sum
    scale = max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(want[3]))
    for name in spec.params:
      np.testing.assert_allclose(got[3][name], want[3][name], atol=1e-2 * scale,
                                 err_msg=name)


@pytest.mark.parametrize("causal,window,dtype,position", [
    (True, None, jnp.bfloat16, None), (False, 32, jnp.float16, "t5"),
    (True, None, jnp.bfloat16, "fire")])
def test_the_gradient_lowers_for_cuda_to_mosaic_gpu_calls_only(causal, window, dtype,
                                                                 position):
  """jax.grad of attention (grouped K/V heads, lengths and head dim 80 padded inside), in
  q, k, v and a bias's parameters (FIRE's default 32 units): forward, dk/dv and dq
  kernels, three Mosaic GPU custom calls and nothing of Triton."""
  shape = jax.ShapeDtypeStruct
  spec = _spec(position, 4, causal, settings={})
  params = {} if spec is None else jax.tree.map(lambda x: shape(x.shape, x.dtype),
                                                spec.params)
  args = ([shape((2, 200, 4, 80), dtype)] + [shape((2, 200, 2, 80), dtype)] * 2
          + [params] + [shape((2, 200), jnp.int32)] * 4)

  def loss(q, k, v, params, *ids):
    out = mosaic_gpu_attention(
        q, k, v, q_segments=ids[0], k_segments=ids[1], q_positions=ids[2],
        k_positions=ids[3], causal=causal, window=window, scale=0.1, interpret=False,
        bias_spec=None if spec is None else dataclasses.replace(spec, params=params))
    return jnp.sum(out.astype(jnp.float32))

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 3
  assert text.count("stablehlo.custom_call @") == 3
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
      interpret=InterpretGPUParams() if interpret else None)
  return lambda qp, kp, ds: mosaic_bias.params_gradient(spec, packing, call(qp, kp, rows, ds))


def test_block_gradient_is_the_vjp_of_the_dense_bias():
  """FIRE's (its two sums per unit; the vjp of the input at dS·A(x)), per head, against the
  vjp of the dense formula of that head alone; positions restarting in both blocks, so
  k − q runs over both signs and onto the kink at 0. (T5's and KERPLE's gradients are
  test_gradients_equal_the_dense_formulas'.)"""
  position = "fire"
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


def test_auto_never_takes_it():
  """Unmeasured, so in no AUTO_ORDER: on a GPU, auto takes another kernel for a bf16 layer
  it could run, and does not consider it."""
  choice, _ = choose("auto", Needs({"grouped_query"}, dtype="bfloat16"), Target("gpu"))
  assert choice.name != "mosaic_gpu"
  assert "mosaic_gpu" not in dict(choice.passed_over)
