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

from transformer.model.kernels.pallas import tables

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
  # the table's gradient added by atomics (compiled Triton); else by a scatter-add (interpret
  # mode, whose atomic_add keeps one of repeated indices): tables.add
  atomic_table: bool = False
  grad: object = None  # the BiasSpec's grad (its fn's vjp in closed form), or None: the vjp
  # the BiasSpec's mlp_input where the bias is read as the pieces of its MLP from a table
  # (piecewise.py), else None
  mlp_input: object = None
  normalizer: "Normalizer" = None  # how logits become weights (None: softmax)
  vectors: bool = False  # a data bias u_i − w_j from two vectors per row and head (read_vectors)


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


def _bias_grad(st: Static, params, qp, kp, dlogits):
  """A block's share of the bias parameters' gradient as a row [1, width], from the logits'
  gradient dlogits [bq, bk]: the BiasSpec's grad where it declares one (block sums in
  closed form), else the vjp of its fn (one reduction per parameter)."""
  if st.grad is not None:
    return _row(st, st.grad(params, qp, kp, dlogits))
  _, bias_vjp = jax.vjp(lambda p: st.fn(p, qp, kp), params)
  return _row(st, bias_vjp(dlogits)[0])


def _logits(st, theta, q, k, qp, kp):
  """One block's biased logits in base 2 [bq, bk] float32: q·kᵀ (q already multiplied by
  scale·log2 e) + log2(e)·bias. theta: (this head's parameters, the table's ref or None)."""
  logits = _dot(q, k, transpose_b=True)
  params, table_ref = theta
  if tables.reads(st):  # gathered from this head's row of the table (tables.py)
    logits = logits + LOG2E * tables.read(st, params, table_ref, qp, kp)
  elif st.fn is not None:
    logits = logits + LOG2E * st.fn(params, qp, kp)
  return logits


def grad_by_table(st: Static) -> bool:
  """The bias parameters' gradient is taken through the table (tables.add_gradient), not
  a vjp of the BiasSpec's fn per block: the one backward kernel of a layout that reads a
  table."""
  return st.learned and st.dq_atomic and tables.reads(st)


@dataclasses.dataclass(frozen=True)
class Normalizer:
  """How the kernels turn a block's base-2 logits into weights: softmax over the visible
  keys, with one more logit per head in its normaliser and no value (sink: read from the
  kernel's sink input, in base 2), or σ(x + b) at each visible key with no normaliser
  (sigmoid; bias = b·log2 e)."""

  sigmoid: bool = False
  bias: float = 0.0
  sink: bool = False


SOFTMAX = Normalizer()


def _norm(st: Static) -> Normalizer:
  return st.normalizer or SOFTMAX


def _sigmoid(norm: Normalizer, logits):
  """σ(x + b) of base-2 logits: 1 / (1 + 2^−(logits + b·log2 e)); 0 at _MASKED."""
  return 1.0 / (1.0 + jnp.exp2(-(logits + norm.bias)))


def _start(st: Static, sink, rows: int, dv: int):
  """The forward's carry before any key block: running max and normaliser [rows, lanes]
  (a sink: its logit `sink`, read at the kernel's top, as a key already seen, and 2^0 = 1),
  output [rows, d_v]."""
  stat = (rows, st.lanes)
  if _norm(st).sink:
    top, total = jnp.full(stat, sink, jnp.float32), 1.0
  else:
    top, total = jnp.full(stat, _MASKED, jnp.float32), 0.0
  return top, jnp.full(stat, total, jnp.float32), jnp.zeros((rows, dv), jnp.float32)


def _accumulate(st: Static, carry, logits, visible, v):
  """One key block's step of the forward's carry: logits [bq, bk] in base 2 (_MASKED where
  hidden), visible the partial block's mask (None: a full block)."""
  top, total, acc = carry
  dv = acc.shape[-1]
  if _norm(st).sigmoid:  # no normaliser: the weights are summed as they come
    p = _sigmoid(_norm(st), logits)
    p = p if visible is None else jnp.where(visible, p, 0.0)
    return top, total, acc + _dot(p.astype(v.dtype), v)
  new_top = jnp.maximum(top, logits.max(-1, keepdims=True))
  p = jnp.exp2(logits - widen(new_top, st.block_k))
  if visible is not None:  # a row with no visible key yet has new_top = _MASKED
    p = jnp.where(visible, p, 0.0)
  rescale = jnp.exp2(top - new_top)  # 0 when the first visible key arrives, else ≤ 1
  acc = acc * widen(rescale, dv) + _dot(p.astype(v.dtype), v)
  return new_top, total * rescale + p.sum(-1, keepdims=True), acc


def _finish(st: Static, carry):
  """(output [bq, d_v] float32, base-2 logsumexp [bq, lanes]; 0 for sigmoid, which keeps
  none, and for a row that saw no key)."""
  top, total, acc = carry
  if _norm(st).sigmoid:
    return acc, jnp.zeros(top.shape, jnp.float32)
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  return acc / widen(total, acc.shape[-1]), jnp.where(seen, top + jnp.log2(total), 0.0)


