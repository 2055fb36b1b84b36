"""A Mosaic GPU (Hopper) forward for the Pallas attention, warp-specialised as
FlashAttention-3: per (head, block of 128 queries, batch row), a producer warpgroup issues
the TMA copies of the visited key blocks into SLOTS shared-memory slots while two consumer
warpgroups, 64 queries each, compute QKᵀ and PV by wgmma and the online softmax in base 2,
handing each slot back by a barrier and taking turns, one's softmax beside the other's
wgmma. The key blocks are those of sparsity's visit lists (the row's list copied to shared
memory, read as scalars): the partial ones first, masked from segment and position rows
copied with them, then the full ones, unmasked and without those rows. A BiasSpec's bias
(mosaic_bias.tile) is added to every visited block before its mask: then every visit's
key position row is copied, and the head's parameters once, read as scalars per block.
The backward and the differentiable `attention`: mosaic_gpu_backward.py. The same body runs
as one warpgroup per block of 64 queries issuing its own copies one visit ahead (interpret
mode's default: the interpreter sets up each warpgroup of a warp-specialised kernel anew
for every block of queries). Opt-in and unmeasured: it lowers for cuda and runs in Mosaic
GPU interpret mode; it has not run on a GPU. Interpret mode takes wgmma operands as
untransposed shared-memory refs and has no register layouts nor run_state, so there Kᵀ
and P are copied to shared memory, the id rows are read plainly and P·V goes to a fresh
accumulator, added to the running one."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels.pallas import mosaic_bias, sparsity
from transformer.model.kernels.pallas.mosaic_blocks import (BLOCK, TILE_TRANSFORMS, cast,
                                                            copy_in, interpret_params, load,
                                                            visible, visit_lists)

# Consumer warpgroups per block of queries, each 64 queries sharing the K/V slots, as
# FlashAttention-3 and JAX's attention_mgpu: one block's copies feed twice the wgmma work.
# Two, as their alternation (`turn` in forward) is written for two.
CONSUMERS = 2
# K/V shared-memory slots: the producer fills visit j + 1's slot while the consumers compute
# visit j. A third slot would let it run two visits ahead, at 2·64·d·2 more bytes of shared
# memory per block of queries, which no measurement has yet asked for.
SLOTS = 2
# Registers per thread (set_max_registers): the producer issues copies only; the consumers
# hold a 64×d float32 accumulator and a 64×64 logits tile. 128·(2·232 + 40) ≤ 65536.
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232
# Two q tiles and SLOTS K and V slots of 64×d: 192 KiB at 256, over Hopper's 227 KiB of
# shared memory per block from 320 on (the lowering refuses those).
MAX_HEAD_DIM = 256


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


def _forward_scratch(d, dtype, width, params, consumers, interpret):
  """Shared memory of the forward, in its kernel's argument order: the consumers' q tiles
  [consumers, 64, d] (their outputs too) and the K, V slots [SLOTS, 64, d], tiled and
  swizzled; the consumers' segment and position rows and the slots' ones; the consumers'
  lse rows; the visit list; the head's bias parameters (a row of `params` floats); the
  barriers (q rows per consumer; the list and the parameters; K, V and the id rows per
  slot; K's and V's slots handed back by the consumers and the consumers' turns, used when
  warp-specialised); and the interpreter's Kᵀ and P tiles, per consumer."""
  tiles = lambda n: plgpu.SMEM((n, BLOCK, d), dtype, transforms=TILE_TRANSFORMS)  # noqa: E731
  rows = lambda n, t=jnp.int32: plgpu.SMEM((n, BLOCK), t)  # noqa: E731
  scratch = [tiles(consumers), tiles(SLOTS), tiles(SLOTS), rows(consumers), rows(SLOTS),
             rows(consumers), rows(SLOTS), rows(consumers, jnp.float32),
             plgpu.SMEM((width,), jnp.int32), plgpu.SMEM((params,), jnp.float32),
             plgpu.Barrier(num_barriers=3 * consumers), plgpu.Barrier(num_barriers=2)]
  scratch += [plgpu.Barrier(num_barriers=SLOTS)] * 4
  scratch += [plgpu.Barrier(num_arrivals=consumers, num_barriers=SLOTS)] * 2
  scratch += [plgpu.Barrier(num_arrivals=consumers)]
  if interpret:
    scratch += [plgpu.SMEM((consumers, d, BLOCK), dtype),
                plgpu.SMEM((consumers, BLOCK, BLOCK), dtype)]
  return scratch


