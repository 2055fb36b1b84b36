"""Config-string registries (every pluggable axis is a small dict chosen from once), the
settings sections of their entries, the checks that turn a config section into a validated
dataclass, and the errors the CLIs print as one `error:` line."""

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
  """A bad value in the user's configuration or input; the CLIs print it as one line and
  exit with status 2, before anything is written."""


class RunError(RuntimeError):
  """A run that cannot go on (training diverged, the workdir is in use, no checkpoint
  restores); the CLIs print it as one line and exit with status 1."""


class Interrupted(Exception):  # noqa: N818 - a stop request, not a failure
  """A stop signal arrived during work that cannot be saved half-done (an evaluation)."""


def lookup(registry: Mapping[str, T], name: str, what: str) -> T:
  """Returns `registry[name]`, or raises ConfigError naming `name` and the choices."""
  try:
    return registry[name]
  except (KeyError, TypeError):
    choices = ", ".join(sorted(registry))
    raise ConfigError(f"unknown {what} {name!r}; choose one of: {choices}") from None


@dataclasses.dataclass(frozen=True)
class Range:
  """Allowed values of a numeric field: lo ≤ (or <) value ≤ (or <) hi, either end open."""

  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False

  def __contains__(self, value) -> bool:
    return ((self.lo is None or value > self.lo or (not self.lo_open and value == self.lo))
            and (self.hi is None or value < self.hi or (not self.hi_open and value == self.hi)))

  def __str__(self) -> str:
    if self.hi is None:
      return f"{'>' if self.lo_open else '≥'} {self.lo}"
    return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


AT_LEAST_0, AT_LEAST_1 = Range(0), Range(1)
POSITIVE = Range(0, lo_open=True)
FRACTION = Range(0, 1, hi_open=True)  # rates and probabilities below 1


class FieldError(ConfigError):
  """A field outside its allowed values; dataclass_from prefixes the config section."""

  def __init__(self, field: str, value, allowed: str):
    super().__init__(f"{field}={value!r} is not allowed; it must be {allowed}")
    self.field, self.value, self.allowed = field, value, allowed


def check_ranges(obj, **ranges: Range) -> None:
  """Raises FieldError for the first of obj's numeric fields outside its Range."""
  for field, allowed in ranges.items():
    value = getattr(obj, field)
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value in allowed):
      raise FieldError(field, value, str(allowed))


def check(ok: bool, field: str, value, allowed: str) -> None:
  """Raises FieldError(field, value, allowed) unless ok."""
  if not ok:
    raise FieldError(field, value, allowed)


_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _check_type(field: str, value, annotation) -> None:
  expected = typing.get_args(annotation) or (annotation,)  # e.g. int | None
  for t in expected:
    if t is type(None) and value is None:
      return
    if t is bool and isinstance(value, bool):
      return
    if t in (int, float) and isinstance(value, int if t is int else (int, float)) \
        and not isinstance(value, bool):
      return
    if t is str and isinstance(value, str):
      return
    if t not in _TYPES and t is not type(None):
      return  # a nested dataclass or another type: checked by its own constructor
  names = " or ".join(_TYPES.get(t, "null") for t in expected)
  raise FieldError(field, value, names)


def dataclass_from(cls: type[T], section: Mapping[str, Any], name: str, **extra) -> T:
  """cls(**section, **extra) with every value type-checked against cls's annotations and
  each nested section (a field whose type is a dataclass) built the same way; a
  ConfigError names unknown fields, and a FieldError raised by cls's checks gets the
  section's name (`config.train.batch_size=0 is not allowed; ...`)."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(section) - set(fields))
  if unknown:
    raise ConfigError(f"unknown field(s) {', '.join(unknown)} in config.{name}; "
                      f"fields: {', '.join(sorted(set(fields) - set(extra))) or 'none'}")
  hints = typing.get_type_hints(cls)
  section = {key: dataclass_from(hints[key], value, f"{name}.{key}")
             if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping) else value
             for key, value in section.items()}
  try:
    for key, value in section.items():
      _check_type(key, value, hints[key])
    return cls(**{**section, **extra})
  except FieldError as e:
    raise ConfigError(f"config.{name}.{e}") from None


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


def settings_config(sections_class: type) -> dict[str, dict[str, Any]]:
  """The default sections as a nested dict, for a config file: {key: {field: value}}."""
  return dataclasses.asdict(sections_class())
