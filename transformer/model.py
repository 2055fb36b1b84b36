"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017),
and the encoder-only and decoder-only families built from the same layers (ARCHS).

Pure model code: a frozen ModelConfig in, NNX modules out; no file I/O, no flags. The
pluggable parts (attention score, window, positional encoding, residual placement) are
chosen once, in constructors, from their registries.

Every family has the same training interface: features(batch) [b, t, d_model] and
projection(dtype) (weights [n_out, d_model], bias or None), whose product is scored against
batch["targets"] where batch["targets_segmentation"] > 0 (metrics.loss_head_metrics):
  encoder_decoder  targets: the target sentence (teacher-forced, shifted right inside);
  encoder          targets: a label per input token (pooling "none": sequence labelling),
                   or each sequence's class at its first token (pooling "cls" | "mean");
  decoder          targets: the next token of each input token (a causal language model).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.attention import AttentionConfig, MultiHeadAttention
from transformer.kernels import check_bias
from transformer.layers import Dense, Dropout, LayerNorm
from transformer.masks import WINDOWS, Mask
from transformer.positions import (POSITIONS, PositionalEncoding, PositionSettings,
                                   make_positional_encoding)
from transformer.registry import AT_LEAST_1, FRACTION, check, check_ranges, lookup
from transformer.vocab import BOS_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout: float = 0.1  # on embeddings+positions and on every sublayer output
  position: str = "sinusoidal"  # a key of positions.POSITIONS
  max_len: int = 512  # longest sequence the `learned` table covers
  norm: str = "post"  # a key of RESIDUALS: LayerNorm(x + f(x)) or x + f(LayerNorm(x))
  share_embeddings: bool = True  # one matrix for source, target and pre-softmax projection
  dtype: str = "float32"  # a key of DTYPES: the computation's; parameters are always float32
  remat: bool = False  # recompute each layer's activations in the backward pass (less memory)
  scan_layers: bool = False  # run each stack's layers as one lax.scan: compiled once, not N times
  attention: AttentionConfig = AttentionConfig()
  # Each encoding's own knobs (`position_settings.alibi.max_bias`, ...): every section is
  # checked, the chosen encoding's is used.
  position_settings: PositionSettings = PositionSettings()
  arch: str = "encoder_decoder"  # a key of ARCHS: encoder_decoder | encoder | decoder
  pooling: str = "none"  # a key of POOLINGS (encoder): none (a label per token) | cls | mean
  num_classes: int = 0  # outputs of the encoder's head (given by the data source)

  def __post_init__(self):
    check_ranges(self, vocab_size=AT_LEAST_1, d_model=AT_LEAST_1, num_heads=AT_LEAST_1,
                 d_ff=AT_LEAST_1, num_encoder_layers=AT_LEAST_1, num_decoder_layers=AT_LEAST_1,
                 dropout=FRACTION, max_len=AT_LEAST_1)
    check(self.d_model % self.num_heads == 0, "num_heads", self.num_heads,
          f"a divisor of d_model ({self.d_model})")
    lookup(POSITIONS, self.position, "position")
    lookup(RESIDUALS, self.norm, "norm")
    lookup(DTYPES, self.dtype, "model dtype")
    lookup(ARCHS, self.arch, "model arch")
    lookup(POOLINGS, self.pooling, "model pooling")
    check(self.arch != "encoder" or self.num_classes >= 1, "num_classes", self.num_classes,
          "≥ 1 for an encoder (its data source sets it)")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(cfg: ModelConfig):
  return lookup(DTYPES, cfg.dtype, "model dtype")


# --------------------------------------------------------------------------- residual blocks


