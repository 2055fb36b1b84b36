"""Sweeps: override sets, an interrupted sweep finishing without redoing finished runs, the
report's mean ± std over seeds and its record of runs without results (failed, not trained),
duplicate runs refused, --only, progress lines, worker sharding, shipped sweep configs."""

import csv
import itertools
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.clirun import CliRunner
from tests.conftest import make_tiny_config
from transformer.core.errors import ConfigError
from transformer.data.sources import SOURCES
from transformer.run.state import read_failure, run_state
from transformer.study import report, report_plots, results, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWEEP_CONFIG = """
from tests.conftest import make_tiny_config
from transformer.study.sweep import axis, product

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
  command = [sys.executable, "sweep.py", "--config", str(config_path), "--sweep_dir",
             str(sweep_dir)]
  first = sweep_dir / "model.position=sinusoidal,seed=0"
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  deadline = time.time() + 300
  while not run_state(str(first), 30).finished and time.time() < deadline and proc.poll() is None:
    time.sleep(0.5)
  proc.kill()  # SIGKILL mid-sweep: the second run has started or is starting
  proc.communicate(timeout=120)
  assert run_state(str(first), 30).finished
  finished_at = os.path.getmtime(first / "metrics.jsonl")

  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert "model.position=sinusoidal,seed=0 is finished; skipped" in done.stdout
  assert os.path.getmtime(first / "metrics.jsonl") == finished_at  # not redone
  for name in ("sinusoidal,seed=0", "sinusoidal,seed=1", "rotary,seed=0", "rotary,seed=1"):
    assert run_state(str(sweep_dir / f"model.position={name}"), 30).finished

  with open(sweep_dir / "report.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  assert set(rows) == {"model.position=sinusoidal", "model.position=rotary"}
  exact = [run_state(str(sweep_dir / f"model.position=rotary,seed={s}"), 30).final["valid"]
           ["exact_match"] for s in (0, 1)]
  row = rows["model.position=rotary"]
  assert row["seeds"] == "2"
  np.testing.assert_allclose(float(row["valid/exact_match mean"]), np.mean(exact))
  np.testing.assert_allclose(float(row["valid/exact_match std"]), np.std(exact, ddof=1))
  np.testing.assert_allclose(  # two seeds: t with 1 degree of freedom, 12.706
      [float(row[f"valid/exact_match ci_{end}"]) for end in ("low", "high")],
      np.mean(exact) + np.array([-1, 1]) * 12.7062047 * np.std(exact, ddof=1) / np.sqrt(2),
      rtol=1e-6)
  assert "| model.position=rotary | 2 |" in (sweep_dir / "report.md").read_text()
  for picture in ("curves.png", "final.png", "extrapolation.png"):
    assert (sweep_dir / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  final = run_state(str(first)).final  # exact match per length, training and longer ones
  assert {"3", "4", "5"} <= set(final["valid"]["exact_match_by_length"]) <= set("12345")
  assert set(final["longer"]["exact_match_by_length"]) == {"6", "7"}

  shutil.rmtree(sweep_dir / "model.position=rotary,seed=1")  # one seed: no spread is shown
  report.write(str(config_path), str(sweep_dir))
  row = next(r for r in (sweep_dir / "report.md").read_text().splitlines() if "rotary" in r)
  assert row.startswith("| model.position=rotary | 1 | ") and "±" not in row and "[" not in row
  assert f"{exact[0]:.4f}" in row


def test_workers_split_the_runs_and_commands_are_printed(tmp_path):
  config_path = tmp_path / "tiny_sweep.py"
  config_path.write_text(SWEEP_CONFIG)
  out = subprocess.run([sys.executable, "sweep.py", "--config", str(config_path), "--sweep_dir",
                        "D", "--num_workers=3", "--print_commands", "--only=seed=1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120).stdout.splitlines()
  assert len(out) == 3 and out[2].endswith("--only=seed=1 --num_workers=3 --worker=2")
  _, runs = sweep.load(str(config_path))
  shares = [runs[w::3] for w in range(3)]
  assert sorted(map(sweep.run_name, sum(shares, []))) == sorted(map(sweep.run_name, runs))


@pytest.mark.parametrize("name,count", [("positions", 27), ("scorers", 15), ("heads", 12),
                                        ("heads.py:gpu", 12), ("heads.py:cpu", 4),
                                        ("chomsky.py:cpu", 105),
                                        ("lm_extrapolation.py:t5_distance", 6)])
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
  with pytest.raises(ConfigError, match="heads.py:tpu: get_config.. raised unknown heads sweep "
                                        "size 'tpu'; choose one of: cpu, full, gpu"):
    sweep.load(os.path.join(ROOT, "configs", "heads.py:tpu"))


FAILING_SWEEP = """
from tests.conftest import make_tiny_config
from transformer.study.sweep import axis, product

