"""The persistent compilation cache of the CLIs (transformer/run/compile_cache.py): where it
is, that a second identical run compiles nothing (it loads every program from the cache,
which the counters of compilations prove, not a timing) and gets bit-identical results, that
a run of another seed compiles nothing either, and that --nocompilation_cache compiles
everything and writes nothing."""

import json
import os
import re

import pytest

from tests.clirun import CliRunner
from tests.support import TINY_FLAGS
from transformer.run import compile_cache


def test_the_cache_directory_is_the_users_choice_else_a_user_cache_directory():
  home = os.path.expanduser("~")
  assert compile_cache.directory({}) == f"{home}/.cache/transformer-ablations/jax"
  assert compile_cache.directory({"XDG_CACHE_HOME": "/x"}) == "/x/transformer-ablations/jax"
  assert compile_cache.directory({"XDG_CACHE_HOME": "/x", "JAX_COMPILATION_CACHE_DIR": "/j"}
                                 ) == "/j"


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


def _compilations(workdir) -> tuple[int, int]:
  """(compiled, loaded) of the last run in workdir, from its log (training.py)."""
  text = open(os.path.join(workdir, "train.log")).read()
  found = re.findall(r"compilation: (\d+) program\(s\) compiled, (\d+) loaded", text)
  return tuple(map(int, found[-1]))


def _records(workdir) -> list[dict]:
  """metrics.jsonl less its timings."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items()
             if k not in ("tokens_per_sec", "ms_per_step")} for line in f]


def test_a_second_identical_run_loads_every_program_and_gets_the_same_results(cli, tmp_path):
  cache = tmp_path / "cache"
  env = {"JAX_COMPILATION_CACHE_DIR": str(cache),  # this test's own, empty
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # tiny programs compile fast
  args = ["--config", "configs/default.py", *TINY_FLAGS, "--config.train.num_steps=10"]
  first = cli.run("train.py", *args, "--workdir", str(tmp_path / "a"), env=env)
  assert first.returncode == 0, first.stderr
  compiled, loaded = _compilations(tmp_path / "a")
  assert compiled >= 5 and loaded == 0, (compiled, loaded)  # init, step, evaluation's
  assert "compiled the train step in" in first.stdout
  entries = {p.name for p in cache.iterdir()}

  second = cli.run("train.py", *args, "--workdir", str(tmp_path / "b"), env=env)
  assert second.returncode == 0, second.stderr
  assert _compilations(tmp_path / "b") == (0, compiled)
  assert "loaded the train step from the compilation cache in" in second.stdout
  assert {p.name for p in cache.iterdir()} == entries  # nothing new to keep
  assert _records(tmp_path / "b") == _records(tmp_path / "a")  # the same executables

  # another seed (a sweep's next run) runs the same programs: the seed is their argument
  seeded = cli.run("train.py", *args, "--workdir", str(tmp_path / "s"), "--config.seed=1",
                   env=env)
  assert seeded.returncode == 0, seeded.stderr
  assert _compilations(tmp_path / "s") == (0, compiled)
  assert _records(tmp_path / "s") != _records(tmp_path / "a")  # another initialisation

  off = cli.run("train.py", *args, "--workdir", str(tmp_path / "c"), "--nocompilation_cache",
                env=env)
  assert off.returncode == 0, off.stderr
  assert _compilations(tmp_path / "c") == (compiled, 0)
  assert {p.name for p in cache.iterdir()} == entries
  assert _records(tmp_path / "c") == _records(tmp_path / "a")
