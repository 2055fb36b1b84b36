"""Sweeps: named sets of config overrides declared next to a config's get_config(), one
workdir per run under the sweep directory (the report over them: transformer/study/report.py).

A sweep config file defines `get_config()` as usual and `get_sweep()`, a list of override
dicts, usually built as `product(axis("model.position", [...]), axis("seed", [0, 1, 2]))`.
Running a sweep is idempotent: finished runs (run/state.py) are skipped, interrupted ones
resume from their checkpoints, and workers (hosts) take every num_workers-th run. A run
that fails (it diverges, or its data cannot be prepared) leaves a record in its workdir
(state.record_failure), so that every report shows it, whichever process writes it.
"""

import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import time
from collections.abc import Sequence

import ml_collections

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError, one_line
from transformer.run import checkpoint, experiment, lock, sharding
from transformer.run import config as config_lib
from transformer.run import workdir as workdir_lib
from transformer.run.progress import duration
from transformer.run.state import clear_failure, read_failure, record_failure, run_state
from transformer.run.training import train_and_evaluate
from transformer.study import sweep_record, sweep_workers

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
  ml_collections' config flags, calls get_config(ARG) and get_sweep(ARG). Whatever the
  file does wrong (get_sweep raises, or returns anything but a non-empty list of
  {dotted field: value} dicts) is a ConfigError naming the file."""
  path, _, arg = path.partition(":")
  if not os.path.isfile(path):  # a Python file: local
    raise ConfigError(f"sweep config file not found: {path}")
  spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  shown = f"{path}:{arg}" if arg else path
  args = (arg,) if arg else ()
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 - the file's own error, in one line
    raise ConfigError(f"sweep config file {shown}: {one_line(e)}") from None
  for function in ("get_config", "get_sweep"):
    if not hasattr(module, function):
      raise ConfigError(f"{path} defines no {function}(); a sweep config file defines "
                        "get_config() and get_sweep(), which returns the runs' override sets")
  calls = {}
  for function in ("get_config", "get_sweep"):
    try:
      calls[function] = getattr(module, function)(*args)
    except Exception as e:  # noqa: BLE001 - whatever the config file raises
      raise ConfigError(f"sweep config file {shown}: {function}() raised {one_line(e)}"
                        ) from None
  check_sweep(calls["get_sweep"], shown)
  return calls["get_config"], [dict(overrides) for overrides in calls["get_sweep"]]


def check_sweep(sweep, path: str) -> None:
  """A ConfigError unless `sweep` (what get_sweep() returned) is a non-empty list of
  override dicts with dotted field names as keys."""
  wanted = ("get_sweep() must return a non-empty list of override dicts "
            "({'dotted.field': value, ...}, e.g. product(axis(...), axis(...)))")
  if not isinstance(sweep, (list, tuple)):
    raise ConfigError(f"{path}: {wanted}; it returned a {type(sweep).__name__}")
  if not sweep:
    raise ConfigError(f"{path}: {wanted}; it returned an empty {type(sweep).__name__}")
  for i, overrides in enumerate(sweep):
    if not isinstance(overrides, dict):
      raise ConfigError(f"{path}: {wanted}; its item {i} is a {type(overrides).__name__}: "
                        f"{overrides!r:.60}")
    for field in overrides:
      if not isinstance(field, str) or not field:
        raise ConfigError(f"{path}: {wanted}; its item {i} has the key {field!r}, not a "
                          "dotted field name")


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


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep: its override set, its name (the workdir's) and its typed config."""

  name: str
  overrides: dict
  config: config_lib.Config
  workdir: str

  @property
  def variant(self) -> str:
    """The run's name without its seed: the runs of a variant differ only in their seed."""
    return run_name({k: v for k, v in self.overrides.items() if k != SEED})


