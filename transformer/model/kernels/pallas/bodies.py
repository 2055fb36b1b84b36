"""The bodies of the Pallas flash-attention kernels (transformer/model/kernels/pallas/attention.py),
one code for every lowering: interpret mode, Triton (GPU) and Mosaic (TPU).

A kernel holds one "outer" block (a query block: forward, dq; a key block: dk, dv) and
visits the inner blocks of the other side that its visit list names (sparsity.visit_lists,
decided in XLA before the kernel): first the partial ones, masked, then the full ones,
with no mask, no segment or position test and no branch; blocks with no visible pair are
never visited. The driver is a fori_loop over each part of the list, the inner blocks read
at their index from whole rows (the loop driver: interpret mode, Triton), or the grid's
last axis, the list read by the index maps from scalar memory so that the pipeline copies
only the listed blocks into VMEM, the carry kept in scratch memory between grid steps (the
grid driver: Mosaic TPU).

The logits are kept in base 2, as FlashAttention-2 does: q arrives multiplied by
scale·log2(e) (attention.py), the bias is multiplied by log2(e) here, the softmax is exp2,
and the saved logsumexp is in base 2; the probabilities are the same, and the gradients of
q and k carry a factor ln 2 (applied once, at the end).

Arrays in a kernel are 2-D, laid out as transformer/model/kernels/pallas/layouts.py says: a query
side's segment ids, positions and row statistics (running max, normaliser, logsumexp,
delta) are [rows, lanes] (lanes = 1, or 128 broadcast along the TPU's lanes), a key side's
ids and positions [sublanes, keys] (row 0 read); `widen` brings a [rows, lanes] value to
[rows, n]. The bias parameters are one flat float32 array [heads · width] read as scalars
(the head's `width` of them from the head's program id · width), so a BiasSpec's fn sees
dict name -> tuple of scalars; their gradient leaves each kernel as a row [1, width].
"""

