"""Token embeddings (shared or separate tables and the pre-softmax projection) and the
default positions, segments and self-attention mask of a batch's inputs."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.vocab import PAD_ID
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.layers import Dense, mesh_axes
from transformer.model.masks import Mask


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

def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

def default_segments(tokens: jax.Array) -> jax.Array:
  return (tokens != PAD_ID).astype(jnp.int32)


def target_weights(batch: dict[str, jax.Array]) -> jax.Array:
  """[b, t] bool: the target tokens scored, where batch["targets_segmentation"] > 0, or, in
  a batch without it (one sequence per row, padded at the right), where a target is not
  PAD_ID."""
  if "targets_segmentation" in batch:
    return batch["targets_segmentation"] > 0
  return batch["targets"] != PAD_ID


def inputs_mask(batch: dict[str, jax.Array], causal: bool) -> tuple[jax.Array, Mask]:
  """batch["inputs"] and its self-attention Mask from the optional positions/segmentation.

  A batch that gives neither declares one sequence per row from slot 0, padded at the
  right with PAD_ID (which no sequence holds): its positions are 0, 1, … and its segment ids
  1 where a token is not PAD_ID, and its Mask is declared `padded`, which cuDNN takes as
  sequence lengths (kernels/cudnn_mask.py). Which keys a batch carries is part of its
  structure, known when the step is traced."""
  inputs = batch["inputs"]
  padded = "inputs_positions" not in batch and "inputs_segmentation" not in batch
  positions = batch.get("inputs_positions", default_positions(inputs))
  segments = batch.get("inputs_segmentation", default_segments(inputs))
  return inputs, Mask(segments, segments, positions, positions, causal=causal, padded=padded)
