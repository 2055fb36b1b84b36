"""The multi-head attention layer and its key/value cache.

The layer's parts come from their registries, chosen once here: the scorer
(transformer/scores.py), the kernel computing softmax(score + bias)·V
(transformer/kernels.py); masks (transformer/masks.py) and the positional encoding are
handed to each call, and the layer hands the encoding on to the kernel, which calls its
logit seams.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.errors import ConfigError
from transformer.fields import AT_LEAST_1, FRACTION, check_ranges, execution
from transformer.kernel_choice import check_kernel_name, choose_kernel
from transformer.layers import Dense, Dropout, project
from transformer.masks import WINDOWS, Mask
from transformer.positions import PositionalEncoding
from transformer.registry import lookup
from transformer.scores import SCORES, ScoreSettings, make_score


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  score: str = "scaled_dot"  # a key of SCORES
  window: str = "full"  # a key of WINDOWS
  window_size: int = 16  # `local`: each query sees keys within ±window_size positions
  dropout: float = 0.0  # on the attention weights
  # a key of KERNELS, how softmax(score + bias)·V is computed, or "auto": per layer the
  # fastest that can (transformer/kernel_choice.py)
  kernel: str = execution("auto")
  block_size: int = execution(512)  # `blockwise`: queries and keys per block
  # Each scorer's own knobs (`score_settings.additive.dim`, ...): every section is checked,
  # the chosen scorer's is used (and is the run's identity).
  score_settings: ScoreSettings = dataclasses.field(default_factory=ScoreSettings,
                                                    metadata={"chosen_by": "score"})

  def __post_init__(self):
    check_ranges(self, window_size=AT_LEAST_1, dropout=FRACTION, block_size=AT_LEAST_1)
    lookup(SCORES, self.score, "attention score")
    lookup(WINDOWS, self.window, "attention window")
    check_kernel_name(self.kernel)


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with W_Q, W_K, W_V, W_O and d_k = d_v = d_model / num_heads."""

  def __init__(self, d_model: int, num_heads: int, cfg: AttentionConfig, *, dtype=jnp.float32,
               encoding: PositionalEncoding | None = None, position: str = "none",
               rngs: nnx.Rngs):
    """dtype: of the computation; parameters stay float32. encoding: the positional encoding
    its calls will be handed (None: none), whose declarations the kernel must meet;
    position: its config name, for error lines."""
    if d_model % num_heads:
      raise ConfigError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    self.num_heads, self.head_dim = num_heads, d_model // num_heads
    # Heads split over the mesh's tensor axis: Q, K, V kernels [d_model, heads·head_dim] by
    # their columns, the output kernel [heads·head_dim, d_model] by its rows.
    dense = lambda axes: Dense(d_model, d_model, use_bias=False, kernel_axes=axes,  # noqa: E731
                               dtype=dtype, rngs=rngs)
    heads_in, heads_out = ("fsdp", "tensor"), ("tensor", "fsdp")
    self.query, self.key, self.value = dense(heads_in), dense(heads_in), dense(heads_in)
    self.out = dense(heads_out)
    self.score = make_score(cfg.score, num_heads, self.head_dim, cfg.score_settings, rngs=rngs)
    self.kernel_choice, self.kernel = choose_kernel(
        cfg.kernel, score_name=cfg.score, score=self.score, dropout=cfg.dropout,
        block_size=cfg.block_size, encoding=encoding, position=position, dtype=dtype)
    self.dropout = Dropout(cfg.dropout)
    self.cache: KVCache | None = nnx.data(None)  # set for incremental decoding by init_*_cache

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
    return encoding.rotate_keys(self._heads(k), k_positions), self._heads(v)

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
    q = encoding.rotate_queries(self._heads(q), mask.q_positions)
    out = self.kernel(q, k, v, mask, encoding, self.score, self.dropout, rngs)
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
