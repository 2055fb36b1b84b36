"""A stack of layers: the positional encoding, embedding dropout, N encoder/decoder layers
(looped, or one lax.scan) and pre-LN's final norm; each call's randomized positions are
drawn by its RandomPositions (positions/randomized.py), and cached decoding asks the stack
for its slots' positions."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import lookup
from transformer.model import layer_pattern
from transformer.model.blocks import EncoderLayer
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.layers import Dropout
from transformer.model.masks import WINDOWS, Mask
from transformer.model.positions import (PositionalEncoding, RandomPositions,
                                         make_positional_encoding)
from transformer.model.residual import RESIDUALS, make_norm


class Stack(nnx.Module):
  """Positional encoding, embedding dropout, N layers and (pre-LN) a final norm.

  With cfg.random_positions, each call draws its sequences' positions as
  cfg.random_positions_draw says (`random`, positions/randomized.py) from a key of the rngs'
  dropout stream (the train step folds it from seed and step, so a resumed run draws the
  same ones), or when deterministic from the key its caller sets (the evaluator's, one per
  batch; random.draw_from): evaluation samples too, as Ruoss et al. do.

  Layer-wise patterns (model/layer_pattern.py): under model.position=`rotary+none` layer i
  calls the seams of entry i mod 2 (positions.PositionPattern), under
  model.attention.window=`local+full` its mask has entry i mod 2's window; the kernel of
  each layer is chosen for what that layer needs."""

  def __init__(self, cfg: ModelConfig, layer: type[EncoderLayer], num_layers: int, *, rngs):
    self.random = (RandomPositions(cfg.random_positions_draw, cfg.max_position, layer.causal)
                   if cfg.random_positions else None)
    # Sampled positions reach max_position - 1: a learned table (xPos's centre) covers them.
    self.position = make_positional_encoding(
        cfg.position, cfg.d_model, cfg.num_heads,
        cfg.max_position if cfg.random_positions else cfg.max_len,
        causal=layer.causal, settings=cfg.position_settings, rngs=rngs)
    self.position_names = layer_pattern.entries(cfg.position)
    windows = layer_pattern.entries(cfg.attention.window)
    self.windows = tuple(lookup(WINDOWS, w, "attention window")(cfg.attention.window_size)
                         for w in windows)
    self.period = layer_pattern.period(cfg.position, cfg.attention.window)
    self.dropout = Dropout(cfg.dropout)
    self.layers = nnx.List([layer(
        cfg, encoding=self.handed(i), rngs=rngs, depth=i,
        attention=dataclasses.replace(cfg.attention,
                                      window=layer_pattern.of_layer(cfg.attention.window, i)))
        for i in range(num_layers)])
    self.remat, self.scan_layers = cfg.remat, cfg.scan_layers
    has_final = lookup(RESIDUALS, cfg.norm, "norm").final_norm
    self.final_norm = make_norm(cfg.norm_type, cfg.d_model, dtype=compute_dtype(cfg),
                                rngs=rngs) if has_final else None

  def handed(self, layer: int):
    """Layer `layer`'s encoding as its kernel will be handed it, for the kernel's choice."""
    encoding = self.position.for_layer(layer)
    return encoding if self.random is None else self.random.declared(encoding)

  def encodings(self) -> dict[str, PositionalEncoding]:
    """Its positional encodings by name: one, or a pattern's entries (each shared by the
    layers that take it)."""
    names = dict.fromkeys(self.position_names)
    return {name: self.position.for_layer(self.position_names.index(name)) for name in names}

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""
    if self.random is not None:
      self.random.check_length(length)
    self.position.check_length(length)

  def slot_positions(self, batch: int, max_len: int, repeat: int = 1) -> jax.Array:
    """The positions [batch·repeat, max_len] of cached decoding's slots: 0..max_len-1, or
    per_row's draw for rows of max_len tokens (per_batch maps them in each call)."""
    positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
    if self.random is not None:
      positions = self.random.slot_positions(positions)
    return jnp.repeat(positions, repeat, axis=0)

  def __call__(self, x, mask: Mask, rngs, *, cached: bool = False, **cross):
    """x [b, t, d_model] at positions mask.q_positions; `mask` is the self-attention's, to
    which the stack adds each layer's window. `cached`: a cached decoding step's mask, whose
    keys are the cache's slots (at slot_positions); with random positions the stack draws
    the rest."""
    keys = None
    if self.random is not None:
      self.check_length(mask.k_positions.shape[1] if cached else mask.q_positions.shape[1])
      mask, keys = self.random.start(mask, rngs, len(self.layers), cached)
    embedded = (mask.q_positions if self.random is None
                else self.random.embed_positions(mask, keys, cached))
    x = self.position.embed(x, embedded)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    masks = [dataclasses.replace(mask, window=window) for window in self.windows]

    def call(i, layer, x, rngs, key=None):  # layer i of the stack (or of its period: alike),
      # at its own draw if it has one
      layer_mask, encoding = masks[i % len(masks)], self.position.for_layer(i)
      if key is not None:
        layer_mask, encoding = self.random.layer(layer_mask, encoding, key, cached)
      return layer(x, layer_mask, encoding, rngs, **cross)

    layer_keys = None if keys is None else keys[1:]
    if self.scan_layers:
      x = scan_layers(call, self.layers, x, rngs, layer_keys, period=self.period,
                      remat=self.remat)
    else:
      for i, layer in enumerate(self.layers):
        f = functools.partial(call, i)
        f = nnx.remat(f) if self.remat else f
        x = f(layer, x, rngs) if layer_keys is None else f(layer, x, rngs, layer_keys[i])
    return x if self.final_norm is None else self.final_norm(x)


