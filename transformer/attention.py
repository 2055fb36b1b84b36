"""Multi-head attention with pluggable scoring functions and attention windows.

A scorer maps per-head queries and keys to logits with one signature,
`score(q [b, tq, h, d], k [b, tk, h, d]) -> [b, h, tq, tk]`; scorers with parameters are
NNX modules. Masks are booleans [b, 1, tq, tk] (True = may attend) built from explicit
segment ids and positions, so padding, packing, causality and windows compose by `&`.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.positions import PositionalEncoding
from transformer.registry import ConfigError, lookup


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


def full_window(q_positions, k_positions, size: int) -> jax.Array:
  del k_positions, size
  return jnp.ones((q_positions.shape[0], 1, q_positions.shape[1], 1), bool)


def local_window(q_positions, k_positions, size: int) -> jax.Array:
  """Truncated attention: keys within ±size positions of the query, [b, 1, tq, tk]."""
  offset = q_positions[:, :, None] - k_positions[:, None, :]
  return (jnp.abs(offset) <= size)[:, None]


WINDOWS: dict[str, Callable[[jax.Array, jax.Array, int], jax.Array]] = {
    "full": full_window,
    "local": local_window,
}


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis where masked entries get exactly 0 and all-masked rows are 0."""
  logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  return jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)


# --------------------------------------------------------------------------- kernels
# A kernel computes the heads' outputs [b, tq, h, d] from q, k, v [b, t, h, d], the layer's
# scorer and dropout, a logit bias broadcastable to [b, h, tq, tk] and the boolean mask.


def reference_kernel(q, k, v, bias, mask, score, dropout, rngs):
  """The formula, any scorer: softmax(score(q, k) + bias) over unmasked keys, dropout, ·V."""
  weights = masked_softmax(score(q, k) + bias, mask).astype(v.dtype)
  weights = dropout(weights, deterministic=rngs is None, rngs=rngs)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def fused_kernel(implementation: str):
  """jax.nn.dot_product_attention (XLA's fused attention, or cuDNN's flash attention on
  NVIDIA GPUs) for the dot-product scorers; no dropout on the weights. A query row with no
  visible key (padding) attends to every key instead of none, so it stays finite (no NaN
  to leak into later layers); the loss never reads it."""

  def kernel(q, k, v, bias, mask, score, dropout, rngs):
    del dropout, rngs
    mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)
    bias = None if jnp.ndim(bias) == 0 else bias.astype(q.dtype)
    impl = "xla" if q.shape[1] == 1 else implementation  # cuDNN has no 1-query decode step
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=score.scale,
                                        implementation=impl)

  return kernel


KERNELS: dict[str, Callable] = {
    "reference": reference_kernel,
    "xla": fused_kernel("xla"),
    "cudnn": fused_kernel("cudnn"),
}


def check_kernel(cfg: AttentionConfig) -> Callable:
  """The kernel for cfg, or a ConfigError naming what the fused kernels cannot do."""
  kernel = lookup(KERNELS, cfg.kernel, "attention kernel")
  if kernel is not reference_kernel:
    if not issubclass(SCORES[cfg.score], ScaledDot):
      raise ConfigError(f"attention.kernel '{cfg.kernel}' computes dot-product scores only "
                        f"(scaled_dot, dot), not '{cfg.score}'; use kernel 'reference'")
    if cfg.dropout:
      raise ConfigError(f"attention.kernel '{cfg.kernel}' has no attention dropout; set "
                        f"model.attention.dropout=0 (got {cfg.dropout}) or kernel 'reference'")
  return kernel


