"""The multi-head attention layer and its key/value cache.

The layer's parts come from their registries, chosen once here: the scorer
(transformer/model/scores.py), the kernel computing softmax(score + bias)·V
(transformer/model/kernels/registry.py), the norm of each head's queries and keys (transformer/model/qk_norm.py);
masks (transformer/model/masks.py) and the positional encoding are
handed to each call, and the layer hands the encoding on to the kernel, which calls its
logit seams. With num_kv_heads < num_heads (grouped-query attention; 1: multi-query) the
key and value projections, and the KV cache, have num_kv_heads heads, each read by
num_heads / num_kv_heads query heads; with model.attention.kv=latent (multi-head latent
attention, transformer/model/latent_kv.py) self-attention's keys and values come from a
latent, which the cache holds.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_0, AT_LEAST_1, FRACTION, check_ranges, execution
from transformer.core.registry import lookup
from transformer.model import layer_pattern
from transformer.model.data_biases import DATA_BIASES, make_data_bias
from transformer.model.differential import HEADS, make_heads
from transformer.model.gates import GATES, make_gate
from transformer.model.kernels import Needs, check_kernel_name, choose
from transformer.model.latent_kv import KV_FORMS, KVSettings, make_kv_form
from transformer.model.layers import Dense, Dropout, project
from transformer.model.masks import WINDOWS, Mask
from transformer.model.normalizers import NORMALIZERS, NormalizerSettings, make_normalizer
from transformer.model.positions import PositionalEncoding
from transformer.model.qk_norm import QK_NORMS, make_qk_norm
from transformer.model.scores import SCORES, ScoreSettings, make_score


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  score: str = "scaled_dot"  # a key of SCORES
  # a key of WINDOWS, or a layer-wise pattern of them joined by '+' (`local+full`: local
  # and global attention alternating; model/layer_pattern.py)
  window: str = "full"
  window_size: int = 16  # `local`: each query sees keys within ±window_size positions
  dropout: float = 0.0  # on the attention weights
  # a key of KERNELS, how softmax(score + bias)·V is computed, or "auto": per layer the
  # fastest that can (transformer/model/kernels/choice.py)
  kernel: str = execution("auto")
  block_size: int = execution(512)  # `blockwise`: queries and keys per block
  qk_norm: str = "none"  # a key of QK_NORMS: none | rmsnorm | layernorm, per head
  # c > 0: the scorer's logits become c·tanh(logit / c), positional biases added after the
  # cap (so distance biases are not bounded by c); 0: off
  logit_softcap: float = 0.0
  # Each scorer's own knobs (`score_settings.additive.dim`, ...): every section is checked,
  # the chosen scorer's is used (and is the run's identity).
  score_settings: ScoreSettings = dataclasses.field(default_factory=ScoreSettings,
                                                    metadata={"chosen_by": "score"})
  # a key of NORMALIZERS: how each row of logits becomes the weights (softmax, sigmoid, a
  # softmax with a sink, stick-breaking; transformer/model/normalizers.py)
  normalizer: str = "softmax"
  # Each normaliser's own knobs (`normalizer_settings.sink.learned`, ...), as score_settings.
  normalizer_settings: NormalizerSettings = dataclasses.field(
      default_factory=NormalizerSettings, metadata={"chosen_by": "normalizer"})
  # a key of GATES: a sigmoid gate on each head's output from the layer's input, after the
  # kernel and before W_O (gated attention): none | headwise | elementwise
  gate: str = "none"
  # a key of HEADS: how the heads' outputs combine: plain, or differential (pairs of heads,
  # softmax(A₁) − λ·softmax(A₂); transformer/model/differential.py)
  heads: str = "plain"
  # a key of DATA_BIASES: a logit bias computed from the tokens, added to the positional
  # one: none | forget (FoX's forget gate, c_i − c_j) | selective (selective attention: one
  # head's logits mask keys for later queries; transformer/model/data_biases.py)
  data_bias: str = "none"
  # a key of KV_FORMS: how self-attention forms its keys and values and what its cache
  # holds: heads (per-head projections; model.num_kv_heads for grouped-query) | latent
  # (multi-head latent attention, DeepSeek-V2; transformer/model/latent_kv.py)
  kv: str = "heads"
  # Each form's own knobs (`kv_settings.latent.rank`), as score_settings.
  kv_settings: KVSettings = dataclasses.field(default_factory=KVSettings,
                                              metadata={"chosen_by": "kv"})

  def __post_init__(self):
    check_ranges(self, window_size=AT_LEAST_1, dropout=FRACTION, block_size=AT_LEAST_1,
                 logit_softcap=AT_LEAST_0)
    lookup(SCORES, self.score, "attention score")
    lookup(NORMALIZERS, self.normalizer, "attention normalizer")
    lookup(GATES, self.gate, "attention gate")
    lookup(HEADS, self.heads, "attention heads")
    lookup(DATA_BIASES, self.data_bias, "attention data_bias")
    lookup(KV_FORMS, self.kv, "attention kv")
    layer_pattern.check("window", self.window, WINDOWS, "attention window")
    check_kernel_name(self.kernel)
    lookup(QK_NORMS, self.qk_norm, "attention qk_norm")


class MultiHeadAttention(nnx.Module):
  """Multi-head attention with W_Q, W_K, W_V, W_O and d_k = d_v = d_model / num_heads; K and V
  with num_kv_heads heads (0: num_heads). With kv=latent, K and V from the latent form
  (latent_kv.py), d_k = its qk_dim."""

  def __init__(self, d_model: int, num_heads: int, cfg: AttentionConfig, *, dtype=jnp.float32,
               num_kv_heads: int = 0, encoding: PositionalEncoding | None = None,
               cross: bool = False, causal: bool = False, max_len: int = 0, depth: int = 0,
               rngs: nnx.Rngs):
    """dtype: of the computation; parameters stay float32. encoding: the positional encoding
    its calls will be handed (None: none), whose declarations the kernel must meet. cross:
    cross-attention (its masks carry no window). causal: causal self-attention (what a
    causal-only normaliser or data bias needs). max_len: the model's longest sequence (the
    sigmoid normaliser's default n). depth: the layer's index in its stack (differential
    attention's λ_init). The kernel is chosen for the target of the model's construction
    (kernels.choosing_for)."""
    if d_model % num_heads:
      raise ConfigError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
    num_kv_heads = num_kv_heads or num_heads
    if num_kv_heads < 0 or num_heads % num_kv_heads:
      raise ConfigError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
    self.head_dim = d_model // num_heads
    # Heads split over the mesh's tensor axis: Q kernel [d_model, heads·head_dim], K and V
    # kernels [d_model, kv_heads·head_dim] by their columns, the output kernel
    # [heads·head_dim, d_model] by its rows (sharding.check_kv_heads: whole kv heads).
    dense = lambda width, axes, width_in=d_model: Dense(  # noqa: E731
        width_in, width, use_bias=False, kernel_axes=axes, dtype=dtype, rngs=rngs)
    heads_in, heads_out = ("fsdp", "tensor"), ("tensor", "fsdp")
    kv_width = num_kv_heads * self.head_dim
    # cross-attention keeps per-head K/V: its keys are the encoder's, projected once
    self.latent = None if cross else make_kv_form(
        cfg.kv, d_model, num_heads, self.head_dim, cfg.kv_settings, encoding=encoding,
        dtype=dtype, rngs=rngs)
    # W_Q, from the input or from the latent's compressed query, to heads of qk_dim (the
    # latent's: head_dim + its rotary part; latent_kv.py)
    self.qk_dim = self.latent.qk_dim if self.latent else self.head_dim
    self.query = dense(num_heads * self.qk_dim, heads_in,
                       self.latent.query_features if self.latent else d_model)
    if self.latent is None:
      self.key, self.value = dense(kv_width, heads_in), dense(kv_width, heads_in)
    elif num_kv_heads < num_heads or cfg.qk_norm != "none":
      raise ConfigError(
          f"model.attention.kv='latent' forms every head's key and value from one latent: it "
          f"takes no model.num_kv_heads ({num_kv_heads} of {num_heads} heads) and no "
          f"model.attention.qk_norm ({cfg.qk_norm!r}): set num_kv_heads=0 and qk_norm=none")
    self.out = dense(d_model, heads_out)
    self.q_norm = make_qk_norm(cfg.qk_norm, self.head_dim, dtype=dtype, rngs=rngs)
    self.k_norm = make_qk_norm(cfg.qk_norm, self.head_dim, dtype=dtype, rngs=rngs)
    self.score = make_score(cfg.score, num_heads, self.qk_dim, cfg.score_settings, rngs=rngs)
    self.normalizer = make_normalizer(cfg.normalizer, num_heads, cfg.normalizer_settings,
                                      max_len=max_len, causal=causal and not cross, rngs=rngs)
    self.head_mix = make_heads(cfg.heads, num_heads, num_kv_heads, self.head_dim, depth=depth,
                               dtype=dtype, rngs=rngs)
    self.gate = make_gate(cfg.gate, d_model, num_heads, self.head_dim, dtype=dtype, rngs=rngs)
    self.data_bias = make_data_bias(cfg.data_bias, d_model, num_heads,
                                    causal=causal and not cross, dtype=dtype, rngs=rngs)
    self.logit_softcap = cfg.logit_softcap
    self.needs = Needs.of(  # what it asks of its kernel (transformer/model/kernels/choice.py)
        self.score, encoding or PositionalEncoding(), normalizer=self.normalizer,
        data_bias=self.data_bias.vectors or self.data_bias.array,
        data_bias_array=self.data_bias.array, score=cfg.score, dropout=cfg.dropout,
        softcap=cfg.logit_softcap,
        window=not cross and WINDOWS[cfg.window](cfg.window_size) is not None,
        grouped=num_kv_heads < num_heads, dtype=jnp.dtype(dtype).name,
        block_size=cfg.block_size, heads=num_heads)
    self.kernel_choice, self.kernel = choose(cfg.kernel, self.needs)
    self.dropout = Dropout(cfg.dropout)
    self.cache: KVCache | None = nnx.data(None)  # set for incremental decoding by init_*_cache

  def _heads(self, x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(*x.shape[:2], heads, -1)

  def keys_values(self, x_kv: jax.Array, k_positions: jax.Array,
                  encoding: PositionalEncoding) -> tuple[jax.Array, jax.Array]:
    """Per-head keys (normalised, position-rotated) and values of x_kv [b, tk, d_model]:
    [b, tk, kv_heads, d] each.

    Computed apart from the queries so that cross-attention K/V are projected once per
    source sentence and decoder self-attention K/V are cached step by step.
    """
    k, v = project(x_kv, self.key, self.value, groups=self.num_kv_heads)
    return self._keys_values(k, v, k_positions, encoding)

  def _keys_values(self, k, v, k_positions, encoding):
    k = self.k_norm(self._heads(k, self.num_kv_heads))
    return encoding.rotate_keys(k, k_positions), self._heads(v, self.num_kv_heads)

  def __call__(self, x_q: jax.Array, kv: tuple[jax.Array, jax.Array], mask: Mask, *,
               encoding: PositionalEncoding, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Attends from x_q [b, tq, d_model] to kv = keys_values(...) under `mask`.

    `encoding` rotates the queries and biases the logits (the identity for cross-attention).
    `rngs` with a `dropout` stream enables dropout; None means deterministic.
    """
    return self._attend(x_q, self._queries(x_q), kv, mask, encoding, rngs)

  def _queries(self, x):
    """W_Q of x [b, t, d_model]: [b, t, heads·qk_dim] (through the latent's compressed query
    where it has one)."""
    return self.query(x if self.latent is None else self.latent.compress_query(x))

  def _attend(self, x_q, q, kv, mask, encoding, rngs):
    """__call__ with the queries projected: q [b, tq, heads·qk_dim]. The data bias may read the
    logits first (logit_view: selective attention's); the kernel's output per head is
    combined (head_mix: plain or differential) and gated from x_q before W_O."""
    k, v = kv
    q = self.q_norm(self._heads(q, self.num_heads))
    q = encoding.rotate_queries(q, mask.q_positions) if self.latent is None else (
        self.latent.rotate_queries(q, mask.q_positions, encoding))
    encoding = self.data_bias.logit_view(encoding, q, k, mask, self.score, self.logit_softcap)
    out = self.kernel(q, k, self.head_mix.values(v), mask, encoding, self.score, self.dropout,
                      rngs, normalizer=self.normalizer)
    return self.out(self.gate(x_q, self.head_mix.combine(out)))

  def self_attend(self, x, mask: Mask, encoding, rngs=None):
    """Self-attention of x [b, t, d_model] at positions mask.q_positions. With a cache
    (init_self_cache), x holds the next token(s): their keys/values are appended and they
    attend over everything cached, the mask's keys being cache slots 0..cache_len-1."""
    if self.latent is None:
      q, k, v = project(x, self.query, self.key, self.value, groups=self.num_kv_heads)
      state = self._keys_values(k, v, mask.q_positions, encoding)
    else:
      q, state = self._queries(x), self.latent.state(x, mask.q_positions, encoding)
    encoding = self._data_biased(x, encoding)
    if self.cache is not None:
      state = self.cache.append(state)
    kv = state if self.latent is None else self.latent.keys_values(state)
    return self._attend(x, q, kv, mask, encoding, rngs)

  def _data_biased(self, x, encoding):
    """The encoding with the data bias of x's tokens (data_biases.py); with a cache, x's
    cumulative sums continue the cached ones and are cached with its keys (call it before
    the keys are appended)."""
    if self.cache is None:
      sums = self.data_bias.sums(x, None)
      return self.data_bias.view(encoding, sums, sums)
    sums = self.data_bias.sums(x, self.cache.last_sum())
    return self.data_bias.view(encoding, sums, self.cache.append_sums(sums))

  def cross_attend(self, x, encoded, mask: Mask, encoding, rngs=None):
    """Attention from x to the encoder output; K/V come from the cache when one was made
    (init_cross_cache), so decoding projects the source once, not at every step."""
    kv = (self.cache.k[...], self.cache.v[...]) if self.cache is not None else (
        self.keys_values(encoded, mask.k_positions, encoding))
    return self(x, kv, mask, encoding=encoding, rngs=rngs)

  def init_self_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> None:
    shape = (batch, max_len, self.num_kv_heads, self.head_dim)
    shapes = (shape, shape) if self.latent is None else self.latent.cache_shapes(batch, max_len)
    sums = jnp.zeros((batch, max_len, self.num_heads), jnp.float32) if (
        self.data_bias.vectors) else None
    self.cache = KVCache(*(jnp.zeros(s, dtype) for s in shapes), sums)
    self.data_bias.init_cache(batch, max_len)

  def init_cross_cache(self, encoded, encoded_positions, encoding) -> None:
    self.cache = KVCache(*self.keys_values(encoded, encoded_positions, encoding))


class KVCache(nnx.Module):
  """Keys and values [b, max_len, kv_heads, d] of the positions decoded so far (with
  model.attention.kv=latent the latent [b, max_len, rank] and the rotated shared key
  [b, max_len, r] in their place: latent_kv.py), and their count; with a data bias, its
  cumulative sums [b, max_len, heads] at those positions."""

  def __init__(self, k: jax.Array, v: jax.Array, sums: jax.Array | None = None):
    self.k, self.v = nnx.Cache(k), nnx.Cache(v)
    self.index = nnx.Cache(jnp.zeros((), jnp.int32))
    self.sums = None if sums is None else nnx.Cache(sums)

  def last_sum(self) -> jax.Array | None:
    """The sum [b, heads] at the last position decoded (0 before the first); None without
    sums."""
    if self.sums is None:
      return None
    i = self.index[...]
    last = jax.lax.dynamic_index_in_dim(self.sums[...], jnp.maximum(i - 1, 0), 1, keepdims=False)
    return jnp.where(i > 0, last, 0.0)

  def append_sums(self, sums: jax.Array | None) -> jax.Array | None:
    """Writes sums [b, t, heads] at the current index (append then moves it); returns all."""
    if sums is None:
      return None
    self.sums[...] = jax.lax.dynamic_update_slice_in_dim(self.sums[...], sums, self.index[...], 1)
    return self.sums[...]

  def append(self, kv):
    """Writes kv ([b, t, ...] each, as k and v) at the current index; returns the whole
    cache."""
    i = self.index[...]
    self.k[...] = jax.lax.dynamic_update_slice_in_dim(self.k[...], kv[0].astype(self.k.dtype), i, 1)
    self.v[...] = jax.lax.dynamic_update_slice_in_dim(self.v[...], kv[1].astype(self.v.dtype), i, 1)
    self.index[...] = i + kv[0].shape[1]
    return self.k[...], self.v[...]