def runs(config_path: str, sweep_dir: str, overrides: dict | None = None,
         only: Sequence[str] = ()) -> list[Run]:
  """The runs of a sweep config file, each config parsed; the ones `only` selects (see
  select). `overrides` ({dotted field: value}, e.g. from --config.train.num_steps=100)
  apply to every run; a field the sweep itself varies cannot be overridden. Runs logged to
  W&B (train.wandb_project) are grouped under the sweep directory's name unless
  train.wandb_group names another group. Two override
  sets that give the same config (the same overrides twice, in any order) or the same
  workdir name are refused: a run listed twice would be counted as two seeds."""
  base, sweep = load(config_path)
  overrides = overrides or {}
  swept = sorted({field for run in sweep for field in run} & set(overrides))
  if swept:
    raise ConfigError(f"--config.{swept[0]} is varied by the sweep itself; it cannot be "
                      f"overridden for every run (to train some of its runs: --only "
                      f"{swept[0]}=VALUE[,VALUE...])")
  base = with_overrides(base, overrides)
  out, by_config, by_name = [], {}, {}
  for i, run_overrides in enumerate(sweep):
    name = run_name(run_overrides)
    try:
      cfg = config_lib.parse(with_overrides(base, run_overrides))
    except ConfigError as e:
      raise ConfigError(f"sweep run {name}: {e}") from None
    if cfg.train.wandb_project and not cfg.train.wandb_group:  # W&B groups the sweep's runs
      group = os.path.basename(storage.absolute(sweep_dir).rstrip("/"))
      cfg = config_lib.replace(cfg, "train.wandb_group", group)
    key = json.dumps(config_lib.to_dict(cfg), sort_keys=True, default=str)
    if (seen := by_config.get(key)) is not None:
      raise ConfigError(f"{config_path}: get_sweep() lists the same run twice: item {seen} "
                        f"{sweep[seen]} and item {i} {run_overrides} give the same config; "
                        "list each run once")
    if (seen := by_name.get(name)) is not None:
      raise ConfigError(f"{config_path}: get_sweep()'s items {seen} {sweep[seen]} and {i} "
                        f"{run_overrides} would share the workdir {name}")
    by_config[key], by_name[name] = i, i
    out.append(Run(name, run_overrides, cfg, storage.join(sweep_dir, name)))
  return select(out, only)


def _matches(text: str, value) -> bool:
  """Whether --only's `text` names the swept `value`, read as a value of its type."""
  if isinstance(value, bool):
    return text.lower() in (("true", "1", "yes") if value else ("false", "0", "no"))
  if isinstance(value, (int, float)):
    try:
      return float(text) == value
    except ValueError:
      return False
  return text == str(value)


def select(all_runs: list[Run], only: Sequence[str]) -> list[Run]:
  """The runs whose override sets match every `only` filter (`field=v1,v2`: the field
  has one of these values; repeating a field adds values; `all` alone: every run). An
  unknown field or a value the sweep does not have is a ConfigError listing what the
  sweep has."""
  values: dict[str, list] = {}
  for run in all_runs:
    for field, value in run.overrides.items():
      if value not in values.setdefault(field, []):
        values[field].append(value)
  wanted: dict[str, list] = {}
  for spec in [] if list(only) == [sweep_record.ALL] else only:
    field, eq, texts = spec.partition("=")
    if not eq or not texts:
      raise ConfigError(f"--only {spec}: expected FIELD=VALUE[,VALUE...], e.g. --only "
                        f"{next(iter(values), 'seed')}=...")
    if field not in values:
      listed = "; ".join(f"{f} ({', '.join(map(str, v))})" for f, v in values.items())
      raise ConfigError(f"--only {spec}: the sweep does not vary {field!r}; it varies: {listed}")
    for text in texts.split(","):
      matched = [v for v in values[field] if _matches(text, v)]
      if not matched:
        raise ConfigError(f"--only {spec}: the sweep has no {field}={text}; its values: "
                          f"{', '.join(map(str, values[field]))}")
      wanted.setdefault(field, []).extend(matched)
  selected = [run for run in all_runs if all(
      field in run.overrides and run.overrides[field] in allowed
      for field, allowed in wanted.items())]
  if not selected:
    raise ConfigError(f"--only {' --only '.join(only)}: no run of the sweep has all of these")
  return selected


