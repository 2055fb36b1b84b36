"""A config's every field with its value and what it allows (train.py --show_config).

What a field allows is not kept in a list here: it is asked of the typed config itself.
Each field is set, in turn, to a value no check lets through (a name no registry holds;
a number far below, then far above, any range) and parsed (config.parse); the error that
names the field says what it allows: the registry's choices (registry.UnknownName) or the
range and other conditions its section checks (fields.FieldError). A field added to a
section, an entry added to a registry, or a range changed is described as the code says.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError, flat
from transformer.core.registry import UnknownName, one_of
from transformer.run import config as config_lib

_UNKNOWN_NAME = "\0no such entry"
_FAR = 10**30  # beyond any range a field declares, below and above


@dataclasses.dataclass(frozen=True)
class Field:
  """A config field: its dotted path under `config.`, its value and what it allows ('' for
  any value of its type)."""

  path: str
  value: Any
  allowed: str


def describe(config: ml_collections.ConfigDict | Mapping[str, Any]) -> list[Field]:
  """Every field of the typed config of `config` (a config file's ConfigDict, overrides
  applied), in its order. A ConfigError if the config itself is bad."""
  raw = config_lib.to_dict(config_lib.parse(config))
  return [Field(path, value, _allowed(raw, path, value)) for path, value in flat(raw).items()]


def render(fields: list[Field]) -> str:
  """Aligned lines `path  value  allowed`."""
  width = max(len(f.path) for f in fields) + 2
  values = [repr(f.value) for f in fields]
  value_width = min(max(len(v) for v in values), 24)
  return "\n".join(f"  {f.path:<{width}}  {v:<{value_width}}  {f.allowed}".rstrip()
                   for f, v in zip(fields, values))


def _allowed(raw: dict, path: str, value) -> str:
  if isinstance(value, bool):
    return "true or false"
  if isinstance(value, str):
    probes = [_UNKNOWN_NAME]
  elif isinstance(value, (int, float)):
    probes = [type(value)(-_FAR), type(value)(_FAR)]
  else:
    return ""
  said = []
  for probe in probes:
    try:
      config_lib.parse(_with(raw, path.split("."), probe))
    except UnknownName as e:
      if e.name == probe:
        return one_of(e.choices)
    except FieldError as e:
      if e.field == f"config.{path}" and e.allowed not in said:
        said.append(e.allowed)
    except (ConfigError, ArithmeticError, TypeError, ValueError):
      pass  # another field's or section's check: it says nothing of this field
  return "; ".join(said)


def _with(d: dict, keys: list[str], value) -> dict:
  """A copy of the nested dict `d` with the field at `keys` set to `value`."""
  head, *rest = keys
  return {**d, head: _with(d[head], rest, value) if rest else value}
