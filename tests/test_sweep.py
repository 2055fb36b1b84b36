"""Sweeps: override sets, an interrupted sweep finishing without redoing finished runs, the
report's mean ± std over seeds and its record of runs without results (failed, not trained),
duplicate runs refused, --only, progress lines, worker sharding and SLURM arrays, the sweep
directory's record of how it was run, shipped sweep configs."""

import csv
import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.clirun import CliRunner
from tests.support import ROOT, fake_run, make_tiny_config
from transformer.core.errors import ConfigError
from transformer.data.sources import SOURCES
from transformer.run.evaluator import PER_EXAMPLE
from transformer.run.state import read_failure, run_state
from transformer.study import report, report_plots, results, sweep, sweep_record, sweep_workers


SWEEP_CONFIG = """
from tests.support import make_tiny_config
from transformer.api import axis, product

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
  np.testing.assert_allclose(  # two seeds: t with 1 degree of freedom, 12.706, within [0, 1]
      [float(row[f"valid/exact_match ci_{end}"]) for end in ("low", "high")],
      np.clip(np.mean(exact) + np.array([-1, 1]) * 12.7062047 * np.std(exact, ddof=1)
              / np.sqrt(2), 0, 1), rtol=1e-6)
  md = (sweep_dir / "report.md").read_text()
  assert "| model.position=rotary | 2 |" in md
  for picture in ("curves.png", "final.png", "extrapolation.png"):
    assert (sweep_dir / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # The final evaluation records each example's results, and they give its metrics again.
  for split, record in run_state(str(first)).final.items():
    examples = record[PER_EXAMPLE]
    assert len(examples["exact"]) == len(examples["tokens"]) == record["examples"]
    assert np.mean(examples["exact"]) == pytest.approx(record["exact_match"])
    assert sum(examples["correct"]) / sum(examples["tokens"]) == pytest.approx(
        record["accuracy"], rel=1e-6)
    assert sum(examples["nll"]) / sum(examples["tokens"]) == pytest.approx(record["loss"],
                                                                         rel=1e-5)
  # The synthetic task draws each seed's examples from the seed: a bootstrap per seed.
  paired = next(r for r in md.split("## Paired differences")[1].splitlines()
                if r.startswith("| model.position=rotary |"))
  assert paired.endswith(" | 64 per seed |") and "| [" in paired.split("|", 5)[5]
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
  assert len(out) == 3 and out[2].endswith(
      "--only=seed=1 --sweep_dir D --num_workers=3 --worker=2")
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
from tests.support import make_tiny_config
from transformer.api import axis, product

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
  assert table[2] == ["train.learning_rate=1e+30", "0", "1", "0"] + ["failed"] * (
      len(table[0]) - 4)  # diverged: failed in every metric's column
  assert "| train.learning_rate=1e+30,seed=0 | failed: training diverged at step 1:" in md
  with open(sweep_dir / "report.csv") as f:
    header = next(csv.reader(f))
  assert header[:4] == table[0][:4]
  assert header[5:5 + 10 * len(table[0][4:]):10] == [f"{name} mean" for name in table[0][4:]]

  # Another invocation without --only reports the recorded selection (sweep_record): the
  # same report, not one of every run; --only all selects every run, and the failure was
  # recorded for any invocation to see.
  result = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), "--report_only")
  assert result.returncode == 0, result.stderr
  assert f"as recorded in {sweep_dir / 'sweep.json'}: --config {config_path} --only=seed=0" \
      in result.stdout
  assert _table((sweep_dir / "report.md").read_text()) == table
  result = cli.run("sweep.py", *args, "--report_only", "--only", "all")
  assert result.returncode == 0, result.stderr
  md = (sweep_dir / "report.md").read_text()
  assert "selected" not in md
  assert "- runs: 4 in 2 variant(s): 1 finished, 1 failed, 2 unfinished" in md
  assert [row[:4] for row in _table(md)[1:]] == [["train.learning_rate=0.5", "1", "0", "1"],
                                                   ["train.learning_rate=1e+30", "0", "1", "1"]]
  assert "| train.learning_rate=0.5,seed=1 | not trained yet |" in md
  assert "| train.learning_rate=1e+30,seed=0 | failed: training diverged" in md

  # Another config for the same names is refused before anything trains: by the record,
  # and without one (a sweep directory of older code) by the workdirs holding other runs.
  result = cli.run("sweep.py", *args, "--config.model.d_ff=48")
  assert result.returncode == 2 and "--config.model.d_ff=48 would describe other runs" in (
      result.stderr)
  (sweep_dir / "sweep.json").unlink()
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
      "from transformer.api import axis\n"
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
  body = ("from tests.support import make_tiny_config\n"
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


GRID = """
from tests.support import make_tiny_config
from transformer.api import axis, product