def plan(config_path: str, sweep_dir: str, overrides: dict | None = None,
         only: Sequence[str] = ()) -> list[tuple[str, config_lib.Config, str]]:
  """(name, typed config, workdir) of every selected run of the sweep (runs), each config
  checked whole (experiment.build) and against its workdir (a workdir holding another
  run is refused): a bad value, override or workdir fails here, before anything trains."""
  planned = []
  for run in runs(config_path, sweep_dir, overrides, only):
    try:
      experiment.build(run.config, run.workdir, announce=False)  # each run says it when it runs
      workdir_lib.check_usable(run.workdir)
      workdir_lib.check_identity(run.config, run.workdir, checkpoint.has_checkpoints(run.workdir))
    except ConfigError as e:
      raise ConfigError(f"sweep run {run.name}: {e}") from None
    planned.append((run.name, run.config, run.workdir))
  return planned


def run(config_path: str, sweep_dir: str, worker: int = 0, num_workers: int = 1,
        should_stop=lambda: False, overrides: dict | None = None, only: Sequence[str] = ()
        ) -> tuple[list[str], dict[str, str]]:
  """Runs this worker's share (every num_workers-th run) of the sweep's runs that `only`
  selects, after checking them all (plan). A run another process is training is skipped;
  a run that fails (RunError: it diverged; ConfigError: e.g. its data cannot be prepared)
  is recorded (record_failure) and the sweep goes on. Stops after the current run once
  should_stop() is true. With several processes (jax.distributed) every process walks the
  same runs in the same order and each run spans them all. Logs each run's place in the
  share and, from the runs trained to the end here, an ETA for the rest. Records the
  invocation in sweep_dir (sweep_record.write) once the runs are checked. Returns (names
  trained, {name: error} failed)."""
  sweep_workers.assignment(worker, num_workers, {})  # a ConfigError for a worker out of range
  share = plan(config_path, sweep_dir, overrides, only)[worker::num_workers]
  todo = [not run_state(w, cfg.train.num_steps).finished for _, cfg, w in share]  # for the ETA
  # how these runs were asked for, for the later invocations (study/sweep_record.py)
  sweep_record.write(sweep_dir, sweep_record.Invocation(config_path, dict(overrides or {}),
                                                        tuple(only)))
  of = f" of worker {worker}/{num_workers}" if num_workers > 1 else ""
  trained, failed, durations = [], {}, []
  for i, (name, cfg, workdir) in enumerate(share):
    if should_stop():
      break
    place = f"run {i + 1}/{len(share)}{of}"
    if sharding.process0_decides(run_state(workdir, cfg.train.num_steps).finished):
      log.info("sweep: %s: %s is finished; skipped", place, name)
      continue
    eta = (f" | {len(durations)} run(s) trained in {duration(sum(durations))}, ETA "
           f"{duration(sum(durations) / len(durations) * sum(todo[i:]))} for "
           f"{sum(todo[i:])} left" if durations else "")
    before = read_failure(workdir)
    again = f" (it failed before: {before['error']:.200}; trying again)" if before else ""
    log.info("sweep: %s: training %s%s%s", place, name, again, eta)
    started = time.time()
    try:
      step = train_and_evaluate(cfg, workdir, should_stop)
    except lock.Locked as e:
      log.info("sweep: %s skipped: %s", name, e)
      continue
    except (RunError, ConfigError) as e:  # a ConfigError here: found once the run started
      log.error("sweep: %s failed: %s", name, e)
      record_failure(workdir, e)
      failed[name] = str(e)
      continue
    if step == cfg.train.num_steps:  # not stopped part-way
      clear_failure(workdir)
      durations.append(time.time() - started)
    trained.append(name)
  return trained, failed