def _dlogits(st: Static, p, dp, delta):
  """The natural logits' gradient [bq, bk] from the weights p and dp = dO·vᵀ: softmax's
  p·(dp − dO·O), sigmoid's σ(1 − σ)·dp."""
  if _norm(st).sigmoid:
    return p * (1.0 - p) * dp
  return p * (dp - delta)


def read_vectors(st: Static, u, w):
  """A block's data bias in base 2, log2(e)·(u_i − w_j) [bq, bk] (0 without one): u the
  query block's [bq, lanes], w the key block's [1, bk]."""
  return LOG2E * (widen(u, st.block_k) - w) if st.vectors else 0.0


def take_terms(st: Static, refs):
  """(the normaliser's and data bias's input refs by name: "sink", "u", "w", the rest of
  refs), the kernel's inputs after its fixed ones."""
  terms = {}
  if _norm(st).sink:
    terms["sink"], refs = refs[0], refs[1:]
  if st.vectors:
    terms["u"], terms["w"], refs = refs[0], refs[1], refs[2:]
  return terms, refs


def _probabilities(st, theta, q, k, qp, kp, lse, visible, data=0.0):
  """One block's weights [bq, bk]: softmax's from the saved base-2 logsumexp, or the
  sigmoid's; visible: the mask of a partial block (0 where not visible), None for a full
  one; data: the block's data bias in base 2 (read_vectors)."""
  logits = _logits(st, theta, q, k, qp, kp)
  if st.vectors:
    logits = logits + data
  weigh = ((lambda x: _sigmoid(_norm(st), x)) if _norm(st).sigmoid
           else (lambda x: jnp.exp2(x - widen(lse, st.block_k))))
  if visible is None:
    return weigh(logits)
  return jnp.where(visible, weigh(jnp.where(visible, logits, 0.0)), 0.0)


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
  t_ref, refs = (refs[0], refs[1:]) if tables.reads(st) else (None, refs)
  refs = refs[aliased:]
  counts = 2 if st.count else 0
  return ((_theta(st, p_ref), t_ref), refs[:outputs], refs[outputs:outputs + counts],
          refs[outputs + counts:])


def forward_kernel(lists_ref, q_ref, qs_ref, qp_ref, k_ref, v_ref, ks_ref, kp_ref, *refs,
                   st: Static):
  """Outer: a query block; this block's output [bq, d_v] and base-2 logsumexp [bq, lanes]."""
  terms, refs = take_terms(st, refs)
  theta, (o_ref, lse_ref), count_refs, scratch = _split(st, refs, 2)
  q, qs, qp = q_ref[...], widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  u = terms["u"][...] if st.vectors else None
  # this head's sink logit, read here: a program id inside a conditional (the grid
  # driver's init) does not lower in interpret mode
  sink = terms["sink"][program(st, "head")] if _norm(st).sink else None

  def step(j, carry, masked):
    kp = _inner(st, kp_ref, j, keys=True)
    logits = _logits(st, theta, q, _inner(st, k_ref, j), qp, kp)
    if st.vectors:
      logits = logits + read_vectors(st, u, _inner(st, terms["w"], j, keys=True))
    visible = None
    if masked:
      visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp)
      logits = jnp.where(visible, logits, _MASKED)
    return _accumulate(st, carry, logits, visible, _inner(st, v_ref, j))

  def finish(carry):
    out, lse = _finish(st, carry)
    o_ref[...] = out.astype(o_ref.dtype)  # no key seen: 0
    lse_ref[...] = lse

  _drive(st, lists_ref, lambda: _start(st, sink, q.shape[0], o_ref.shape[-1]), step, finish,
         scratch, count_refs)


def dq_kernel(lists_ref, q_ref, qs_ref, qp_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref,
              ks_ref, kp_ref, *refs, st: Static):
  """Outer: a query block; dq [bq, d], (learned) this block's share of the bias
  parameters' gradient [1, width] and (st.vectors) the data bias's gradient at the
  queries, Σ_j dlogits [bq, lanes]."""
  terms, refs = take_terms(st, refs)
  theta, (dq_ref, *rest), count_refs, scratch = _split(st, refs, 1 + st.learned + st.vectors)
  drow, du_ref = rest[:st.learned], rest[st.learned:]
  q, do = q_ref[...], do_ref[...]
  qs, qp = widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  lse, delta = lse_ref[...], widen(delta_ref[...], st.block_k)
  u = terms["u"][...] if st.vectors else None

  def step(j, carry, masked):
    kp = _inner(st, kp_ref, j, keys=True)
    visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp) if masked else None
    k, v = _inner(st, k_ref, j), _inner(st, v_ref, j)
    data = read_vectors(st, u, _inner(st, terms["w"], j, keys=True)) if st.vectors else 0.0
    p = _probabilities(st, theta, q, k, qp, kp, lse, visible, data)
    dlogits = _dlogits(st, p, _dot(do, v, transpose_b=True), delta)  # of the natural logits
    out = (carry[0] + _dot(dlogits.astype(k.dtype), k),)
    if st.learned:
      out += (carry[1] + _bias_grad(st, theta[0], qp, kp, dlogits),)
    if st.vectors:
      out += (carry[-1] + dlogits.sum(-1, keepdims=True),)
    return out

  def init():
    dq = (jnp.zeros(q.shape, jnp.float32),)
    learned = (jnp.zeros((1, st.width), jnp.float32),) * st.learned
    return dq + learned + (jnp.zeros((q.shape[0], st.lanes), jnp.float32),) * st.vectors

  def finish(carry):
    dq_ref[...] = (carry[0] * LN2).astype(dq_ref.dtype)
    if st.learned:
      drow[0][...] = carry[1]
    if st.vectors:
      du_ref[0][...] = carry[-1]

  _drive(st, lists_ref, init, step, finish, scratch, count_refs)


