"""Evaluation-time sweeps (study/sweep_eval.py): the axes and their combinations, and a tiny
trained 2-seed rotary LM sweep evaluated again under a RoPE scaling without retraining,
reported with paired differences by seed that are checked against the files themselves."""

import csv
import json
import pathlib

import numpy as np
import pytest

from tests.clirun import CliRunner
from tests.support import write_lm_config
from transformer.core.errors import ConfigError
from transformer.run.state import run_state
from transformer.study import stats, sweep_eval

ROTARY = "model.position_settings.rotary."
LM_SWEEP = """
from transformer.api import axis

def get_config():
  config = _tiny_lm()
  config.model.position = "rotary"
  config.data.max_factor = 2  # evaluated at 8 and 16 tokens
  return config

def get_sweep():
  return axis("seed", [0, 1])
"""


def test_axes_combinations_and_names():
  sweep = sweep_eval.parse([f"{ROTARY}scaling=linear,yarn", f"--config.{ROTARY}factor=2,4"])
  assert sweep.combinations == [
      {ROTARY + "scaling": s, ROTARY + "factor": f} for s in ("linear", "yarn") for f in "24"]
  assert sweep.folder == "eval_sweep,rotary.factor=2+4,rotary.scaling=linear+yarn"
  assert sweep_eval.label(sweep.combinations[1]) == "rotary.scaling=linear,rotary.factor=4"
  for specs, message in (([f"{ROTARY}scaling"], "expected FIELD=VALUE"),
                         ([f"{ROTARY}scaling=linear,"], "expected FIELD=VALUE"),
                         ([f"{ROTARY}factor=2", f"{ROTARY}factor=4"], "given twice"),
                         ([f"{ROTARY}factor=2,2"], "listed twice")):
    with pytest.raises(ConfigError, match=message):
      sweep_eval.parse(specs)


def _csv(path) -> dict[tuple[str, str], dict]:
  with open(path) as f:
    return {(row["evaluation"], row["metric"]): row for row in csv.DictReader(f)}


def test_a_trained_sweep_is_evaluated_again_under_a_scaling(tmp_path):
  """Linear scaling with factor 1 computes the run's own frequencies: its paired differences
  are 0 (an equivalence); with factor 2 they are the per-seed differences of the files the
  evaluations wrote and the final evaluations the runs recorded, their mean and t interval
  (1 degree of freedom: t = 12.706). The plain evaluation's files, the checkpoints and the
  metrics are untouched; a second invocation reads the evaluations back."""
  config_path, sweep_dir = tmp_path / "lm_sweep.py", tmp_path / "sweep"
  config_path.write_text(pathlib.Path(write_lm_config(tmp_path)).read_text().replace(
      "def get_config():", "def _tiny_lm():") + LM_SWEEP)
  cli = CliRunner()
  trained = cli.run("sweep.py", "--config", str(config_path), "--sweep_dir", str(sweep_dir),
                    timeout=600)
  assert trained.returncode == 0, trained.stderr[-3000:]
  runs = {seed: sweep_dir / f"seed={seed}" for seed in (0, 1)}
  kept = {path: path.read_bytes() for run in runs.values()
          for path in (run / "metrics.jsonl", run / "config.json")}
  kept.update({path: path.stat().st_mtime_ns for run in runs.values()
               for path in (run / "checkpoints").rglob("*") if path.is_file()})
  axes = ["--eval_sweep", f"{ROTARY}scaling=linear", "--eval_sweep", f"{ROTARY}factor=1,2"]
  result = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), *axes, timeout=600)  # recorded
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count("eval sweep: ") == 4  # 2 runs × 2 evaluations
  folder = sweep_dir / "eval_sweep,rotary.factor=1+2,rotary.scaling=linear"
  md, rows = (folder / "report.md").read_text(), _csv(folder / "report.csv")
  assert "## perplexity (lower is better)" in md
  assert "## Paired differences of perplexity: evaluation − unmodified, by seed" in md
  for run in runs.values():
    assert not (run / "eval_step_5.json").exists()  # no plain evaluation written
    assert sorted(p.name for p in run.glob("eval_step_*")) == [
        "eval_step_5,rotary.factor=2.0,rotary.scaling=linear.json",
        "eval_step_5,rotary.scaling=linear.json"]  # factor 1 is the run's own: not in the name
  for path, content in kept.items():
    assert (path.read_bytes() if isinstance(content, bytes) else path.stat().st_mtime_ns) \
        == content, path

  finals = {s: run_state(str(run), 5).final for s, run in runs.items()}
  for label, name in (("rotary.scaling=linear,rotary.factor=1", "rotary.scaling=linear"),
                      ("rotary.scaling=linear,rotary.factor=2",
                       "rotary.factor=2.0,rotary.scaling=linear")):
    files = {s: json.loads((run / f"eval_step_5,{name}.json").read_text())["splits"]
             for s, run in runs.items()}
    for split in ("len8", "len16"):
      for key in ("loss", "perplexity"):
        row = rows[(label, f"{split}/{key}")]
        differences = [files[s][split][key] - finals[s][split][key] for s in (0, 1)]
        recorded = json.loads(row["diff values"])
        np.testing.assert_allclose([recorded["0"], recorded["1"]], differences, rtol=1e-9,
                                   atol=1e-12)
        mean, std = np.mean(differences), np.std(differences, ddof=1)
        np.testing.assert_allclose(float(row["diff mean"]), mean, rtol=1e-9, atol=1e-12)
        if stats.identical(differences):  # the same in each seed: no zero-width interval
          assert row["diff ci_low"] == row["diff ci_high"] == ""
        else:
          np.testing.assert_allclose(
              [float(row["diff ci_low"]), float(row["diff ci_high"])],
              mean + np.array([-1, 1]) * 12.7062047 * std / np.sqrt(2), rtol=1e-6, atol=1e-9)
        if label.endswith("factor=1"):  # linear by 1 = the run's own frequencies
          np.testing.assert_allclose(differences, 0, atol=1e-5)
        else:
          assert max(abs(d) for d in differences) > 1e-4
  unmodified = rows[("unmodified", "len16/perplexity")]
  assert json.loads(unmodified["values"]) == {
      str(s): finals[s]["len16"]["perplexity"] for s in (0, 1)}

  stamps = {p: p.stat().st_mtime_ns for run in runs.values() for p in run.glob("eval_step_*")}
  again = cli.run("sweep.py", "--sweep_dir", str(sweep_dir), *axes)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "eval sweep: " not in again.stdout  # read back, not evaluated again
  assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
  assert _csv(folder / "report.csv") == rows
