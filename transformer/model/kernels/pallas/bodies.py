"""The bodies of the Pallas flash-attention kernels (transformer/model/kernels/pallas/attention.py), one
code for every lowering: interpret mode, Triton (GPU) and Mosaic (TPU).

A kernel holds one "outer" block (a query block: forward, dq; a key block: dk, dv) and
visits the "inner" blocks of the other side, carrying running sums: by a fori_loop over
whole rows held by the kernel (the loop driver: interpret mode, Triton), or as the last
grid axis, the carry kept in scratch memory between grid steps (the grid driver: Mosaic
TPU, whose pipeline then streams the inner blocks through VMEM). A step whose block holds
no visible (query, key) pair is skipped.

Arrays in a kernel are 2-D, laid out as transformer/model/kernels/pallas/layouts.py says: a query
side's segment ids, positions and row statistics (running max, normaliser, logsumexp,
delta) are [rows, lanes] (lanes = 1, or 128 broadcast along the TPU's lanes), a key side's
ids and positions [sublanes, keys] (row 0 read); `widen` brings a [rows, lanes] value to
[rows, n]. The bias parameters are one flat float32 array [heads · width] read as scalars
(the head's `width` of them from pl.program_id(1) · width), so a BiasSpec's fn sees
dict name -> tuple of scalars; their gradient leaves each kernel as a row [1, width].
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The running maximum before any visible key, and the logit of hidden keys: finite (no inf
# arithmetic in the kernels), so low that exp(_MASKED − any real logit) is exactly 0.
_MASKED = -1e30


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


def _any(visible):
  return jnp.max(visible.astype(jnp.float32)) > 0


def _theta(st: Static, p_ref):
  """This head's bias parameters: name -> tuple of scalars."""
  if st.fn is None:
    return {}
  base = pl.program_id(1) * st.width
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
  """One block's biased logits [bq, bk] float32: q·kᵀ (q already scaled) + bias."""
  logits = _dot(q, k, transpose_b=True)
  if st.fn is not None:
    logits = logits + st.fn(theta, qp, kp)
  return logits


def _probabilities(st, theta, q, k, visible, qp, kp, lse):
  """One block's softmax weights [bq, bk] from the saved logsumexp (0 where not visible)."""
  logits = jnp.where(visible, _logits(st, theta, q, k, qp, kp), 0.0)
  return jnp.where(visible, jnp.exp(logits - widen(lse, st.block_k)), 0.0)


def _inner(st: Static, ref, j, keys: bool = False):
  """Inner block j of ref: rows [block, ·] of a [t, ·] array, or (keys) row 0's block
  [1, block] of a key side's [sublanes, t]."""
  if st.grid_inner:  # the pipeline delivered block j
    return ref[0:1, :] if keys else ref[...]
  size = st.inner_block
  at = pl.ds(pl.multiple_of(j * size, size), size)
  return ref[0:1, at] if keys else ref[at, :]


def _drive(st: Static, init, step, finish, scratch):
  """Runs step(j, carry) over the inner blocks from init(), then finish(carry)."""
  if not st.grid_inner:
    finish(jax.lax.fori_loop(0, st.inner, step, init()))
    return
  j = pl.program_id(3)

  @pl.when(j == 0)
  def _():
    for ref, x in zip(scratch, init()):
      ref[...] = x

  carry = step(j, tuple(ref[...] for ref in scratch))
  for ref, x in zip(scratch, carry):
    ref[...] = x

  @pl.when(j == st.inner - 1)
  def _():
    finish(carry)