def get_config():
  return make_tiny_config()

def get_sweep():
  return product(axis("model.position", ["sinusoidal", "rotary"]), axis("seed", [0, 1]))
"""


def test_the_sweep_dir_remembers_how_it_was_run(tmp_path):
  """A --report_only (or a re-run) without the first invocation's --config.FIELD overrides
  and --only would judge the runs by the config file's defaults and write "0 finished" over
  a correct report: the sweep directory records them (sweep.json) and later invocations use
  them; flags that would describe other runs are refused; --only given
  again selects anew. The runs are finished runs' files (fake_run): nothing trains."""
  config_path, sweep_dir = tmp_path / "grid.py", tmp_path / "sweep"
  config_path.write_text(GRID)
  for i, (position, seed) in enumerate(itertools.product(("sinusoidal", "rotary"), (0, 1))):
    fake_run(sweep_dir / f"model.position={position},seed={seed}", 0.5 + i / 10, seed, steps=20,
             **{"model.position": position})
  cli = CliRunner()
  first = cli.run("sweep.py", "--config", str(config_path), "--sweep_dir", str(sweep_dir),
                  "--config.train.num_steps=20", "--only", "model.position=rotary")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "model.position=rotary,seed=1 is finished; skipped" in first.stdout
  record = json.loads((sweep_dir / "sweep.json").read_text())
  assert (record["config"], record["overrides"], record["only"]) == (
      str(config_path), {"train.num_steps": 20}, ["model.position=rotary"])
  md = (sweep_dir / "report.md").read_text()
  assert "- runs: 2 in 1 variant(s): 2 finished, 0 failed, 0 unfinished" in md
  assert "- every run: --config.train.num_steps=20" in md
  assert "- selected: --only model.position=rotary" in md

  for given in ([], ["--config", str(config_path)]):  # the record completes the flags
    again = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), "--report_only", *given)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--config.train.num_steps=20 --only=model.position=rotary" in again.stdout
    assert (sweep_dir / "report.md").read_text() == md
  for given in ([], ["--config.train.num_steps=20"]):  # the recorded overrides, --config left out
    printed = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), "--print_commands",
                      "--num_workers", "2", *given).stdout.splitlines()
    assert len(printed) == 2 and all(
        f"--config {config_path} --config.train.num_steps=20 --only=model.position=rotary "
        f"--sweep_dir {sweep_dir}" in line for line in printed), printed

  # Other overrides would judge the same workdirs as other runs: refused, nothing written.
  for given in (["--config", str(config_path)], []):
    refused = cli.run("sweep.py", *given, "--sweep_dir", str(sweep_dir), "--report_only",
                      "--config.train.num_steps=40")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--config.train.num_steps=40 would describe other runs" in refused.stderr
    assert (sweep_dir / "report.md").read_text() == md

  # --only anew: every run, recorded for the next invocation.
  everything = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), "--only", "all")
  assert everything.returncode == 0, everything.stderr[-3000:]
  assert json.loads((sweep_dir / "sweep.json").read_text())["only"] == []
  md = (sweep_dir / "report.md").read_text()
  assert "- runs: 4 in 2 variant(s): 4 finished, 0 failed, 0 unfinished" in md
  assert "selected" not in md


