"""Sweeps: override sets, an interrupted sweep finishing without redoing finished runs, the
report's mean ± std over seeds, worker sharding, shipped sweep configs."""

import csv
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from transformer import report, sweep
from transformer.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWEEP_CONFIG = """
from tests.conftest import make_tiny_config
from transformer.sweep import axis, product

def get_config():
  return make_tiny_config(**{"train.num_steps": 30, "train.checkpoint_every": 10})

def get_sweep():
  return product(axis("model.position", ["sinusoidal", "rotary"]), axis("seed", [0, 1]))
"""


def test_product_and_names():
  runs = sweep.product(sweep.axis("model.position", ["none", "rotary"]), sweep.axis("seed", [0, 1]))
  assert runs == [{"model.position": "none", "seed": 0}, {"model.position": "none", "seed": 1},
                  {"model.position": "rotary", "seed": 0}, {"model.position": "rotary", "seed": 1}]
  assert sweep.run_name(runs[3]) == "model.position=rotary,seed=1"


def test_bad_override_names_the_field(tiny_config):
  with pytest.raises(ConfigError, match=r"sweep override model.positon='rotary': the config has "
                                        r"no field 'model.positon'"):
    sweep.with_overrides(tiny_config(), {"model.positon": "rotary"})
  with pytest.raises(ConfigError, match="the config has no field 'modle.position'"):
    sweep.with_overrides(tiny_config(), {"modle.position": "rotary"})


def test_killed_sweep_finishes_without_redoing_finished_runs(tmp_path):
  config_path, sweep_dir = tmp_path / "tiny_sweep.py", tmp_path / "sweep"
  config_path.write_text(SWEEP_CONFIG)
  command = [sys.executable, "sweep.py", "--config", str(config_path), "--sweep_dir", str(sweep_dir)]
  first = sweep_dir / "model.position=sinusoidal,seed=0"
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  deadline = time.time() + 300
  while not sweep.is_finished(str(first), 30) and time.time() < deadline and proc.poll() is None:
    time.sleep(0.5)
  proc.kill()  # SIGKILL mid-sweep: the second run has started or is starting
  proc.communicate(timeout=120)
  assert sweep.is_finished(str(first), 30)
  finished_at = os.path.getmtime(first / "metrics.jsonl")

  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "model.position=sinusoidal,seed=0 is finished; skipped" in done.stdout
  assert os.path.getmtime(first / "metrics.jsonl") == finished_at  # not redone
  for name in ("sinusoidal,seed=0", "sinusoidal,seed=1", "rotary,seed=0", "rotary,seed=1"):
    assert sweep.is_finished(str(sweep_dir / f"model.position={name}"), 30)

  with open(sweep_dir / "report.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  assert set(rows) == {"model.position=sinusoidal", "model.position=rotary"}
  exact = [report.final_metrics(str(sweep_dir / f"model.position=rotary,seed={s}"))["valid"]
           ["exact_match"] for s in (0, 1)]
  row = rows["model.position=rotary"]
  assert row["seeds"] == "2"
  np.testing.assert_allclose(float(row["valid/exact_match mean"]), np.mean(exact))
  np.testing.assert_allclose(float(row["valid/exact_match std"]), np.std(exact))
  assert "| model.position=rotary | 2 |" in (sweep_dir / "report.md").read_text()
  for picture in ("curves.png", "final.png", "extrapolation.png"):
    assert (sweep_dir / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  final = report.final_metrics(str(first))  # exact match per length, training and longer ones
  assert {"3", "4", "5"} <= set(final["valid"]["exact_match_by_length"]) <= {"1", "2", "3", "4", "5"}
  assert set(final["longer"]["exact_match_by_length"]) == {"6", "7"}

  shutil.rmtree(sweep_dir / "model.position=rotary,seed=1")  # one seed: no spread is shown
  report.write(str(config_path), str(sweep_dir))
  row = next(r for r in (sweep_dir / "report.md").read_text().splitlines() if "rotary" in r)
  assert row.startswith("| model.position=rotary | 1 | ") and "±" not in row
  assert f"{exact[0]:.4f}" in row


def test_workers_split_the_runs_and_commands_are_printed(tmp_path):
  config_path = tmp_path / "tiny_sweep.py"
  config_path.write_text(SWEEP_CONFIG)
  out = subprocess.run([sys.executable, "sweep.py", "--config", str(config_path), "--sweep_dir",
                        "D", "--num_workers=3", "--print_commands"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120).stdout.splitlines()
  assert len(out) == 3 and out[2].endswith("--num_workers=3 --worker=2")
  _, runs = sweep.load(str(config_path))
  shares = [runs[w::3] for w in range(3)]
  assert sorted(map(sweep.run_name, sum(shares, []))) == sorted(map(sweep.run_name, runs))


@pytest.mark.parametrize("name,count", [("positions", 27), ("scorers", 15), ("heads", 12),
                                        ("heads.py:gpu", 12), ("heads.py:cpu", 4)])
def test_shipped_sweeps_build_every_run(name, count):
  base, runs = sweep.load(os.path.join(ROOT, "configs", name if ".py" in name else f"{name}.py"))
  assert len(runs) == count and len({sweep.run_name(r) for r in runs}) == count
  for overrides in runs:
    sweep.with_overrides(base, overrides)
  if name == "positions":
    assert base.task.longer_max_len == 2 * base.task.max_len
  if name.startswith("heads"):  # fixed d_model, d_k = d_model / heads
    assert {r["model.num_heads"] for r in runs} == {1, 2, 4, 8}
    assert base.model.d_model == (128 if name.endswith(":cpu") else 256)
    assert base.model.dtype == ("bfloat16" if name.endswith(":gpu") else "float32")


def test_sweep_argument_is_checked():
  with pytest.raises(ConfigError, match="unknown heads sweep size 'tpu'; choose one of: cpu, full, gpu"):
    sweep.load(os.path.join(ROOT, "configs", "heads.py:tpu"))
