"""Multi-head attention with pluggable scoring functions and attention windows.

A scorer maps per-head queries and keys to logits with one signature,
`score(q [b, tq, h, d], k [b, tk, h, d]) -> [b, h, tq, tk]`; scorers with parameters are
NNX modules. Masks are booleans [b, 1, tq, tk] (True = may attend) built from explicit
segment ids and positions, so padding, packing, causality and windows compose by `&`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.layers import Dense, Dropout, project
from transformer.positions import PositionalEncoding
from transformer.registry import (AT_LEAST_0, AT_LEAST_1, FRACTION, ConfigError, check_ranges,
                                  lookup)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  score: str = "scaled_dot"  # a key of SCORES
  window: str = "full"  # a key of WINDOWS
  window_size: int = 16  # `local`: each query sees keys within ±window_size positions
  dropout: float = 0.0  # on the attention weights
  additive_dim: int = 0  # hidden size of the additive scorer per head; 0 = head_dim
  gaussian_sigma: float = 0.0  # initial kernel width; 0 = head_dim ** 0.25 (matches √d scaling)
  learn_sigma: bool = True  # Gaussian width learned per head, or fixed
  kernel: str = "reference"  # a key of KERNELS: how softmax(scores + bias)·V is computed
  block_size: int = 512  # `blockwise`: queries and keys per block

  def __post_init__(self):
    check_ranges(self, window_size=AT_LEAST_1, dropout=FRACTION, additive_dim=AT_LEAST_0,
                 gaussian_sigma=AT_LEAST_0, block_size=AT_LEAST_1)
    lookup(SCORES, self.score, "attention score")
    lookup(WINDOWS, self.window, "attention window")
    lookup(KERNELS, self.kernel, "attention kernel")


# --------------------------------------------------------------------------- scorers


class ScaledDot(nnx.Module):
  """q·k / √d_k ("Attention Is All You Need", eq. 1)."""

  def __init__(self, num_heads: int, head_dim: int, cfg: AttentionConfig, *, rngs: nnx.Rngs):
    self.scale = 1.0 / math.sqrt(head_dim)

  def __call__(self, q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(self.scale, q.dtype), k)


class Dot(ScaledDot):
  """Unscaled q·k (Luong et al. 2015)."""

  def __init__(self, num_heads, head_dim, cfg, *, rngs):
    self.scale = 1.0


class Additive(nnx.Module):
  """w_vᵀ tanh(W_q q + W_k k) per head (Bahdanau et al. 2015)."""

  def __init__(self, num_heads, head_dim, cfg, *, rngs):
    a = cfg.additive_dim or head_dim
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.w_q = nnx.Param(init(rngs.params(), (num_heads, head_dim, a)))
    self.w_k = nnx.Param(init(rngs.params(), (num_heads, head_dim, a)))
    self.w_v = nnx.Param(nnx.initializers.normal(a ** -0.5)(rngs.params(), (num_heads, a)))

  def __call__(self, q, k):
    qa = jnp.einsum("bqhd,hda->bhqa", q, self.w_q[...].astype(q.dtype))
    ka = jnp.einsum("bkhd,hda->bhka", k, self.w_k[...].astype(k.dtype))
    hidden = jnp.tanh(qa[:, :, :, None, :] + ka[:, :, None, :, :])  # [b, h, q, k, a]
    return jnp.einsum("bhqka,ha->bhqk", hidden, self.w_v[...].astype(q.dtype))


class Gaussian(nnx.Module):
  """−‖q − k‖² / (2σ²) per head: Nadaraya-Watson kernel regression as attention."""

  def __init__(self, num_heads, head_dim, cfg, *, rngs):
    sigma = cfg.gaussian_sigma or head_dim ** 0.25
    if sigma <= 0:
      raise ConfigError(f"gaussian_sigma must be positive, got {sigma}")
    self.learn_sigma = cfg.learn_sigma
    self.log_sigma = nnx.Param(jnp.full((num_heads,), math.log(sigma), jnp.float32))

  def __call__(self, q, k):
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    q2 = jnp.einsum("bqhd,bqhd->bhq", q, q)[..., :, None]
    k2 = jnp.einsum("bkhd,bkhd->bhk", k, k)[..., None, :]
    sq_dist = jnp.maximum(q2 + k2 - 2.0 * jnp.einsum("bqhd,bkhd->bhqk", q, k), 0.0)
    log_sigma = self.log_sigma[...]
    if not self.learn_sigma:  # fixed width: the parameter exists but never moves
      log_sigma = jax.lax.stop_gradient(log_sigma)
    inv_two_var = 0.5 * jnp.exp(-2.0 * log_sigma)[None, :, None, None]
    return -sq_dist * inv_two_var


SCORES: dict[str, type[nnx.Module]] = {
    "scaled_dot": ScaledDot,
    "dot": Dot,
    "additive": Additive,
    "gaussian": Gaussian,
}


# --------------------------------------------------------------------------- masks


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
  """[b, tq], [b, tk] segment ids (0 = padding) -> [b, 1, tq, tk]: same non-pad segment."""
  same = q_segments[:, :, None] == k_segments[:, None, :]
  real = (q_segments[:, :, None] != 0) & (k_segments[:, None, :] != 0)
  return (same & real)[:, None]


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """Keys at positions ≤ the query's: [b, 1, tq, tk]."""
  return (k_positions[:, None, :] <= q_positions[:, :, None])[:, None]


