"""Typed config fields: allowed ranges, type checks, and building a frozen dataclass from a
config section (dataclass_from), with errors that name the field and what it allows."""

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from transformer.errors import ConfigError

T = TypeVar("T")


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