def get_config():
  return make_tiny_config(**{"train.num_steps": 6, "train.log_every": 3,
                             "train.checkpoint_every": 3, "train.warmup_steps": 2})

def get_sweep():  # a learning rate of 1e30 diverges at the first step
  return product(axis("train.learning_rate", [0.5, 1e30]), axis("seed", [0, 1]))
"""


def _table(markdown: str) -> list[list[str]]:
  """The cells of report.md's first table, header first."""
  lines = markdown.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("| "))
  rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
  return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows
          if not row.startswith("|---")]


def test_failed_and_untrained_runs_are_reported_and_only_narrows_the_sweep(tmp_path):
  config_path, sweep_dir = tmp_path / "failing.py", tmp_path / "sweep"
  config_path.write_text(FAILING_SWEEP)
  cli = CliRunner()
  args = ["--config", str(config_path), "--sweep_dir", str(sweep_dir)]
  result = cli.run("sweep.py", *args, "--only", "seed=0", timeout=300)
  assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: 1 run(s) failed"), result.stderr
  assert "train.learning_rate=1e+30,seed=0: training diverged at step 1" in lines[0]
  out = result.stdout
  assert "sweep: run 1/2: training train.learning_rate=0.5,seed=0\n" in out
  assert ("sweep: run 2/2: training train.learning_rate=1e+30,seed=0 | 1 run(s) trained in "
          in out) and "for 1 left" in out.split("run 2/2")[1].splitlines()[0]
  assert not (sweep_dir / "train.learning_rate=0.5,seed=1").exists()  # not selected
  assert read_failure(str(sweep_dir / "train.learning_rate=1e+30,seed=0"))["kind"] == (
      "RunError")

  md = (sweep_dir / "report.md").read_text()
  assert md.startswith(f"# Sweep {config_path}\n") and "- training steps: 6\n" in md
  assert "- selected: --only seed=0" in md and "- main metric: valid/exact_match" in md
  table = _table(md)
  assert table[0][:5] == ["variant", "seeds", "failed", "unfinished", "valid/exact_match"]
  assert table[1][:4] == ["train.learning_rate=0.5", "1", "0", "0"] and table[1][4]
  assert table[2] == ["train.learning_rate=1e+30", "0", "1", "0"] + [""] * (len(table[0]) - 4)
  assert "| train.learning_rate=1e+30,seed=0 | failed: training diverged at step 1:" in md
  with open(sweep_dir / "report.csv") as f:
    header = next(csv.reader(f))
  assert header[:4] == table[0][:4]
  assert header[5:5 + 8 * len(table[0][4:]):8] == [f"{name} mean" for name in table[0][4:]]

  # Every run of the sweep, from another invocation: the failure was recorded.
  result = cli.run("sweep.py", *args, "--report_only")
  assert result.returncode == 0, result.stderr
  md = (sweep_dir / "report.md").read_text()
  assert "selected" not in md
  assert "- runs: 4 in 2 variant(s): 1 finished, 1 failed, 2 unfinished" in md
  assert [row[:4] for row in _table(md)[1:]] == [["train.learning_rate=0.5", "1", "0", "1"],
                                                   ["train.learning_rate=1e+30", "0", "1", "1"]]
  assert "| train.learning_rate=0.5,seed=1 | not trained yet |" in md
  assert "| train.learning_rate=1e+30,seed=0 | failed: training diverged" in md

  # A workdir holding another run is refused before anything trains.
  result = cli.run("sweep.py", *args, "--config.model.d_ff=48")
  assert result.returncode == 2 and "holds a run with a different config.model" in result.stderr
  assert not (sweep_dir / "train.learning_rate=0.5,seed=1").exists()