WINDOWS: dict[str, Callable[[int], int | None]] = {
    "full": lambda size: None,  # every key of the sequence (within the segment)
    "local": lambda size: size,  # keys within ±size positions
}


def local_window(q_positions, k_positions, size: int) -> jax.Array:
  """Truncated attention: keys within ±size positions of the query, [b, 1, tq, tk]."""
  offset = q_positions[:, :, None] - k_positions[:, None, :]
  return (jnp.abs(offset) <= size)[:, None]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_segments", "k_segments", "q_positions", "k_positions"],
                   meta_fields=["causal", "window"])
@dataclasses.dataclass(frozen=True)
class Mask:
  """Which keys each query may see, kept as its ingredients ([b, tq] / [b, tk] segment ids
  and positions) so a kernel can build the whole [b, 1, tq, tk] boolean or any block of it
  without the rest: the same non-pad segment, and optionally causal (key position ≤ the
  query's) and a local window (|query − key position| ≤ window)."""

  q_segments: jax.Array
  k_segments: jax.Array
  q_positions: jax.Array
  k_positions: jax.Array
  causal: bool = False
  window: int | None = None

  def dense(self) -> jax.Array:
    mask = segment_mask(self.q_segments, self.k_segments)
    if self.causal:
      mask &= causal_mask(self.q_positions, self.k_positions)
    if self.window is not None:
      mask &= local_window(self.q_positions, self.k_positions, self.window)
    return mask

  def block(self, q_start, q_size: int, k_start, k_size: int) -> "Mask":
    """The mask of queries q_start.. (q_size of them) against keys k_start.. (k_size)."""
    q = lambda x: jax.lax.dynamic_slice_in_dim(x, q_start, q_size, axis=1)  # noqa: E731
    k = lambda x: jax.lax.dynamic_slice_in_dim(x, k_start, k_size, axis=1)  # noqa: E731
    return dataclasses.replace(self, q_segments=q(self.q_segments), q_positions=q(self.q_positions),
                               k_segments=k(self.k_segments), k_positions=k(self.k_positions))


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis where masked entries get exactly 0 and all-masked rows are 0
  (float32). Its backward pass is the softmax's, p·(g − Σ p·g), which is already 0 where p
  is: no selects on the way back (about 10 ms of the small benchmark's train step)."""
  return _masked_softmax(logits.astype(jnp.float32), mask)


@jax.custom_vjp
def _masked_softmax(logits, mask):
  logits = jnp.where(mask, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))  # masked: exp(-inf) = 0
  total = jnp.sum(exp, axis=-1, keepdims=True)
  return exp / jnp.where(total > 0, total, 1.0)


def _masked_softmax_fwd(logits, mask):
  weights = _masked_softmax(logits, mask)
  return weights, weights


def _masked_softmax_bwd(weights, g):
  return weights * (g - jnp.sum(weights * g, axis=-1, keepdims=True)), None


_masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


# --------------------------------------------------------------------------- kernels
# A kernel computes the heads' outputs [b, tq, h, d] from q, k, v [b, t, h, d], a Mask, the
# logit bias as a function of (query positions, key positions) -> broadcastable to
# [b, h, tq, tk], and the layer's scorer and dropout. KERNELS maps a name to a Kernel: how
# to make the function from the AttentionConfig, and what it supports.


def attention_weights(q, k, mask: Mask, bias, score) -> jax.Array:
  """softmax(score(q, k) + bias) over the unmasked keys: [b, h, tq, tk] float32."""
  logits = score(q, k) + bias(mask.q_positions, mask.k_positions)
  return masked_softmax(logits, mask.dense())