class PostNorm(nnx.Module):
  """LayerNorm(x + Dropout(sublayer(x))), as in the paper."""

  final_norm = False  # the stack output is already normalised

  def __init__(self, d_model: int, dropout: float, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.norm = LayerNorm(d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
    self.dropout = Dropout(dropout)

  def __call__(self, x, sublayer, rngs):
    return self.norm(x + self.dropout(sublayer(x), deterministic=rngs is None, rngs=rngs))


class PreNorm(PostNorm):
  """x + Dropout(sublayer(LayerNorm(x))); the stack ends with a LayerNorm."""

  final_norm = True

  def __call__(self, x, sublayer, rngs):
    return x + self.dropout(sublayer(self.norm(x)), deterministic=rngs is None, rngs=rngs)


RESIDUALS: dict[str, type[PostNorm]] = {"post": PostNorm, "pre": PreNorm}


def residual_block(cfg: ModelConfig, rngs: nnx.Rngs) -> PostNorm:
  residual = lookup(RESIDUALS, cfg.norm, "norm")
  return residual(cfg.d_model, cfg.dropout, dtype=compute_dtype(cfg), rngs=rngs)


class FeedForward(nnx.Module):
  """max(0, x W_1 + b_1) W_2 + b_2."""

  def __init__(self, d_model: int, d_ff: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.wi = Dense(d_model, d_ff, dtype=dtype, rngs=rngs)
    self.wo = Dense(d_ff, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.wo(jax.nn.relu(self.wi(x)))


# The identity encoding: cross-attention relates two different sequences' positions.
NO_POSITION = PositionalEncoding()


class EncoderLayer(nnx.Module):

  causal = False  # its self-attention sees keys after the query

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = compute_dtype(cfg)
    self.self_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention,
                                             dtype=dtype, rngs=rngs)
    self.attention_block = residual_block(cfg, rngs)
    self.ffn = FeedForward(cfg.d_model, cfg.d_ff, dtype=dtype, rngs=rngs)
    self.ffn_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class DecoderLayer(EncoderLayer):

  causal = True  # its self-attention never sees keys after the query

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    self.cross_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, cfg.attention,
                                              dtype=compute_dtype(cfg), rngs=rngs)
    self.cross_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs, *, encoded, cross_mask):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    cross = lambda y: self.cross_attention.cross_attend(  # noqa: E731
        y, encoded, cross_mask, NO_POSITION, rngs)
    x = self.cross_block(x, cross, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class Stack(nnx.Module):
  """Positional encoding, embedding dropout, N layers and (pre-LN) a final LayerNorm."""

  def __init__(self, cfg: ModelConfig, layer: type[EncoderLayer], num_layers: int, *, rngs):
    self.position = make_positional_encoding(
        cfg.position, cfg.d_model, cfg.num_heads, cfg.max_len, causal=layer.causal,
        settings=cfg.position_settings, rngs=rngs)
    check_bias(cfg.attention.kernel, position=cfg.position, biases=self.position.biases)
    self.window = lookup(WINDOWS, cfg.attention.window, "attention window")
    self.window_size = cfg.attention.window_size
    self.dropout = Dropout(cfg.dropout)
    self.layers = nnx.List([layer(cfg, rngs=rngs) for _ in range(num_layers)])
    self.remat, self.scan_layers = cfg.remat, cfg.scan_layers
    has_final = lookup(RESIDUALS, cfg.norm, "norm").final_norm
    self.final_norm = LayerNorm(cfg.d_model, epsilon=1e-6, dtype=compute_dtype(cfg),
                                    rngs=rngs) if has_final else None

  def __call__(self, x, mask: Mask, rngs, **cross):
    """x [b, t, d_model] at positions mask.q_positions; `mask` is the self-attention's, to
    which the stack adds its window."""
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
    embed = lambda: nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype,  # noqa: E731
                              rngs=rngs)
    self.scale = math.sqrt(cfg.d_model)
    self.source_table = embed()
    if cfg.share_embeddings:
      self.target_table, self.output = None, None
    else:
      self.target_table = embed()
      self.output = Dense(cfg.d_model, cfg.vocab_size, dtype=dtype, rngs=rngs)

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


def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def default_segments(tokens: jax.Array) -> jax.Array:
  return (tokens != PAD_ID).astype(jnp.int32)


def shift_right(targets: jax.Array, positions: jax.Array) -> jax.Array:
  """Decoder inputs: each segment's tokens moved one step right with BOS at its position 0."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(positions == 0, BOS_ID, shifted)


class Transformer(nnx.Module):
  """Encoder-decoder Transformer.

  Token arrays are int32 [batch, length]; positions restart at 0 in each segment and
  segment ids are 0 on padding (defaults: one segment, positions 0..length-1).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs=rngs)
    self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers, rngs=rngs)
    self.decoder = Stack(cfg, DecoderLayer, cfg.num_decoder_layers, rngs=rngs)

  def encode(self, inputs, positions=None, segments=None, *, rngs=None):
    """inputs [b, s] -> encoded [b, s, d_model]."""
    positions = default_positions(inputs) if positions is None else positions
    segments = default_segments(inputs) if segments is None else segments
    x = self.embeddings.source(inputs)
    return self.encoder(x, Mask(segments, segments, positions, positions), rngs)

  def decode(self, encoded, inputs_segments, decoder_inputs, positions=None, segments=None,
             *, inputs_positions=None, rngs=None):
    """encoded [b, s, d], decoder_inputs [b, t] -> logits [b, t, vocab] (float32)."""
    return self.embeddings.logits(self.decoder_outputs(
        encoded, inputs_segments, decoder_inputs, positions, segments,
        inputs_positions=inputs_positions, rngs=rngs)).astype(jnp.float32)

  def decoder_outputs(self, encoded, inputs_segments, decoder_inputs, positions=None,
                      segments=None, *, inputs_positions=None, rngs=None):
    """decode() up to the output projection: the decoder stack's outputs [b, t, d_model]."""
    positions = default_positions(decoder_inputs) if positions is None else positions
    segments = default_segments(decoder_inputs) if segments is None else segments
    inputs_positions = (default_positions(inputs_segments) if inputs_positions is None
                        else inputs_positions)
    x = self.embeddings.target(decoder_inputs)
    return self.decoder(x, Mask(segments, segments, positions, positions, causal=True), rngs,
                        encoded=encoded,
                        cross_mask=Mask(segments, inputs_segments, positions, inputs_positions))

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Teacher-forced decoder outputs [b, t, d_model] (before the output projection) for a
    batch with keys `inputs`, `targets` and optional `{inputs,targets}_{positions,segmentation}`."""
    inputs, targets = batch["inputs"], batch["targets"]
    in_pos = batch.get("inputs_positions", default_positions(inputs))
    in_seg = batch.get("inputs_segmentation", default_segments(inputs))
    tgt_pos = batch.get("targets_positions", default_positions(targets))
    tgt_seg = batch.get("targets_segmentation", default_segments(targets))
    encoded = self.encode(inputs, in_pos, in_seg, rngs=rngs)
    return self.decoder_outputs(encoded, in_seg, shift_right(targets, tgt_pos), tgt_pos, tgt_seg,
                                inputs_positions=in_pos, rngs=rngs)

  def __call__(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Teacher-forced logits [b, t, vocab] (float32) of a batch, as in features()."""
    return self.embeddings.logits(self.features(batch, rngs=rngs)).astype(jnp.float32)

  def projection(self, dtype) -> tuple[jax.Array, jax.Array | None]:
    """The output projection of features(): see Embeddings.projection."""
    return self.embeddings.projection(dtype)

  def stacks(self) -> dict[str, Stack]:
    """The model's stacks by name (pictures draw each)."""
    return {"encoder": self.encoder, "decoder": self.decoder}

  # ------------------------------------------------------------------ incremental decoding

  def init_decoding(self, encoded, inputs_positions, max_len: int) -> None:
    """Prepares decode_step: empty self-attention caches of max_len positions and the
    cross-attention K/V of `encoded` [b, s, d], projected once here."""
    self.decoder.position.check_length(max_len)
    for layer in self.decoder.layers:
      layer.self_attention.init_self_cache(encoded.shape[0], max_len, encoded.dtype)
      layer.cross_attention.init_cross_cache(encoded, inputs_positions, NO_POSITION)

  def decode_step(self, tokens, index, inputs_segments, inputs_positions):
    """Logits [b, vocab] for the next position given the token [b] at position `index`
    (BOS at 0); appends to the caches made by init_decoding."""
    b, max_len = tokens.shape[0], self.decoder.layers[0].self_attention.cache.k.shape[1]
    positions = jnp.full((b, 1), index, jnp.int32)
    key_positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
    x = self.embeddings.target(tokens[:, None])
    ones = jnp.ones((b, 1), jnp.int32)
    y = self.decoder(x, Mask(ones, jnp.ones((b, max_len), jnp.int32), positions, key_positions,
                             causal=True), None, encoded=None,
                     cross_mask=Mask(ones, inputs_segments, positions, inputs_positions))
    return self.embeddings.logits(y[:, 0]).astype(jnp.float32)


