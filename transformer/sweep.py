"""Sweeps: named sets of config overrides declared next to a config's get_config(), one
workdir per run under the sweep directory (the report over them: transformer/report.py).

A sweep config file defines `get_config()` as usual and `get_sweep()`, a list of override
dicts, usually built as `product(axis("model.position", [...]), axis("seed", [0, 1, 2]))`.
Running a sweep is idempotent: finished runs are skipped, interrupted ones resume from
their checkpoints, and workers (hosts) take every num_workers-th run.
"""

import importlib.util
import itertools
import logging
import os

import ml_collections

from transformer import checkpoint, config as config_lib, experiment, lock, sharding, storage
from transformer import workdir as workdir_lib
from transformer.errors import ConfigError, RunError
from transformer.training import train_and_evaluate

log = logging.getLogger("transformer")
SEED = "seed"


def axis(field: str, values) -> list[dict]:
  """One override set per value of a config field (dotted path)."""
  return [{field: value} for value in values]


def product(*axes: list[dict]) -> list[dict]:
  """Every combination of one override set from each axis."""
  return [dict(itertools.chain.from_iterable(d.items() for d in combo))
          for combo in itertools.product(*axes)]


def run_name(overrides: dict) -> str:
  """A readable, filesystem-safe directory name: `model.position=rotary,seed=1`."""
  return ",".join(f"{k}={v}" for k, v in overrides.items()).replace("/", "_") or "base"


def load(path: str) -> tuple[ml_collections.ConfigDict, list[dict]]:
  """(base config, override sets) of a sweep config file. `file.py:ARG`, as with
  ml_collections' config flags, calls get_config(ARG) and get_sweep(ARG)."""
  path, _, arg = path.partition(":")
  if not os.path.isfile(path):  # a Python file: local
    raise ConfigError(f"sweep config file not found: {path}")
  spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ConfigError(f"{path} defines no get_sweep(); a sweep config returns its override sets")
  args = (arg,) if arg else ()
  return module.get_config(*args), module.get_sweep(*args)


def with_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(config.to_dict())  # a copy, type-checked on assignment
  for field, value in overrides.items():
    *sections, name = field.split(".")
    node = config
    for section in sections:
      node = node.get(section) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      raise ConfigError(f"sweep override {field}={value!r}: the config has no field {field!r}")
    try:
      node[name] = value
    except TypeError as e:  # ConfigDict keeps each field's type
      raise ConfigError(f"sweep override {field}={value!r}: {e}") from None
  return config


def is_finished(workdir: str, num_steps: int) -> bool:
  """Whether the run trained to num_steps and its final evaluation is recorded."""
  if checkpoint.steps(workdir)[-1:] != [num_steps]:
    return False
  return any(r["step"] == num_steps and r["split"] != "train"
             for r in workdir_lib.read_metrics(workdir))


def plan(config_path: str, sweep_dir: str, overrides: dict | None = None
         ) -> list[tuple[str, config_lib.Config, str]]:
  """(name, typed config, workdir) of every run of the sweep, each config checked whole
  (config.parse, experiment.build): a bad value or override fails here, before anything
  trains.
  `overrides` ({dotted field: value}, e.g. from --config.train.num_steps=100) apply to
  every run; a field the sweep itself varies cannot be overridden."""
  base, sweep = load(config_path)
  overrides = overrides or {}
  swept = sorted({field for run in sweep for field in run} & set(overrides))
  if swept:
    raise ConfigError(f"--config.{swept[0]} is varied by the sweep itself; it cannot be "
                      "overridden for every run")
  base = with_overrides(base, overrides)
  runs = []
  for run_overrides in sweep:
    name = run_name(run_overrides)
    workdir = storage.join(sweep_dir, name)
    try:
      cfg = config_lib.parse(with_overrides(base, run_overrides))
      experiment.build(cfg, workdir)
    except ConfigError as e:
      raise ConfigError(f"sweep run {name}: {e}") from None
    runs.append((name, cfg, workdir))
  return runs


def run(config_path: str, sweep_dir: str, worker: int = 0, num_workers: int = 1,
        should_stop=lambda: False, overrides: dict | None = None
        ) -> tuple[list[str], dict[str, str]]:
  """Runs this worker's share (every num_workers-th run) of the sweep after checking every
  run (plan). A run another process is training is skipped; a run that fails (RunError:
  it diverged) is reported and the sweep goes on. Stops after the current run once
  should_stop() is true. With several processes (jax.distributed) every process walks the
  same runs in the same order and each run spans them all. Returns (names trained,
  {name: error} failed)."""
  if not 0 <= worker < num_workers:
    raise ConfigError(f"--worker must be in 0..{num_workers - 1}, got {worker}")
  runs = plan(config_path, sweep_dir, overrides)
  trained, failed = [], {}
  for name, cfg, workdir in runs[worker::num_workers]:
    if should_stop():
      break
    if sharding.process0_decides(is_finished(workdir, cfg.train.num_steps)):
      log.info("sweep: %s is finished; skipped", name)
      continue
    log.info("sweep: training %s", name)
    try:
      train_and_evaluate(cfg, workdir, should_stop)
    except lock.Locked as e:
      log.info("sweep: %s skipped: %s", name, e)
      continue
    except RunError as e:
      log.error("sweep: %s failed: %s", name, e)
      failed[name] = str(e)
      continue
    trained.append(name)
  return trained, failed
