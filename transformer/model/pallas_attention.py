"""Flash attention as Pallas kernels, with the positional bias computed inside them.

softmax(q·kᵀ + bias)·V over the visible keys (the same non-pad segment, optionally causal and
within a local window, read from segment ids and positions as transformer/model/masks.py does), in
blocks: the forward kernel runs an online softmax over key blocks and saves each query's
logsumexp; the backward kernels recompute each block's probabilities from it (one kernel per
query block for dq and the bias parameters' gradient, one per key block for dk and dv). The
bias comes from the encoding's BiasSpec (transformer/model/positions/base.py), evaluated on each
[block_q, block_k] block of positions from the head's parameters, so no [L, L] array exists
in memory, forward or backward; the gradient of the bias parameters is the vjp of the
block's bias function at the logits' gradient, summed over blocks.

On the CPU the kernels run in Pallas' interpret mode (the kernel bodies as ordinary JAX
ops); on GPU (Triton) and TPU (Mosaic) they are compiled. Neither lowering has been run (no
accelerator where this was written; the tests run in interpret mode), and these may need
work there: Triton wants blocks and head dims that are powers of two ≥ 16; the in-kernel vjp
of a bias function (T5's select-sum over its buckets transposes into pads of the table row)
may use primitives a lowering lacks; Mosaic wants (8, 128)-tiled blocks, which the 1-D
segment, position and parameter-row blocks are not (splash attention broadcasts its segment
ids along lanes); and pallas_call is not partitioned over a device mesh (a mesh wider than
one device would need shard_map around it).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from transformer.model.positions.base import BiasSpec

# The running maximum before any visible key, and the logit of hidden keys: finite (no inf
# arithmetic in the kernels), so low that exp(_MASKED − any real logit) is exactly 0.
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the kernels are specialised on."""

  fn: object  # the BiasSpec's fn, or None: no bias
  learned: bool  # the bias parameters' gradient is computed
  causal: bool
  window: int | None
  block_q: int
  block_k: int
  interpret: bool


def _dot(a, b, contract_a: int, contract_b: int):
  """a·b contracting a's axis contract_a with b's contract_b (2-D operands), in float32."""
  return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _visible(st: _Static, qs, ks, qp, kp):
  """Which keys of a block each query sees [bq, bk]: segment ids (0 = padding), causal and
  window by position, as masks.Mask.dense."""
  visible = (qs[:, None] == ks[None, :]) & (qs[:, None] != 0) & (ks[None, :] != 0)
  if st.causal:
    visible &= kp[None, :] <= qp[:, None]
  if st.window is not None:
    visible &= jnp.abs(qp[:, None] - kp[None, :]) <= st.window
  return visible


def _probabilities(st, params, q, k, visible, qp, kp, lse):
  """One block's softmax weights [bq, bk] float32 from the saved logsumexp [bq] (0 where
  not visible)."""
  logits = _logits(st, params, q, k, qp, kp)
  return jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - lse[:, None]), 0.0)


def _logits(st, params, q, k, qp, kp):
  """One block's biased logits [bq, bk] float32: q·kᵀ (q already scaled) + bias."""
  logits = _dot(q, k, 1, 1)
  if st.fn is not None:
    logits = logits + st.fn(params, qp, kp)
  return logits


def _any(visible):
  return jnp.max(visible.astype(jnp.int32)) > 0


def _params(refs, names):
  return {name: ref[...] for name, ref in zip(names, refs)}


