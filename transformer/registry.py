"""Config-string registries: every pluggable axis is a small dict chosen from once."""

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
  """A bad value in the user's configuration; the CLIs print it as one line."""


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
  """Returns `registry[name]`, or raises ConfigError naming `name` and the choices."""
  try:
    return registry[name]
  except (KeyError, TypeError):
    choices = ", ".join(sorted(registry))
    raise ConfigError(f"unknown {what} {name!r}; choose one of: {choices}") from None


def dataclass_from(cls: type[T], section: Mapping[str, Any], name: str, **extra) -> T:
  """cls(**section, **extra), or a ConfigError naming unknown fields of config.<name>."""
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(section) - fields)
  if unknown:
    raise ConfigError(f"unknown field(s) {', '.join(unknown)} in config.{name}; "
                      f"fields: {', '.join(sorted(fields - set(extra)))}")
  return cls(**{**section, **extra})
