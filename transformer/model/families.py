"""The model families, built from the same blocks (transformer/model/blocks.py): the encoder-decoder
Transformer of "Attention Is All You Need" (Vaswani et al. 2017), an encoder-only
classifier and a decoder-only language model, registered in ARCHS (config.model.arch).

Every family meets ModelFamily: the same training interface, features(batch)
[b, t, d_model] and projection(dtype) (weights [n_out, d_model], bias or None), whose
product is scored against batch["targets"] where embeddings.target_weights says
(targets_segmentation > 0, or without it, the targets that are not PAD_ID;
metrics.loss_head_metrics); one decoding interface (init_decoding, decode_step) for the
families that decode or generate; and declarations of what it learns (data.Targets) and
whether it decodes or generates, which the wiring, evaluation and pictures read instead of
its name. tests/test_families.py runs one conformance suite over every registered family.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.fields import check
from transformer.core.registry import lookup
from transformer.core.vocab import BOS_ID
from transformer.data import Targets
from transformer.model.blocks import NO_POSITION, CausalLayer, DecoderLayer, EncoderLayer
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.data_biases import outside_causal
from transformer.model.embeddings import (Embeddings, default_positions, default_segments,
                                          inputs_mask)
from transformer.model.kernels import Target, choosing_for
from transformer.model.layers import Dense
from transformer.model.masks import Mask
from transformer.model.pooling import pool_segments
from transformer.model.stack import Stack


class ModelFamily(nnx.Module):
  """The interface of a model family (module docstring). Token arrays are int32
  [batch, length]; positions restart at 0 in each segment and segment ids are 0 on padding
  (defaults: one segment, positions 0..length-1)."""

  learns: ClassVar[frozenset[Targets]]  # the data source targets it can be trained on
  decodes: ClassVar[bool] = False  # predicts a target sequence for an input by decoding
  generates: ClassVar[bool] = False  # continues a prompt (eval.py --generate)
  cfg: ModelConfig

  @classmethod
  def check_targets(cls, cfg: ModelConfig, targets: Targets, source: str) -> None:
    """A ConfigError if this config of the family cannot learn `targets` (one of `learns`)
    of data.source `source`: for options that only some targets fit."""
    del cfg, targets, source

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """The outputs [b, t, d_model] before the output projection (rngs: dropout)."""
    raise NotImplementedError

  def projection(self, dtype) -> tuple[jax.Array, jax.Array | None]:
    """(weights [n_out, d_model], bias [n_out] or None) in `dtype`: logits = features·wᵀ + b."""
    raise NotImplementedError

  def __call__(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Logits [b, t, n_out] (float32) at every position."""
    raise NotImplementedError

  def stacks(self) -> dict[str, Stack]:
    """The model's stacks by name (pictures draw each)."""
    raise NotImplementedError

  def draw_positions_from(self, key: jax.Array) -> None:
    """Random positions drawn per batch (model.random_positions_draw=per_batch) in the calls
    without rngs (evaluation, decoding) from `key` instead of key 0 (positions/randomized.py).
    The evaluator sets one per batch, so each batch gets a fresh, reproducible draw."""
    for stack in self.stacks().values():
      if stack.random is not None:
        stack.random.draw_from(key)

  def init_decoding(self, batch: dict[str, jax.Array], max_len: int, repeat: int = 1) -> None:
    """Prepares decode_step for the rows of `batch` (its `inputs` and optional positions and
    segmentation: what is decoded from, or the prompts), each repeated `repeat` times (beam
    hypotheses): caches of max_len positions."""
    raise NotImplementedError(f"{type(self).__name__} neither decodes nor generates")

  def decode_step(self, tokens: jax.Array, index) -> jax.Array:
    """Logits [b, t, n_out] (float32) for tokens [b, t] at positions index..index+t-1,
    appended to the caches made by init_decoding (which hold positions 0..index-1)."""
    raise NotImplementedError(f"{type(self).__name__} neither decodes nor generates")


def cached_mask(length: int, index, slots: jax.Array) -> Mask:
  """The causal self-attention mask of `length` new tokens in slots index.. against all the
  cache slots, slot p at position slots[:, p] (Stack.slot_positions)."""
  batch, max_len = slots.shape
  positions = jax.lax.dynamic_slice_in_dim(slots, index, length, axis=1)
  return Mask(jnp.ones((batch, length), jnp.int32), jnp.ones((batch, max_len), jnp.int32),
              positions, slots, causal=True)