def reference_kernel(q, k, v, mask: Mask, bias, score, dropout, rngs):
  """The formula, any scorer: softmax(score(q, k) + bias) over unmasked keys, dropout, ·V."""
  weights = attention_weights(q, k, mask, bias, score).astype(v.dtype)
  weights = dropout(weights, deterministic=rngs is None, rngs=rngs)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def fused_kernel(implementation: str):
  """jax.nn.dot_product_attention (XLA's fused attention, or cuDNN's flash attention on
  NVIDIA GPUs) for the dot-product scorers; no dropout on the weights. A query row with no
  visible key (padding) attends to every key instead of none, so it stays finite (no NaN
  to leak into later layers); the loss never reads it."""

  def kernel(q, k, v, mask, bias, score, dropout, rngs):
    del dropout, rngs
    dense = mask.dense()
    dense = dense | ~jnp.any(dense, axis=-1, keepdims=True)
    bias = bias(mask.q_positions, mask.k_positions)
    bias = None if jnp.ndim(bias) == 0 else bias.astype(q.dtype)
    impl = "xla" if q.shape[1] == 1 else implementation  # cuDNN has no 1-query decode step
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=dense, scale=score.scale,
                                        implementation=impl)

  return kernel


def _pad_time(x, before: int, after: int):
  return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))


def blockwise_kernel(q, k, v, mask: Mask, bias, score, dropout, rngs, *, block: int):
  """Memory-bounded attention, any scorer: queries in blocks of `block`, each block's softmax
  accumulated online over key blocks (flash-attention style, in plain JAX), and each query
  block rematerialised in the backward pass, so no [tq, tk] array exists, only
  [block, block] ones. With a local window a query block reads only the keys within the
  window of it: O(L·(block + 2w)) work and memory instead of O(L²). Fully masked rows give
  0, as the reference does; no attention dropout."""
  del dropout, rngs
  b, tq, h, d = q.shape
  tk = k.shape[1]
  if tq == 1 or (tq <= block and tk <= block):
    return reference_kernel(q, k, v, mask, bias, score, Dropout(0.0), None)
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
    logits = (score(q_blk, k_blk) + bias(m.q_positions, m.k_positions)).astype(jnp.float32)
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
  """A way to compute softmax(score + bias)·V, and what it supports."""

  make: Callable[[AttentionConfig], Callable]  # the kernel function for a config
  any_score: bool  # runs every scorer; False: the dot-product scorers only
  dropout: bool  # dropout on the attention weights
  backends: tuple[str, ...] | None = None  # the JAX backends it runs on; None: every one
  stand_in: str | None = None  # a kernel computing the same function on any backend


KERNELS: dict[str, Kernel] = {
    "reference": Kernel(lambda cfg: reference_kernel, any_score=True, dropout=True),
    "xla": Kernel(lambda cfg: fused_kernel("xla"), any_score=False, dropout=False),
    "cudnn": Kernel(lambda cfg: fused_kernel("cudnn"), any_score=False, dropout=False,
                    backends=("gpu",), stand_in="xla"),
    "blockwise": Kernel(lambda cfg: functools.partial(blockwise_kernel, block=cfg.block_size),
                        any_score=True, dropout=False),
}


def check_kernel(cfg: AttentionConfig) -> Callable:
  """The kernel for cfg, or a ConfigError naming what the kernel cannot do."""
  kernel = lookup(KERNELS, cfg.kernel, "attention kernel")
  if not kernel.any_score and not issubclass(SCORES[cfg.score], ScaledDot):
    raise ConfigError(f"attention.kernel '{cfg.kernel}' computes dot-product scores only "
                      f"(scaled_dot, dot), not '{cfg.score}'; use kernel 'reference'")
  if cfg.dropout and not kernel.dropout:
    raise ConfigError(f"attention.kernel '{cfg.kernel}' has no attention dropout; set "
                      f"model.attention.dropout=0 (got {cfg.dropout}) or kernel 'reference'")
  return kernel.make(cfg)


