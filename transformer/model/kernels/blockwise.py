"""Blockwise attention: the formula in blocks of queries and keys, in plain JAX, memory-bounded
(the kernel `blockwise` of KERNELS, transformer/model/kernels/registry.py)."""

import dataclasses

import jax
import jax.numpy as jnp

from transformer.model.layers import Dropout
from transformer.model.masks import Mask
from transformer.model.kernels.reference import reference_kernel, repeat_heads, soft_cap
from transformer.model.normalizers import SOFTMAX


def _pad_time(x, before: int, after: int):
  return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))


def blockwise_kernel(q, k, v, mask: Mask, encoding, score, dropout, rngs, normalizer=None, *,
                     block: int, softcap: float = 0.0):
  """Memory-bounded attention, any scorer: queries in blocks of `block`, each block's softmax
  (or the online form of another normaliser: its start, step and divisor) accumulated
  online over key blocks (flash-attention style, in plain JAX), and each query
  block rematerialised in the backward pass, so no [tq, tk] array exists, only
  [block, block] ones. With a local window a query block reads only the keys within the
  window of it: O(L·(block + 2w)) work and memory instead of O(L²). Fully masked rows give
  0, as the reference does; no attention dropout, and no content bias (no block sees a
  query's whole row of logits). The logits are capped (soft_cap) before the bias."""
  del dropout, rngs
  normalizer = normalizer or SOFTMAX
  b, tq, h = q.shape[:3]
  tk, d = k.shape[1], v.shape[-1]  # the values' width, which may differ from q's and k's
  if tq == 1 or (tq <= block and tk <= block):
    return reference_kernel(q, k, v, mask, encoding, score, Dropout(0.0), None, normalizer,
                            softcap=softcap)
  k, v = repeat_heads(k, h), repeat_heads(v, h)
  local = mask.window is not None and tq == tk  # self-attention: keys at the queries' indices
  q_pad = -tq % block
  span = block + 2 * mask.window if local else block
  k_before = mask.window if local else 0
  k_after = (tq + q_pad + mask.window - tk) if local else -tk % block
  q, k, v = _pad_time(q, 0, q_pad), _pad_time(k, k_before, k_after), _pad_time(v, k_before, k_after)
  mask = dataclasses.replace(  # padding has segment 0: masked
      mask, q_segments=_pad_time(mask.q_segments, 0, q_pad),
      q_positions=_pad_time(mask.q_positions, 0, q_pad),
      k_segments=_pad_time(mask.k_segments, k_before, k_after),
      k_positions=_pad_time(mask.k_positions, k_before, k_after))
  num_key_blocks = 1 if local else k.shape[1] // block

  def key_block(carry, q_start, k_start, q_blk):
    state, acc = carry  # the normaliser's running state, output [b,h,bq,d]
    m = mask.block(q_start, block, k_start, span)
    k_blk = jax.lax.dynamic_slice_in_dim(k, k_start, span, axis=1)
    v_blk = jax.lax.dynamic_slice_in_dim(v, k_start, span, axis=1)
    visible = m.dense()
    bias = encoding.bias(m.q_positions, m.k_positions)
    logits = (soft_cap(score(q_blk, k_blk), softcap) + bias).astype(jnp.float32)
    logits = jnp.where(visible, logits, -jnp.inf)
    state, p, rescale = normalizer.step(state, logits, visible)
    acc = acc * rescale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v_blk,
                                                preferred_element_type=jnp.float32)
    return state, acc

  @jax.checkpoint
  def query_block(q_start):
    q_blk = jax.lax.dynamic_slice_in_dim(q, q_start, block, axis=1)
    carry = (normalizer.start((b, h, block)), jnp.zeros((b, h, block, d), jnp.float32))
    if local:  # padded keys start `window` before the queries: this block's span
      carry = key_block(carry, q_start, q_start, q_blk)
    else:
      step = jax.checkpoint(lambda c, j: (key_block(c, q_start, j * block, q_blk), None))
      carry = jax.lax.scan(step, carry, jnp.arange(num_key_blocks))[0]
    state, acc = carry
    out = acc / normalizer.divisor(state)[..., None]  # no visible key: 0
    return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [b, block, h, d]

  blocks = jax.lax.map(query_block, jnp.arange(0, tq + q_pad, block))  # [n, b, block, h, d]
  return jnp.moveaxis(blocks, 0, 1).reshape(b, tq + q_pad, h, d)[:, :tq]
