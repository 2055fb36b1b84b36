"""The backward of the Mosaic GPU (Hopper) attention and the differentiable `attention`
(kernel `mosaic_gpu` of the registry): `backward`, a dk/dv kernel per key block over the
transposed visit lists and a dq kernel per query block, one warpgroup each, masking every
visited block (mosaic_blocks.visible) and adding the bias (mosaic_bias.tile), the dq
kernel giving its parameters' gradient; `attention`, a custom VJP over mosaic_gpu.forward
and `backward`, q unscaled, any lengths and head dims, padded to multiples of 64 inside.
Opt-in and unmeasured: it lowers for cuda and runs in Mosaic GPU interpret mode; it has
not run on a GPU. Interpret mode takes wgmma operands as untransposed shared-memory refs
and has no register layouts, so there the operands go through shared-memory copies and
the id rows are read plainly."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels.pallas import mosaic_bias, sparsity
from transformer.model.kernels.pallas.bodies import LN2, LOG2E
from transformer.model.kernels.pallas.layouts import round_up
from transformer.model.kernels.pallas.mosaic_blocks import (BLOCK, TILE_TRANSFORMS, cast,
                                                            copy_in, interpret_params, load,
                                                            visible, visit_lists)
from transformer.model.kernels.pallas.mosaic_gpu import forward


def _product(shape, a, b, copies, *, registers=False, transpose=False):
  """a·b (transpose: a·bᵀ) by wgmma into a fresh float32 accumulator of `shape`: a a
  shared-memory ref, or (registers) an array in the wgmma layout; b a shared-memory ref.
  copies: None where lowered; in interpret mode, whose wgmma takes untransposed refs only,
  two shared-memory tiles ([64, 64], [d, 64]) through which the array and bᵀ go."""

  def body(acc):
    lhs, rhs = a, b
    if copies is not None:
      if registers:
        copies[0][...] = a
        lhs = copies[0]
      if transpose:
        copies[1][...] = b[...].T
        rhs = copies[1]
    elif transpose:
      rhs = plgpu.transpose_ref(b, (1, 0))
    plgpu.wgmma(acc, lhs, rhs)
    return acc[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _scratch(d, dtype, interpret, barriers):
  """Shared memory of a backward kernel: four wgmma tiles [64, d] (tiled and swizzled), six
  rows of 64 (ids, lse, delta), its visit list, the barriers, and the interpreter's copies."""
  tile = plgpu.SMEM((BLOCK, d), dtype, transforms=TILE_TRANSFORMS)
  ids, stats = plgpu.SMEM((BLOCK,), jnp.int32), plgpu.SMEM((BLOCK,), jnp.float32)
  return ([tile] * 4 + [ids] * 4 + [stats] * 2, [plgpu.Barrier(num_barriers=barriers)],
          [plgpu.SMEM((BLOCK, BLOCK), dtype), plgpu.SMEM((d, BLOCK), dtype)] if interpret
          else [])


