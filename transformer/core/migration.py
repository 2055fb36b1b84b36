"""A config field's past, declared on the field, and the two readers of old configs that
follow the declarations (never a hand-kept list of paths):
  * `moved_from` (field metadata: a dotted path): where the field lived in an older config
    layout; migrate moves a value given there to the field's place;
  * `changed(new, old=...)`: a field added when what the code computes changed; configs get
    `new`, and a run saved before the field existed meant `old`, which as_saved gives back to
    its saved config.
Old workdirs keep their meaning through these (tests/test_old_workdirs.py)."""

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

# Field metadata: the value a config saved before the field existed meant (changed).
OLD = "value_before"


def changed(new: Any, *, old: Any, metadata: Mapping[str, Any] | None = None) -> Any:
  """A field added when what the code computes changed: configs get `new` by default; a run
  saved before the field existed (its config.json lacks it) meant `old` and keeps it
  (as_saved)."""
  return dataclasses.field(default=new, metadata={OLD: old, **(metadata or {})})


def as_saved(cls: type, section: Mapping[str, Any]) -> dict[str, Any]:
  """A saved config's section of dataclass `cls` (nested dicts), every `changed` field it
  lacks set to the value it meant when saved, in its nested sections too."""
  hints = typing.get_type_hints(cls)
  out = dict(section)
  for field in dataclasses.fields(cls):
    if OLD in field.metadata and field.name not in out:
      out[field.name] = field.metadata[OLD]
    elif dataclasses.is_dataclass(hints[field.name]) and _has_changed(hints[field.name]):
      sub = out.get(field.name, {})
      if isinstance(sub, Mapping):
        out[field.name] = as_saved(hints[field.name], sub)
  return out


def _has_changed(cls: type) -> bool:
  hints = typing.get_type_hints(cls)
  return any(OLD in f.metadata or (dataclasses.is_dataclass(hints[f.name])
                                   and _has_changed(hints[f.name]))
             for f in dataclasses.fields(cls))


def migrate(raw: dict, cls: type, prefix: tuple[str, ...]) -> dict:
  """`raw` (a whole config as nested dicts) with the value of every field of `cls` (the
  section at `prefix`) and of its nested sections that declares `moved_from` (a dotted
  path in an older layout) moved from there to its place; a value given at the old path
  replaces one at the new. Returns a new dict; `raw` is not changed."""
  moves = list(_moves(cls, prefix))
  if not any(_get(raw, old) is not _ABSENT for old, _ in moves):
    return raw
  raw = _copy(raw)
  for old, new in moves:
    value = _pop(raw, old)
    if value is not _ABSENT:
      _put(raw, new, value)
  return raw


def _moves(cls: type, prefix: tuple[str, ...]):
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    path = (*prefix, field.name)
    if "moved_from" in field.metadata:
      yield tuple(field.metadata["moved_from"].split(".")), path
    if dataclasses.is_dataclass(hints[field.name]):
      yield from _moves(hints[field.name], path)


_ABSENT = object()


def _copy(d):
  return {k: _copy(v) for k, v in d.items()} if isinstance(d, Mapping) else d


def _get(d, path):
  for key in path:
    if not isinstance(d, Mapping) or key not in d:
      return _ABSENT
    d = d[key]
  return d


def _pop(d, path):
  parent = _get(d, path[:-1])
  return parent.pop(path[-1]) if isinstance(parent, dict) and path[-1] in parent else _ABSENT


def _put(d, path, value):
  for key in path[:-1]:
    d = d.setdefault(key, {})
  d[path[-1]] = value