def forward(q, k, v, q_segments, k_segments, q_positions, k_positions, *, causal, window,
            bias_spec=None, interpret=False, specialised=None):
  """q [b, tq, h, d] (already scaled by scale·log2e), k, v [b, tk, h_kv, d], segments and
  positions int32 [b, tq] / [b, tk] (segment 0 is padding) -> out [b, tq, h, d], base-2
  logsumexp float32 [b, h, tq]. tq, tk multiples of 64; d a multiple of 64, at most
  MAX_HEAD_DIM; bf16/fp16. bias_spec: a positional bias (BiasSpec, params [h, size] each)
  added to the logits, evaluated per block inside the kernel (mosaic_bias.tile), on every
  visited block; None: none. specialised: warp-specialised (a producer and CONSUMERS
  consumers per block of 128 queries; the queries padded here to a multiple of 128), or one
  warpgroup per block of 64 queries issuing its own copies one visit ahead; None: the first
  where compiled, the second in interpret mode, which runs each warpgroup of a
  warp-specialised kernel as a thread set up anew for every block of queries."""
  (b, tq, h, d), tk = q.shape, k.shape[1]
  if d % 64 or tq % BLOCK or tk % BLOCK:
    raise ValueError(f"head dim {d} must be a multiple of 64 and lengths {tq}, {tk} of {BLOCK}")
  if d > MAX_HEAD_DIM:
    raise ValueError(f"head dim {d} must be at most {MAX_HEAD_DIM} (shared memory)")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"dtype {q.dtype} must be bfloat16 or float16")
  specialised = not interpret if specialised is None else specialised
  consumers = CONSUMERS if specialised else 1
  rows_q = consumers * BLOCK
  pad = -tq % rows_q
  if pad:  # padding (segment 0) at the last query's position: a block's position range,
    # which decides a saturating bias's constant blocks, stays its real queries'
    q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
    q_segments = jnp.pad(q_segments, [(0, 0), (0, pad)])
    q_positions = jnp.pad(q_positions, [(0, 0), (0, pad)], mode="edge")
  groups, dtype, nk = h // k.shape[2], q.dtype, tk // BLOCK
  kind = sparsity.classify(q_segments, k_segments, q_positions, k_positions, causal=causal,
                           window=window, block_q=rows_q, block_k=BLOCK, lq=tq + pad, lk=tk)
  lists = visit_lists(kind)
  width = lists.shape[-1]
  params, packing = mosaic_bias.operand(bias_spec, h)
  biased = bias_spec is not None

  def kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, list_ref, par_ref, out_ref,
             lse_ref, q_smem, k_smem, v_smem, qs_smem, ks_smem, qp_smem, kp_smem, lse_smem,
             list_smem, par_smem, q_bar, list_bar, k_bar, v_bar, ks_bar, kp_bar, k_free,
             v_free, turns, *copies):
    head, qb, row = lax.axis_index("heads"), lax.axis_index("q_seq"), lax.axis_index("batch")
    wg = lax.axis_index("wg") if specialised else 0
    kv_head = lax.div(head, jnp.array(groups, head.dtype))

    def fetch(i):
      """Issues visit i's copies into slot i mod SLOTS: K and V, the key block's segment
      row if it is partial (the partial visits come first), and its position row if it is
      partial or a bias is added."""
      slot = lax.rem(i, SLOTS)
      keys = (row, pl.ds(list_smem[2 + i] * BLOCK, BLOCK))
      if specialised:  # once both consumers have handed back visit i − SLOTS's K
        pl.when(i >= SLOTS)(lambda: plgpu.barrier_wait(k_free.at[slot]))
      plgpu.copy_gmem_to_smem(k_ref.at[keys + (kv_head,)], k_smem.at[slot], k_bar.at[slot])

      @pl.when(i < list_smem[0])
      def _():
        plgpu.copy_gmem_to_smem(ks_ref.at[keys], ks_smem.at[slot], ks_bar.at[slot])
        if not biased:
          plgpu.copy_gmem_to_smem(kp_ref.at[keys], kp_smem.at[slot], kp_bar.at[slot])
      if biased:
        plgpu.copy_gmem_to_smem(kp_ref.at[keys], kp_smem.at[slot], kp_bar.at[slot])
      if specialised:  # and its V
        pl.when(i >= SLOTS)(lambda: plgpu.barrier_wait(v_free.at[slot]))
      plgpu.copy_gmem_to_smem(v_ref.at[keys + (kv_head,)], v_smem.at[slot], v_bar.at[slot])

    def fetch_row():
      """Issues the copies of the row's visit list and (with a bias) the head's parameters,
      on list_bar[0] and [1]."""
      plgpu.copy_gmem_to_smem(list_ref.at[row, qb], list_smem, list_bar.at[0])
      if biased:
        plgpu.copy_gmem_to_smem(par_ref.at[head], par_smem, list_bar.at[1])

    def produce():
      """The producer warpgroup: the list and parameters, then every visit's copies in
      turn."""
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      fetch_row()
      plgpu.barrier_wait(list_bar.at[0])
      pl.loop(0, list_smem[1])(fetch)

    def consume():
      """A consumer warpgroup: its 64 queries against the visits, the partial ones masked,
      then the full ones."""
      q0 = qb * rows_q + wg * BLOCK
      queries = (row, pl.ds(q0, BLOCK))
      my_q, my_qs, my_qp = q_smem.at[wg], qs_smem.at[wg], qp_smem.at[wg]
      if specialised:
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      else:  # its own list and parameters
        fetch_row()
      copy_in([(q_ref.at[queries + (head,)], my_q), (qs_ref.at[queries], my_qs),
               (qp_ref.at[queries], my_qp)], q_bar, 3 * wg)
      plgpu.barrier_wait(list_bar.at[0])
      if biased:  # the head's parameters, read as scalars per block
        plgpu.barrier_wait(list_bar.at[1])
      n_partial, n_visited = list_smem[0], list_smem[1]
      rows, cols = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
      qseg, qpos = load(my_qs, rows, interpret), load(my_qp, rows, interpret)
      m_i = cast(interpret, jnp.full((BLOCK,), -jnp.inf, jnp.float32), rows)
      l_i = cast(interpret, jnp.full((BLOCK,), 0, jnp.float32), rows)
      acc = cast(interpret, jnp.full((BLOCK, d), 0, jnp.float32), plgpu.Layout.WGMMA)
      kt, p_copy = (c.at[wg] for c in copies) if interpret else (None, None)

      def turn():
        """A turn of the two consumers' alternation (FlashAttention-3's ping-pong): each
        arrives and waits for the other's arrival, so that one's softmax runs while the
        other's wgmma has the tensor cores. Consumer 1 starts a turn behind and consumer 0
        ends one behind, so that every turn has both arrivals."""
        plgpu.barrier_arrive(turns)
        plgpu.barrier_wait(turns)

      def step(j, carry, masked):
        """Visit j from its slot. Warp-specialised, the slot is handed back (when a later
        visit will fill it) once its wgmma has been awaited: K after QKᵀ (and the id rows'
        reads), V after PV; else visit j + SLOTS − 1's copies are issued first, into the
        slot visit j − 1 read (its wgmmas awaited when their results were read)."""
        acc, m_i, l_i = carry
        slot = lax.rem(j, SLOTS)
        refill = j + SLOTS < n_visited
        if not specialised:
          pl.when(j + SLOTS - 1 < n_visited)(lambda: fetch(j + SLOTS - 1))
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
          if interpret:  # the interpreter's wgmma takes refs only, untransposed
            kt[...] = k_smem[slot].T
            plgpu.wgmma(acc_ref, my_q, kt)
          else:
            plgpu.wgmma(acc_ref, my_q, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
          if specialised:
            turn()  # the other consumer's softmax runs beside this QKᵀ
          return acc_ref[...]
        x = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
        if masked or biased:
          plgpu.barrier_wait(kp_bar.at[slot])
          kpos = load(kp_smem.at[slot], cols, interpret)
        if masked:
          plgpu.barrier_wait(ks_bar.at[slot])
          kseg = load(ks_smem.at[slot], cols, interpret)
        if specialised:
          pl.when(refill)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
        if biased:
          x = x + mosaic_bias.tile(bias_spec, mosaic_bias.theta(par_smem, packing), qpos,
                                   kpos, interpret=interpret)
        if masked:
          keep = visible(qseg, qpos, kseg, kpos, causal=causal, window=window, query_axis=0)
          x = jnp.where(keep, x, -jnp.inf)
        p, m_i, l_i, acc = _softmax_step(x, m_i, l_i, acc, masked)
        if specialised:
          plgpu.barrier_arrive(turns)  # softmax done: the other's wgmma may start
        plgpu.barrier_wait(v_bar.at[slot])
        if specialised:
          plgpu.barrier_wait(turns)
        if interpret:  # no run_state there: P·V into a fresh accumulator, then added
          def pv(acc_ref):
            p_copy[...] = p.astype(dtype)
            plgpu.wgmma(acc_ref, p_copy, v_smem.at[slot])
            return acc_ref[...]
          acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK, d), jnp.float32))
        else:  # P·V accumulated into the running accumulator itself
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
          acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        if specialised:
          pl.when(refill)(lambda: plgpu.barrier_arrive(v_free.at[slot]))
        return acc, m_i, l_i

      if specialised:
        pl.when(wg == 1)(turn)
      else:
        for i in range(SLOTS - 1):
          pl.when(i < n_visited)(functools.partial(fetch, i))
      carry = lax.fori_loop(0, n_partial, functools.partial(step, masked=True), (acc, m_i, l_i))
      acc, m_i, l_i = lax.fori_loop(n_partial, n_visited,
                                    functools.partial(step, masked=False), carry)
      if specialised:
        pl.when(wg == 0)(turn)
      empty = l_i == 0
      inv = 1.0 / jnp.where(empty, 1.0, l_i)
      my_q[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
      lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf,
                                       m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(my_q, out_ref.at[queries + (head,)])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[row, head, pl.ds(q0, BLOCK)])
      plgpu.wait_smem_to_gmem(0)

    if specialised:
      pl.when(wg == consumers)(produce)
      pl.when(wg < consumers)(consume)
    else:
      consume()

  call = plgpu.kernel(
      kernel, out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                        jax.ShapeDtypeStruct((b, h, tq + pad), jnp.float32)],
      scratch_types=_forward_scratch(d, dtype, width, params.shape[1], consumers, interpret),
      grid=(h, (tq + pad) // rows_q, b), grid_names=("heads", "q_seq", "batch"),
      num_threads=consumers + 1 if specialised else None,
      thread_name="wg" if specialised else None,
      interpret=interpret_params() if interpret else None)
  i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
  out, lse = call(q, k, v, i32(q_segments), i32(k_segments), i32(q_positions),
                  i32(k_positions), lists, params)
  return out[:, :tq], lse[..., :tq]