def dkv_kernel(lists_ref, k_ref, v_ref, ks_ref, kp_ref, q_ref, qs_ref, qp_ref, do_ref, lse_ref,
               delta_ref, *refs, st: Static):
  """Outer: a key block; dk [bk, d] and dv [bk, d_v] over its listed query blocks, and
  (st.vectors) the data bias's gradient at the keys, −Σ_i dlogits [sublanes, bk]. With
  st.dq_atomic, also each listed query block's share of dq, added atomically into the whole
  float32 dq [lq, d] (in natural-log units but for the factor ln 2), (learned) this key
  block's share of the bias parameters' gradient [1, width] (or, grad_by_table, of the
  table's [table_width], added per entry: tables.add_gradient), and (st.vectors) its
  share of the data bias's gradient at the queries, added atomically into [lq, lanes]."""
  terms, refs = take_terms(st, refs)
  by_table = grad_by_table(st)
  # dq (and the table's and the queries' data gradient) added to
  atomic = (1 + by_table + st.vectors) * st.dq_atomic
  outputs = 2 + st.vectors + atomic + st.learned * st.dq_atomic
  theta, (dk_ref, dv_ref, *rest), count_refs, scratch = _split(st, refs, outputs,
                                                               aliased=atomic)
  dw_ref, rest = rest[:st.vectors], rest[st.vectors:]
  split = st.dq_atomic * (1 + st.learned)
  dq_refs, du_ref = rest[:split], rest[split:]
  k, v, ks, kp = k_ref[...], v_ref[...], ks_ref[0:1, :], kp_ref[0:1, :]
  w = terms["w"][0:1, :] if st.vectors else None
  learned = st.learned and st.dq_atomic and not by_table  # a row carried per kernel

  def step(i, carry, masked):
    dk, dv = carry[:2]
    qp = widen(_inner(st, qp_ref, i), st.block_k)
    visible = (_visible(st, widen(_inner(st, qs_ref, i), st.block_k), ks, qp, kp)
               if masked else None)
    q, do = _inner(st, q_ref, i), _inner(st, do_ref, i)
    data = read_vectors(st, _inner(st, terms["u"], i), w) if st.vectors else 0.0
    p = _probabilities(st, theta, q, k, qp, kp, _inner(st, lse_ref, i), visible, data)
    dv = dv + _dot(p.T.astype(do.dtype), do)
    delta = widen(_inner(st, delta_ref, i), st.block_k)
    dlogits = _dlogits(st, p, _dot(do, v, transpose_b=True), delta)
    if st.dq_atomic:
      rows = pl.ds(pl.multiple_of(i * st.inner_block, st.inner_block), st.inner_block)
      add = lowering("triton").atomic_add
      add(dq_refs[0], (rows, slice(None)), _dot(dlogits.astype(k.dtype), k))
      if st.vectors:
        add(du_ref[0], (rows, slice(None)), dlogits.sum(-1, keepdims=True))
      if by_table:
        tables.add_gradient(st, *theta, dq_refs[1], qp, kp, dlogits)
    out = (dk + _dot(dlogits.T.astype(q.dtype), q), dv)
    if learned:
      out += (carry[2] + _bias_grad(st, theta[0], qp, kp, dlogits),)
    if st.vectors:
      out += (carry[-1] - dlogits.sum(0, keepdims=True),)
    return out

  def init():
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    zeros += (jnp.zeros((1, st.width), jnp.float32),) * learned
    return zeros + (jnp.zeros((1, k.shape[0]), jnp.float32),) * st.vectors

  def finish(carry):
    dk_ref[...] = (carry[0] * LN2).astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)
    if learned:
      dq_refs[1][...] = carry[2]
    if st.vectors:
      dw_ref[0][...] = jnp.broadcast_to(carry[-1], dw_ref[0].shape)

  _drive(st, lists_ref, init, step, finish, scratch, count_refs)