# --------------------------------------------------------------------------- other families


class CausalLayer(EncoderLayer):
  """The decoder-only layer: causal self-attention and the FFN, no cross-attention."""

  causal = True


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


def _inputs_mask(batch: dict[str, jax.Array], causal: bool) -> tuple[jax.Array, Mask]:
  """batch["inputs"] and its self-attention Mask from the optional positions/segmentation."""
  inputs = batch["inputs"]
  positions = batch.get("inputs_positions", default_positions(inputs))
  segments = batch.get("inputs_segmentation", default_segments(inputs))
  return inputs, Mask(segments, segments, positions, positions, causal=causal)


class EncoderOnly(nnx.Module):
  """The encoder stack with a classifier over its outputs: a label per token (pooling
  "none", sequence labelling) or per sequence, read at each segment's first token (pooling
  "cls": that token's output, e.g. a CLS token the data puts there; "mean": the mean of the
  segment's outputs)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(dataclasses.replace(cfg, share_embeddings=True), rngs=rngs)
    self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers, rngs=rngs)
    self.head = Dense(cfg.d_model, cfg.num_classes, dtype=compute_dtype(cfg), rngs=rngs)

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """[b, t, d_model]: the encoder's outputs, pooled per segment unless pooling is none."""
    inputs, mask = _inputs_mask(batch, causal=False)
    x = self.encoder(self.embeddings.source(inputs), mask, rngs)
    return pool_segments(x, mask.q_segments, mask.q_positions, self.cfg.pooling)

  def projection(self, dtype) -> tuple[jax.Array, jax.Array | None]:
    return self.head.kernel[...].T.astype(dtype), self.head.bias[...].astype(dtype)

  def stacks(self) -> dict[str, Stack]:
    return {"encoder": self.encoder}

  def __call__(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Class logits [b, t, num_classes] (float32) at every token."""
    return self.head(self.features(batch, rngs=rngs)).astype(jnp.float32)


class DecoderOnly(nnx.Module):
  """A causal language model: embeddings, a stack of CausalLayers and the (tied) output
  projection; logits at each position predict the next token."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs=rngs)
    self.decoder = Stack(cfg, CausalLayer, cfg.num_decoder_layers, rngs=rngs)

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """[b, t, d_model] of batch["inputs"] (and optional positions/segmentation)."""
    inputs, mask = _inputs_mask(batch, causal=True)
    return self.decoder(self.embeddings.target(inputs), mask, rngs)

  def projection(self, dtype) -> tuple[jax.Array, jax.Array | None]:
    return self.embeddings.projection(dtype)

  def stacks(self) -> dict[str, Stack]:
    return {"decoder": self.decoder}

  def __call__(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Next-token logits [b, t, vocab] (float32)."""
    return self.embeddings.logits(self.features(batch, rngs=rngs)).astype(jnp.float32)

  def init_decoding(self, batch_size: int, max_len: int, dtype=jnp.float32) -> None:
    """Prepares decode_step: empty self-attention caches of max_len positions."""
    self.decoder.position.check_length(max_len)
    for layer in self.decoder.layers:
      layer.self_attention.init_self_cache(batch_size, max_len, dtype)

  def decode_step(self, tokens: jax.Array, index) -> jax.Array:
    """Logits [b, t, vocab] for tokens [b, t] at positions index..index+t-1, appended to
    the caches made by init_decoding (which hold positions 0..index-1)."""
    (b, t), max_len = tokens.shape, self.decoder.layers[0].self_attention.cache.k.shape[1]
    positions = index + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    key_positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
    mask = Mask(jnp.ones((b, t), jnp.int32), jnp.ones((b, max_len), jnp.int32), positions,
                key_positions, causal=True)
    y = self.decoder(self.embeddings.target(tokens), mask, None)
    return self.embeddings.logits(y).astype(jnp.float32)


ARCHS: dict[str, type[nnx.Module]] = {"encoder_decoder": Transformer, "encoder": EncoderOnly,
                                      "decoder": DecoderOnly}


def make_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The model of the family cfg.arch names."""
  return lookup(ARCHS, cfg.arch, "model arch")(cfg, rngs=rngs)