def scan_layers(call, layers, x, rngs, layer_keys=None, *, period: int = 1,
                remat: bool = False):
  """x after call(i, layer, x, rngs[, key]) for each of `layers`, i its index, as one
  jax.lax.scan over their states stacked along a new leading axis, so the layer is traced
  and compiled once instead of once per layer. Under a layer-wise pattern of `period`
  layers, layers i, i + period, ... are alike (call depends on i mod period): each scan
  step runs one period, and the layers of an unfinished last period run one by one. The
  parameters keep their per-layer layout (checkpoints do not depend on this option); the
  stack is built inside the step. Each layer draws its own dropout key (as without a
  scan), and gets its row of `layer_keys` [n] if given (its random positions' key); caches
  updated by the calls (decoding) are written back."""
  whole = len(layers) - len(layers) % period  # the layers in whole periods
  keys = None if rngs is None else jax.random.split(rngs.dropout(), len(layers))

  def one(i, layer, x, rngs, layer_key):
    return call(i, layer, x, rngs) if layer_key is None else call(i, layer, x, rngs, layer_key)

  if whole:
    groups = [[layers[i] for i in range(j, whole, period)] for j in range(period)]
    graphdefs = [nnx.graphdef(group[0]) for group in groups]
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in group))
               for group in groups]
    by_step = lambda k: None if k is None else k[:whole].reshape(whole // period, period)  # noqa: E731

    def body(x, per_step):
      states, step_key, step_layer_key = per_step
      caches = []
      for j in range(period):
        layer = nnx.merge(graphdefs[j], states[j])
        x = one(j, layer, x, None if step_key is None else nnx.Rngs(dropout=step_key[j]),
                None if step_layer_key is None else step_layer_key[j])
        caches.append(nnx.state(layer, nnx.Cache))
      return x, caches

    x, caches = jax.lax.scan(jax.checkpoint(body) if remat else body, x,
                             (stacked, by_step(keys), by_step(layer_keys)))
    for group, cache in zip(groups, caches):
      for s, layer in enumerate(group):
        nnx.update(layer, jax.tree.map(lambda c: c[s], cache))  # noqa: B023
  for i in range(whole, len(layers)):
    f = functools.partial(one, i)
    f = nnx.remat(f) if remat else f
    x = f(layers[i], x, None if keys is None else nnx.Rngs(dropout=keys[i]),
          None if layer_keys is None else layer_keys[i])
  return x
