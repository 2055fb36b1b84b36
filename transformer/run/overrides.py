"""Evaluation-time overrides of a trained run's execution fields: `eval.py --workdir DIR
--config.PATH=VALUE ...`, e.g. --config.model.position_settings.rotary.scaling=yarn.

A run's identity (core/fields.py: what its parameters mean) is fixed by its training; its
execution fields (a RoPE scaling, the attention kernel, the compute dtype, where the data
lives, the evaluation's batch) may differ when it is evaluated. An override is checked
against the run's saved config before any work: the field exists, its value parses as the
field's type and passes the section's checks, the run reads the field (an entry's settings
section that the run does not choose changes nothing), and it is not an identity field. An
override equal to the run's value is no override. The evaluation's files are named after
the overrides that remain (suffix), so they never replace the plain evaluation's.

A scaling of RoPE's frequencies that needs the length the run trained on (YaRN's
`original_length`), not given, is the run's own: its data source's train_length (an LM's
window, data.max_len), logged, and named in the files like a given override; a run whose
source says no training length (translation) must be given it.
"""

import dataclasses
import difflib
import hashlib
import logging
import re
import typing
from collections.abc import Mapping
from typing import Any

from transformer.core import fields
from transformer.core.errors import ConfigError
from transformer.run import config as config_lib

log = logging.getLogger("transformer")
PREFIX = "--config."
TRAINED_LENGTH = "original_length"  # a settings field that is the length trained on
# Sections an evaluation reads; `seed`, `train` and `mesh` are training's (an evaluation
# lays the parameters over every device of this machine).
EVALUATED = ("data", "task", "model", "eval")
# eval.py's own flags set these (--temperature, --top_k, --top_p, --min_p, --sample_seed).
BY_FLAGS = ("eval.sampling", "eval.sample_seed")
_PARSERS = {bool: lambda text: {"true": True, "false": False, "1": True, "0": False}[text.lower()],
            int: int, float: float, str: str}


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
  """({path: text} of argv's --config.PATH=VALUE arguments, the other arguments), up to a
  `--`; a ConfigError for --config.PATH without `=VALUE` or given twice."""
  overrides, rest = {}, []
  for i, arg in enumerate(argv):
    if arg == "--":
      rest += argv[i:]
      break
    if not arg.startswith(PREFIX):
      rest.append(arg)
      continue
    path, equals, text = arg[len(PREFIX):].partition("=")
    if not equals:
      raise ConfigError(f"{arg}: give the value as {arg}=VALUE")
    if path in overrides:
      raise ConfigError(f"{PREFIX}{path} is given twice ({overrides[path]!r} and {text!r})")
    overrides[path] = text
  return overrides, rest


def apply(cfg: config_lib.Config, overrides: Mapping[str, str]
          ) -> tuple[config_lib.Config, dict[str, Any]]:
  """(cfg with `overrides` ({path: text}) applied, {path: value} of those that change it);
  a ConfigError for an override that is not allowed (module docstring)."""
  if not overrides:
    return cfg, {}
  raw, before = config_lib.to_dict(cfg), fields.in_use(cfg)
  for path, text in overrides.items():
    value = _parse(cfg, path, text)
    if path not in before:
      raise ConfigError(f"{PREFIX}{path}={text} changes nothing: this run does not read "
                        f"{path} (a settings section of an entry it does not use)")
    *sections, name = path.split(".")
    node = raw
    for key in sections:
      node = node[key]
    node[name] = value
  new, defaulted = _checked(raw, cfg.source.train_length(cfg.data, cfg.task))
  read, identity = fields.in_use(new), fields.identity(new)
  for path, text in overrides.items():
    if path in identity and identity[path] != before[path]:
      execution = sorted(p for p in read if p.startswith("model.") and p not in identity)
      raise ConfigError(
          f"{PREFIX}{path}={text}: {path} is part of the run's identity (what its parameters "
          f"mean: it was trained with {before[path]!r}); eval.py overrides execution fields "
          f"only, such as {', '.join(execution)}")
  applied = {path: read[path] for path in [*overrides, *defaulted]
             if read.get(path) != before[path]}
  return (new if applied else cfg), applied


