"""train.py and eval.py as a user runs them: SIGTERM and resume, eval output and pictures.
(Bad input: tests/test_bad_input.py; faults: tests/test_faults.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

from tests.clirun import ROOT, TINY


def _run(script, *args, timeout=180):
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def _train_args(workdir, *extra):
  return ["--config", os.path.join(ROOT, "configs", "default.py"), "--workdir", workdir, *extra]


def _assert_one_line_error(result, *fragments):
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def test_sigterm_saves_then_rerun_resumes_and_eval_reports(tmp_path):
  workdir = str(tmp_path / "run")
  args = _train_args(workdir, *TINY, "--config.train.num_steps=100000",
                     "--config.train.checkpoint_every=100000")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until training is under way
      if "step 10/" in line or time.time() > deadline:
        break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert "checkpoint saved" in out
  steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert len(steps) == 1 and steps[0] >= 10
  stopped_at = steps[0]

  resumed = _run("train.py", *_train_args(workdir, *TINY, f"--config.train.num_steps={stopped_at + 5}"))
  assert resumed.returncode == 0, resumed.stderr
  assert f"resuming from the checkpoint at step {stopped_at}" in resumed.stdout
  assert f"step {stopped_at + 5}/{stopped_at + 5}" in resumed.stdout

  result = _run("eval.py", "--workdir", workdir)
  assert result.returncode == 0, result.stderr
  assert f"step {stopped_at + 5}" in result.stdout and "longer" in result.stdout
  path = os.path.join(workdir, f"eval_step_{stopped_at + 5}.json")
  assert path in result.stdout
  with open(path) as f:
    metrics = json.load(f)
  assert set(metrics["splits"]) == {"valid", "longer"}
  assert 0.0 <= metrics["splits"]["valid"]["exact_match"] <= 1.0

  plot_dir = tmp_path / "plots"
  bad = _run("eval.py", "--workdir", workdir, "--sentence", "0 9", "--nometrics",
             "--plot_dir", str(plot_dir))
  _assert_one_line_error(bad, "'0 9'", "0..5")
  assert not plot_dir.exists()  # a bad sentence writes nothing
  drawn = _run("eval.py", "--workdir", workdir, "--sentence", "0 1 2", "--sentence", "5 4",
               "--nometrics", "--plot_dir", str(plot_dir))
  assert drawn.returncode == 0, drawn.stderr
  expected = {f"attention_{i}_{kind}.png" for i in (0, 1) for kind in ("encoder", "decoder", "cross")}
  assert set(os.listdir(plot_dir)) == expected | {"positions.png"}
  for name in expected | {"positions.png"}:
    with open(plot_dir / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