def _forward_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, *refs, st, names):
  """Grid (batch, head, query block): this block's output [bq, d] and logsumexp [bq]."""
  params, (o_ref, lse_ref) = _params(refs, names), refs[len(names):]
  q, qs, qp = q_ref[...], qs_ref[...], qp_ref[...]

  def key_block(j, carry):
    keys = pl.ds(j * st.block_k, st.block_k)
    kp = kp_ref[keys]
    visible = _visible(st, qs, ks_ref[keys], qp, kp)

    def update(carry):
      top, total, acc = carry  # running max [bq], normaliser [bq], output [bq, d]
      logits = jnp.where(visible, _logits(st, params, q, k_ref[keys, :], qp, kp), _MASKED)
      new_top = jnp.maximum(top, logits.max(-1))
      p = jnp.where(visible, jnp.exp(logits - new_top[:, None]), 0.0)
      rescale = jnp.exp(top - new_top)  # 0 when the first visible key arrives, else ≤ 1
      v = v_ref[keys, :]
      acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v, 1, 0)
      return new_top, total * rescale + p.sum(-1), acc

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)  # skip hidden blocks

  carry = (jnp.full(qs.shape, _MASKED, jnp.float32), jnp.zeros(qs.shape, jnp.float32),
           jnp.zeros((q.shape[0], v_ref.shape[-1]), jnp.float32))
  top, total, acc = jax.lax.fori_loop(0, k_ref.shape[0] // st.block_k, key_block, carry)
  seen = total > 0
  o_ref[...] = (acc / jnp.where(seen, total, 1.0)[:, None]).astype(o_ref.dtype)  # none seen: 0
  lse_ref[...] = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, do_ref, lse_ref, delta_ref,
               *refs, st, names):
  """Grid (batch, head, query block): dq [bq, d] and this block's share of the bias
  parameters' gradient (each [size]), over the key blocks."""
  params, dq_ref, dparam_refs = _params(refs, names), refs[len(names)], refs[len(names) + 1:]
  q, qs, qp, do, lse, delta = (ref[...] for ref in (q_ref, qs_ref, qp_ref, do_ref, lse_ref,
                                                    delta_ref))

  def key_block(j, carry):
    keys = pl.ds(j * st.block_k, st.block_k)
    kp = kp_ref[keys]
    visible = _visible(st, qs, ks_ref[keys], qp, kp)

    def update(carry):
      dq, dparams = carry
      k, v = k_ref[keys, :], v_ref[keys, :]
      p = _probabilities(st, params, q, k, visible, qp, kp, lse)
      dlogits = p * (_dot(do, v, 1, 1) - delta[:, None])  # [bq, bk]
      dq = dq + _dot(dlogits.astype(k.dtype), k, 1, 0)
      if st.learned:  # the bias parameters' share: the vjp of this block's bias at dlogits
        _, bias_vjp = jax.vjp(lambda theta: st.fn(theta, qp, kp), params)
        dparams = jax.tree.map(jnp.add, dparams, bias_vjp(dlogits)[0])
      return dq, dparams

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)

  dparams = {name: jnp.zeros_like(params[name]) for name in names} if st.learned else {}
  dq, dparams = jax.lax.fori_loop(0, k_ref.shape[0] // st.block_k, key_block,
                                  (jnp.zeros(q.shape, jnp.float32), dparams))
  dq_ref[...] = dq.astype(dq_ref.dtype)
  for name, ref in zip(names if st.learned else (), dparam_refs):
    ref[...] = dparams[name]


def _dkv_kernel(q_ref, k_ref, v_ref, qs_ref, ks_ref, qp_ref, kp_ref, do_ref, lse_ref, delta_ref,
                *refs, st, names):
  """Grid (batch, head, key block): dk and dv [bk, d], over the query blocks."""
  params, (dk_ref, dv_ref) = _params(refs, names), refs[len(names):]
  k, v, ks, kp = k_ref[...], v_ref[...], ks_ref[...], kp_ref[...]

  def query_block(i, carry):
    rows = pl.ds(i * st.block_q, st.block_q)
    qp = qp_ref[rows]
    visible = _visible(st, qs_ref[rows], ks, qp, kp)

    def update(carry):
      dk, dv = carry
      q, do = q_ref[rows, :], do_ref[rows, :]
      p = _probabilities(st, params, q, k, visible, qp, kp, lse_ref[rows])
      dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
      dlogits = p * (_dot(do, v, 1, 1) - delta_ref[rows][:, None])
      return dk + _dot(dlogits.astype(q.dtype), q, 0, 0), dv

    return jax.lax.cond(_any(visible), update, lambda c: c, carry)

  zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = jax.lax.fori_loop(0, q_ref.shape[0] // st.block_q, query_block, zeros)
  dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _spec(shape, block: int | None):
  """The BlockSpec of an array [b, h, t, d], [b, h, t] or [b, t] at grid step (i, j, n) =
  (batch, head, block): its n-th block of `block` along t, or (None) the whole of t."""
  rank, size = len(shape), shape[2 if len(shape) > 2 else 1] if block is None else block
  at = (lambda n: 0) if block is None else (lambda n: n)  # noqa: E731
  if rank == 4:
    return pl.BlockSpec((None, None, size, shape[3]), lambda i, j, n: (i, j, at(n), 0))
  if rank == 3:
    return pl.BlockSpec((None, None, size), lambda i, j, n: (i, j, at(n)))
  return pl.BlockSpec((None, size), lambda i, j, n: (i, at(n)))


def _call(kernel, st: _Static, blocks: int, inputs, in_blocks, params, outputs, out_specs):
  """pallas_call of `kernel` over the grid (batch, head, blocks): inputs in blocks of
  in_blocks (None: whole), then the bias parameters [h, size], one head's row each."""
  b, h = inputs[0].shape[:2]
  names = sorted(params)
  in_specs = [_spec(x.shape, block) for x, block in zip(inputs, in_blocks)] + [
      pl.BlockSpec((None, params[name].shape[-1]), lambda i, j, n: (j, 0)) for name in names]
  return pl.pallas_call(
      functools.partial(kernel, st=st, names=names), grid=(b, h, blocks), in_specs=in_specs,
      out_specs=out_specs, out_shape=outputs, interpret=st.interpret,
  )(*inputs, *(params[name] for name in names))


def _forward(st, q, k, v, qs, ks, qp, kp, params):
  b, h, tq, _ = q.shape
  outputs = [jax.ShapeDtypeStruct((b, h, tq, v.shape[-1]), v.dtype),
             jax.ShapeDtypeStruct((b, h, tq), jnp.float32)]
  bq = st.block_q
  return _call(_forward_kernel, st, tq // bq, (q, k, v, qs, ks, qp, kp),
               (bq, None, None, bq, None, bq, None), params, outputs,
               [_spec(x.shape, bq) for x in outputs])


def _backward(st, q, k, v, qs, ks, qp, kp, params, out, lse, do):
  """Gradients of q, k, v [b, h, t, d] and of the bias parameters ([h, size] each)."""
  b, h, tq, _ = q.shape
  bq, bk, nq = st.block_q, st.block_k, tq // st.block_q
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), -1)  # Σ_k p·dp [b, h, tq]
  inputs = (q, k, v, qs, ks, qp, kp, do, lse, delta)
  dparams = [jax.ShapeDtypeStruct((b, h, nq, params[name].shape[-1]), jnp.float32)
             for name in sorted(params)] if st.learned else []
  dq, *dparams = _call(
      _dq_kernel, st, nq, inputs, (bq, None, None, bq, None, bq, None, bq, bq, bq), params,
      [jax.ShapeDtypeStruct(q.shape, q.dtype), *dparams],
      [_spec(q.shape, bq)] + [pl.BlockSpec((None, None, None, x.shape[-1]),
                                           lambda i, j, n: (i, j, n, 0)) for x in dparams])
  outputs = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dk, dv = _call(_dkv_kernel, st, k.shape[2] // bk, inputs,
                 (None, bk, bk, None, bk, None, bk, None, None, None), params, outputs,
                 [_spec(x.shape, bk) for x in outputs])
  if st.learned:  # each block's share, summed over batch and query blocks
    dparams = {name: d.sum((0, 2)) for name, d in zip(sorted(params), dparams)}
  else:
    dparams = jax.tree.map(jnp.zeros_like, params)
  return dq, dk, dv, dparams


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, qs, ks, qp, kp, params):
  return _forward(st, q, k, v, qs, ks, qp, kp, params)[0]