def forward_kernel(q_ref, qs_ref, qp_ref, k_ref, v_ref, ks_ref, kp_ref, *refs, st: Static):
  """Outer: a query block; this block's output [bq, d_v] and logsumexp [bq, lanes]."""
  p_ref, (o_ref, lse_ref, *scratch) = (refs[0], refs[1:]) if st.fn else (None, refs)
  theta = _theta(st, p_ref)
  q, qs, qp = q_ref[...], widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  rows, dv = q.shape[0], o_ref.shape[-1]

  def step(j, carry):
    kp = _inner(st, kp_ref, j, keys=True)
    visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp)

    def update(carry):
      top, total, acc = carry  # running max, normaliser [bq, lanes]; output [bq, d_v]
      logits = jnp.where(visible, _logits(st, theta, q, _inner(st, k_ref, j), qp, kp), _MASKED)
      new_top = jnp.maximum(top, logits.max(-1, keepdims=True))
      p = jnp.where(visible, jnp.exp(logits - widen(new_top, st.block_k)), 0.0)
      rescale = jnp.exp(top - new_top)  # 0 when the first visible key arrives, else ≤ 1
      v = _inner(st, v_ref, j)
      acc = acc * widen(rescale, dv) + _dot(p.astype(v.dtype), v)
      return new_top, total * rescale + p.sum(-1, keepdims=True), acc

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)

  def init():
    stat = (rows, st.lanes)
    return (jnp.full(stat, _MASKED, jnp.float32), jnp.zeros(stat, jnp.float32),
            jnp.zeros((rows, dv), jnp.float32))

  def finish(carry):
    top, total, acc = carry
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    o_ref[...] = (acc / widen(total, dv)).astype(o_ref.dtype)  # no key seen: 0
    lse_ref[...] = jnp.where(seen, top + jnp.log(total), 0.0)

  _drive(st, init, step, finish, scratch)


def dq_kernel(q_ref, qs_ref, qp_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, ks_ref, kp_ref,
              *refs, st: Static):
  """Outer: a query block; dq [bq, d] and (learned) this block's share of the bias
  parameters' gradient [1, width]."""
  p_ref, (dq_ref, *refs) = (refs[0], refs[1:]) if st.fn else (None, refs)
  (drow_ref, *scratch) = refs if st.learned else (None, *refs)
  theta = _theta(st, p_ref)
  q, do = q_ref[...], do_ref[...]
  qs, qp = widen(qs_ref[...], st.block_k), widen(qp_ref[...], st.block_k)
  lse, delta = lse_ref[...], widen(delta_ref[...], st.block_k)

  def step(j, carry):
    kp = _inner(st, kp_ref, j, keys=True)
    visible = _visible(st, qs, _inner(st, ks_ref, j, keys=True), qp, kp)

    def update(carry):
      k, v = _inner(st, k_ref, j), _inner(st, v_ref, j)
      p = _probabilities(st, theta, q, k, visible, qp, kp, lse)
      dlogits = p * (_dot(do, v, transpose_b=True) - delta)  # [bq, bk]
      dq = carry[0] + _dot(dlogits.astype(k.dtype), k)
      if not st.learned:
        return (dq,)
      _, bias_vjp = jax.vjp(lambda theta: st.fn(theta, qp, kp), theta)
      return dq, carry[1] + _row(st, bias_vjp(dlogits)[0])  # the vjp of the block's bias

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)

  def init():
    dq = jnp.zeros(q.shape, jnp.float32)
    return (dq, jnp.zeros((1, st.width), jnp.float32)) if st.learned else (dq,)

  def finish(carry):
    dq_ref[...] = carry[0].astype(dq_ref.dtype)
    if st.learned:
      drow_ref[...] = carry[1]

  _drive(st, init, step, finish, scratch)


def dkv_kernel(k_ref, v_ref, ks_ref, kp_ref, q_ref, qs_ref, qp_ref, do_ref, lse_ref, delta_ref,
               *refs, st: Static):
  """Outer: a key block; dk [bk, d] and dv [bk, d_v] over the query blocks."""
  p_ref, (dk_ref, dv_ref, *scratch) = (refs[0], refs[1:]) if st.fn else (None, refs)
  theta = _theta(st, p_ref)
  k, v, ks, kp = k_ref[...], v_ref[...], ks_ref[0:1, :], kp_ref[0:1, :]

  def step(i, carry):
    qp = widen(_inner(st, qp_ref, i), st.block_k)
    visible = _visible(st, widen(_inner(st, qs_ref, i), st.block_k), ks, qp, kp)

    def update(carry):
      dk, dv = carry
      q, do = _inner(st, q_ref, i), _inner(st, do_ref, i)
      p = _probabilities(st, theta, q, k, visible, qp, kp, _inner(st, lse_ref, i))
      dv = dv + _dot(p.T.astype(do.dtype), do)
      delta = widen(_inner(st, delta_ref, i), st.block_k)
      dlogits = p * (_dot(do, v, transpose_b=True) - delta)
      return dk + _dot(dlogits.T.astype(q.dtype), q), dv

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)

  def finish(carry):
    dk_ref[...], dv_ref[...] = (x.astype(ref.dtype) for x, ref in zip(carry, (dk_ref, dv_ref)))

  _drive(st, lambda: (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)),
         step, finish, scratch)
