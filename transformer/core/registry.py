"""Config-string registries: every pluggable axis is a small dict chosen from once, by name,
and each entry with knobs declares them as its own `Settings` section."""

import dataclasses
from collections.abc import Mapping
from typing import TypeVar

from transformer.core.errors import ConfigError

T = TypeVar("T")


def one_of(choices) -> str:
  """How a field's choices are said, in errors and in --show_config: 'one of: a, b, c'."""
  return "one of: " + ", ".join(choices)


class UnknownName(ConfigError):
  """A name that is not an entry of its registry; carries the choices (train.py
  --show_config lists them by asking each field for an unknown name)."""

  def __init__(self, name, choices: list[str], what: str):
    super().__init__(f"unknown {what} {name!r}; choose {one_of(choices)}")
    self.name, self.choices, self.what = name, choices, what


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
  """Returns `registry[name]`, or raises UnknownName (a ConfigError) naming `name` and the
  choices."""
  try:
    return registry[name]
  except (KeyError, TypeError):
    raise UnknownName(name, sorted(registry), what) from None


# --------------------------------------------------------------------------- settings
# An entry of a registry (a scorer, a positional encoding) declares its knobs as a frozen
# dataclass `Settings` (defaults = its paper's values, checked in __post_init__). The config
# holds one section per entry that has knobs, named after its registry key, so that each
# knob is overridable and sweepable like any other field and only its owner reads it.


@dataclasses.dataclass(frozen=True)
class NoSettings:
  """The settings of an entry without knobs (it has no config section)."""


def settings_sections(registry: Mapping[str, type], name: str) -> type:
  """A frozen dataclass with one field per entry of `registry` whose Settings has fields:
  the entry's key, of type entry.Settings, defaulting to its defaults. Building it checks
  every section, whichever entry the config chooses."""
  fields = [(key, entry.Settings, dataclasses.field(default_factory=entry.Settings))
            for key, entry in registry.items() if dataclasses.fields(entry.Settings)]
  return dataclasses.make_dataclass(name, fields, frozen=True)


def settings_of(sections, registry: Mapping[str, type], key: str):
  """The Settings of registry[key] in `sections` (a settings_sections instance)."""
  return getattr(sections, key, None) or registry[key].Settings()
