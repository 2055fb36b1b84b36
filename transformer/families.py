"""The model families, built from the same blocks (transformer/blocks.py): the encoder-decoder
Transformer of "Attention Is All You Need" (Vaswani et al. 2017), an encoder-only
classifier and a decoder-only language model (ARCHS).

Every family has the same training interface: features(batch) [b, t, d_model] and
projection(dtype) (weights [n_out, d_model], bias or None), whose product is scored against
batch["targets"] where batch["targets_segmentation"] > 0 (metrics.loss_head_metrics):
  encoder_decoder  targets: the target sentence (teacher-forced, shifted right inside);
  encoder          targets: a label per input token (pooling "none": sequence labelling),
                   or each sequence's class at its first token (pooling "cls" | "mean");
  decoder          targets: the next token of each input token (a causal language model).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.blocks import (NO_POSITION, CausalLayer, DecoderLayer, Embeddings, EncoderLayer,
                                ModelConfig, Stack, compute_dtype, default_positions,
                                default_segments, inputs_mask, pool_segments)
from transformer.layers import Dense
from transformer.masks import Mask
from transformer.registry import lookup
from transformer.vocab import BOS_ID


def shift_right(targets: jax.Array, positions: jax.Array) -> jax.Array:
  """Decoder inputs: each segment's tokens moved one step right with BOS at its position 0."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(positions == 0, BOS_ID, shifted)


class EncoderDecoder(nnx.Module):
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


class EncoderOnly(nnx.Module):
  """The encoder stack with a classifier over its outputs: a label per token (pooling
  "none", sequence labelling) or per sequence, read at each segment's first token (pooling
  "cls": that token's output, e.g. a CLS token the data puts there; "mean": the mean of the
  segment's outputs)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(dataclasses.replace(cfg, share_embeddings=True), rngs=rngs)
    self.encoder = Stack(cfg, EncoderLayer, cfg.num_encoder_layers, rngs=rngs)
    # Replicated (no mesh axes declared): with a few classes the head [d_model, classes] is a
    # few thousand parameters (5120 at base dims and 10 classes), not worth a collective.
    self.head = Dense(cfg.d_model, cfg.num_classes, dtype=compute_dtype(cfg), rngs=rngs)

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """[b, t, d_model]: the encoder's outputs, pooled per segment unless pooling is none."""
    inputs, mask = inputs_mask(batch, causal=False)
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
    inputs, mask = inputs_mask(batch, causal=True)
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


ARCHS: dict[str, type[nnx.Module]] = {"encoder_decoder": EncoderDecoder, "encoder": EncoderOnly,
                                      "decoder": DecoderOnly}


def make_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  """The model of the family cfg.arch names."""
  return lookup(ARCHS, cfg.arch, "model arch")(cfg, rngs=rngs)
