"""A stack of layers: the positional encoding, embedding dropout, N encoder/decoder layers
(looped, or one lax.scan) and pre-LN's final norm; randomized positions are drawn here
(positions/randomized.py), and cached decoding asks the stack for its slots' positions."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.blocks import EncoderLayer
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.kernel_choice import Target
from transformer.model.layers import Dropout
from transformer.model.masks import WINDOWS, Mask
from transformer.model.positions import make_positional_encoding
from transformer.model.positions.randomized import DRAWS
from transformer.model.residual import RESIDUALS, make_norm


class Stack(nnx.Module):
  """Positional encoding, embedding dropout, N layers and (pre-LN) a final norm.

  With cfg.random_positions, each call draws its sequences' positions as
  cfg.random_positions_draw says (positions/randomized.py) from a key of the rngs' dropout
  stream (the train step folds it from seed and step, so a resumed run draws the same
  ones), or when deterministic from evaluation_key(): evaluation samples too, as Ruoss et
  al. do; per_batch from the key its caller sets in draw_key (the evaluator: one per batch),
  per_row from a fixed key (every evaluation the same)."""

  def __init__(self, cfg: ModelConfig, layer: type[EncoderLayer], num_layers: int, *, rngs,
               target: Target | None = None):
    """target: where the model will run, for its attention kernels (None: here)."""
    self.max_position = cfg.max_position if cfg.random_positions else None
    self.draw = (lookup(DRAWS, cfg.random_positions_draw, "model random_positions_draw")(
        cfg.max_position) if cfg.random_positions else None)
    self.draw_key: jax.Array | None = nnx.data(None)  # evaluation_key's base (None: key 0)
    self.causal = layer.causal
    # Sampled positions reach max_position - 1: a learned table (xPos's centre) covers them.
    self.position = make_positional_encoding(
        cfg.position, cfg.d_model, cfg.num_heads, self.max_position or cfg.max_len,
        causal=layer.causal, settings=cfg.position_settings, rngs=rngs)
    self.window = lookup(WINDOWS, cfg.attention.window, "attention window")
    self.window_size = cfg.attention.window_size
    self.dropout = Dropout(cfg.dropout)
    # the encoding as the layers' kernels will be handed it, for their choice
    handed = self.position if self.draw is None else self.draw.declared(self.position)
    self.layers = nnx.List([layer(cfg, encoding=handed, target=target, rngs=rngs)
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
    """The key of deterministic calls' random positions (one per kind of stack): from
    draw_key under per_batch (key 0 if none is set), from key 0 under per_row."""
    base = self.draw_key if self.draw_key is not None and self.draw.per_batch else None
    return jax.random.fold_in(jax.random.key(0) if base is None else base, int(self.causal))

  def slot_positions(self, batch: int, max_len: int, repeat: int = 1) -> jax.Array:
    """The positions [batch·repeat, max_len] of cached decoding's slots: 0..max_len-1, or
    per_row's draw for rows of max_len tokens (per_batch maps them in each call)."""
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    if self.draw is not None:
      positions = self.draw.slot_positions(self.evaluation_key(), positions)
    return jnp.repeat(positions, repeat, axis=0)

  def __call__(self, x, mask: Mask, rngs, *, cached: bool = False, **cross):
    """x [b, t, d_model] at positions mask.q_positions; `mask` is the self-attention's, to
    which the stack adds its window. `cached`: a cached decoding step's mask, whose keys are
    the cache's slots (at slot_positions); with random positions the stack draws the rest."""
    keys = None
    if self.draw is not None:
      self.check_length(mask.k_positions.shape[1] if cached else mask.q_positions.shape[1])
      key = self.evaluation_key() if rngs is None else rngs.dropout()
      mask, keys = self.draw.start(mask, key, len(self.layers), cached)
    embedded = mask.q_positions if keys is None else self.draw.embed_positions(mask, keys, cached)
    x = self.position.embed(x, embedded)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    mask = dataclasses.replace(mask, window=self.window(self.window_size))

    def call(layer, x, rngs, key=None):  # each layer at its own draw, if it has one
      layer_mask, encoding = (mask, self.position) if key is None else self.draw.layer(
          mask, self.position, key, cached)
      return layer(x, layer_mask, encoding, rngs, **cross)

    layer_keys = None if keys is None else keys[1:]
    if self.scan_layers:
      x = scan_layers(call, self.layers, x, rngs, layer_keys, remat=self.remat)
    else:
      call = nnx.remat(call) if self.remat else call
      for i, layer in enumerate(self.layers):
        x = call(layer, x, rngs) if layer_keys is None else call(layer, x, rngs, layer_keys[i])
    return x if self.final_norm is None else self.final_norm(x)

def scan_layers(call, layers, x, rngs, layer_keys=None, *, remat: bool = False):
  """x after call(layer, x, rngs[, key]) for each of `layers` (identical in structure), as
  one jax.lax.scan over their states stacked along a new leading axis, so the layer is
  traced and compiled once instead of once per layer. The parameters keep their per-layer
  layout (checkpoints do not depend on this option); the stack is built inside the step.
  Each layer draws its own dropout key, and gets its row of `layer_keys` [n] if given (its
  random positions' key); caches updated by the calls (decoding) are written back."""
  graphdef = nnx.graphdef(layers[0])
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in layers))
  keys = None if rngs is None else jax.random.split(rngs.dropout(), len(layers))

  def body(x, per_layer):
    state, key, layer_key = per_layer
    layer = nnx.merge(graphdef, state)
    rngs = None if key is None else nnx.Rngs(dropout=key)
    x = call(layer, x, rngs) if layer_key is None else call(layer, x, rngs, layer_key)
    return x, nnx.state(layer, nnx.Cache)

  x, caches = jax.lax.scan(jax.checkpoint(body) if remat else body, x,
                           (stacked, keys, layer_keys))
  for i, layer in enumerate(layers):
    nnx.update(layer, jax.tree.map(lambda c: c[i], caches))  # noqa: B023
  return x
