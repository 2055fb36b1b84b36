"""Two processes on localhost (jax.distributed, CPU collectives), as the hosts of a pod or a
SLURM job: a 2-process sweep equals the 1-process one, and a SIGTERM to one host stops both
at the same step, from which a re-run reaches the uninterrupted run's parameters exactly. A
launch that cannot start fails fast in one line: process 0 on a port that a coordinator of
an earlier launch still holds, a process whose peers never come.

The launcher holds a global timeout and kills every survivor when one process fails, since
a peer of a dead process blocks forever inside a collective.
"""

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.clirun import ROOT, CliRunner
from tests.support import restore_and_evaluate
from transformer.run import distributed
from transformer.run.restored_run import restore_run
from transformer.run.workdir import read_metrics
from transformer.study import sweep

# Beyond ~30 steps the 1e-6 differences between 1 and 2 processes (the order of their sums)
# grow chaotically at this learning rate; up to here they stay below 1e-5.
STEPS = 30
SWEEP = f"""
from tests.support import make_tiny_config
from transformer.api import axis

def get_config():
  return make_tiny_config(**{{"train.num_steps": {STEPS}, "train.checkpoint_every": 100,
                             "train.log_every": 5, "model.dropout": 0.1}})

def get_sweep():
  return axis("seed", [0, 1])
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# Runs SCRIPT pinned to one CPU core, set before anything else (threads inherit it), and
# writes the numbers of its polls of JAX's preemption sync point, in order, to POLLS.I
# (I: its --process_id) at exit. argv: CORE POLLS SCRIPT ARGS...
PINNED = """
import atexit, json, os, runpy, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
from jax.experimental import multihost_utils
polls, reached = [], multihost_utils.reached_preemption_sync_point
def poll(number):
  polls.append(number)
  return reached(number)
