"""Attention kernels: ways to compute softmax(score(q, k) + bias)·V, and what each supports.

A kernel computes the heads' outputs [b, tq, h, d] from q [b, tq, h, d], k, v
[b, tk, kv_heads, d] (kv_heads divides h: query head i reads kv head i // (h / kv_heads),
grouped-query attention; kv_heads = h is multi-head attention), a Mask, the positional
encoding, and the layer's scorer and dropout:
`kernel(q, k, v, mask, encoding, score, dropout, rngs)`. Of the encoding it calls the logit
seams it supports: every kernel adds `encoding.bias(q_positions, k_positions)` (`pallas`
evaluates it block by block from `encoding.bias_spec()`, inside its kernels); a kernel that
declares `content_bias` also adds `encoding.content_bias(q, logits)`, a function of each
query's whole row of logits. KERNELS maps a name to a Kernel: how to make the function, and
its declared capabilities, which transformer/model/kernel_choice.py compares once, when a
layer is made, with what the layer needs (its scorer, dropout, encoding, dtype, ...); a new
kernel is one function and its line in KERNELS, and tests/test_kernel_conformance.py runs it
against the reference kernel over everything it declares.

A kernel declaring `softcap` is made with `softcap=c` when the layer caps its logits
(model.attention.logit_softcap = c > 0): the scorer's logits become c·tanh(score / c), and
the positional biases are added after the cap, so distance biases (ALiBi, T5) are not
bounded by c.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer.core.errors import ConfigError
from transformer.model.layers import Dropout
from transformer.model.log_once import log_once
from transformer.model.masks import Mask, masked_softmax
from transformer.model.pallas_attention import flash_attention


def repeat_heads(x: jax.Array, heads: int) -> jax.Array:
  """x [b, t, kv_heads, d] with each kv head repeated for its heads / kv_heads query heads:
  [b, t, heads, d] (head i is kv head i // (heads / kv_heads)); x itself when kv_heads = heads."""
  return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap · tanh(logits / cap) in float32; the logits themselves when cap is 0 (off)."""
  return cap * jnp.tanh(logits.astype(jnp.float32) / cap) if cap else logits


def attention_weights(q, k, mask: Mask, encoding, score, softcap: float = 0.0) -> jax.Array:
  """softmax(cap(score(q, k)) + bias + content bias) over the unmasked keys: [b, h, tq, tk]
  float32, cap = soft_cap(·, softcap). k may have fewer heads than q (repeat_heads). The
  content bias sees the logits before it, −inf at the masked keys."""
  visible = mask.dense()
  k = repeat_heads(k, q.shape[2])
  logits = soft_cap(score(q, k), softcap) + encoding.bias(mask.q_positions, mask.k_positions)
  if encoding.content_biases:  # otherwise no pass over the logits for a zero
    logits = jnp.where(visible, logits.astype(jnp.float32), -jnp.inf)
    logits = logits + encoding.content_bias(q, logits)
  return masked_softmax(logits, visible)


def reference_kernel(q, k, v, mask: Mask, encoding, score, dropout, rngs, *,
                     softcap: float = 0.0):
  """The formula, any scorer and every seam: softmax(cap(score(q, k)) + bias + content bias)
  over unmasked keys, dropout, ·V."""
  weights = attention_weights(q, k, mask, encoding, score, softcap).astype(v.dtype)
  weights = dropout(weights, deterministic=rngs is None, rngs=rngs)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, repeat_heads(v, q.shape[2]))


def fused_kernel(implementation: str):
  """jax.nn.dot_product_attention (XLA's fused attention, or cuDNN's flash attention on
  NVIDIA GPUs) for the scorers declaring a dot product, whose transforms and scale it
  applies: softmax(scale · queries(q) · keys(k)ᵀ + bias)·V, the bias computed beforehand
  from positions alone; no dropout on the weights, no content bias, and not the declared
  row_term (softmax ignores it). A query row with no visible key (padding) attends to every
  key instead of none, so it stays finite (no NaN to leak into later layers); the loss
  never reads it. Fewer key/value heads than query heads are attended natively
  (grouped-query attention), without repeating them, unless the key transform is per
  query head (DotProduct.keys_per_head)."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs):
    del dropout, rngs
    product = score.dot_product
    dense = mask.dense()
    dense = dense | ~jnp.any(dense, axis=-1, keepdims=True)
    bias = encoding.bias(mask.q_positions, mask.k_positions)
    bias = None if jnp.ndim(bias) == 0 else bias.astype(q.dtype)
    impl = implementation
    if q.shape[1] == 1 and implementation == "cudnn":  # cuDNN has no 1-query decode step
      impl = "xla"
      log_once("kernel cudnn: one query per row (a decoding step) runs XLA's attention "
               f"over the row [b, h, 1, {k.shape[1]}], not cuDNN's")
    if product.keys_per_head:  # each query head's own key transform: one key head each
      k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])
    qt, kt, vt = equal_head_dims(product.queries(q).astype(v.dtype),
                                 product.keys(k).astype(v.dtype), v)
    out = jax.nn.dot_product_attention(qt, kt, vt, bias=bias, mask=dense, scale=product.scale,
                                       implementation=impl)
    return out[..., :v.shape[-1]]

  return kernel


