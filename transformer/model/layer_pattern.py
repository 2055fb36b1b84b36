"""Layer-wise patterns: a config value that names one registry entry for every layer of a
stack, or several joined by '+', cycled over the stack's layers: layer i takes entry
i mod n of the n entries.

  model.position=rotary+rotary+rotary+none   three rotary layers, then one without
                                             positions, repeated (Llama 4's and SmolLM3's
                                             interleaved NoPE; MaxText's nope_layer_interval=4)
  model.attention.window=local+full          local and global attention alternating
                                             (Gemma 2; Gemma 3's is local×5+full)

A stack of 6 layers under a pattern of 4 entries takes entries 0, 1, 2, 3, 0, 1. The
separator is '+', not a comma: sweep directories name runs `field=value,field=value`, and
sweep.py's --only reads a comma as "or".
"""

import math

from transformer.core.fields import FieldError
from transformer.core.registry import lookup

SEPARATOR = "+"


def entries(value: str) -> tuple[str, ...]:
  """The entries of a pattern value, in layer order: 'rotary+none' -> ('rotary', 'none');
  a plain name is a pattern of one entry."""
  return tuple(value.split(SEPARATOR))


def is_pattern(value: str) -> bool:
  """Whether `value` names more than one entry (a layer-wise pattern)."""
  return SEPARATOR in value


def of_layer(value: str, layer: int) -> str:
  """The entry of layer `layer` (0-based) under the pattern `value`."""
  names = entries(value)
  return names[layer % len(names)]


def period(*values: str) -> int:
  """The number of layers after which every pattern of `values` repeats together: the
  least common multiple of their numbers of entries."""
  return math.lcm(*(len(entries(v)) for v in values))


def check(field: str, value: str, registry, what: str, per_layer=None, why: str = "") -> None:
  """Checks a value that may be a pattern of `registry`'s keys (`what` names the registry in
  errors). A plain name must be a key (registry.lookup's UnknownName otherwise). In a
  pattern every entry must be one of `per_layer` (default: every key); a FieldError names the
  field, the value, the keys allowed and the first entry that is not, with `why` saying why
  a key of the registry that is not in `per_layer` cannot vary per layer."""
  if not isinstance(value, str) or not is_pattern(value):
    lookup(registry, value, what)
    return
  allowed = sorted(registry if per_layer is None else per_layer)
  for name in entries(value):
    if name in allowed:
      continue
    reason = (f"{name!r} {why}" if name in registry else
              f"{name!r} is not among them" if name else "an entry is empty")
    raise FieldError(field, value, f"a {what} ({', '.join(sorted(registry))}) or a pattern "
                     f"of {', '.join(allowed)} joined by '{SEPARATOR}', cycled over each "
                     f"stack's layers; {reason}")
