"""A stack of layers: the positional encoding, embedding dropout, N encoder/decoder layers
(looped, or one lax.scan) and pre-LN's final norm; randomized positions are drawn here, and
cached decoding asks the stack for its slots' positions."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model import layer_pattern
from transformer.model.blocks import EncoderLayer
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.kernel_choice import Target
from transformer.model.layers import Dropout
from transformer.model.masks import WINDOWS, Mask
from transformer.model.positions import PositionalEncoding, make_positional_encoding
from transformer.model.positions.randomized import sample_positions
from transformer.model.residual import RESIDUALS, make_norm


class Stack(nnx.Module):
  """Positional encoding, embedding dropout, N layers and (pre-LN) a final norm.

  With cfg.random_positions, each call draws its sequences' positions
  (positions/randomized.py) from the rngs' dropout stream (the train step folds it from seed
  and step, so a resumed run draws the same ones), or from a fixed key when deterministic
  (evaluation samples too, as Ruoss et al. do, and every evaluation the same).

  Layer-wise patterns (model/layer_pattern.py): under model.position=`rotary+none` layer i
  calls the seams of entry i mod 2 (positions.PositionPattern), under
  model.attention.window=`local+full` its mask has entry i mod 2's window; the kernel of
  each layer is chosen for what that layer needs."""

  def __init__(self, cfg: ModelConfig, layer: type[EncoderLayer], num_layers: int, *, rngs,
               target: Target | None = None):
    """target: where the model will run, for its attention kernels (None: here)."""
    self.max_position = cfg.max_position if cfg.random_positions else None
    self.causal = layer.causal
    # Sampled positions reach max_position - 1: a learned table (xPos's centre) covers them.
    self.position = make_positional_encoding(
        cfg.position, cfg.d_model, cfg.num_heads, self.max_position or cfg.max_len,
        causal=layer.causal, settings=cfg.position_settings, rngs=rngs)
    self.position_names = layer_pattern.entries(cfg.position)
    windows = layer_pattern.entries(cfg.attention.window)
    self.windows = tuple(lookup(WINDOWS, w, "attention window")(cfg.attention.window_size)
                         for w in windows)
    self.period = layer_pattern.period(cfg.position, cfg.attention.window)
    self.dropout = Dropout(cfg.dropout)
    self.layers = nnx.List([layer(
        cfg, encoding=self.position.for_layer(i), target=target, rngs=rngs,
        position=layer_pattern.of_layer(cfg.position, i),
        attention=dataclasses.replace(cfg.attention,
                                      window=layer_pattern.of_layer(cfg.attention.window, i)))
        for i in range(num_layers)])
    self.remat, self.scan_layers = cfg.remat, cfg.scan_layers
    has_final = lookup(RESIDUALS, cfg.norm, "norm").final_norm
    self.final_norm = make_norm(cfg.norm_type, cfg.d_model, dtype=compute_dtype(cfg),
                                rngs=rngs) if has_final else None

  def encodings(self) -> dict[str, PositionalEncoding]:
    """Its positional encodings by name: one, or a pattern's entries (each shared by the
    layers that take it)."""
    names = dict.fromkeys(self.position_names)
    return {name: self.position.for_layer(self.position_names.index(name)) for name in names}

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
    which the stack adds each layer's window. With random positions, `drawn`: the mask's
    positions are already drawn (cached decoding's slot_positions); otherwise the stack
    draws them."""
    if self.max_position is not None and not drawn:
      mask = self.draw_positions(mask, rngs)
    x = self.position.embed(x, mask.q_positions)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    masks = [dataclasses.replace(mask, window=window) for window in self.windows]

    def call(i, layer, x, rngs):  # layer i of the stack (or of its period: the same kinds)
      return layer(x, masks[i % len(masks)], self.position.for_layer(i), rngs, **cross)

    if self.scan_layers:
      x = scan_layers(call, self.layers, x, rngs, period=self.period, remat=self.remat)
    else:
      for i, layer in enumerate(self.layers):
        f = functools.partial(call, i)
        x = (nnx.remat(f) if self.remat else f)(layer, x, rngs)
    return x if self.final_norm is None else self.final_norm(x)


def scan_layers(call, layers, x, rngs, *, period: int = 1, remat: bool = False):
  """x after call(i, layer, x, rngs) for each of `layers`, i its index, as one
  jax.lax.scan over their states stacked along a new leading axis, so the layer is traced
  and compiled once instead of once per layer. Under a layer-wise pattern of `period`
  layers, layers i, i + period, ... are alike (call depends on i mod period): each scan
  step runs one period, and the layers of an unfinished last period run one by one. The
  parameters keep their per-layer layout (checkpoints do not depend on this option); the
  stack is built inside the step. Each layer draws its own dropout key (as without a
  scan); caches updated by the calls (decoding) are written back."""
  whole = len(layers) - len(layers) % period  # the layers in whole periods
  keys = None if rngs is None else jax.random.split(rngs.dropout(), len(layers))
  key = lambda i: None if keys is None else nnx.Rngs(dropout=keys[i])  # noqa: E731
  if whole:
    groups = [[layers[i] for i in range(j, whole, period)] for j in range(period)]
    graphdefs = [nnx.graphdef(group[0]) for group in groups]
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in group))
               for group in groups]
    step_keys = None if keys is None else keys[:whole].reshape(whole // period, period)

    def body(x, per_step):
      states, step_key = per_step
      caches = []
      for j in range(period):
        layer = nnx.merge(graphdefs[j], states[j])
        x = call(j, layer, x, None if step_key is None else nnx.Rngs(dropout=step_key[j]))
        caches.append(nnx.state(layer, nnx.Cache))
      return x, caches

    x, caches = jax.lax.scan(jax.checkpoint(body) if remat else body, x, (stacked, step_keys))
    for group, cache in zip(groups, caches):
      for s, layer in enumerate(group):
        nnx.update(layer, jax.tree.map(lambda c: c[s], cache))  # noqa: B023
  for i in range(whole, len(layers)):
    f = functools.partial(call, i)
    x = (nnx.remat(f) if remat else f)(layers[i], x, key(i))
  return x