import dataclasses
import importlib
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The running maximum before any visible key, and the logit of hidden keys: finite (no inf
# arithmetic in the kernels), so low that exp2(_MASKED − any real logit) is exactly 0.
_MASKED = -1e30
LOG2E, LN2 = math.log2(math.e), math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Static:
  """What a kernel is specialised on."""

  fn: object  # the BiasSpec's fn, or None: no bias
  learned: bool  # the bias parameters' gradient is computed
  causal: bool
  window: int | None
  block_q: int
  block_k: int
  params: tuple[tuple[str, int, int], ...]  # (name, offset, size) in a head's parameter row
  width: int  # a head's parameter row (≥ Σ sizes: a layout may pad it)
  lanes: int  # the query side's [rows, lanes]
  grid_inner: bool  # the inner blocks are the grid's last axis (else a loop in the kernel)
  inner: int  # the number of inner blocks
  inner_block: int  # the length of an inner block (block_k, or block_q for dk and dv)
  axes: tuple[str, ...] = ("batch", "head", "outer")  # the grid's axes, in order
  visits: int = 0  # the width of a visit list (sparsity.visit_lists)
  count: bool = False  # also output how many blocks were visited and masked (for tests)
  reverse: bool = False  # outer blocks from the last: a causal mask's heaviest query blocks first
  dq_atomic: bool = False  # the dk/dv kernel adds dq atomically and gives the parameters' gradient
  table: int | None = None  # the bias read from a table over k − q clipped to ±table (tables.py)
  table_width: int = 0  # a head's row of that table (the block the kernel sees)


def outer_block(st: Static, index, outers: int):
  """The outer block at grid index `index` along "outer" (of `outers`): reversed when
  st.reverse."""
  return outers - 1 - index if st.reverse else index


def lowering(name: str):
  """jax.experimental.pallas.tpu or .triton, imported when a layout or kernel uses them: they
  take 0.4 s of imports that a run on the CPU never needs."""
  return importlib.import_module(f"jax.experimental.pallas.{name}")


def widen(x, n: int):
  """x [rows, lanes] (lanes 1, or equal entries along lanes) as a value broadcastable to
  [rows, n]: itself when lanes is 1 or n, its first n lanes when n < lanes, else tiled."""
  lanes = x.shape[-1]
  if lanes in (1, n):
    return x
  if n < lanes:
    return x[:, :n]
  return jnp.tile(x, (1, n // lanes)) if n % lanes == 0 else x[:, :1]


def _dot(a, b, transpose_b: bool = False):
  """a·b (a·bᵀ when transpose_b) of 2-D operands, in float32."""
  dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(st: Static, qs, ks, qp, kp):
  """Which keys of a block each query sees [bq, bk]: the same non-pad segment (0 =
  padding), causal and window by position, as masks.Mask.dense. qs, qp [bq, 1 or bk];
  ks, kp [1, bk]."""
  visible = (qs == ks) & (qs != 0) & (ks != 0)
  if st.causal:
    visible &= kp <= qp
  if st.window is not None:
    visible &= jnp.abs(qp - kp) <= st.window
  return visible


def program(st: Static, axis: str):
  """The grid index along a named axis of st.axes."""
  return pl.program_id(st.axes.index(axis))


def _theta(st: Static, p_ref):
  """This head's bias parameters: name -> tuple of scalars."""
  if st.fn is None:
    return {}
  base = program(st, "head") * st.width
  return {name: tuple(p_ref[base + offset + u] for u in range(size))
          for name, offset, size in st.params}


def _row(st: Static, grads):
  """The parameters' gradients (name -> tuple of scalars) as a row [1, width]."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, st.width), 1)
  row = jnp.zeros((1, st.width), jnp.float32)
  for name, offset, size in st.params:
    for u in range(size):
      row = row + jnp.where(lane == offset + u, grads[name][u], 0.0)
  return row


def _logits(st, theta, q, k, qp, kp):
  """One block's biased logits in base 2 [bq, bk] float32: q·kᵀ (q already multiplied by
  scale·log2 e) + log2(e)·bias. theta: (this head's parameters, the table's ref or None)."""
  logits = _dot(q, k, transpose_b=True)
  params, table_ref = theta
  if st.table is not None:  # a gather from this head's row of the table (tables.py)
    at = jnp.clip(kp - qp, -st.table, st.table) + st.table
    logits = logits + LOG2E * table_ref[at]
  elif st.fn is not None:
    logits = logits + LOG2E * st.fn(params, qp, kp)
  return logits


def _probabilities(st, theta, q, k, qp, kp, lse, visible):
  """One block's softmax weights [bq, bk] from the saved base-2 logsumexp; visible: the
  mask of a partial block (0 where not visible), None for a full one."""
  logits = _logits(st, theta, q, k, qp, kp)
  if visible is None:
    return jnp.exp2(logits - widen(lse, st.block_k))
  logits = jnp.where(visible, logits, 0.0)
  return jnp.where(visible, jnp.exp2(logits - widen(lse, st.block_k)), 0.0)


def _inner(st: Static, ref, j, keys: bool = False):
  """Inner block j of ref: rows [block, ·] of a [t, ·] array, or (keys) row 0's block
  [1, block] of a key side's [sublanes, t]."""
  if st.grid_inner:  # the pipeline delivered block j
    return ref[0:1, :] if keys else ref[...]
  size = st.inner_block
  at = pl.ds(pl.multiple_of(j * size, size), size)
  return ref[0:1, at] if keys else ref[at, :]


def _visit_list(st: Static, ref):
  """Entry e of this outer block's visit list, as a function of e: the loop driver's block
  of the lists [width], or the grid driver's whole flat lists in scalar memory."""
  if not st.grid_inner:
    return lambda e: ref[e]
  outers = pl.num_programs(st.axes.index("outer"))
  outer = outer_block(st, program(st, "outer"), outers)
  base = (program(st, "batch") * outers + outer) * st.visits
  return lambda e: ref[base + e]


def _drive(st: Static, lists_ref, init, step, finish, scratch, count_refs):
  """Runs step(j, carry, masked) over the inner blocks j of the outer block's visit list
  from init(), the partial ones (masked=True) then the full ones, then finish(carry)."""
  entry = _visit_list(st, lists_ref)
  partial, visited = entry(0), entry(1)
  if st.count:  # two more carries: the blocks visited and those masked
    step, init, finish = _counting(step, init, finish, count_refs)
  if not st.grid_inner:
    carry = jax.lax.fori_loop(0, partial, lambda m, c: step(entry(2 + m), c, True), init())
    finish(jax.lax.fori_loop(partial, visited, lambda m, c: step(entry(2 + m), c, False),
                             carry))
    return
  m = program(st, "inner")
  load = lambda: tuple(ref[...] for ref in scratch)  # noqa: E731

  def store(carry):
    for ref, x in zip(scratch, carry):
      ref[...] = x

  pl.when(m == 0)(lambda: store(init()))
  pl.when(m < partial)(lambda: store(step(m, load(), True)))
  pl.when((m >= partial) & (m < visited))(lambda: store(step(m, load(), False)))
  pl.when(m == st.inner - 1)(lambda: finish(load()))


def _counting(step, init, finish, count_refs):
  """step, init and finish carrying two counters [1, 1] (blocks visited, blocks masked),
  written to count_refs' blocks at the end."""
  def counted_step(j, carry, masked):
    *carry, visited, masks = carry
    return (*step(j, tuple(carry), masked), visited + 1.0, masks + float(masked))

  def counted_init():
    return (*init(), jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.float32))

  def counted_finish(carry):
    *carry, visited, masks = carry
    finish(tuple(carry))
    for ref, x in zip(count_refs, (visited, masks)):
      ref[...] = jnp.broadcast_to(x, ref.shape)

  return counted_step, counted_init, counted_finish


def _split(st: Static, refs, outputs: int, aliased: int = 0):
  """(theta: (this head's parameters, the table's ref or None), output refs, count refs,
  scratch refs) of a kernel's refs after its inputs; `aliased`: inputs after the parameters
  and table that alias outputs (not read here)."""
  p_ref, refs = (refs[0], refs[1:]) if st.fn else (None, refs)
  t_ref, refs = (refs[0], refs[1:]) if st.table is not None else (None, refs)
  refs = refs[aliased:]
  counts = 2 if st.count else 0
  return ((_theta(st, p_ref), t_ref), refs[:outputs], refs[outputs:outputs + counts],
          refs[outputs + counts:])


def forward_kernel(lists_ref, q_ref, qs_ref, qp_ref, k_ref, v_ref, ks_ref, kp_ref, *refs,
                   st: Static):
  """Outer: a query block; this block's output [bq, d_v] and base-2 logsumexp [bq, lanes]."""
  theta, (o_ref, lse_ref), count_refs, scratch = _split(st, refs, 2)
  q, qs, qp = q_ref[...], widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  rows, dv = q.shape[0], o_ref.shape[-1]

  def step(j, carry, masked):
    top, total, acc = carry  # running max, normaliser [bq, lanes]; output [bq, d_v]
    kp = _inner(st, kp_ref, j, keys=True)
    logits = _logits(st, theta, q, _inner(st, k_ref, j), qp, kp)
    if masked:
      visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp)
      logits = jnp.where(visible, logits, _MASKED)
    new_top = jnp.maximum(top, logits.max(-1, keepdims=True))
    p = jnp.exp2(logits - widen(new_top, st.block_k))
    if masked:  # a row with no visible key yet has new_top = _MASKED
      p = jnp.where(visible, p, 0.0)
    rescale = jnp.exp2(top - new_top)  # 0 when the first visible key arrives, else ≤ 1
    v = _inner(st, v_ref, j)
    acc = acc * widen(rescale, dv) + _dot(p.astype(v.dtype), v)
    return new_top, total * rescale + p.sum(-1, keepdims=True), acc

  def init():
    stat = (rows, st.lanes)
    return (jnp.full(stat, _MASKED, jnp.float32), jnp.zeros(stat, jnp.float32),
            jnp.zeros((rows, dv), jnp.float32))

  def finish(carry):
    top, total, acc = carry
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    o_ref[...] = (acc / widen(total, dv)).astype(o_ref.dtype)  # no key seen: 0
    lse_ref[...] = jnp.where(seen, top + jnp.log2(total), 0.0)

  _drive(st, lists_ref, init, step, finish, scratch, count_refs)


