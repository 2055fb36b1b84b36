"""Typed config fields: allowed ranges, type checks, building a frozen dataclass from a config
section (dataclass_from) with errors that name the field and what it allows, and each
field's declared role:
  * identity (the default): what the run's parameters mean; a workdir's run keeps them;
  * execution: how the run computes or where its files are (kernel, dtype, paths, the
    training schedule); may differ when a run is resumed or evaluated elsewhere;
    a field without a declared role has its section's, so a section of the execution role
    may hold an identity field (identity_field: train.init_from);
  * derived: not a config field; set from other parts (a model's vocabulary size from its
    data source).
A field may also declare the sibling switch it is read under (`used_if`), and a section of
per-entry settings which entry counts (`chosen_by`); and its past (transformer/core/
migration.py): where it lived in an older config layout (`moved_from`), the value a run saved
before the field existed meant (`changed`). Checks and migrations derive from these
declarations (identity, in_use, migrate, as_saved), never from hand-kept lists of paths.

The dataclasses are the config's schema: `schema` gives a section's every field with its
default, the ConfigDict a config file starts from (run/config.py) and changes by deltas."""

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ml_collections import config_dict

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup

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
  fields = {f.name: f for f in dataclasses.fields(cls) if is_config_field(f)}
  unknown = sorted(set(section) - set(fields))
  if unknown:
    hint = getattr(cls, "unknown_hint", "")  # a class may say where such fields belong
    raise ConfigError(f"unknown field(s) {', '.join(unknown)} in config.{name}; "
                      f"fields: {', '.join(sorted(set(fields) - set(extra))) or 'none'}"
                      + (f"; {hint}" if hint else ""))
  hints = typing.get_type_hints(cls)
  section = {key: dataclass_from(hints[key], value, f"{name}.{key}")
             if dataclasses.is_dataclass(hints[key]) and isinstance(value, Mapping) else value
             for key, value in section.items()}
  try:
    for key, value in section.items():
      _check_type(key, value, hints[key])
    return cls(**{**section, **extra})
  except FieldError as e:  # the same error, its field named by its whole path
    raise FieldError(f"config.{name}.{e.field}", e.value, e.allowed) from None


# --------------------------------------------------------------------------- roles

ROLE, IDENTITY, EXECUTION, DERIVED = "role", "identity", "execution", "derived"


def execution(default: Any = dataclasses.MISSING, **kwargs) -> Any:
  """A field with the execution role (module docstring); `default` may be a dataclass
  instance (a section)."""
  if dataclasses.is_dataclass(default):
    kwargs["default_factory"], default = (lambda d=default: d), dataclasses.MISSING
  return dataclasses.field(default=default, metadata={ROLE: EXECUTION}, **kwargs)


def identity_field(default: Any = dataclasses.MISSING) -> Any:
  """A field with the identity role in a section of the execution role (a field without a
  role has its section's): train.init_from, the parameters a run starts from."""
  return dataclasses.field(default=default, metadata={ROLE: IDENTITY})


def derived(default: Any = dataclasses.MISSING) -> Any:
  """A field set from other parts of the config, never given in it (module docstring)."""
  return dataclasses.field(default=default, metadata={ROLE: DERIVED})


# Field metadata: the sibling boolean under which alone the field is read (its knob counts
# for nothing while the switch is off: neither identity nor in_use lists it).
USED_IF = "used_if"


def is_config_field(field: dataclasses.Field) -> bool:
  return field.metadata.get(ROLE) != DERIVED