def pallas_kernel(block_size: int, mesh: jax.sharding.AbstractMesh | None = None):
  """flash_attention (transformer/model/pallas_attention.py) for a scorer declaring a dot product
  (its transforms applied before, its scale passed in) and the encoding's BiasSpec, computed
  in-kernel; blocks of block_size queries and keys. Fewer key/value heads than query heads
  are read by their query heads in-kernel (grouped-query attention), unless the key
  transform is per query head (DotProduct.keys_per_head). On a mesh of several devices it
  runs on each device's shard (per_device): XLA does not partition a pallas_call."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs):
    del dropout, rngs
    spec = encoding.bias_spec()
    if spec is None and encoding.biases:
      raise ConfigError(f"attention.kernel 'pallas' needs a BiasSpec of the positional "
                        f"encoding {type(encoding).__name__}, which declares none; use kernel "
                        "'reference' or 'blockwise'")
    product = score.dot_product
    if product.keys_per_head:  # each query head's own key transform: one key head each
      k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])

    def attend(q, k, v, ids, params):
      return flash_attention(
          q, k, v, q_segments=ids[0], k_segments=ids[1], q_positions=ids[2],
          k_positions=ids[3], causal=mask.causal, window=mask.window,
          bias_spec=None if spec is None else dataclasses.replace(spec, params=params),
          scale=product.scale, block_q=block_size, block_k=block_size)

    ids = (mask.q_segments, mask.k_segments, mask.q_positions, mask.k_positions)
    params = {} if spec is None else dict(spec.params)
    return per_device(attend, mesh)(product.queries(q), product.keys(k), v, ids, params)

  return kernel


def per_device(attend: Callable, mesh: jax.sharding.AbstractMesh | None) -> Callable:
  """attend(q, k, v, ids, params) run by jax.shard_map on each device's shard of a mesh of
  several devices (itself on one): the rows over the mesh's batch axes, `data` and `fsdp`,
  and the heads over `tensor` (the axes of transformer/run/sharding.py), each where it
  divides them (otherwise that dimension is whole on every device). q [b, t, h, d], k, v
  [b, t, kv_heads, d] and the output split by rows and heads (a device's query heads read
  its own key/value heads: both split alike, or neither), the ids ([b, t] segments and
  positions) by rows, the params ({name: [h, size]}, a BiasSpec's) by heads. Each device's
  rows and heads are independent attentions, so no collective is needed; the gradients of
  the params, which the rows share, are summed over the batch axes by shard_map's
  transpose."""
  if mesh is None or mesh.size == 1:
    return attend

  def sharded(q, k, v, ids, params):
    rows = ("data", "fsdp")
    rows = rows if q.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    tensor = mesh.shape["tensor"]
    heads = "tensor" if q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    x, t = P(rows, None, heads, None), P(rows, None)
    in_specs = (x, x, x, (t,) * len(ids), jax.tree.map(lambda _: P(heads, None), params))
    # check_vma=False: a pallas_call's out_shape (pallas_attention.py) declares no varying
    # mesh axes, which the check requires; the tests compare values and gradients with one
    # device's (test_sharding: the losses of a 2x2x2 mesh).
    return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=x,
                         check_vma=False)(q, k, v, ids, params)

  return sharded


def equal_head_dims(q, k, v, multiple: int = 8):
  """q, k [b, t, h, d'] and v [b, t, h, d] padded with zeros to one head dim, a multiple of
  `multiple` (cuDNN's), when d' ≠ d: jax.nn.dot_product_attention needs q, k and v of one
  head dim. Zeros change no dot product, and v's zero columns give output columns to drop."""
  dq, dv = q.shape[-1], v.shape[-1]
  if dq == dv:
    return q, k, v
  dim = -max(dq, dv) // multiple * -multiple
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, dim - x.shape[-1])])  # noqa: E731
  return pad(q), pad(k), pad(v)