def dq_kernel(lists_ref, q_ref, qs_ref, qp_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref,
              ks_ref, kp_ref, *refs, st: Static):
  """Outer: a query block; dq [bq, d] and (learned) this block's share of the bias
  parameters' gradient [1, width]."""
  theta, (dq_ref, *drow), count_refs, scratch = _split(st, refs, 1 + st.learned)
  q, do = q_ref[...], do_ref[...]
  qs, qp = widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  lse, delta = lse_ref[...], widen(delta_ref[...], st.block_k)

  def step(j, carry, masked):
    kp = _inner(st, kp_ref, j, keys=True)
    visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp) if masked else None
    k, v = _inner(st, k_ref, j), _inner(st, v_ref, j)
    p = _probabilities(st, theta, q, k, qp, kp, lse, visible)
    dlogits = p * (_dot(do, v, transpose_b=True) - delta)  # [bq, bk], of the natural logits
    dq = carry[0] + _dot(dlogits.astype(k.dtype), k)
    if not st.learned:
      return (dq,)
    _, bias_vjp = jax.vjp(lambda params: st.fn(params, qp, kp), theta[0])
    return dq, carry[1] + _row(st, bias_vjp(dlogits)[0])  # the vjp of the block's bias

  def init():
    dq = jnp.zeros(q.shape, jnp.float32)
    return (dq, jnp.zeros((1, st.width), jnp.float32)) if st.learned else (dq,)

  def finish(carry):
    dq_ref[...] = (carry[0] * LN2).astype(dq_ref.dtype)
    if st.learned:
      drow[0][...] = carry[1]

  _drive(st, lists_ref, init, step, finish, scratch, count_refs)


