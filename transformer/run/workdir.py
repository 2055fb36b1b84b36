"""The workdir of a run: its resolved config, metrics log and (checkpoint.py) checkpoints.

A workdir holds one run. Its identity is what its parameters mean: the identity fields of
its typed config (config.Config, fields.identity; execution fields such as the kernel, the
dtype or where the data lives may differ when a run is resumed or evaluated elsewhere). A
workdir with no checkpoint yet holds no run: a corrected config replaces its config.json.
"""

import json

import jax
from etils import epath

from transformer.core import fields, storage
from transformer.core.errors import ConfigError
from transformer.run import config as config_lib

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def flatten(d: dict, prefix: str = "") -> dict:
  """{dotted path: value} of a nested dict (a config as config.to_dict gives it)."""
  out = {}
  for k, v in d.items():
    out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def check_usable(workdir: str) -> None:
  """A ConfigError if `workdir` cannot be a workdir: a file, or not creatable/writable."""
  if epath.Path(workdir).exists() and not epath.Path(workdir).is_dir():
    raise ConfigError(f"--workdir {workdir} is a file, not a directory")
  problem = storage.writable_directory(workdir)
  if problem:
    raise ConfigError(f"--workdir {workdir}: {problem}")


def check_identity(cfg: config_lib.Config, workdir: str, has_checkpoints: bool) -> None:
  """Refuses (ConfigError) a config whose identity differs from the run in `workdir`'s.
  A field missing from the saved config (added to the code since the run began) is compared
  at the value its parse gives it: the default, or the legacy value a field declares, means
  what the run did before the field existed (an old rotary run rotated every dimension, and
  resuming it with model.position_settings.rotary.rotated_fraction=0.5 is another model)."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not has_checkpoints or not path.exists():
    return
  saved = fields.identity(saved_config(workdir))
  new = fields.identity(cfg)
  changed = [k for k in saved if new.get(k) != saved[k]]
  if changed:
    section = min((k.split(".")[0] for k in changed), key=config_lib.SECTIONS.index)
    fields_changed = sorted(k.split(".", 1)[1] for k in changed if k.startswith(section + "."))
    raise ConfigError(f"workdir {workdir} holds a run with a different config.{section} "
                      f"(differs in: {', '.join(fields_changed)}); use a new --workdir")


def write_config(cfg: config_lib.Config, workdir: str) -> None:
  """Writes the resolved config (process 0)."""
  if jax.process_index() == 0:
    storage.write(storage.join(workdir, CONFIG_FILE),
                  json.dumps(config_lib.to_dict(cfg), indent=2))


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def load_config(workdir: str) -> dict:
  """The saved config of the run in `workdir`, as written (saved_config makes it typed); a
  ConfigError naming the file if it is missing, not JSON (cut short, garbled) or not a
  JSON object."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise ConfigError(f"{workdir} has no {CONFIG_FILE}: not a training workdir")
  damaged = ("the run's saved config is damaged; restore it from a copy, or train into a "
             "new --workdir")
  try:
    raw = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                      f"{e.colno}): {damaged}") from None
  except ValueError as e:  # not UTF-8
    raise ConfigError(f"{path} is not JSON text ({type(e).__name__}): {damaged}") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{path} holds {_JSON_KINDS.get(type(raw), 'a JSON value')}, not a "
                      f"config (an object of sections: {', '.join(config_lib.SECTIONS)}): "
                      f"{damaged}")
  return raw


def saved_config(workdir: str) -> config_lib.Config:
  """The typed config of the run in `workdir` (load_config, config.parse); a ConfigError
  naming the file for a value that does not parse."""
  return _parse_saved(load_config(workdir), workdir)


def _parse_saved(raw: dict, workdir: str) -> config_lib.Config:
  try:
    return config_lib.parse(raw, saved=True)
  except ConfigError as e:
    raise ConfigError(f"{epath.Path(workdir) / CONFIG_FILE} (the run's saved config): "
                      f"{e}") from None


def _metric_lines(workdir: str) -> list[str]:
  path = epath.Path(workdir) / METRICS_FILE
  return path.read_text().splitlines() if path.exists() else []


def read_metrics(workdir: str) -> list[dict]:
  """The records of metrics.jsonl; a line cut short by a killed process is skipped."""
  records = []
  for line in _metric_lines(workdir):
    try:
      records.append(json.loads(line))
    except ValueError:
      continue
  return records


def has_evaluation(workdir: str, step: int) -> bool:
  """Whether the run's metrics record a held-out evaluation at `step`."""
  return any(r["step"] == step and r["split"] != "train" for r in read_metrics(workdir))


def append_metrics(workdir: str, *records: dict) -> None:
  """Appends the records in one write (process 0): the records of one evaluation, a split
  each, are there together or not at all, so a run killed in between is not taken for
  one whose final evaluation is recorded."""
  if jax.process_index() == 0:
    storage.append(storage.join(workdir, METRICS_FILE),
                   "".join(json.dumps(record) + "\n" for record in records))


def truncate_metrics(workdir: str, step: int) -> None:
  """Drops the records after `step` (process 0): on resuming from the checkpoint at `step`
  those steps are trained again and logged anew, so each step is recorded once."""
  kept = [r for r in read_metrics(workdir) if r["step"] <= step]
  if jax.process_index() == 0 and len(kept) < len(_metric_lines(workdir)):
    storage.write(storage.join(workdir, METRICS_FILE),
                  "".join(json.dumps(r) + "\n" for r in kept))