def test_workers_from_flags_or_a_slurm_array():
  assign = sweep_workers.assignment
  assert assign(None, None, {}) == (0, 1)
  assert assign(None, 3, {}) == (0, 3) and assign(2, 3, {}) == (2, 3)
  array = {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "4"}
  assert assign(1, 2, array) == (1, 2)  # the flags win
  assert assign(None, None, {**array, "SLURM_ARRAY_TASK_ID": "3"}) == (3, 4)
  assert assign(None, None, {**array, "SLURM_ARRAY_TASK_MIN": "6"}) == (3, 4)  # --array=6-9
  # --array=1-7:2: tasks 1, 3, 5, 7 are workers 0..3
  odd = {**array, "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2"}
  assert [assign(None, None, {**odd, "SLURM_ARRAY_TASK_ID": str(t)}) for t in (1, 3, 5, 7)] == [
      (w, 4) for w in range(4)]
  for bad in ({**array, "SLURM_ARRAY_TASK_COUNT": "0"}, {**odd, "SLURM_ARRAY_TASK_ID": "9"},
              {"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}):
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_(COUNT|ID)"):
      assign(None, None, bad)


def test_what_a_record_completes_and_what_it_refuses(tmp_path, monkeypatch):
  record = sweep_record.Invocation("configs/heads.py:cpu", {"train.num_steps": 5},
                                   ("seed=0",))
  monkeypatch.chdir(ROOT)
  assert sweep_record.resolve(str(tmp_path), "configs/heads.py:cpu", {}, ()) == (
      sweep_record.Invocation("configs/heads.py:cpu", {}, ()), False)  # nothing recorded yet
  sweep_record.write(str(tmp_path), record)
  absolute = os.path.join(ROOT, "configs", "heads.py:cpu")
  assert sweep_record.read(str(tmp_path)) == sweep_record.Invocation(
      absolute, {"train.num_steps": 5}, ("seed=0",))
  resolve = lambda *given: sweep_record.resolve(str(tmp_path), *given)  # noqa: E731
  assert resolve(None, {}, ()) == (sweep_record.Invocation(
      absolute, {"train.num_steps": 5}, ("seed=0",)), True)
  # the same file by another path, the same values: nothing supplied but the --only
  same = resolve(f"{ROOT}/configs/../configs/heads.py:cpu", {"train.num_steps": 5.0}, ())
  assert same == (sweep_record.Invocation(f"{ROOT}/configs/../configs/heads.py:cpu",
                                          {"train.num_steps": 5}, ("seed=0",)), True)
  assert resolve("configs/heads.py:cpu", {"train.num_steps": 5}, ("seed=1",))[0].only == (
      "seed=1",)
  assert resolve(None, {}, ("all",))[0].only == ()
  for given, refused in ((("configs/heads.py:gpu", {}, ()), "--config configs/heads.py:gpu"),
                         ((None, {"train.num_steps": 6}, ()), "--config.train.num_steps=6"),
                         ((None, {"train.num_steps": 5, "seed": 1}, ()), "--config.seed=1")):
    with pytest.raises(ConfigError, match=f"holds the runs of .* {refused}.* would describe"):
      resolve(*given)


NARROWED = """
from tests.support import make_tiny_config
from transformer.api import axis, product

def get_config():
  return make_tiny_config()

def get_sweep():
  return product(axis("model.position", ["sinusoidal", "rotary"]),
                 axis("model.norm", ["pre", "post"]), axis("seed", [0, 1]))
"""


def test_variant_names_leave_out_the_fields_every_variant_shares(tmp_path):
  """A sweep narrowed by --only holds model.norm at one value: the variants are named by
  the position alone, and the header says what they share (no training: the runs' files
  are written as training writes them)."""
  config_path, sweep_dir = tmp_path / "narrowed.py", tmp_path / "sweep"
  config_path.write_text(NARROWED)
  for run in sweep.runs(str(config_path), str(sweep_dir)):
    fields = {k: v for k, v in run.overrides.items() if k != "seed"}
    fake_run(run.workdir, 0.5 + 0.1 * run.config.seed, run.config.seed, **fields)
  report.write(str(config_path), str(sweep_dir), only=["model.norm=pre"],
               baseline="model.position=rotary,model.norm=pre")  # its name in full works too
  md = (sweep_dir / "report.md").read_text()
  assert [row[0] for row in _table(md)[1:]] == ["model.position=sinusoidal",
                                                "model.position=rotary"]
  assert "- every variant (left out of their names): model.norm=pre\n" in md
  assert "## Paired differences against model.position=rotary (valid/exact_match)" in md
  report.write(str(config_path), str(sweep_dir))  # the whole sweep: a grid, names in full
  md = (sweep_dir / "report.md").read_text()
  assert "model.position=rotary,model.norm=post" in md and "every variant" not in md
  assert "## valid/exact_match by model.position" in md


def test_config_files_import_from_the_public_module_and_an_old_path_names_it(tmp_path):
  """A sweep file imports axis and product from transformer.api, and every shipped config
  file imports its parts from there alone; one written against a module that no longer
  exists (transformer.sweep) fails, in train.py and in sweep.py, with one `error:` line that
  names transformer.api, before anything is written."""
  public = tmp_path / "public.py"
  public.write_text(GRID)
  base, sweep_runs = sweep.load(str(public))
  assert base is not None and len(sweep_runs) == 4
  for path in sorted(pathlib.Path(ROOT, "configs").glob("*.py")):
    imported = re.findall(r"^from (transformer[\w.]*) import", path.read_text(), re.M)
    assert set(imported) <= {"transformer.api"}, path.name
  old = tmp_path / "old.py"
  old.write_text(GRID.replace("transformer.api", "transformer.sweep"))
  cli = CliRunner()
  for script, out in (("sweep.py", "--sweep_dir"), ("train.py", "--workdir")):
    result = cli.run(script, "--config", str(old), out, str(tmp_path / "out"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (script, result.stderr)
    assert lines[0].startswith("error: ") and "transformer.sweep" in lines[0]
    assert "from transformer.api" in lines[0]
  assert not (tmp_path / "out").exists()
