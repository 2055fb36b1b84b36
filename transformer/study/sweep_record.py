"""How a sweep directory's runs were asked for, so that a later invocation cannot describe
other runs under the same names (a `--report_only` without the first invocation's
`--config.train.num_steps=100` would judge every run against the config file's steps).

An invocation that trains writes SWEEP_DIR/sweep.json (RECORD_FILE): the sweep config file
(absolute, with its :ARG), the --config.FIELD=VALUE overrides of every run and its --only
selection. A later invocation (a re-run, a worker, --report_only, --print_commands,
--eval_sweep) that leaves them out runs with the recorded ones (resolve). What defines the
runs must match: another config file or other overrides are refused in one line (they
would give other configs the same workdir names). --only selects among the same runs: given
again it replaces the recorded selection, and `--only all` selects every run.
"""

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence

import jax
from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError

RECORD_FILE = "sweep.json"
ALL = "all"  # --only all: every run of the sweep


@dataclasses.dataclass(frozen=True)
class Invocation:
  """What selects and defines a sweep's runs: the config file as given (`config`, with
  :ARG), the overrides of every run ({dotted field: value}) and the --only specs (none:
  every run)."""

  config: str
  overrides: dict
  only: tuple[str, ...] = ()

  def flags(self) -> list[str]:
    """The command-line flags that give this invocation."""
    return (["--config", self.config]
            + [f"--config.{field}={value}" for field, value in self.overrides.items()]
            + [f"--only={spec}" for spec in self.only])


def _file(config: str) -> tuple[str, str]:
  """(the config file's absolute real path, its :ARG) of a --config value."""
  path, _, arg = config.partition(":")
  return os.path.realpath(path), arg


def _same_values(a: Mapping, b: Mapping) -> bool:
  """Whether two override dicts give the same values, as JSON reads them back."""
  return json.loads(json.dumps(dict(a), default=str)) == json.loads(json.dumps(dict(b),
                                                                               default=str))


def path(sweep_dir: str) -> str:
  return storage.join(sweep_dir, RECORD_FILE)


def read(sweep_dir: str) -> Invocation | None:
  """The invocation recorded in sweep_dir, or None; a ConfigError naming the file if it
  cannot be read as one."""
  file = path(sweep_dir)
  try:
    text = storage.read_text(file)
  except FileNotFoundError:
    return None
  except OSError as e:
    raise ConfigError(f"{file} (how the sweep was run) cannot be read: {e.strerror}") from None
  try:
    record = json.loads(text)
    invocation = Invocation(record["config"], dict(record["overrides"]),
                            tuple(record["only"]))
    if not (isinstance(invocation.config, str) and all(isinstance(s, str)
                                                       for s in invocation.only)):
      raise TypeError("a value of another type")
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f"{file} (how the sweep was run) is damaged ({type(e).__name__}: {e}); "
                      "remove it, and give the sweep's flags again") from None
  return invocation


def resolve(sweep_dir: str, config: str | None, overrides: Mapping | None,
            only: Sequence[str]) -> tuple[Invocation, bool]:
  """(the invocation to run, whether the record supplied part of it) from the flags given
  (config None, overrides empty, only empty: not given) and the record in sweep_dir (module
  docstring). A ConfigError when the flags would describe other runs than the recorded
  ones, or nothing names the config file."""
  recorded = read(sweep_dir)
  only = tuple(only)
  if ALL in only and only != (ALL,):
    raise ConfigError(f"--only {ALL} selects every run; it takes no other --only")
  if recorded is None:
    if config is None:
      raise ConfigError(f"--config FILE is required: {path(sweep_dir)} does not exist (no "
                        "invocation has trained in this sweep directory yet)")
    return Invocation(config, dict(overrides or {}), () if only == (ALL,) else only), False
  differs = []
  if config is not None and _file(config) != _file(recorded.config):
    differs.append(f"--config {config}")
  if overrides and not _same_values(overrides, recorded.overrides):
    differs.append(" ".join(f"--config.{k}={v}" for k, v in overrides.items()))
  if differs:
    before = " ".join(Invocation(recorded.config, recorded.overrides).flags())
    raise ConfigError(
        f"--sweep_dir {sweep_dir} holds the runs of `{before}` (recorded in "
        f"{path(sweep_dir)}); {' and '.join(differs)} would describe other runs under the "
        "same names: give the recorded flags (or leave them out: they apply), or another "
        f"--sweep_dir (a config file that only moved: remove {path(sweep_dir)})")
  supplied = (config is None or not overrides and bool(recorded.overrides)
              or not only and bool(recorded.only))
  chosen = (() if only == (ALL,) else only) if only else recorded.only
  return Invocation(recorded.config if config is None else config, dict(recorded.overrides),
                    chosen), supplied


def write(sweep_dir: str, invocation: Invocation) -> None:
  """Records `invocation` in sweep_dir (process 0): its config file by absolute path, so
  that an invocation from another directory finds it."""
  if jax.process_index() != 0:
    return
  file, arg = _file(invocation.config)
  epath.Path(sweep_dir).mkdir(parents=True, exist_ok=True)
  storage.write(path(sweep_dir), json.dumps({
      "config": file + (f":{arg}" if arg else ""), "overrides": invocation.overrides,
      "only": list(invocation.only), "written": time.strftime("%Y-%m-%d %H:%M:%S")},
      indent=2, default=str) + "\n")
