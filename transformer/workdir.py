"""The workdir of a run: its resolved config, metrics log and (checkpoint.py) checkpoints.

A workdir holds one run. Its identity is what its parameters mean: the data, task and
model sections, less the execution choices that change how the model is computed or where
the data lives (EXECUTION_FIELDS), which may differ when a run is resumed or evaluated
elsewhere. A workdir with no checkpoint yet holds no run: a corrected config replaces its
config.json.
"""

import json
import os

import jax
import ml_collections

from transformer.registry import ConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
IDENTITY_SECTIONS = ("data", "task", "model")
EXECUTION_FIELDS = frozenset({
    "model.dtype", "model.remat", "model.scan_layers", "model.attention.kernel",
    "model.attention.block_size", "data.dir", "data.tfds_dir"})


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def write_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file, so readers never see half of it."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def check_usable(workdir: str) -> None:
  """A ConfigError if `workdir` cannot be a workdir: a file, or not creatable/writable."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f"--workdir {workdir} is a file, not a directory")
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f"--workdir {workdir}: {existing} is a file, not a directory")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f"--workdir {workdir}: {existing} is not writable")


def check_identity(config: ml_collections.ConfigDict, workdir: str, has_checkpoints: bool) -> None:
  """Refuses (ConfigError) a config whose identity differs from the run in `workdir`'s.
  Fields missing from the saved config were added to the code since the run began."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not has_checkpoints or not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  resolved = json.loads(config.to_json_best_effort())
  for section in IDENTITY_SECTIONS:
    new, old = _flatten(resolved.get(section, {})), _flatten(saved.get(section, {}))
    changed = sorted(k for k in old if new.get(k) != old[k]
                     and f"{section}.{k}" not in EXECUTION_FIELDS)
    if changed:
      raise ConfigError(
          f"workdir {workdir} holds a run with a different config.{section} "
          f"(differs in: {', '.join(changed)}); use a new --workdir")


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes the resolved config (process 0)."""
  if jax.process_index() == 0:
    write_atomically(os.path.join(workdir, CONFIG_FILE), config.to_json_best_effort(indent=2))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise ConfigError(f"{workdir} has no {CONFIG_FILE}: not a training workdir")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def read_metrics(workdir: str) -> list[dict]:
  """The records of metrics.jsonl; a line cut short by a killed process is skipped."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except ValueError:
        continue
  return records


def append_metrics(workdir: str, record: dict) -> None:
  if jax.process_index() == 0:
    with open(os.path.join(workdir, METRICS_FILE), "a") as f:
      f.write(json.dumps(record) + "\n")


def truncate_metrics(workdir: str, step: int) -> None:
  """Drops the records after `step` (process 0): on resuming from the checkpoint at `step`
  those steps are trained again and logged anew, so each step is recorded once."""
  path = os.path.join(workdir, METRICS_FILE)
  records = read_metrics(workdir)
  kept = [r for r in records if r["step"] <= step]
  lines = sum(1 for _ in open(path)) if os.path.exists(path) else 0
  if jax.process_index() == 0 and len(kept) < lines:
    write_atomically(os.path.join(workdir, METRICS_FILE),
                     "".join(json.dumps(r) + "\n" for r in kept))