# --------------------------------------------------------------------------- layer


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with W_Q, W_K, W_V, W_O and d_k = d_v = d_model / num_heads."""

  def __init__(self, d_model: int, num_heads: int, cfg: AttentionConfig, *, dtype=jnp.float32,
               rngs: nnx.Rngs):
    """dtype: of the computation; parameters stay float32."""
    if d_model % num_heads:
      raise ConfigError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    self.num_heads, self.head_dim = num_heads, d_model // num_heads
    dense = lambda: nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)  # noqa: E731
    self.query, self.key, self.value, self.out = dense(), dense(), dense(), dense()
    self.score = lookup(SCORES, cfg.score, "attention score")(num_heads, self.head_dim, cfg, rngs=rngs)
    self.kernel = check_kernel(cfg)
    self.dropout = nnx.Dropout(cfg.dropout)
    self.cache: KVCache | None = nnx.data(None)  # set for incremental decoding by init_*_cache

  def _heads(self, x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:2], self.num_heads, self.head_dim)

  def keys_values(self, x_kv: jax.Array, k_positions: jax.Array,
                  encoding: PositionalEncoding) -> tuple[jax.Array, jax.Array]:
    """Per-head keys (position-rotated) and values of x_kv [b, tk, d_model]: [b, tk, h, d] each.

    Computed apart from the queries so that cross-attention K/V are projected once per
    source sentence and decoder self-attention K/V are cached step by step.
    """
    k = encoding.rotate(self._heads(self.key(x_kv)), k_positions)
    return k, self._heads(self.value(x_kv))

  def __call__(
      self,
      x_q: jax.Array,
      kv: tuple[jax.Array, jax.Array],
      mask: jax.Array,
      *,
      q_positions: jax.Array,
      k_positions: jax.Array,
      encoding: PositionalEncoding,
      rngs: nnx.Rngs | None = None,
  ) -> jax.Array:
    """Attends from x_q [b, tq, d_model] to kv = keys_values(...) under mask [b, 1, tq, tk].

    `encoding` rotates the queries and biases the logits (the identity for cross-attention).
    `rngs` with a `dropout` stream enables dropout; None means deterministic.
    """
    k, v = kv
    q = encoding.rotate(self._heads(self.query(x_q)), q_positions)
    out = self.kernel(q, k, v, encoding.bias(q_positions, k_positions), mask, self.score,
                      self.dropout, rngs)
    return self.out(out.reshape(*out.shape[:2], -1))

  def self_attend(self, x, mask, positions, encoding, rngs=None):
    """Self-attention of x [b, t, d_model]. With a cache (init_self_cache), x holds the next
    token(s): their keys/values are appended and they attend over everything cached, with
    `mask` [b, 1, t, cache_len] given against cache positions 0..cache_len-1."""
    kv = self.keys_values(x, positions, encoding)
    k_positions = positions
    if self.cache is not None:
      kv, k_positions = self.cache.append(kv)
    return self(x, kv, mask, q_positions=positions, k_positions=k_positions, encoding=encoding,
                rngs=rngs)

  def cross_attend(self, x, encoded, mask, positions, encoded_positions, encoding, rngs=None):
    """Attention from x to the encoder output; K/V come from the cache when one was made
    (init_cross_cache), so decoding projects the source once, not at every step."""
    kv = (self.cache.k[...], self.cache.v[...]) if self.cache is not None else (
        self.keys_values(encoded, encoded_positions, encoding))
    return self(x, kv, mask, q_positions=positions, k_positions=encoded_positions,
                encoding=encoding, rngs=rngs)

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
    """Writes kv ([b, t, h, d] each) at the current index; returns the whole cache and the
    key positions [b, max_len]."""
    i = self.index[...]
    self.k[...] = jax.lax.dynamic_update_slice_in_dim(self.k[...], kv[0].astype(self.k.dtype), i, 1)
    self.v[...] = jax.lax.dynamic_update_slice_in_dim(self.v[...], kv[1].astype(self.v.dtype), i, 1)
    self.index[...] = i + kv[0].shape[1]
    b, max_len = self.k.shape[:2]
    return (self.k[...], self.v[...]), jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32),
                                                        (b, max_len))