multihost_utils.reached_preemption_sync_point = poll
path = sys.argv[2] + "." + next(a.split("=")[1] for a in sys.argv if "--process_id=" in a)
atexit.register(lambda: open(path, "w").write(json.dumps(polls)))
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _start(args, num_processes=2, core=None, polls=None):
  """Starts the processes of one job; with `core`, all of them on that one CPU core (the
  load under which timing bugs between processes show), recording their polls of the
  preemption sync point into `polls`.PROCESS_ID."""
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": ROOT}
  # no compilation cache (conftest's, or the CLIs' default one under ~/.cache): these tests
  # time the processes' start and their signals, which loaded programs would change
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  pin = [] if core is None else ["-c", PINNED, str(core), polls]
  return [subprocess.Popen(
      [sys.executable, *pin, *args, f"--coordinator_address=127.0.0.1:{port}",
       f"--num_processes={num_processes}", f"--process_id={i}"], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(num_processes)]


def _finish(procs, statuses=(0,), timeout=420):
  """Waits for all; kills all as soon as one exits with a status not in `statuses`."""
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, *statuses)]
      assert not failed and time.time() < deadline, "a process failed or the run timed out"
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    outputs = [p.communicate()[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode in statuses, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
  return outputs


def _params(workdir, step):
  return restore_run(workdir, step).params  # onto this process's one device


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
  """The same sweep of 2 runs, by 1 process and by 2 (each run spanning both)."""
  root = tmp_path_factory.mktemp("sweeps")
  (root / "tiny_sweep.py").write_text(SWEEP)
  one, two = str(root / "one"), str(root / "two")
  sweep.run(str(root / "tiny_sweep.py"), one)
  outputs = _finish(_start(["sweep.py", "--config", str(root / "tiny_sweep.py"),
                            "--sweep_dir", two]))
  return root, one, two, outputs


def test_a_two_process_sweep_equals_the_one_process_sweep(sweeps):
  _, one, two, outputs = sweeps
  assert "report written to" in outputs[0] and "report written to" not in outputs[1]
  assert f"step {STEPS}/{STEPS}" in outputs[0] and "step" not in outputs[1]  # process 0 logs
  for seed in (0, 1):
    run = f"seed={seed}"
    train = [[r["loss"] for r in read_metrics(os.path.join(d, run)) if r["split"] == "train"]
             for d in (one, two)]
    assert len(train[0]) == STEPS // 5
    np.testing.assert_allclose(train[1], train[0], rtol=2e-5)
  with open(os.path.join(two, "report.csv")) as f:
    rows = list(csv.DictReader(f))
  assert [r["variant"] for r in rows] == ["base"] and rows[0]["seeds"] == "2"
  # Saved by both processes, restored here by one.
  step, results, _ = restore_and_evaluate(os.path.join(two, "seed=0"))
  _, expected, _ = restore_and_evaluate(os.path.join(one, "seed=0"))
  assert step == STEPS
  np.testing.assert_allclose(results["valid"]["loss"], expected["valid"]["loss"], rtol=2e-4)


def test_sigterm_to_one_host_stops_both_at_one_step_and_the_rerun_is_exact(sweeps):
  root, _, two, _ = sweeps
  workdir = str(root / "preempted")
  args = ["train.py", "--config", str(root / "tiny_sweep.py"), "--workdir", workdir,
          "--config.seed=0"]  # the sweep's first run
  procs = _start(args)
  for line in procs[0].stdout:
    if "compiling the train step" in line:  # just before the first step's compilation
      break
  procs[1].send_signal(signal.SIGTERM)  # one host is preempted: JAX's notifier needs ~1 s to
  # agree on a stop step with the other host, which the first step's compilation covers
  outputs = _finish(procs, statuses=(128 + signal.SIGTERM,))
  assert all("stopped at step " in out for out in outputs), outputs
  stopped = [int(out.split("stopped at step ")[1].split(";")[0]) for out in outputs]
  assert stopped[0] == stopped[1] and 1 <= stopped[0] < STEPS, outputs
  assert [s for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit()] == [
      str(stopped[0])]

  outputs = _finish(_start(args))
  assert f"resuming from the checkpoint at step {stopped[0]}" in outputs[0]
  jax.tree.map(np.testing.assert_array_equal, _params(workdir, STEPS),
               _params(os.path.join(two, "seed=0"), STEPS))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to a core")
def test_sigterm_to_one_host_stops_a_sweep_under_load_and_the_rerun_finishes_it(sweeps):
  """The preemption sync point is the poll numbered one more than the highest number any
  process had passed when the notice came. A sweep polls once more than its runs (before
  each run), and orbax's CheckpointManager polled too, numbering its polls by the step it
  saved: the point could fall on a number no poll would pass again, and both hosts trained
  the whole sweep (1 trial in 3 here before the fix). One poller, one numbering 1, 2, 3, ...
  on every process; tried with orbax's polls most frequent (a save every step), both
  processes on one core, in the sweep's second run (the first, copied from the
  uninterrupted sweep, is finished)."""
  root, _, two, _ = sweeps
  sweep_dir = root / "preempted_sweep"
  shutil.copytree(os.path.join(two, "seed=0"), sweep_dir / "seed=0")
  args = ["sweep.py", "--config", str(root / "tiny_sweep.py"), "--sweep_dir", str(sweep_dir),
          "--config.train.checkpoint_every=1"]
  polls = str(root / "polls")
  procs, seen = _start(args, core=min(os.sched_getaffinity(0)), polls=polls), []
  for line in procs[0].stdout:
    seen.append(line)
    if "step 5/" in line:
      break
  procs[1].send_signal(signal.SIGTERM)
  outputs = _finish(procs, statuses=(128 + signal.SIGTERM,))
  assert "seed=0 is finished; skipped" in "".join(seen) and "training seed=1" in "".join(seen)
  assert all("stopped at step " in out for out in outputs), outputs
  stopped = [int(out.split("stopped at step ")[1].split(";")[0]) for out in outputs]
  assert stopped[0] == stopped[1] and 5 <= stopped[0] < STEPS, outputs
  run = sweep_dir / "seed=1"
  assert max(int(s) for s in os.listdir(run / "checkpoints") if s.isdigit()) == stopped[0]
  numbers = []
  for i in (0, 1):
    with open(f"{polls}.{i}") as f:
      numbers.append(json.load(f))
  assert numbers[0] == numbers[1] == list(range(1, len(numbers[0]) + 1)), numbers

  outputs = _finish(_start(args))
  assert f"resuming from the checkpoint at step {stopped[0]}" in outputs[0]
  assert "report written to" in outputs[0]
  final = [[(r["step"], r["split"], r["loss"]) for r in read_metrics(d) if r["step"] == STEPS]
           for d in (str(run), os.path.join(two, "seed=1"))]
  assert final[0] == final[1] and len(final[0]) == 3  # train, valid, longer


# A process 0 of an earlier launch, still waiting for its process 1 (`PORT`).
STALE = """
import sys, jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", 2, 0, initialization_timeout=120)
"""


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


def test_a_port_that_an_earlier_launch_holds_is_refused(cli, tmp_path):
  """JAX's coordination service binds its port with SO_REUSEPORT, so a new process 0 would
  start a second service beside a coordinator of an earlier launch still running there, the
  new process 1 be handed to the old one, and the new process 0 wait 300 s for it before JAX
  aborted it (exit 134). Process 0 refuses the port at once, in one line, and writes
  nothing."""
  (tmp_path / "sweep.py").write_text(SWEEP)
  port = _free_port()
  stale = subprocess.Popen([sys.executable, "-c", STALE, str(port)], cwd=ROOT,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 120
    while not distributed.port_in_use(f"127.0.0.1:{port}"):
      assert stale.poll() is None and time.time() < deadline, "the stale coordinator did not start"
      time.sleep(0.2)
    started = time.time()
    result = cli.run(
        "sweep.py", "--config", str(tmp_path / "sweep.py"), "--sweep_dir",
        str(tmp_path / "sweep"), f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
        "--process_id=0", timeout=60)
    assert time.time() - started < 60
  finally:
    stale.kill()
    stale.wait()
  assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
  assert result.stderr.startswith(f"error: --coordinator_address=127.0.0.1:{port}: another "
                                  f"process already listens on port {port}"), result.stderr
  assert not (tmp_path / "sweep").exists()


def test_a_process_whose_peers_never_come_exits_in_one_line(cli, tmp_path):
  """A process 1 without a process 0 leaves within its --join_timeout, in one line, exit 1
  (JAX alone waited 300 s, then aborted with a C++ stack trace)."""
  (tmp_path / "sweep.py").write_text(SWEEP)
  started = time.time()
  result = cli.run(
      "sweep.py", "--config", str(tmp_path / "sweep.py"), "--sweep_dir", str(tmp_path / "sweep"),
      f"--coordinator_address=127.0.0.1:{_free_port()}", "--num_processes=2", "--process_id=1",
      "--join_timeout=2", timeout=60)
  assert time.time() - started < 60
  assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
  assert result.stderr.startswith("error: process 1 of 2 could not join the job at "
                                  "127.0.0.1:") and "within 2 s (--join_timeout)" in result.stderr
  assert not (tmp_path / "sweep").exists()
