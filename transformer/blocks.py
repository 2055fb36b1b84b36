"""The building blocks of every model family (transformer/families.py): the model's config,
residual placement, the attention layers, the stacks, embeddings, pooling (the feed-forward
layers are in transformer/feedforward.py).

Pure model code: a frozen ModelConfig in, NNX modules out; no file I/O, no flags. The
pluggable parts (attention score, window, positional encoding, residual placement, norm,
feed-forward layer) are chosen once, in constructors, from their registries.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.attention import AttentionConfig, MultiHeadAttention
from transformer.errors import ConfigError
from transformer.fields import AT_LEAST_1, FRACTION, check, check_ranges, derived, execution
from transformer.feedforward import FFNS
from transformer.layers import NORMS, Dense, Dropout, mesh_axes
from transformer.masks import WINDOWS, Mask
from transformer.positions import (POSITIONS, PositionalEncoding, PositionSettings,
                                   make_positional_encoding)
from transformer.positions.randomized import sample_positions
from transformer.registry import lookup
from transformer.vocab import PAD_ID


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """config.model; vocab_size and num_classes are set from the data source."""

  vocab_size: int = derived()
  d_model: int = 512
  num_heads: int = 8
  # key/value heads: 0 = num_heads (multi-head), 1 = multi-query, else a divisor of num_heads
  # (grouped-query attention: query head i reads kv head i // (num_heads / num_kv_heads))
  num_kv_heads: int = 0
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout: float = 0.1  # on embeddings+positions and on every sublayer output
  position: str = "sinusoidal"  # a key of positions.POSITIONS
  max_len: int = 512  # longest sequence the `learned` table covers
  # Randomized positions (Ruoss et al. 2023; positions/randomized.py): each sequence's
  # positions a sorted random sample of [0, max_position), in training and evaluation alike.
  random_positions: bool = False
  max_position: int = 2048  # random_positions: the range drawn from (and the learned table's rows)
  norm: str = "post"  # a key of RESIDUALS: LayerNorm(x + f(x)) or x + f(LayerNorm(x))
  norm_type: str = "layernorm"  # a key of layers.NORMS: every norm of the model
  ffn: str = "relu"  # a key of feedforward.FFNS; d_ff is every variant's hidden width
  share_embeddings: bool = True  # one matrix for source, target and pre-softmax projection
  # a key of DTYPES: the computation's; parameters are always float32
  dtype: str = execution("float32")
  remat: bool = execution(False)  # recompute each layer's activations in the backward pass
  scan_layers: bool = execution(False)  # each stack's layers as one lax.scan: compiled once
  attention: AttentionConfig = AttentionConfig()
  # Each encoding's own knobs (`position_settings.alibi.max_bias`, ...): every section is
  # checked, the chosen encoding's is used (and is the run's identity).
  position_settings: PositionSettings = dataclasses.field(
      default_factory=PositionSettings, metadata={"chosen_by": "position"})
  arch: str = "encoder_decoder"  # a key of families.ARCHS: encoder_decoder | encoder | decoder
  pooling: str = "none"  # a key of POOLINGS (encoder): none (a label per token) | cls | mean
  num_classes: int = derived(0)  # outputs of the encoder's head

  def __post_init__(self):
    check_ranges(self, vocab_size=AT_LEAST_1, d_model=AT_LEAST_1, num_heads=AT_LEAST_1,
                 d_ff=AT_LEAST_1, num_encoder_layers=AT_LEAST_1, num_decoder_layers=AT_LEAST_1,
                 dropout=FRACTION, max_len=AT_LEAST_1, max_position=AT_LEAST_1)
    check(self.d_model % self.num_heads == 0, "num_heads", self.num_heads,
          f"a divisor of d_model ({self.d_model})")
    check(self.num_kv_heads >= 0 and self.num_heads % (self.num_kv_heads or self.num_heads) == 0,
          "num_kv_heads", self.num_kv_heads,
          f"0 (= num_heads) or a divisor of num_heads ({self.num_heads})")
    if self.num_kv_heads == 0:  # one spelling of multi-head attention: the run's identity
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    encoding = lookup(POSITIONS, self.position, "position")
    if self.random_positions:
      check(encoding.takes_positions, "random_positions", True,
            f"false for position {self.position!r}, which takes no positions")
      check(self.attention.window == "full", "random_positions", True,
            f"false with attention.window={self.attention.window!r} (a window of "
            "±window_size positions would span sampled positions)")
    lookup(RESIDUALS, self.norm, "norm")
    lookup(NORMS, self.norm_type, "norm_type")
    lookup(FFNS, self.ffn, "ffn")
    lookup(DTYPES, self.dtype, "model dtype")
    lookup(POOLINGS, self.pooling, "model pooling")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(cfg: ModelConfig):
  return lookup(DTYPES, cfg.dtype, "model dtype")


# --------------------------------------------------------------------------- residual blocks


class PostNorm(nnx.Module):
  """Norm(x + Dropout(sublayer(x))), as in the paper; Norm an entry of layers.NORMS
  (model.norm_type)."""

  final_norm = False  # the stack output is already normalised

  def __init__(self, d_model: int, dropout: float, *, norm: str = "layernorm",
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.norm = make_norm(norm, d_model, dtype=dtype, rngs=rngs)
    self.dropout = Dropout(dropout)

  def __call__(self, x, sublayer, rngs):
    return self.norm(x + self.dropout(sublayer(x), deterministic=rngs is None, rngs=rngs))


class PreNorm(PostNorm):
  """x + Dropout(sublayer(Norm(x))); the stack ends with a Norm."""

  final_norm = True

  def __call__(self, x, sublayer, rngs):
    return x + self.dropout(sublayer(self.norm(x)), deterministic=rngs is None, rngs=rngs)


RESIDUALS: dict[str, type[PostNorm]] = {"post": PostNorm, "pre": PreNorm}


def make_norm(norm_type: str, d_model: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
  """The norm NORMS[norm_type] over d_model features (ε = 1e-6)."""
  return lookup(NORMS, norm_type, "norm_type")(d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)


def residual_block(cfg: ModelConfig, rngs: nnx.Rngs) -> PostNorm:
  residual = lookup(RESIDUALS, cfg.norm, "norm")
  return residual(cfg.d_model, cfg.dropout, norm=cfg.norm_type, dtype=compute_dtype(cfg),
                  rngs=rngs)


def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The feed-forward layer FFNS[cfg.ffn] of width cfg.d_ff."""
  ffn = lookup(FFNS, cfg.ffn, "ffn")
  return ffn(cfg.d_model, cfg.d_ff, dtype=compute_dtype(cfg), rngs=rngs)


