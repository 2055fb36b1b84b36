"""The workdir of a run: its resolved config, metrics log and (checkpoint.py) checkpoints.

A workdir holds one run. Its identity is what its parameters mean: the data, task and
model sections (with the settings of the chosen scorer and encoding only), less the
execution choices that change how the model is computed or where the data lives
(EXECUTION_FIELDS), which may differ when a run is resumed or evaluated elsewhere. A workdir with no checkpoint yet holds no run: a corrected config replaces its
config.json.
"""

import json

import jax
import ml_collections
from etils import epath

from transformer import experiment, storage
from transformer.errors import ConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
IDENTITY_SECTIONS = ("data", "task", "model")
EXECUTION_FIELDS = frozenset({
    "model.dtype", "model.remat", "model.scan_layers", "model.attention.kernel",
    "model.attention.block_size", "data.dir", "data.tfds_dir", "data.cache_dir"})


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def check_usable(workdir: str) -> None:
  """A ConfigError if `workdir` cannot be a workdir: a file, or not creatable/writable."""
  if epath.Path(workdir).exists() and not epath.Path(workdir).is_dir():
    raise ConfigError(f"--workdir {workdir} is a file, not a directory")
  problem = storage.writable_directory(workdir)
  if problem:
    raise ConfigError(f"--workdir {workdir}: {problem}")


def _identity(config: dict) -> dict:
  """The config's identity sections, its model section in today's layout (older runs'
  configs migrated) with only the chosen scorer's and encoding's settings: the knobs of
  entries the run does not use do not change its model."""
  model = experiment.migrate_model(config.get("model", {}))
  attention = model.get("attention", {})
  chosen = lambda sections, key: {k: v for k, v in sections.items() if k == key}  # noqa: E731
  model = {**model, "position_settings": chosen(model.get("position_settings", {}),
                                                model.get("position")),
           "attention": {**attention, "score_settings": chosen(
               attention.get("score_settings", {}), attention.get("score"))}}
  return {**config, "model": model}


def check_identity(config: ml_collections.ConfigDict, workdir: str, has_checkpoints: bool) -> None:
  """Refuses (ConfigError) a config whose identity differs from the run in `workdir`'s.
  Fields missing from the saved config were added to the code since the run began."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not has_checkpoints or not path.exists():
    return
  saved = _identity(json.loads(path.read_text()))
  resolved = _identity(json.loads(config.to_json_best_effort()))
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
    storage.write(storage.join(workdir, CONFIG_FILE), config.to_json_best_effort(indent=2))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise ConfigError(f"{workdir} has no {CONFIG_FILE}: not a training workdir")
  return ml_collections.ConfigDict(json.loads(path.read_text()))


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


def append_metrics(workdir: str, record: dict) -> None:
  if jax.process_index() == 0:
    storage.append(storage.join(workdir, METRICS_FILE), json.dumps(record) + "\n")


def truncate_metrics(workdir: str, step: int) -> None:
  """Drops the records after `step` (process 0): on resuming from the checkpoint at `step`
  those steps are trained again and logged anew, so each step is recorded once."""
  kept = [r for r in read_metrics(workdir) if r["step"] <= step]
  if jax.process_index() == 0 and len(kept) < len(_metric_lines(workdir)):
    storage.write(storage.join(workdir, METRICS_FILE),
                  "".join(json.dumps(r) + "\n" for r in kept))
