"""A Mosaic GPU (Hopper) forward for the Pallas attention: one warpgroup per (head, block
of 64 queries, batch row), QKᵀ and PV by wgmma from shared memory, online softmax in
base 2. Opt-in and unmeasured: it lowers for cuda and runs in Mosaic GPU interpret mode;
it has not run on a GPU. It visits the key blocks of sparsity's visit lists (the row's list
copied to shared memory, read as scalars), masking each from segments and positions, the
full blocks too (no bias, no pipelining, no warp specialisation). Interpret mode
takes wgmma operands as untransposed shared-memory refs and has no register layouts, so
there Kᵀ and P are copied to shared memory and the id rows are read plainly."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels.pallas import sparsity

BLOCK = 64
# K/V shared-memory slots: visit j + 1's copies are issued before visit j's wgmmas, so
# they overlap one block's compute; a third slot would copy two blocks ahead at 2·64·d·2
# more bytes of shared memory per block of queries, which no measurement has yet asked for.
SLOTS = 2


def _interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _load(ref, layout, interpret):
  """A 1-D shared-memory vector in a wgmma row/column layout."""
  return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def _cast(interpret, x, layout):
  """x in a register layout (interpret mode has none)."""
  return x if interpret else plgpu.layout_cast(x, layout)


def _softmax_step(x, m_i, l_i, acc, masked):
  """One block of the online softmax in base 2: logits x [64, 64] (−inf where masked) ->
  weights p, and m_i, l_i [64], acc [64, d] rescaled to the new running max. A block with
  no mask has a finite max in every row, so only a masked one needs the guard for rows
  that have seen no key yet."""
  m_new = jnp.maximum(m_i, x.max(axis=1))
  safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m_i - safe)
  p = jnp.exp2(x - lax.broadcast_in_dim(safe, x.shape, [0]))
  l_i = l_i * alpha + p.sum(axis=1)
  return p, m_new, l_i, acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def _copy(pairs, barriers, first):
  """Copies each (GMEM ref, SMEM ref) pair on its own barrier from barriers[first] on and
  waits for all of them."""
  for i, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[first + i])
  for i in range(len(pairs)):
    plgpu.barrier_wait(barriers.at[first + i])


def _visible(q_seg, q_pos, k_seg, k_pos, *, causal, window, query_axis):
  """Which (query, key) pairs of a tile are visible, bool [64, 64]: the rows of 64 queries'
  and keys' segment ids and positions laid along their axes (the queries along query_axis):
  the same non-padding segment, the key not after the query (causal), and within window
  positions of it on each side."""
  shape, key_axis = (BLOCK, BLOCK), 1 - query_axis
  qs, qp = (lax.broadcast_in_dim(a, shape, [query_axis]) for a in (q_seg, q_pos))
  ks, kp = (lax.broadcast_in_dim(a, shape, [key_axis]) for a in (k_seg, k_pos))
  keep = (qs == ks) & (ks != 0)
  if causal:
    keep &= kp <= qp
  if window is not None:
    keep &= (qp - kp <= window) & (kp - qp <= window)
  return keep


def forward(q, k, v, q_segments, k_segments, q_positions, k_positions, *, causal, window,
            interpret=False):
  """q [b, tq, h, d] (already scaled by scale·log2e), k, v [b, tk, h_kv, d], segments and
  positions int32 [b, tq] / [b, tk] (segment 0 is padding) -> out [b, tq, h, d], base-2
  logsumexp float32 [b, h, tq]. tq, tk multiples of 64; d a multiple of 64; bf16/fp16."""
  (b, tq, h, d), tk = q.shape, k.shape[1]
  if d % 64 or tq % BLOCK or tk % BLOCK:
    raise ValueError(f"head dim {d} must be a multiple of 64 and lengths {tq}, {tk} of {BLOCK}")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"dtype {q.dtype} must be bfloat16 or float16")
  groups, dtype, nk = h // k.shape[2], q.dtype, tk // BLOCK
  width = -(-(nk + 2) // BLOCK) * BLOCK
  kind = sparsity.classify(q_segments, k_segments, q_positions, k_positions, causal=causal,
                           window=window, block_q=BLOCK, block_k=BLOCK, lq=tq, lk=tk)
  lists = sparsity.visit_lists(kind, width)

  def kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, list_ref, out_ref, lse_ref,
             q_smem, k_smem, v_smem, qs_smem, ks_smem, qp_smem, kp_smem, lse_smem, list_smem,
             bar, k_bar, v_bar, ks_bar, kp_bar, *copies):
    head, qb, row = lax.axis_index("heads"), lax.axis_index("q_seq"), lax.axis_index("batch")
    kv_head = lax.div(head, jnp.array(groups, head.dtype))
    q0 = qb * BLOCK
    _copy([(q_ref.at[row, pl.ds(q0, BLOCK), head], q_smem),
           (qs_ref.at[row, pl.ds(q0, BLOCK)], qs_smem),
           (qp_ref.at[row, pl.ds(q0, BLOCK)], qp_smem), (list_ref.at[row, qb], list_smem)],
          bar, 0)
    n_partial, n_visited = list_smem[0], list_smem[1]
    rows = plgpu.Layout.WGMMA.reduce(1)
    cols = plgpu.Layout.WGMMA.reduce(0)
    qseg = _load(qs_smem, rows, interpret)
    qpos = _load(qp_smem, rows, interpret)
    m_i = _cast(interpret, jnp.full((BLOCK,), -jnp.inf, jnp.float32), rows)
    l_i = _cast(interpret, jnp.full((BLOCK,), 0, jnp.float32), rows)
    acc = _cast(interpret, jnp.full((BLOCK, d), 0, jnp.float32), plgpu.Layout.WGMMA)

    def fetch(i):
      """Issues the copies of visit i into slot i mod SLOTS: K and V, and the key block's
      segment and position rows if it is partial (the partial visits come first)."""
      slot = lax.rem(i, SLOTS)
      s = (row, pl.ds(list_smem[2 + i] * BLOCK, BLOCK))
      plgpu.copy_gmem_to_smem(k_ref.at[s + (kv_head,)], k_smem.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[s + (kv_head,)], v_smem.at[slot], v_bar.at[slot])

      @pl.when(i < n_partial)
      def _():
        plgpu.copy_gmem_to_smem(ks_ref.at[s], ks_smem.at[slot], ks_bar.at[slot])
        plgpu.copy_gmem_to_smem(kp_ref.at[s], kp_smem.at[slot], kp_bar.at[slot])

    for i in range(SLOTS - 1):
      pl.when(i < n_visited)(lambda i=i: fetch(i))

    def step(j, carry, masked):
      """Visit j from slot j mod SLOTS, the copies of visit j + SLOTS − 1 issued first into
      the slot visit j − 1 read (its wgmmas awaited when their results were read)."""
      acc, m_i, l_i = carry
      slot = lax.rem(j, SLOTS)
      pl.when(j + SLOTS - 1 < n_visited)(lambda: fetch(j + SLOTS - 1))
      plgpu.barrier_wait(k_bar.at[slot])

      def qk(acc_ref):
        if interpret:  # the interpreter's wgmma takes refs only, untransposed
          copies[0][...] = k_smem[slot].T
          plgpu.wgmma(acc_ref, q_smem, copies[0])
        else:
          plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return acc_ref[...]
      x = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
      if masked:
        plgpu.barrier_wait(ks_bar.at[slot])
        plgpu.barrier_wait(kp_bar.at[slot])
        kseg = _load(ks_smem.at[slot], cols, interpret)
        kpos = _load(kp_smem.at[slot], cols, interpret)
        keep = _visible(qseg, qpos, kseg, kpos, causal=causal, window=window, query_axis=0)
        x = jnp.where(keep, x, -jnp.inf)
      p, m_i, l_i, acc = _softmax_step(x, m_i, l_i, acc, masked)
      plgpu.barrier_wait(v_bar.at[slot])

      def pv(acc_ref):
        if interpret:
          copies[1][...] = p.astype(dtype)
          plgpu.wgmma(acc_ref, copies[1], v_smem.at[slot])
        else:
          plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
        return acc_ref[...]
      acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK, d), jnp.float32))
      return acc, m_i, l_i

    carry = lax.fori_loop(0, n_partial, functools.partial(step, masked=True), (acc, m_i, l_i))
    acc, m_i, l_i = lax.fori_loop(n_partial, n_visited, functools.partial(step, masked=False),
                                  carry)
    empty = l_i == 0
    inv = 1.0 / jnp.where(empty, 1.0, l_i)
    acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    q_smem[...] = acc.astype(dtype)
    lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[row, pl.ds(q0, BLOCK), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, head, pl.ds(q0, BLOCK)])
    plgpu.wait_smem_to_gmem(0)

  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  tile = plgpu.SMEM((BLOCK, d), dtype, transforms=transforms)
  tiles = plgpu.SMEM((SLOTS, BLOCK, d), dtype, transforms=transforms)
  ids = plgpu.SMEM((BLOCK,), jnp.int32)
  id_slots = plgpu.SMEM((SLOTS, BLOCK), jnp.int32)
  scratch = [tile, tiles, tiles, ids, id_slots, ids, id_slots,
             plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((width,), jnp.int32),
             plgpu.Barrier(num_barriers=4)] + [plgpu.Barrier(num_barriers=SLOTS)] * 4
  scratch += [plgpu.SMEM((d, BLOCK), dtype), plgpu.SMEM((BLOCK, BLOCK), dtype)] if interpret else []
  call = plgpu.kernel(
      kernel, out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                        jax.ShapeDtypeStruct((b, h, tq), jnp.float32)],
      scratch_types=scratch, grid=(h, tq // BLOCK, b),
      grid_names=("heads", "q_seq", "batch"),
      interpret=_interpret_params() if interpret else None)
  i32 = lambda a: a.astype(jnp.int32)
  return tuple(call(q, k, v, i32(q_segments), i32(k_segments), i32(q_positions),
                    i32(k_positions), lists))