# The identity encoding: cross-attention relates two different sequences' positions.
NO_POSITION = PositionalEncoding()


class EncoderLayer(nnx.Module):

  causal = False  # its self-attention sees keys after the query

  def __init__(self, cfg: ModelConfig, *, encoding: PositionalEncoding | None = None,
               rngs: nnx.Rngs):
    """encoding: the stack's, which its self-attention will be handed."""
    dtype = compute_dtype(cfg)
    self.self_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention,
                                             dtype=dtype, num_kv_heads=cfg.num_kv_heads,
                                             encoding=encoding, position=cfg.position,
                                             rngs=rngs)
    self.attention_block = residual_block(cfg, rngs)
    self.ffn = feed_forward(cfg, rngs)
    self.ffn_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class DecoderLayer(EncoderLayer):

  causal = True  # its self-attention never sees keys after the query

  def __init__(self, cfg: ModelConfig, *, encoding: PositionalEncoding | None = None,
               rngs: nnx.Rngs):
    super().__init__(cfg, encoding=encoding, rngs=rngs)
    self.cross_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention,
                                              dtype=compute_dtype(cfg),
                                              num_kv_heads=cfg.num_kv_heads, rngs=rngs)
    self.cross_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs, *, encoded, cross_mask):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    cross = lambda y: self.cross_attention.cross_attend(  # noqa: E731
        y, encoded, cross_mask, NO_POSITION, rngs)
    x = self.cross_block(x, cross, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class Stack(nnx.Module):
  """Positional encoding, embedding dropout, N layers and (pre-LN) a final norm.

  With cfg.random_positions, each call draws its sequences' positions
  (positions/randomized.py) from the rngs' dropout stream (the train step folds it from seed
  and step, so a resumed run draws the same ones), or from a fixed key when deterministic
  (evaluation samples too, as Ruoss et al. do, and every evaluation the same)."""

  def __init__(self, cfg: ModelConfig, layer: type[EncoderLayer], num_layers: int, *, rngs):
    self.max_position = cfg.max_position if cfg.random_positions else None
    self.causal = layer.causal
    # Sampled positions reach max_position - 1: a learned table (xPos's centre) covers them.
    self.position = make_positional_encoding(
        cfg.position, cfg.d_model, cfg.num_heads, self.max_position or cfg.max_len,
        causal=layer.causal, settings=cfg.position_settings, rngs=rngs)
    self.window = lookup(WINDOWS, cfg.attention.window, "attention window")
    self.window_size = cfg.attention.window_size
    self.dropout = Dropout(cfg.dropout)
    self.layers = nnx.List([layer(cfg, encoding=self.position, rngs=rngs)
                            for _ in range(num_layers)])
    self.remat, self.scan_layers = cfg.remat, cfg.scan_layers
    has_final = lookup(RESIDUALS, cfg.norm, "norm").final_norm
    self.final_norm = make_norm(cfg.norm_type, cfg.d_model, dtype=compute_dtype(cfg),
                                rngs=rngs) if has_final else None

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""
    if self.max_position is not None and length > self.max_position:
      raise ConfigError(
          f"sequence length {length} exceeds model.max_position={self.max_position}, the "
          "range random positions are drawn from; raise model.max_position")
    self.position.check_length(length)

  def evaluation_key(self) -> jax.Array:
    """The key of deterministic calls' random positions (one per kind of stack)."""
    return jax.random.fold_in(jax.random.key(0), int(self.causal))

  def draw_positions(self, mask: Mask, rngs) -> Mask:
    """The self-attention `mask` at random positions (module docstring)."""
    self.check_length(mask.q_positions.shape[1])
    key = self.evaluation_key() if rngs is None else rngs.dropout()
    positions = sample_positions(key, mask.q_positions, mask.q_segments, self.max_position)
    return dataclasses.replace(mask, q_positions=positions, k_positions=positions)

  def slot_positions(self, batch: int, max_len: int, repeat: int = 1) -> jax.Array:
    """The positions [batch·repeat, max_len] of cached decoding's slots: 0..max_len-1, or
    with random positions those a deterministic call draws for rows of max_len tokens."""
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    if self.max_position is not None:
      positions = sample_positions(self.evaluation_key(), positions, jnp.ones_like(positions),
                                   self.max_position)
    return jnp.repeat(positions, repeat, axis=0)

  def __call__(self, x, mask: Mask, rngs, *, drawn: bool = False, **cross):
    """x [b, t, d_model] at positions mask.q_positions; `mask` is the self-attention's, to
    which the stack adds its window. With random positions, `drawn`: the mask's positions
    are already drawn (cached decoding's slot_positions); otherwise the stack draws them."""
    if self.max_position is not None and not drawn:
      mask = self.draw_positions(mask, rngs)
    x = self.position.embed(x, mask.q_positions)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    mask = dataclasses.replace(mask, window=self.window(self.window_size))
    call = lambda layer, x, rngs: layer(x, mask, self.position, rngs, **cross)  # noqa: E731
    if self.scan_layers:
      x = scan_layers(call, self.layers, x, rngs, remat=self.remat)
    else:
      call = nnx.remat(call) if self.remat else call
      for layer in self.layers:
        x = call(layer, x, rngs)
    return x if self.final_norm is None else self.final_norm(x)


def scan_layers(call, layers, x, rngs, *, remat: bool = False):
  """x after call(layer, x, rngs) for each of `layers` (identical in structure), as one
  jax.lax.scan over their states stacked along a new leading axis, so the layer is traced
  and compiled once instead of once per layer. The parameters keep their per-layer layout
  (checkpoints do not depend on this option); the stack is built inside the step. Each
  layer draws its own dropout key; caches updated by the calls (decoding) are written back."""
  graphdef = nnx.graphdef(layers[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in layers))
  keys = None if rngs is None else jax.random.split(rngs.dropout(), len(layers))

  def body(x, per_layer):
    state, key = per_layer
    layer = nnx.merge(graphdef, state)
    x = call(layer, x, None if key is None else nnx.Rngs(dropout=key))
    return x, nnx.state(layer, nnx.Cache)

  x, caches = jax.lax.scan(jax.checkpoint(body) if remat else body, x, (stacked, keys))
  for i, layer in enumerate(layers):
    nnx.update(layer, jax.tree.map(lambda c: c[i], caches))  # noqa: B023
  return x


class Embeddings(nnx.Module):
  """Token embeddings scaled by √d_model and the pre-softmax projection.

  Shared: one matrix E for source, target and logits = y Eᵀ (paper, 3.4). Otherwise
  separate source and target tables and an output layer.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.d_model ** -0.5)  # unit variance after the √d scale
    dtype = compute_dtype(cfg)
    # The vocabulary split over the mesh's tensor axis: tables [vocab, d_model] by rows, the
    # output kernel [d_model, vocab] by columns.
    embed = lambda: nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype,  # noqa: E731
                              embedding_metadata=mesh_axes("tensor", "fsdp"), rngs=rngs)
    self.scale = math.sqrt(cfg.d_model)
    self.source_table = embed()
    if cfg.share_embeddings:
      self.target_table, self.output = None, None
    else:
      self.target_table = embed()
      self.output = Dense(cfg.d_model, cfg.vocab_size, kernel_axes=("fsdp", "tensor"),
                          bias_axes=("tensor",), dtype=dtype, rngs=rngs)

  def source(self, tokens):
    return self.source_table(tokens) * self.scale

  def target(self, tokens):
    return (self.target_table or self.source_table)(tokens) * self.scale

  def logits(self, y):
    return self.source_table.attend(y) if self.output is None else self.output(y)

  def projection(self, dtype) -> tuple[jax.Array, jax.Array | None]:
    """(weights [vocab, d_model], bias [vocab] or None) in `dtype`, such that
    logits(y) = y @ weightsᵀ + bias: for metrics.loss_head_metrics."""
    if self.output is None:
      return self.source_table.embedding[...].astype(dtype), None
    return self.output.kernel[...].T.astype(dtype), self.output.bias[...].astype(dtype)


class CausalLayer(EncoderLayer):
  """The decoder-only layer: causal self-attention and the FFN, no cross-attention."""

  causal = True


def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def default_segments(tokens: jax.Array) -> jax.Array:
  return (tokens != PAD_ID).astype(jnp.int32)


def pool_segments(x: jax.Array, segments: jax.Array, positions: jax.Array,
                  pooling: str) -> jax.Array:
  """Each token's vector replaced by its segment's pooled vector: x [b, t, d] ->
  [b, t, d]. "cls": the segment's first token (position 0); "mean": the mean over its real
  tokens; "none": x itself. Pooling per segment keeps packed rows apart."""
  if pooling == "none":
    return x
  b, t, d = x.shape
  take = (segments > 0) & ((positions == 0) if pooling == "cls" else True)
  ids = (jnp.arange(b)[:, None] * (t + 1) + segments).reshape(-1)  # segment ids are ≤ t
  w = take.reshape(-1).astype(jnp.float32)
  flat = x.reshape(-1, d).astype(jnp.float32) * w[:, None]
  sums = jax.ops.segment_sum(flat, ids, num_segments=b * (t + 1))
  counts = jax.ops.segment_sum(w, ids, num_segments=b * (t + 1))
  return (sums / jnp.maximum(counts, 1)[:, None])[ids].reshape(b, t, d).astype(x.dtype)


POOLINGS = {"none": "none", "cls": "cls", "mean": "mean"}


def inputs_mask(batch: dict[str, jax.Array], causal: bool) -> tuple[jax.Array, Mask]:
  """batch["inputs"] and its self-attention Mask from the optional positions/segmentation."""
  inputs = batch["inputs"]
  positions = batch.get("inputs_positions", default_positions(inputs))
  segments = batch.get("inputs_segmentation", default_segments(inputs))
  return inputs, Mask(segments, segments, positions, positions, causal=causal)
