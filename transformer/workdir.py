"""The workdir of a run: its resolved config, metrics log and (checkpoint.py) checkpoints."""

import json
import os

import jax
import ml_collections

from transformer.registry import ConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def _flatten(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def prepare(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes the resolved config; refuses a workdir whose run has another model or task."""
  path = os.path.join(workdir, CONFIG_FILE)
  resolved = json.loads(config.to_json_best_effort())
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    for section in ("data", "task", "model"):
      new, old = _flatten(resolved.get(section, {})), _flatten(saved.get(section, {}))
      changed = sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))
      if changed:
        raise ConfigError(
            f"workdir {workdir} holds a run with a different config.{section} "
            f"(differs in: {', '.join(changed)}); use a new --workdir")
  os.makedirs(workdir, exist_ok=True)
  if jax.process_index() == 0:
    with open(path + ".tmp", "w") as f:
      json.dump(resolved, f, indent=2)
    os.replace(path + ".tmp", path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise ConfigError(f"{workdir} has no {CONFIG_FILE}: not a training workdir")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def append_metrics(workdir: str, record: dict) -> None:
  if jax.process_index() == 0:
    with open(os.path.join(workdir, METRICS_FILE), "a") as f:
      f.write(json.dumps(record) + "\n")
