"""Config-string registries: every pluggable axis is a small dict chosen from once."""

from collections.abc import Mapping
from typing import TypeVar

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