def _pad_time(x, before: int, after: int):
  return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))


def blockwise_kernel(q, k, v, mask: Mask, encoding, score, dropout, rngs, *, block: int,
                     softcap: float = 0.0):
  """Memory-bounded attention, any scorer: queries in blocks of `block`, each block's softmax
  accumulated online over key blocks (flash-attention style, in plain JAX), and each query
  block rematerialised in the backward pass, so no [tq, tk] array exists, only
  [block, block] ones. With a local window a query block reads only the keys within the
  window of it: O(L·(block + 2w)) work and memory instead of O(L²). Fully masked rows give
  0, as the reference does; no attention dropout, and no content bias (no block sees a
  query's whole row of logits). The logits are capped (soft_cap) before the bias."""
  del dropout, rngs
  b, tq, h, d = q.shape
  tk = k.shape[1]
  if tq == 1 or (tq <= block and tk <= block):
    return reference_kernel(q, k, v, mask, encoding, score, Dropout(0.0), None, softcap=softcap)
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
    top, total, acc = carry  # running max [b,h,bq], normaliser [b,h,bq], output [b,h,bq,d]
    m = mask.block(q_start, block, k_start, span)
    k_blk = jax.lax.dynamic_slice_in_dim(k, k_start, span, axis=1)
    v_blk = jax.lax.dynamic_slice_in_dim(v, k_start, span, axis=1)
    visible = m.dense()
    bias = encoding.bias(m.q_positions, m.k_positions)
    logits = (soft_cap(score(q_blk, k_blk), softcap) + bias).astype(jnp.float32)
    logits = jnp.where(visible, logits, -jnp.inf)
    new_top = jnp.maximum(top, logits.max(-1))
    safe_top = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    p = jnp.where(visible, jnp.exp(logits - safe_top[..., None]), 0.0)
    rescale = jnp.exp(jnp.where(jnp.isfinite(top), top - safe_top, -jnp.inf))
    acc = acc * rescale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p.astype(v.dtype), v_blk,
                                                preferred_element_type=jnp.float32)
    return new_top, total * rescale + p.sum(-1), acc

  @jax.checkpoint
  def query_block(q_start):
    q_blk = jax.lax.dynamic_slice_in_dim(q, q_start, block, axis=1)
    carry = (jnp.full((b, h, block), -jnp.inf, jnp.float32), jnp.zeros((b, h, block), jnp.float32),
             jnp.zeros((b, h, block, d), jnp.float32))
    if local:  # padded keys start `window` before the queries: this block's span
      carry = key_block(carry, q_start, q_start, q_blk)
    else:
      step = jax.checkpoint(lambda c, j: (key_block(c, q_start, j * block, q_blk), None))
      carry = jax.lax.scan(step, carry, jnp.arange(num_key_blocks))[0]
    _, total, acc = carry
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # no visible key: 0
    return jnp.swapaxes(out, 1, 2).astype(v.dtype)  # [b, block, h, d]

  blocks = jax.lax.map(query_block, jnp.arange(0, tq + q_pad, block))  # [n, b, block, h, d]
  return jnp.moveaxis(blocks, 0, 1).reshape(b, tq + q_pad, h, d)[:, :tq]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A way to compute softmax(score + bias)·V, and what it supports: one declaration per
  field of what a layer may need (kernel_choice.Needs), which kernel_choice.check compares.
  Every kernel adds an encoding's positional bias (its `bias` seam) and takes padding,
  packing and causal masks."""

  # make(block_size=, softcap=, mesh=) -> the kernel function: blocks of block_size queries
  # and keys, logits capped at softcap (declared `softcap`; others get 0), for the mesh the
  # model runs on (jax.sharding.AbstractMesh; None: one device)
  make: Callable[..., Callable]
  any_score: bool  # runs every scorer; False: only scorers declaring a dot_product
  dropout: bool  # dropout on the attention weights
  # adds an encoding's content_bias, a function of each query's whole row of logits
  content_bias: bool = False
  softcap: bool = False  # caps the scorer's logits (make's softcap)
  # gives the gradient of a positional bias with parameters (an encoding declaring
  # learned_bias: T5, KERPLE, FIRE)
  learned_bias: bool = True
  # adds a bias read from a table at each pair (an encoding declaring gathered_bias:
  # relative encodings at randomized offsets drawn per batch)
  gathered_bias: bool = True
  local_window: bool = True  # masks with a local window (|query − key position| ≤ w)
  grouped_query: bool = True  # fewer key/value heads than query heads
  dtypes: tuple[str, ...] | None = None  # the compute dtypes it takes; None: every one
  backends: tuple[str, ...] | None = None  # the JAX backends it runs on; None: every one
  # a kernel computing the same function on any backend, which evaluation uses where this
  # one does not run (or, slow_on, runs only emulated)
  stand_in: str | None = None
  slow_on: tuple[str, ...] = ()  # backends where it runs emulated (Pallas' interpret mode)
  # runs on a mesh of several devices: XLA partitions it, or its function does (per_device)
  multi_device: bool = True
  # `auto` offers it only to a layer whose encoding adds a positional bias (kernel_choice)
  auto_only_with_bias: bool = False


def _reference(block_size, softcap=0.0, mesh=None):
  del block_size, mesh
  return functools.partial(reference_kernel, softcap=softcap)


def _blockwise(block_size, softcap=0.0, mesh=None):
  del mesh
  return functools.partial(blockwise_kernel, block=block_size, softcap=softcap)


def _fused(implementation: str):
  def make(block_size, softcap=0.0, mesh=None):
    del block_size, softcap, mesh
    return fused_kernel(implementation)
  return make


def _pallas(block_size, softcap=0.0, mesh=None):
  del softcap
  return pallas_kernel(block_size, mesh)


KERNELS: dict[str, Kernel] = {
    "reference": Kernel(_reference, any_score=True, dropout=True, content_bias=True,
                        softcap=True),
    "xla": Kernel(_fused("xla"), any_score=False, dropout=False),
    # cuDNN's flash attention takes fp16/bf16 only, and its bias gradient is not to be
    # trusted (JAX #23701: for years refused unless batch 1 and one bias per head; #27184,
    # #32242: none, or NaN): it is refused for a learned bias.
    "cudnn": Kernel(_fused("cudnn"), any_score=False, dropout=False, backends=("gpu",),
                    stand_in="xla", learned_bias=False, dtypes=("bfloat16", "float16")),
    "blockwise": Kernel(_blockwise, any_score=True, dropout=False, softcap=True),
    # Pallas flash attention, the encoding's BiasSpec evaluated in-kernel (pallas_attention.py);
    # interpret mode on the CPU; on a mesh, per device (shard_map). auto offers it where its
    # in-kernel bias spares an [L, L] array; elsewhere xla and cudnn are better known.
    "pallas": Kernel(_pallas, any_score=False, dropout=False, stand_in="xla", slow_on=("cpu",),
                     gathered_bias=False, auto_only_with_bias=True),
}


def able(capable: Callable[[Kernel], bool]) -> str:
  """The kernels with a capability, for an error line: "'reference' or 'xla'"."""
  return " or ".join(repr(key) for key, kernel in KERNELS.items() if capable(kernel))