def test_a_run_whose_data_cannot_be_prepared_is_recorded_and_the_sweep_goes_on(tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  sections = SOURCES["text"].example(str(data)).sections
  (data / "bad.en").write_bytes(b"a dog \xff runs\n" * 64)  # found only when it is read
  config_path, sweep_dir = tmp_path / "text_sweep.py", tmp_path / "sweep"
  config = make_tiny_config(**{"train.num_steps": 2, "train.log_every": 2,
                               "train.checkpoint_every": 2, "eval.num_examples": 8,
                               "eval.batch_size": 8, "train.batch_size": 8}).to_dict()
  del config["task"]
  config["data"] = sections["data"]
  config_path.write_text(
      "import ml_collections\n"
      "from transformer.study.sweep import axis\n"
      f"def get_config():\n  return ml_collections.ConfigDict({config!r})\n"
      "def get_sweep():\n  return axis('data.train_source', ['bad.en', 'train.en.gz'])\n")
  trained, failed = sweep.run(str(config_path), str(sweep_dir))
  assert trained == ["data.train_source=train.en.gz"]
  assert list(failed) == ["data.train_source=bad.en"] and "not valid UTF-8" in failed[
      "data.train_source=bad.en"]
  report.write(str(config_path), str(sweep_dir))
  md = (sweep_dir / "report.md").read_text()
  assert "| data.train_source=bad.en | 0 | 1 | 0 |" in md
  assert "| data.train_source=bad.en | failed: " in md and "bad.en:1: not valid UTF-8" in md
  assert "| data.train_source=train.en.gz | 1 | 0 | 0 | " in md
  assert "- main metric: valid/bleu" in md


def test_the_same_run_twice_is_refused(tmp_path):
  config_path = tmp_path / "twice.py"
  body = ("from tests.conftest import make_tiny_config\n"
          "def get_config():\n  return make_tiny_config()\n"
          "def get_sweep():\n  return {}\n")
  for runs, message in [
      ('[{"model.position": "rotary", "seed": 1}, {"seed": 1, "model.position": "rotary"}]',
       "lists the same run twice: item 0 .* and item 1"),
      ('[{"train.learning_rate": 1}, {"train.learning_rate": 1.0}]', "the same config"),
      ('[{"seed": 0}, {"model.position": "sinusoidal", "seed": 0}]',  # the default position
       "the same config"),
      ('[{"model.position": "rotary", "seed": 0}, {"model.position": "rotary", "seed": 1}, '
       '{"seed": 2}, {"seed": 1, "model.position": "rotary"}]', "item 1 .* and item 3")]:
    config_path.write_text(body.format(runs))
    with pytest.raises(ConfigError, match=message):
      sweep.runs(str(config_path), str(tmp_path / "sweep"))
  config_path.write_text(body.format('[{"seed": 0}, {"seed": 1}]'))
  assert [r.name for r in sweep.runs(str(config_path), str(tmp_path / "sweep"))] == [
      "seed=0", "seed=1"]


def test_only_selects_by_the_swept_values():
  overrides = sweep.product(sweep.axis("model.position", ["rotary", "alibi", "t5"]),
                            sweep.axis("train.learning_rate", [0.5, 1e-3]),
                            sweep.axis("model.scan_layers", [True, False]))
  runs = [sweep.Run(sweep.run_name(o), o, None, "") for o in overrides]
  names = lambda *only: [r.name for r in sweep.select(runs, only)]  # noqa: E731
  assert len(names()) == 12
  assert names("model.position=t5,rotary", "train.learning_rate=1e-3",
               "model.scan_layers=false") == [
      "model.position=rotary,train.learning_rate=0.001,model.scan_layers=False",
      "model.position=t5,train.learning_rate=0.001,model.scan_layers=False"]
  assert names("model.position=alibi", "model.position=t5", "train.learning_rate=0.50",
               "model.scan_layers=True") == [
      "model.position=alibi,train.learning_rate=0.5,model.scan_layers=True",
      "model.position=t5,train.learning_rate=0.5,model.scan_layers=True"]
  with pytest.raises(ConfigError, match=r"no train.learning_rate=1e-4; its values: 0.5, 0.001"):
    sweep.select(runs, ["train.learning_rate=1e-4"])
  with pytest.raises(ConfigError, match="does not vary 'seed'; it varies: model.position "
                                        r"\(rotary, alibi, t5\); train.learning_rate"):
    sweep.select(runs, ["seed=0"])


def test_metric_order_and_curve_style():
  names = {"valid/loss", "test/bleu", "valid/chrf", "valid/bleu", "valid/accuracy", "test/loss"}
  assert results.order_metrics(names, None) == (
      ["valid/bleu", "valid/chrf", "valid/accuracy", "valid/loss", "test/bleu", "test/loss"],
      "valid/bleu")
  lm = {"len128/perplexity", "len64/loss", "len64/perplexity", "len128_sliding/perplexity",
        "len128/loss"}
  assert results.order_metrics(lm, 64) == (
      ["len64/perplexity", "len64/loss", "len128/perplexity", "len128/loss",
       "len128_sliding/perplexity"], "len64/perplexity")
  assert report_plots.curve_style([[2.8, 2.3]]) == ("linear", "o")  # a short run: two points
  assert report_plots.curve_style([[9.0, 5.0, 0.5]]) == ("log", "o")
  assert report_plots.curve_style([list(np.linspace(3.0, 1.0, 100))]) == ("linear", None)