class SourceContext(nnx.Module):
  """What cross-attention needs of the source during decoding: its segment ids and
  positions [b, s], kept as caches (beam search reorders them with the K/V)."""

  def __init__(self, segments: jax.Array, positions: jax.Array):
    self.segments, self.positions = nnx.Cache(segments), nnx.Cache(positions)


def shift_right(targets: jax.Array, positions: jax.Array) -> jax.Array:
  """Decoder inputs: each segment's tokens moved one step right with BOS at its position 0."""
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(positions == 0, BOS_ID, shifted)


class EncoderDecoder(ModelFamily):
  """The encoder-decoder Transformer: a target sequence for each input sequence."""

  learns = frozenset({Targets.SEQUENCE})
  decodes = True

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs=rngs)
    # a causal-only data bias acts in the decoder's self-attention alone (data_biases.py)
    encoder = dataclasses.replace(cfg, attention=outside_causal(cfg.attention))
    self.encoder = Stack(encoder, EncoderLayer, cfg.num_encoder_layers, rngs=rngs)
    self.decoder = Stack(cfg, DecoderLayer, cfg.num_decoder_layers, rngs=rngs)
    self.source_context: SourceContext | None = nnx.data(None)  # set by init_decoding
    self.slots: nnx.Cache | None = nnx.data(None)  # cache slots' positions, set by init_decoding

  def encode(self, inputs, positions=None, segments=None, *, rngs=None):
    """inputs [b, s] -> encoded [b, s, d_model]."""
    padded = positions is None and segments is None  # one sequence per row (embeddings.py)
    positions = default_positions(inputs) if positions is None else positions
    segments = default_segments(inputs) if segments is None else segments
    x = self.embeddings.source(inputs)
    return self.encoder(x, Mask(segments, segments, positions, positions, padded=padded), rngs)

  def decode(self, encoded, inputs_segments, decoder_inputs, positions=None, segments=None,
             *, inputs_positions=None, inputs_padded=False, rngs=None):
    """encoded [b, s, d], decoder_inputs [b, t] -> logits [b, t, vocab] (float32)."""
    return self.embeddings.logits(self.decoder_outputs(
        encoded, inputs_segments, decoder_inputs, positions, segments,
        inputs_positions=inputs_positions, inputs_padded=inputs_padded,
        rngs=rngs)).astype(jnp.float32)

  def decoder_outputs(self, encoded, inputs_segments, decoder_inputs, positions=None,
                      segments=None, *, inputs_positions=None, inputs_padded=False,
                      padded=None, rngs=None):
    """decode() up to the output projection: the decoder stack's outputs [b, t, d_model].
    `inputs_padded`: the source rows hold one sequence each (Mask.padded); `padded`: the
    target rows do (None: when neither their positions nor segments are given)."""
    if padded is None:  # one sequence per row (embeddings.py)
      padded = positions is None and segments is None
    positions = default_positions(decoder_inputs) if positions is None else positions
    segments = default_segments(decoder_inputs) if segments is None else segments
    inputs_positions = (default_positions(inputs_segments) if inputs_positions is None
                        else inputs_positions)
    x = self.embeddings.target(decoder_inputs)
    return self.decoder(x, Mask(segments, segments, positions, positions, causal=True,
                                padded=padded), rngs,
                        encoded=encoded,
                        cross_mask=Mask(segments, inputs_segments, positions, inputs_positions,
                                        padded=padded and inputs_padded))

  def features(self, batch: dict[str, jax.Array], *, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Teacher-forced decoder outputs [b, t, d_model] (before the output projection) for a
    batch with keys `inputs`, `targets` and optional `{inputs,targets}_{positions,segmentation}`."""
    inputs, targets = batch["inputs"], batch["targets"]
    in_pos, in_seg = batch.get("inputs_positions"), batch.get("inputs_segmentation")
    tgt_pos, tgt_seg = batch.get("targets_positions"), batch.get("targets_segmentation")
    encoded = self.encode(inputs, in_pos, in_seg, rngs=rngs)
    shifted = shift_right(targets, default_positions(targets) if tgt_pos is None else tgt_pos)
    # Without target segments, a row's sequence is its targets' (not PAD_ID): the decoder
    # input after the last target (its EOS, shifted) is padding, as segment ids make it.
    return self.decoder_outputs(
        encoded, default_segments(inputs) if in_seg is None else in_seg, shifted, tgt_pos,
        default_segments(targets) if tgt_seg is None else tgt_seg, inputs_positions=in_pos,
        inputs_padded=in_pos is None and in_seg is None,
        padded=tgt_pos is None and tgt_seg is None, rngs=rngs)

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

  def init_decoding(self, batch, max_len, repeat=1):
    """Encodes batch["inputs"] once and projects the cross-attention K/V of each row once,
    repeated `repeat` times; empty self-attention caches of max_len positions."""
    inputs = batch["inputs"]
    positions = batch.get("inputs_positions", default_positions(inputs))
    segments = batch.get("inputs_segmentation", default_segments(inputs))
    encoded = self.encode(inputs, positions, segments)
    expand = lambda x: jnp.repeat(x, repeat, axis=0)  # noqa: E731  [b, ...] -> [b*repeat, ...]
    encoded, segments, positions = expand(encoded), expand(segments), expand(positions)
    self.decoder.check_length(max_len)
    self.slots = nnx.Cache(self.decoder.slot_positions(inputs.shape[0], max_len, repeat))
    for layer in self.decoder.layers:
      layer.self_attention.init_self_cache(encoded.shape[0], max_len, encoded.dtype)
      layer.cross_attention.init_cross_cache(encoded, positions, NO_POSITION)
    self.source_context = SourceContext(segments, positions)

  def decode_step(self, tokens, index):
    source = self.source_context
    mask = cached_mask(tokens.shape[1], index, self.slots[...])
    cross_mask = Mask(mask.q_segments, source.segments[...], mask.q_positions,
                      source.positions[...])
    y = self.decoder(self.embeddings.target(tokens), mask, None, cached=True, encoded=None,
                     cross_mask=cross_mask)
    return self.embeddings.logits(y).astype(jnp.float32)


class EncoderOnly(ModelFamily):
  """The encoder stack with a classifier over its outputs: a label per token (pooling
  "none", sequence labelling) or per sequence, read at each segment's first token (pooling
  "cls": that token's output, e.g. a CLS token the data puts there; "mean": the mean of the
  segment's outputs)."""

  learns = frozenset({Targets.TOKEN_LABELS, Targets.SEQUENCE_LABELS})

  @classmethod
  def check_targets(cls, cfg, targets, source):
    pooled = targets is Targets.SEQUENCE_LABELS
    if (cfg.pooling != "none") != pooled:
      raise ConfigError(f"config.model.pooling={cfg.pooling!r} does not fit data.source "
                        f"{source!r}: {'cls or mean' if pooled else 'none'} ({targets.value})")

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    check(cfg.num_classes >= 1, "num_classes", cfg.num_classes,
          "≥ 1 for an encoder (its data source sets it)")
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


class DecoderOnly(ModelFamily):
  """A causal language model: embeddings, a stack of CausalLayers and the (tied) output
  projection; logits at each position predict the next token: of a document, or of the
  answer after a prompt (trained the same way, on the weighted targets; evaluation generates
  the answer)."""

  learns = frozenset({Targets.NEXT_TOKENS, Targets.PROMPTED_ANSWERS})
  generates = True

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs=rngs)
    self.decoder = Stack(cfg, CausalLayer, cfg.num_decoder_layers, rngs=rngs)
    self.slots: nnx.Cache | None = nnx.data(None)  # cache slots' positions, set by init_decoding

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

  def init_decoding(self, batch, max_len, repeat=1):
    """Empty self-attention caches of max_len positions for the prompts batch["inputs"]."""
    self.decoder.check_length(max_len)
    self.slots = nnx.Cache(self.decoder.slot_positions(batch["inputs"].shape[0], max_len, repeat))
    for layer in self.decoder.layers:
      layer.self_attention.init_self_cache(batch["inputs"].shape[0] * repeat, max_len,
                                           compute_dtype(self.cfg))

  def decode_step(self, tokens, index):
    mask = cached_mask(tokens.shape[1], index, self.slots[...])
    y = self.decoder(self.embeddings.target(tokens), mask, None, cached=True)
    return self.embeddings.logits(y).astype(jnp.float32)


ARCHS: dict[str, type[ModelFamily]] = {
    "encoder_decoder": EncoderDecoder,
    "encoder": EncoderOnly,
    "decoder": DecoderOnly,
}


def make_model(cfg: ModelConfig, *, rngs: nnx.Rngs, target: Target | None = None
               ) -> ModelFamily:
  """The model of the family cfg.arch names, for `target` (where it will run: its attention
  kernels are chosen for it, kernels.choosing_for; None: this process's backend, one
  device, training)."""
  with choosing_for(target):
    return lookup(ARCHS, cfg.arch, "model arch")(cfg, rngs=rngs)