def dkv_kernel(lists_ref, k_ref, v_ref, ks_ref, kp_ref, q_ref, qs_ref, qp_ref, do_ref, lse_ref,
               delta_ref, *refs, st: Static):
  """Outer: a key block; dk [bk, d] and dv [bk, d_v] over its listed query blocks. With
  st.dq_atomic, also each listed query block's share of dq, added atomically into the whole
  float32 dq [lq, d] (in natural-log units but for the factor ln 2), and (learned) this key
  block's share of the bias parameters' gradient [1, width]."""
  outputs = 2 + (1 + st.learned) * st.dq_atomic
  theta, (dk_ref, dv_ref, *dq_refs), count_refs, scratch = _split(st, refs, outputs,
                                                                  aliased=int(st.dq_atomic))
  k, v, ks, kp = k_ref[...], v_ref[...], ks_ref[0:1, :], kp_ref[0:1, :]
  learned = st.learned and st.dq_atomic

  def step(i, carry, masked):
    dk, dv = carry[:2]
    qp = widen(_inner(st, qp_ref, i), st.block_k)
    visible = (_visible(st, widen(_inner(st, qs_ref, i), st.block_k), ks, qp, kp)
               if masked else None)
    q, do = _inner(st, q_ref, i), _inner(st, do_ref, i)
    p = _probabilities(st, theta, q, k, qp, kp, _inner(st, lse_ref, i), visible)
    dv = dv + _dot(p.T.astype(do.dtype), do)
    delta = widen(_inner(st, delta_ref, i), st.block_k)
    dlogits = p * (_dot(do, v, transpose_b=True) - delta)
    if st.dq_atomic:
      rows = pl.ds(pl.multiple_of(i * st.inner_block, st.inner_block), st.inner_block)
      lowering("triton").atomic_add(dq_refs[0], (rows, slice(None)),
                                    _dot(dlogits.astype(k.dtype), k))
    dk = dk + _dot(dlogits.T.astype(q.dtype), q)
    if not learned:
      return dk, dv
    _, bias_vjp = jax.vjp(lambda params: st.fn(params, qp, kp), theta[0])
    return dk, dv, carry[2] + _row(st, bias_vjp(dlogits)[0])

  def init():
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return zeros + ((jnp.zeros((1, st.width), jnp.float32),) if learned else ())

  def finish(carry):
    dk_ref[...] = (carry[0] * LN2).astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)
    if learned:
      dq_refs[1][...] = carry[2]

  _drive(st, lists_ref, init, step, finish, scratch, count_refs)

