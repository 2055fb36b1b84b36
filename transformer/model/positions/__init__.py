"""Positional encodings, keyed by config string.

An encoding acts at up to four seams, and the layers call all of them on every encoding:
  * `embed(x, positions)`: added to the scaled token embeddings (sinusoidal, learned);
  * `rotate_queries(x, positions)` and `rotate_keys(x, positions)`: applied to the queries
    and to the keys of every self-attention layer (rotary; xPos, which scales queries up and
    keys down);
  * `bias(q_positions, k_positions)`: added to the attention logits (ALiBi, T5 buckets,
    KERPLE, FIRE); an encoding that adds one declares `biases = True`, and
    `learned_bias = True` if that bias has parameters (a kernel must then give their
    gradient: cuDNN's is refused);
  * `content_bias(q, logits)`: added to the attention logits too, but a function of the
    queries and of the logits before it (CoPE, whose positions count the keys the query
    attends to); an encoding that adds one declares `content_biases = True`, and only the
    kernels declaring `content_bias` (transformer/model/kernels/registry.py) can add it, since it needs
    each query's whole row of logits.
The base class is the identity at each seam; built without arguments it is the identity
encoding. Every registry entry has one constructor, `(d_model, num_heads, max_len, *, causal,
settings, rngs)` (causal: it serves a decoder, whose keys never follow the query), and its
knobs in its own `Settings` (config.model.position_settings.<name>). An encoding defined
only where keys never follow the query declares `causal_only = True`, and
make_positional_encoding refuses it for a bidirectional (encoder) stack.

Positions are explicit int arrays [batch, length] (0-based within each packed segment),
never inferred from array indices, so packing and cached decoding see the right positions.

Layer-wise patterns (transformer/model/layer_pattern.py): model.position may name several
encodings joined by '+', cycled over each stack's layers (`rotary+rotary+rotary+none`). Each
entry is built once per stack and shared by the layers that take it (as the layers of a
stack share T5's table); a layer calls the seams of its own entry (`for_layer`). Only the
encodings acting inside the layers may vary per layer: an encoding declaring `embeds = True`
adds to the embeddings once, before the layers, and a pattern may not name it.
"""

from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup, settings_of, settings_sections
from transformer.model import layer_pattern
from transformer.model.positions import absolute, base, contextual, relative, rotary
from transformer.model.positions.absolute import Learned, Sinusoidal, sinusoid
from transformer.model.positions.base import (BiasSpec, EncodingView, NoPosition,
                                             PositionalEncoding, spec_bias)
from transformer.model.positions.contextual import CoPE
from transformer.model.positions.relative import (ALiBi, Fire, Kerple, T5Bias, alibi_slopes,
                                                  relative_position_bucket)
from transformer.model.positions.rotary import Rotary, XPos, rotate_half_pairs, xpos_scale
from transformer.model.positions.randomized import (RandomPositions, batch_key,
                                                    check_random_positions)

__all__ = ["ALiBi", "CausalOnly", "CoPE", "Fire", "Kerple", "Learned", "NoPosition", "PER_LAYER",
           "POSITIONS", "PositionPattern", "PositionSettings", "PositionalEncoding",
           "RandomPositions", "Rotary", "Sinusoidal", "T5Bias", "XPos", "alibi_slopes",
           "batch_key", "check_position", "check_random_positions", "make_positional_encoding",
           "relative_position_bucket", "rotate_half_pairs", "sinusoid", "xpos_scale"]

# Every encoding, by its config name: the entries each module declares (a new encoding is
# one class and one line in its module's ENCODINGS).
POSITIONS: dict[str, type[PositionalEncoding]] = {
    **base.ENCODINGS, **absolute.ENCODINGS, **rotary.ENCODINGS, **relative.ENCODINGS,
    **contextual.ENCODINGS}

# config.model.position_settings: a section per encoding with settings.
PositionSettings = settings_sections(POSITIONS, "PositionSettings")

# The encodings a layer-wise pattern may name: those acting inside the layers (module docstring).
PER_LAYER = tuple(name for name, cls in POSITIONS.items() if not cls.embeds)


def check_position(value: str) -> tuple[type[PositionalEncoding], ...]:
  """The classes of the encodings config.model.position names, layer by layer of a pattern
  (one for a plain name); an UnknownName for an unknown plain name, a FieldError for a
  pattern naming an unknown encoding or one that cannot vary per layer."""
  layer_pattern.check("position", value, POSITIONS, "position", PER_LAYER,
                      "adds to the embeddings, once per stack, and cannot vary per layer")
  return tuple(POSITIONS[name] for name in layer_pattern.entries(value))


class CausalOnly(ConfigError):
  """An encoding defined for causal self-attention only, asked of a bidirectional stack
  (the wiring adds which configs take it)."""


def make_positional_encoding(name: str, d_model: int, num_heads: int, max_len: int, *,
                             causal: bool = False, settings=None,
                             rngs: nnx.Rngs | None) -> "PositionalEncoding | PositionPattern":
  """The encoding `name` with its section of `settings` (a PositionSettings; None: defaults),
  for a causal (decoder) or bidirectional (encoder) stack: a ConfigError if the encoding is
  defined for causal self-attention only and the stack is bidirectional. A layer-wise
  pattern (`rotary+none`) gives a PositionPattern of its entries."""
  if layer_pattern.is_pattern(name):
    check_position(name)
    return PositionPattern(name, d_model, num_heads, max_len, causal=causal,
                           settings=settings, rngs=rngs)
  cls = lookup(POSITIONS, name, "position")
  if cls.causal_only and not causal:
    raise CausalOnly(
        f"position {name!r} is defined for causal self-attention only (decoder stacks; keys "
        "never after the query), and this model has a bidirectional (encoder) stack: use "
        "another position, or a decoder-only model (model.arch=decoder) on data it learns")
  encoding = cls(d_model, num_heads, max_len, causal=causal,
                 settings=settings_of(settings, POSITIONS, name), rngs=rngs)
  encoding.name = name
  return encoding


class PositionPattern(nnx.Module):
  """A stack's encodings under a layer-wise pattern (module docstring): each distinct entry
  built once, in the order the pattern first names it (so its parameters are drawn in that
  order), under `encodings.<name>`; layer i calls the seams of entry i mod n. The stack's
  own seams: no entry adds to the embeddings (check_position), and a sequence is encodable
  if every entry encodes it."""

  def __init__(self, value: str, d_model: int, num_heads: int, max_len: int, *,
               causal: bool = False, settings=None, rngs: nnx.Rngs | None):
    self.names = layer_pattern.entries(value)
    self.encodings = nnx.Dict({name: make_positional_encoding(
        name, d_model, num_heads, max_len, causal=causal, settings=settings, rngs=rngs)
        for name in dict.fromkeys(self.names)})

  def for_layer(self, layer: int) -> PositionalEncoding:
    return self.encodings[self.names[layer % len(self.names)]]

  def embed(self, x, positions):
    del positions
    return x

  def check_length(self, length: int) -> None:
    for encoding in self.encodings.values():
      encoding.check_length(length)