# --------------------------------------------------------------------------- layer


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with W_Q, W_K, W_V, W_O and d_k = d_v = d_model / num_heads."""

  def __init__(self, d_model: int, num_heads: int, cfg: AttentionConfig, *, dtype=jnp.float32,
               rngs: nnx.Rngs):
    """dtype: of the computation; parameters stay float32."""
    if d_model % num_heads:
      raise ConfigError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    self.num_heads, self.head_dim = num_heads, d_model // num_heads
    dense = lambda: Dense(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
    self.query, self.key, self.value, self.out = dense(), dense(), dense(), dense()
    self.score = lookup(SCORES, cfg.score, "attention score")(num_heads, self.head_dim, cfg, rngs=rngs)
    self.kernel = check_kernel(cfg)
    self.dropout = Dropout(cfg.dropout)
    self.cache: KVCache | None = nnx.data(None)  # set for incremental decoding by init_*_cache
    # True: every call also sows its attention weights (by the formula, whatever the kernel)
    # as nnx.Intermediate `weights`, for pictures (transformer/pictures.py).
    self.record_weights = False

  def _heads(self, x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:2], self.num_heads, self.head_dim)

  def keys_values(self, x_kv: jax.Array, k_positions: jax.Array,
                  encoding: PositionalEncoding) -> tuple[jax.Array, jax.Array]:
    """Per-head keys (position-rotated) and values of x_kv [b, tk, d_model]: [b, tk, h, d] each.

    Computed apart from the queries so that cross-attention K/V are projected once per
    source sentence and decoder self-attention K/V are cached step by step.
    """
    k, v = project(x_kv, self.key, self.value, groups=self.num_heads)
    return self._keys_values(k, v, k_positions, encoding)

  def _keys_values(self, k, v, k_positions, encoding):
    return encoding.rotate(self._heads(k), k_positions), self._heads(v)

  def __call__(self, x_q: jax.Array, kv: tuple[jax.Array, jax.Array], mask: Mask, *,
               encoding: PositionalEncoding, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Attends from x_q [b, tq, d_model] to kv = keys_values(...) under `mask`.

    `encoding` rotates the queries and biases the logits (the identity for cross-attention).
    `rngs` with a `dropout` stream enables dropout; None means deterministic.
    """
    return self._attend(self.query(x_q), kv, mask, encoding, rngs)

  def _attend(self, q, kv, mask, encoding, rngs):
    """__call__ with the queries projected: q [b, tq, d_model]."""
    k, v = kv
    q = encoding.rotate(self._heads(q), mask.q_positions)
    if self.record_weights:
      weights = attention_weights(q, k, mask, encoding.bias, self.score)
      self.sow(nnx.Intermediate, "weights", weights)
    out = self.kernel(q, k, v, mask, encoding.bias, self.score, self.dropout, rngs)
    return self.out(out.reshape(*out.shape[:2], -1))

  def self_attend(self, x, mask: Mask, encoding, rngs=None):
    """Self-attention of x [b, t, d_model] at positions mask.q_positions. With a cache
    (init_self_cache), x holds the next token(s): their keys/values are appended and they
    attend over everything cached, the mask's keys being cache slots 0..cache_len-1."""
    q, k, v = project(x, self.query, self.key, self.value, groups=self.num_heads)
    kv = self._keys_values(k, v, mask.q_positions, encoding)
    if self.cache is not None:
      kv = self.cache.append(kv)
    return self._attend(q, kv, mask, encoding, rngs)

  def cross_attend(self, x, encoded, mask: Mask, encoding, rngs=None):
    """Attention from x to the encoder output; K/V come from the cache when one was made
    (init_cross_cache), so decoding projects the source once, not at every step."""
    kv = (self.cache.k[...], self.cache.v[...]) if self.cache is not None else (
        self.keys_values(encoded, mask.k_positions, encoding))
    return self(x, kv, mask, encoding=encoding, rngs=rngs)

  def init_self_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> None:
    shape = (batch, max_len, self.num_heads, self.head_dim)
    self.cache = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def init_cross_cache(self, encoded, encoded_positions, encoding) -> None:
    self.cache = KVCache(*self.keys_values(encoded, encoded_positions, encoding))


class KVCache(nnx.Module):
  """Keys and values [b, max_len, h, d] of the positions decoded so far, and their count."""

  def __init__(self, k: jax.Array, v: jax.Array):
    self.k, self.v = nnx.Cache(k), nnx.Cache(v)
    self.index = nnx.Cache(jnp.zeros((), jnp.int32))

  def append(self, kv):
    """Writes kv ([b, t, h, d] each) at the current index; returns the whole cache."""
    i = self.index[...]
    self.k[...] = jax.lax.dynamic_update_slice_in_dim(self.k[...], kv[0].astype(self.k.dtype), i, 1)
    self.v[...] = jax.lax.dynamic_update_slice_in_dim(self.v[...], kv[1].astype(self.v.dtype), i, 1)
    self.index[...] = i + kv[0].shape[1]
    return self.k[...], self.v[...]