def _flash_fwd(st, q, k, v, qs, ks, qp, kp, params):
  out, lse = _forward(st, q, k, v, qs, ks, qp, kp, params)
  return out, (q, k, v, qs, ks, qp, kp, params, out, lse)


def _flash_bwd(st, residuals, do):
  q, k, v, qs, ks, qp, kp, params, out, lse = residuals
  dq, dk, dv, dparams = _backward(st, q, k, v, qs, ks, qp, kp, params, out, lse, do)
  return dq, dk, dv, None, None, None, None, dparams


_flash.defvjp(_flash_fwd, _flash_bwd)


def _heads(x, length: int):
  """[b, t, h, d] -> [b, h, length, d], zero-padded along t."""
  x = jnp.swapaxes(x, 1, 2)
  return jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)])


def _ids(x, length: int):
  """[b, t] ids -> int32 [b, length], 0-padded (segment 0: padding, masked)."""
  return jnp.pad(x.astype(jnp.int32), [(0, 0), (0, length - x.shape[1])])


def flash_attention(q, k, v, *, q_segments, k_segments, q_positions, k_positions,
                    causal: bool = False, window: int | None = None,
                    bias_spec: BiasSpec | None = None, scale: float = 1.0, block_q: int = 128,
                    block_k: int = 128, interpret: bool | None = None) -> jax.Array:
  """softmax(scale·q·kᵀ + bias)·V over the visible keys, as Pallas kernels.

  Args:
    q: [b, tq, h, d]; k: [b, tk, h, d]; v: [b, tk, h, d_v] (d_v may differ from d).
    q_segments, k_segments: int [b, tq], [b, tk]; a query sees keys of its own segment, and
      segment 0 (padding) sees and is seen by none.
    q_positions, k_positions: int [b, tq], [b, tk], the tokens' positions (which the causal
      mask, the window and the bias read; never the array indices).
    causal: keys at positions ≤ the query's only; window: within ±window positions.
    bias_spec: the positional bias, evaluated on blocks inside the kernels; its learned
      parameters get gradients.
    block_q, block_k: queries and keys per block (capped at the lengths rounded up to 8);
      lengths are zero-padded to whole blocks inside.
    interpret: run the kernels in Pallas' interpret mode; None: on the CPU backend only.
  Returns:
    [b, tq, h, d_v] in v's dtype; 0 for a query that sees no key.
  """
  b, tq, h, d = q.shape
  tk = k.shape[1]
  block_q, block_k = min(block_q, -(-tq // 8) * 8), min(block_k, -(-tk // 8) * 8)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  st = _Static(fn=None if bias_spec is None else bias_spec.fn,
               learned=bias_spec is not None and bias_spec.learned, causal=causal,
               window=window, block_q=block_q, block_k=block_k, interpret=interpret)
  params = {} if bias_spec is None else dict(bias_spec.params)
  lq, lk = -(-tq // block_q) * block_q, -(-tk // block_k) * block_k
  out = _flash(st, _heads(q * jnp.asarray(scale, q.dtype), lq), _heads(k, lk), _heads(v, lk),
               _ids(q_segments, lq), _ids(k_segments, lk), _ids(q_positions, lq),
               _ids(k_positions, lk), params)
  return jnp.swapaxes(out[:, :, :tq], 1, 2)