def backward(q, k, v, q_segments, k_segments, q_positions, k_positions, lse, delta, do, *,
             causal, window, scale, bias_spec=None, interpret=False):
  """The gradients of forward's inputs: q (as scaled there), k, v, the ids, lse and
  bias_spec as forward's; delta = rowsum(dO·O) float32 [b, h, tq]; do [b, tq, h, d] -> dq
  [b, tq, h, d] of the UNSCALED q (the logits being scale·q·kᵀ + bias), dk, dv [b, tk, h_kv,
  d], and the bias parameters' gradient {name: [h, size]} (None: no bias, or not learned).

  Two kernels, each one warpgroup and none atomic: one per (head, block of 64 keys, row)
  for dk and dv, walking its key block's transposed visit list (the query blocks that see
  it) with 4 wgmma per visited block (Sᵀ = K·Qᵀ, dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dK += dSᵀ·Q), per
  query head (summed over a K/V head's group in XLA); one per (head, block of 64 queries,
  row) for dq over the forward's visit lists (S, dP, dQ += dS·K). dq by a kernel of its own
  rather than atomics: deterministic, dq in its dtype with no float32 array beside it, and
  testable here (the interpreter has no TMA reduction: "reduction_op not supported"); it
  recomputes S and dP (2 wgmma per block more than atomics). The mask on every visited
  block (the forward's on its partial ones only); the bias added to S in both (mosaic_bias.tile), its parameters' gradient
  summed over the dq kernel's blocks (mosaic_bias.block_gradient) into a row per program
  and over the programs in XLA."""
  (b, tq, h, d), tk = q.shape, k.shape[1]
  groups, dtype, nq, nk = h // k.shape[2], q.dtype, tq // BLOCK, tk // BLOCK
  ids = tuple(x.astype(jnp.int32) for x in (q_segments, k_segments, q_positions, k_positions))
  kind = sparsity.classify(*ids, causal=causal, window=window, block_q=BLOCK,
                           block_k=BLOCK, lq=tq, lk=tk)
  by_query, by_key = visit_lists(kind), visit_lists(jnp.swapaxes(kind, 1, 2))
  lse = jnp.where(jnp.isinf(lse), 0.0, lse)  # a query seeing no key: masked wherever read
  rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  shape = (BLOCK, BLOCK)
  mask = functools.partial(visible, causal=causal, window=window)
  params, packing = mosaic_bias.operand(bias_spec, h)
  learned = bias_spec is not None and bias_spec.learned

  def copy_params(par_ref, par_smem, bar, head):  # this head's row, read per block
    if bias_spec is not None:
      copy_in([(par_ref.at[head], par_smem)], bar, 11)

  def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, qp_ref,
                 kp_ref, list_ref, par_ref, dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem,
                 qs_smem, qp_smem, ks_smem, kp_smem, lse_smem, delta_smem, list_smem,
                 par_smem, _, bar, *copies):
    head, kb, row = lax.axis_index("heads"), lax.axis_index("blocks"), lax.axis_index("batch")
    kv_head = lax.div(head, jnp.array(groups, head.dtype))
    keys = (row, pl.ds(kb * BLOCK, BLOCK))
    copy_in([(k_ref.at[keys + (kv_head,)], k_smem), (v_ref.at[keys + (kv_head,)], v_smem),
             (ks_ref.at[keys], ks_smem), (kp_ref.at[keys], kp_smem),
             (list_ref.at[row, kb], list_smem)], bar, 0)
    kseg, kpos = load(ks_smem, rows, interpret), load(kp_smem, rows, interpret)
    copy_params(par_ref, par_smem, bar, head)
    copies = copies or None

    def step(j, carry):
      dk, dv = carry
      q0 = list_smem[2 + j] * BLOCK
      queries = (row, pl.ds(q0, BLOCK))
      stats = (row, head, pl.ds(q0, BLOCK))
      copy_in([(q_ref.at[queries + (head,)], q_smem), (do_ref.at[queries + (head,)], do_smem),
               (qs_ref.at[queries], qs_smem), (qp_ref.at[queries], qp_smem),
               (lse_ref.at[stats], lse_smem), (delta_ref.at[stats], delta_smem)], bar, 5)
      st = _product(shape, k_smem, q_smem, copies, transpose=True)  # keys × queries
      qpos = load(qp_smem, cols, interpret)
      if bias_spec is not None:
        st = st + mosaic_bias.tile(bias_spec, mosaic_bias.theta(par_smem, packing), qpos, kpos,
                                   interpret=interpret, query_axis=1)
      keep = mask(load(qs_smem, cols, interpret), qpos, kseg, kpos, query_axis=1)
      def column(ref):
        return lax.broadcast_in_dim(load(ref, cols, interpret), shape, [1])
      pt = jnp.where(keep, jnp.exp2(st - column(lse_smem)), 0.0)
      dv = dv + _product((BLOCK, d), pt.astype(dtype), do_smem, copies, registers=True)
      dpt = _product(shape, v_smem, do_smem, copies, transpose=True)
      dst = pt * (dpt - column(delta_smem))
      dk = dk + _product((BLOCK, d), dst.astype(dtype), q_smem, copies, registers=True)
      return dk, dv

    zeros = cast(interpret, jnp.zeros((BLOCK, d), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, list_smem[1], step, (zeros, zeros))
    k_smem[...] = (dk * LN2).astype(dtype)  # q was scaled by scale·log2e: ln2·dSᵀ·Q
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys + (head,)])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys + (head,)])
    plgpu.wait_smem_to_gmem(0)

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, qp_ref,
                kp_ref, list_ref, par_ref, dq_ref, dpar_ref, q_smem, do_smem, k_smem, v_smem,
                qs_smem, qp_smem, ks_smem, kp_smem, lse_smem, delta_smem, list_smem, par_smem,
                dpar_smem, bar, *copies):
    head, qb, row = lax.axis_index("heads"), lax.axis_index("blocks"), lax.axis_index("batch")
    kv_head = lax.div(head, jnp.array(groups, head.dtype))
    queries, stats = (row, pl.ds(qb * BLOCK, BLOCK)), (row, head, pl.ds(qb * BLOCK, BLOCK))
    copy_in([(q_ref.at[queries + (head,)], q_smem), (do_ref.at[queries + (head,)], do_smem),
             (qs_ref.at[queries], qs_smem), (qp_ref.at[queries], qp_smem),
             (lse_ref.at[stats], lse_smem), (delta_ref.at[stats], delta_smem),
             (list_ref.at[row, qb], list_smem)], bar, 0)
    qseg, qpos = load(qs_smem, rows, interpret), load(qp_smem, rows, interpret)
    lse_rows, delta_rows = (lax.broadcast_in_dim(load(ref, rows, interpret), shape, [0])
                            for ref in (lse_smem, delta_smem))
    copy_params(par_ref, par_smem, bar, head)
    copies = copies or None

    def step(j, carry):
      dq, dbias = carry
      keys = (row, pl.ds(list_smem[2 + j] * BLOCK, BLOCK))
      copy_in([(k_ref.at[keys + (kv_head,)], k_smem), (v_ref.at[keys + (kv_head,)], v_smem),
               (ks_ref.at[keys], ks_smem), (kp_ref.at[keys], kp_smem)], bar, 7)
      s = _product(shape, q_smem, k_smem, copies, transpose=True)
      kpos = load(kp_smem, cols, interpret)
      if bias_spec is not None:  # the head's parameters read per block, not held
        bias = mosaic_bias.theta(par_smem, packing)
        s = s + mosaic_bias.tile(bias_spec, bias, qpos, kpos, interpret=interpret)
      keep = mask(qseg, qpos, load(ks_smem, cols, interpret), kpos, query_axis=0)
      p = jnp.where(keep, jnp.exp2(s - lse_rows), 0.0)
      ds = p * (_product(shape, do_smem, v_smem, copies, transpose=True) - delta_rows)
      if learned:  # dS is the natural logits' (and the bias's) gradient
        dbias = jax.tree.map(jnp.add, dbias,
                             mosaic_bias.block_gradient(bias_spec, bias, qpos, kpos, ds))
      return dq + _product((BLOCK, d), ds.astype(dtype), k_smem, copies, registers=True), dbias

    zeros = cast(interpret, jnp.zeros((BLOCK, d), jnp.float32), plgpu.Layout.WGMMA)
    dq, dbias = lax.fori_loop(0, list_smem[1], step, (zeros, mosaic_bias.zero_gradient(
        packing if learned else ())))
    q_smem[...] = (dq * scale).astype(dtype)  # dS·K in the unscaled q's units
    if learned:
      mosaic_bias.store(dpar_smem, packing, dbias)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[queries + (head,)])
    if learned:
      plgpu.copy_smem_to_gmem(dpar_smem, dpar_ref.at[row, head, qb])
    plgpu.wait_smem_to_gmem(0)

  def call(kernel, blocks, outputs, width):
    tiles, barrier, copies = _scratch(d, dtype, interpret, 12)
    row_smem = plgpu.SMEM(params.shape[1:], jnp.float32)  # the parameters, their gradient
    return plgpu.kernel(
        kernel, out_type=outputs, scratch_types=tiles + [plgpu.SMEM((width,), jnp.int32)]
        + [row_smem] * 2 + barrier + copies, grid=(h, blocks, b),
        grid_names=("heads", "blocks", "batch"),
        interpret=interpret_params() if interpret else None)

  inputs = (q, k, v, do, lse, delta, *ids)
  per_query_head = jax.ShapeDtypeStruct((b, tk, h, d), dtype)
  dk, dv = call(dkv_kernel, nk, [per_query_head] * 2, by_key.shape[-1])(
      *inputs, by_key, params)
  rows_out = jax.ShapeDtypeStruct((b, h, nq, params.shape[1]) if learned else (1, 1, 1, 1),
                                  jnp.float32)  # a program's row of the gradient
  dq, drows = call(dq_kernel, nq, [jax.ShapeDtypeStruct(q.shape, dtype), rows_out],
                   by_query.shape[-1])(*inputs, by_query, params)
  if groups > 1:  # each query head's share, summed into its key/value head
    dk, dv = (x.reshape(b, tk, h // groups, groups, d).astype(jnp.float32).sum(3)
              .astype(dtype) for x in (dk, dv))
  dparams = (mosaic_bias.params_gradient(bias_spec, packing, drows.sum((0, 2))) if learned
             else None)
  return dq, dk, dv, dparams


@dataclasses.dataclass(frozen=True)
class _Static:
  """What attention's kernels are specialised on."""

  causal: bool
  window: int | None
  scale: float
  interpret: bool  # Mosaic GPU's interpret mode, else compiled
  bias: object = None  # the BiasSpec without its params (passed beside), or None


def _spec(st: _Static, params):
  return None if st.bias is None else dataclasses.replace(st.bias, params=params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, q, k, v, ids, params):
  return _attend_forward(st, q, k, v, ids, params)[0]


def _attend_forward(st: _Static, q, k, v, ids, params):
  scaled = q * jnp.asarray(st.scale * LOG2E, q.dtype)  # the kernels' logits are in base 2
  out, lse = forward(scaled, k, v, *ids, causal=st.causal, window=st.window,
                     bias_spec=_spec(st, params), interpret=st.interpret)
  return out, (scaled, k, v, ids, params, out, lse)


def _attend_backward(st: _Static, residuals, do):
  scaled, k, v, ids, params, out, lse = residuals
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
  dq, dk, dv, dparams = backward(scaled, k, v, *ids, lse, delta, do, causal=st.causal,
                                 window=st.window, scale=st.scale,
                                 bias_spec=_spec(st, params), interpret=st.interpret)
  if dparams is None:
    dparams = jax.tree.map(jnp.zeros_like, params)
  return dq, dk, dv, (None,) * len(ids), dparams


_attend.defvjp(_attend_forward, _attend_backward)


def _pad(x, length: int, width: int | None = None):
  """x [b, t, ...] zero-padded to `length` along t (and to `width` along its last axis)."""
  pads = [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  if width is not None:
    pads[-1] = (0, width - x.shape[-1])
  return jnp.pad(x, pads)


def attention(q, k, v, *, q_segments, k_segments, q_positions, k_positions,
              causal: bool = False, window: int | None = None, scale: float = 1.0,
              bias_spec=None, interpret: bool | None = None):
  """softmax(scale·q·kᵀ + bias)·V over the visible keys by the Mosaic GPU kernels (forward
  and backward: differentiable in q, k, v and the bias's parameters), bfloat16 or float16.

  Args:
    q: [b, tq, h, d]; k: [b, tk, kv_heads, d]; v: [b, tk, kv_heads, d_v] (kv_heads divides
      h). Any lengths and head dims: padded inside to multiples of 64 (the padded keys and
      queries are padding, segment 0; the padded head-dim columns zero).
    q_segments, k_segments, q_positions, k_positions: int [b, tq], [b, tk], as
      flash_attention's (segment 0 is padding; the masks read positions, never indices).
    causal: keys at positions ≤ the query's only; window: within ±window positions.
    bias_spec: a positional bias (BiasSpec, evaluated per block in the kernels:
      mosaic_bias.py), its params' gradient given where it is learned; None: none.
    interpret: run Mosaic GPU's interpret mode (on any platform), else compile the kernels
      (for cuda: Hopper or later); None: interpret unless this process's default backend
      is a GPU. Chosen when traced, not per lowering platform: jax.lax.platform_dependent
      cannot hold the interpreter, whose ordered callbacks the compiled branch lacks (JAX
      0.10.2 lowering for cuda: "Lowering rule for `cond` returns incorrect set of output
      tokens. Expected: (<OrderedIOEffect>,) vs. Actual: ()").
  Returns:
    [b, tq, h, d_v] in v's dtype; 0 for a query that sees no key.
  """
  (_, tq, _, d), tk, dv = q.shape, k.shape[1], v.shape[-1]
  lq, lk, width = round_up(tq, BLOCK), round_up(tk, BLOCK), round_up(max(d, dv), BLOCK)
  # padded positions repeat the last (padding is masked by its segment 0 whatever its
  # positions; so the padded blocks' position ranges, which decide a saturating bias's
  # constant blocks, stay those of their real tokens)
  edge = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])], mode="edge")  # noqa: E731
  ids = (_pad(q_segments, lq), _pad(k_segments, lk), edge(q_positions, lq),
         edge(k_positions, lk))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  st = _Static(causal=causal, window=window, scale=float(scale), interpret=interpret,
               bias=None if bias_spec is None else dataclasses.replace(bias_spec, params=None))
  out = _attend(st, _pad(q, lq, width), _pad(k, lk, width), _pad(v, lk, width),
                tuple(x.astype(jnp.int32) for x in ids),
                {} if bias_spec is None else dict(bias_spec.params))
  return out[:, :tq, :, :dv]