def identity(obj, prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of the identity fields of a typed config (or section), recursing
  into sections; in a settings section declared `chosen_by` a sibling field (or a property
  giving several entries' names), only the chosen entries' settings count (the knobs of
  entries a run does not use do not change it)."""
  return _values(obj, prefix, skipped=(EXECUTION, DERIVED))


def in_use(obj, prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of every config field a run reads, identity and execution: as
  identity, with the execution fields (an override of a path outside it changes nothing)."""
  return _values(obj, prefix, skipped=(DERIVED,))


def _values(obj, prefix: str, skipped: tuple[str, ...], role: str = IDENTITY
            ) -> dict[str, Any]:
  """The fields of `obj` (a section of `role`) whose role is not `skipped`; a field
  without a role has its section's, and a section's fields declaring another role count
  by theirs."""
  out = {}
  for field in dataclasses.fields(obj):
    own = field.metadata.get(ROLE, role)
    if USED_IF in field.metadata and not getattr(obj, field.metadata[USED_IF]):
      continue
    value, path = getattr(obj, field.name), f"{prefix}{field.name}"
    if own in skipped and not (dataclasses.is_dataclass(value) and own == EXECUTION):
      continue
    chosen = field.metadata.get("chosen_by")
    if chosen is not None:  # a field naming the entry, or a property naming several
      keys = getattr(obj, chosen)
      for key in (keys,) if isinstance(keys, str) else keys:
        entry = getattr(value, key, None)
        out.update(_values(entry, f"{path}.{key}.", skipped, own) if entry is not None else {})
    elif dataclasses.is_dataclass(value):
      out.update(_values(value, f"{path}.", skipped, own))
    elif own not in skipped:
      out[path] = value
  return out


def to_dict(obj) -> dict[str, Any]:
  """A typed config (or section) as the nested dict of its config fields: what a config
  file gives, and what dataclass_from reads back."""
  values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if is_config_field(f)}
  return {name: to_dict(value) if dataclasses.is_dataclass(value) else value
          for name, value in values.items()}


def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{dotted path: value} of the fields of a nested dict (a config or section)."""
  out = {}
  for key, value in d.items():
    out.update(flat(value, f"{prefix}{key}.") if isinstance(value, Mapping)
               else {f"{prefix}{key}": value})
  return out


# --------------------------------------------------------------------------- schema


def schema(cls: type, **sections) -> dict[str, Any]:
  """The config section of dataclass `cls` as a nested dict of its config fields' defaults
  (a field whose type is a dataclass: that class's section), `sections` replacing fields by
  name. A field without a default (or defaulting to None) is unset: a typed placeholder,
  None until the config sets it, that --config.PATH=VALUE can set."""
  hints = typing.get_type_hints(cls)
  out = {}
  for field in dataclasses.fields(cls):
    if not is_config_field(field):
      continue
    hint = hints[field.name]
    if field.name in sections:
      out[field.name] = sections[field.name]
    elif dataclasses.is_dataclass(hint):
      out[field.name] = schema(hint)
    else:
      default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                 else field.default)
      out[field.name] = (_unset(cls, field.name, hint)
                         if default is dataclasses.MISSING or default is None else default)
  return out


def _unset(cls: type, name: str, hint) -> config_dict.FieldReference:
  """A placeholder for a field of type `hint` (a scalar, or a scalar or None)."""
  types = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
  if len(types) != 1 or types[0] not in _TYPES:
    raise TypeError(f"{cls.__name__}.{name}: a config field without a default must be one of "
                    f"{', '.join(t.__name__ for t in _TYPES)}, not {hint}")
  return config_dict.placeholder(types[0])


@dataclasses.dataclass(frozen=True)
class Chosen:
  """A config section whose dataclass one of its fields chooses from a registry (e.g.
  task.name picks the labelled task); parse() builds the section as that dataclass."""

  registry: Mapping[str, type]
  key: str  # the field naming the entry
  what: str  # names the registry in the error for an unknown entry

  def parse(self, section: Mapping[str, Any], name: str):
    """The chosen entry's dataclass of `section`; a field that is None takes the entry's
    default (schema)."""
    section = {key: value for key, value in section.items() if value is not None}
    return dataclass_from(lookup(self.registry, section.get(self.key), self.what), section, name)

  def schema(self) -> dict[str, Any]:
    """The section of any entry: the key and every field an entry has, all unset. The
    defaults are the chosen entry's, so a config sets only the fields it changes, and a
    sweep over the key keeps each entry's own defaults (its other fields stay unset)."""
    hints = {}
    for entry in self.registry.values():
      entry_hints = typing.get_type_hints(entry)
      for field in dataclasses.fields(entry):
        hint = entry_hints[field.name]
        if is_config_field(field) and hints.setdefault(field.name, hint) != hint:
          raise TypeError(f"{self.what} entries declare the field {field.name} as "
                          f"{hints[field.name]} and as {hint}")
    return {name: _unset(Chosen, name, hint)
            for name, hint in {self.key: str, **hints}.items()}