def _checked(raw: dict, train_length: int | None) -> tuple[config_lib.Config, list[str]]:
  """(config_lib.parse of the overridden config `raw`: the sections' own checks, a
  FieldError naming the field; the paths set to the run's `train_length`): a field
  TRAINED_LENGTH that a section refuses at 0 (a scaling that needs it, not given) is set to
  the run's train_length, where its source says one, and logged."""
  paths = []
  while True:
    try:
      return config_lib.parse(raw), paths
    except fields.FieldError as e:
      path = e.field.removeprefix("config.")
      if not (train_length and path.endswith("." + TRAINED_LENGTH) and e.value == 0
              and path not in paths):
        raise
      *sections, name = path.split(".")
      node = raw
      for key in sections:
        node = node[key]
      node[name] = train_length
      paths.append(path)
      log.info("%s = %d: the run's training length (not given)", path, train_length)


def _parse(cfg: config_lib.Config, path: str, text: str):
  """The value of `text` as the type of cfg's field at `path`; a ConfigError for a field
  that does not exist, is not an evaluation's, or a text of another type."""
  keys = path.split(".")
  if keys[0] not in EVALUATED:
    raise ConfigError(f"{PREFIX}{path}: an evaluation does not read config.{keys[0]} (it "
                      f"reads {', '.join(EVALUATED)}); train a new run to change it")
  if any(path == p or path.startswith(p + ".") for p in BY_FLAGS):
    raise ConfigError(f"{PREFIX}{path}: eval.py's flags set the sampling (--temperature, "
                      "--top_k, --top_p, --min_p, --sample_seed)")
  node, hint = cfg, None
  for depth, key in enumerate(keys):
    names = ([f.name for f in dataclasses.fields(node) if fields.is_config_field(f)]
             if dataclasses.is_dataclass(node) else [])
    if key not in names:
      close = difflib.get_close_matches(key, names, n=1)
      raise ConfigError(f"{PREFIX}{path}: the run's config has no field "
                        f"{'.'.join(keys[:depth + 1])!r}"
                        + (f'. Did you mean "{close[0]}"?' if close else ""))
    hint, node = typing.get_type_hints(type(node))[key], getattr(node, key)
  if dataclasses.is_dataclass(node):
    raise ConfigError(f"{PREFIX}{path} is a section; override one of its fields: "
                      f"{', '.join(f.name for f in dataclasses.fields(node))}")
  kind = next((t for t in typing.get_args(hint) or (hint,) if t in _PARSERS), str)
  try:
    return _PARSERS[kind](text)
  except (KeyError, ValueError):
    raise ConfigError(f"{PREFIX}{path}={text}: {text!r} is not a valid {kind.__name__}"
                      ) from None


_SAFE = re.compile(r"[A-Za-z0-9._+-]*")


def suffix(applied: Mapping[str, Any]) -> str:
  """What the files of an evaluation under `applied` overrides add to their names: '' for
  none, else ',FIELD=VALUE,...' sorted, each field by its last two names
  (rotary.scaling=yarn) unless two would read alike, or ',overrides-HASH' where a value
  does not fit a file name (a path, a long list)."""
  paths = sorted(applied)
  short = {p: ".".join(p.split(".")[-2:]) for p in paths}
  if len(set(short.values())) < len(paths):
    short = {p: p for p in paths}
  text = "".join(f",{short[p]}={applied[p]}" for p in paths)
  if not paths or (_SAFE.fullmatch(text.replace(",", "").replace("=", "")) and len(text) <= 120):
    return text
  digest = hashlib.sha1(repr(sorted(applied.items())).encode()).hexdigest()[:12]
  return f",overrides-{digest}"


def describe(applied: Mapping[str, Any]) -> str:
  """The overrides as a phrase: 'none' or "model.position_settings.rotary.scaling='yarn', ..."."""
  return ", ".join(f"{path}={value!r}" for path, value in sorted(applied.items())) or "none"
