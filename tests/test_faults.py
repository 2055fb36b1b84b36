"""Runs that never lose work: a non-finite step, two runs on one workdir, a corrupt
checkpoint, an exception during or after a save, signals during an evaluation, resuming
after a crash, a run trained with a kernel this machine cannot run."""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import standard_checkpoint_handler

from tests.clirun import ROOT, CliRunner
from tests.support import TINY_FLAGS, checkpoint_params, make_tiny_config, restore_and_evaluate
from transformer.core.errors import ConfigError, RunError
from transformer.run import evaluator, experiment, lock
from transformer.run import step as step_lib
from transformer.run.config import parse
from transformer.run.state import run_state
from transformer.run.step import make_train_step
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import CONFIG_FILE, METRICS_FILE, read_metrics
from transformer.study import compare

CONFIG = os.path.join(ROOT, "configs", "default.py")
TINY_CONFIG = ("import sys\nsys.path.insert(0, {root!r})\n"
               "from tests.support import make_tiny_config\n"
               "def get_config():\n  return make_tiny_config()\n").format(root=ROOT)


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted tiny run (40 steps, checkpoints every 10): what resumed runs must equal."""
  workdir = str(tmp_path_factory.mktemp("straight") / "run")
  train_and_evaluate(parse(make_tiny_config()), workdir)
  return workdir


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
  """A config file of the `straight` run's config, for the CLIs."""
  path = tmp_path_factory.mktemp("configs") / "tiny.py"
  path.write_text(TINY_CONFIG)
  return str(path)


def _steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


def _assert_same(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _nan_loss_at(monkeypatch, config, steps):
  """Makes the loss NaN on the training batches of the given steps (1-based), recognised
  by a checksum of their targets (a fault in the data or the model at those steps only)."""
  checksum = lambda t: (t.reshape(-1) * np.arange(t.size)).sum()  # noqa: E731
  batches = iter(experiment.build(parse(config)).source.train_batches())
  sums = [int(checksum(next(batches)["targets"])) for _ in range(config.train.num_steps)]
  marks = [sums[s - 1] for s in steps]
  assert all(sums.count(m) == 1 for m in marks)
  real = step_lib.loss_head_metrics

  def poisoned(y, w_out, bias, targets, *args):
    sums = real(y, w_out, bias, targets, *args)
    bad = jnp.isin(checksum(targets), jnp.asarray(marks))
    return {**sums, "loss": jnp.where(bad, jnp.nan, sums["loss"])}

  monkeypatch.setattr(step_lib, "loss_head_metrics", poisoned)


# --------------------------------------------------------------------------- non-finite steps


def test_a_non_finite_step_is_not_applied(tiny_config):
  exp = experiment.build(parse(tiny_config()))
  step = jax.jit(make_train_step(exp.graphdef, exp.optimizer, exp.schedule, label_smoothing=0.0,
                                 seed=0))
  state = exp.init()
  ones = np.ones((2, 4), np.int32)
  batch = {"inputs": 5 * ones, "targets": 6 * ones, "targets_segmentation": ones}
  good, sums = step(state, batch)
  assert float(sums["nonfinite"]) == 0 and float(sums["grad_norm"]) > 0
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(good["params"]),
                                                      jax.tree.leaves(state["params"])))
  poisoned = jax.tree.map(lambda x: x, state)
  poisoned["params"]["embeddings"]["source_table"]["embedding"] = (
      state["params"]["embeddings"]["source_table"]["embedding"].at[5, 0].set(jnp.nan))
  after, sums = step(poisoned, batch)
  assert float(sums["nonfinite"]) == 1 and float(sums["loss"]) == 0 and int(after["step"]) == 1
  _assert_same(after["params"], poisoned["params"])  # nothing applied
  _assert_same(after["opt_state"], poisoned["opt_state"])


def test_nan_mid_run_stops_unsaved_and_the_resumed_run_is_exact(tmp_path, tiny_config,
                                                                 monkeypatch):
  config = tiny_config()  # 40 steps, checkpoints every 10
  skipping = tiny_config(**{"train.skip_nonfinite": 1})
  _nan_loss_at(monkeypatch, config, [25])  # a bad batch at step 25
  straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
  assert train_and_evaluate(parse(skipping), straight) == 40
  with pytest.raises(RunError, match=r"training diverged at step 25: .*\(last checkpoint: "
                                     r"step 20\)"):
    train_and_evaluate(parse(config), broken)
  assert _steps(broken) == [10, 20]  # nothing after the bad step was saved
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(checkpoint_params(broken, 20)))
  # resumes from 20, skips step 25 this time
  assert train_and_evaluate(parse(skipping), broken) == 40
  _assert_same(checkpoint_params(broken, 40), checkpoint_params(straight, 40))
  train = [r["step"] for r in read_metrics(broken) if r["split"] == "train"]
  assert train == sorted(set(train))  # each logged step once


def test_skip_nonfinite_skips_a_few_bad_steps_in_a_row(tmp_path, tiny_config, monkeypatch):
  config = tiny_config(**{"train.skip_nonfinite": 2})
  _nan_loss_at(monkeypatch, config, [25, 26])
  assert train_and_evaluate(parse(config), str(tmp_path / "skips")) == 40
  skipped = {r["step"]: r["skipped_steps"] for r in read_metrics(str(tmp_path / "skips"))
             if r["split"] == "train"}
  assert skipped[30] == 2 and sum(skipped.values()) == 2  # logged every 10 steps
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(checkpoint_params(str(tmp_path / "skips"), 40)))
  _nan_loss_at(monkeypatch, config, [25, 26, 27])
  with pytest.raises(RunError, match="training diverged at step 27"):
    train_and_evaluate(parse(config), str(tmp_path / "three"))


def test_divergence_never_rotates_out_the_last_good_checkpoint(tmp_path, cli):
  workdir = str(tmp_path / "run")
  args = ["--config", CONFIG, "--workdir", workdir, *TINY_FLAGS,
          "--config.train.checkpoint_every=10", "--config.train.keep_checkpoints=2"]
  assert cli.run("train.py", *args, "--config.train.num_steps=30").returncode == 0
  good = checkpoint_params(workdir, 30)
  blowing_up = cli.run("train.py", *args, "--config.train.num_steps=60",  # finite, huge loss
                       "--config.train.learning_rate=1e9")
  assert blowing_up.returncode == 0, blowing_up.stderr
  assert _steps(workdir) == [30, 50, 60]  # the latest 2 and the lowest-loss one
  nan = cli.run("train.py", *args, "--config.train.num_steps=90",
                "--config.train.learning_rate=1e30")
  assert nan.returncode == 1
  lines = nan.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: training diverged at step 61"), nan.stderr
  assert _steps(workdir) == [30, 50, 60]
  _assert_same(checkpoint_params(workdir, 30), good)


# --------------------------------------------------------------------------- workdir lock


def test_lock_refuses_a_second_owner_and_names_the_first(tmp_path):
  first = lock.WorkdirLock(str(tmp_path))
  first.acquire()
  with pytest.raises(lock.Locked, match=rf"in use by pid {os.getpid()} on "):
    lock.WorkdirLock(str(tmp_path)).acquire()
  first.release()
  assert not (tmp_path / lock.LOCK_FILE).exists()
  with lock.WorkdirLock(str(tmp_path)):
    assert (tmp_path / lock.LOCK_FILE).exists()


def _write_lock(path, **owner):
  path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0, **owner}))


def test_stale_locks_are_taken_over_with_a_log_line(tmp_path, caplog):
  path = tmp_path / lock.LOCK_FILE
  gone = subprocess.Popen(["true"])
  gone.wait()
  _write_lock(path, **lock._machine(), pid=gone.pid, heartbeat=time.time())  # died here
  with caplog.at_level(logging.WARNING, logger="transformer"):
    with lock.WorkdirLock(str(tmp_path)):
      assert json.loads(path.read_text())["pid"] == os.getpid()
  assert f"took over the stale lock of pid {gone.pid}" in caplog.text
  assert "that process has exited" in caplog.text
  _write_lock(path, heartbeat=time.time() - 2 * lock.STALE_SECONDS)  # a dead host
  with lock.WorkdirLock(str(tmp_path)):
    pass
  assert "sent no heartbeat for" in caplog.text
  _write_lock(path, heartbeat=time.time() - 10)  # a live host
  with pytest.raises(lock.Locked, match=r"in use by pid 1 on elsewhere"):
    lock.WorkdirLock(str(tmp_path)).acquire()


def test_a_second_run_on_a_workdir_is_refused_and_the_first_finishes_intact(tmp_path, cli):
  workdir = str(tmp_path / "run")
  args = ["--config", CONFIG, "--workdir", workdir, *TINY_FLAGS,
          "--config.train.checkpoint_every=50"]
  first = subprocess.Popen([sys.executable, "train.py", *args, "--config.train.num_steps=150"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    for line in first.stdout:
      if "step 10/" in line:
        break
    second = cli.run("train.py", *args, "--config.train.num_steps=150", "--config.seed=7")
    out, _ = first.communicate(timeout=300)
  finally:
    first.kill()
  assert second.returncode == 1
  lines = second.stderr.strip().splitlines()
  assert len(lines) == 1 and f"is in use by pid {first.pid} on" in lines[0], second.stderr
  assert first.returncode == 0, out
  with open(os.path.join(workdir, CONFIG_FILE)) as f:
    assert json.load(f)["seed"] == 0
  train = [r["step"] for r in read_metrics(workdir) if r["split"] == "train"]
  assert train == list(range(5, 151, 5))
  assert _steps(workdir) == [50, 100, 150] and not (tmp_path / "run" / lock.LOCK_FILE).exists()


# --------------------------------------------------------------------------- checkpoints


def _truncate_data_files(step_dir):
  """Every array data file of the state: which file holds the params (the only part
  evaluation restores) and which the optimizer state varies from save to save."""
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  assert files
  for name in files:
    with open(name, "r+b") as f:
      f.truncate(16)


# tensorstore leaves coroutines of the failed reads unawaited: noise, not a failure
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoints_fall_back_to_the_newest_that_restores(tmp_path, tiny_config,
                                                                    straight, caplog, cli,
                                                                    tiny_file):
  run = str(tmp_path / "run")
  train_and_evaluate(parse(tiny_config(**{"train.num_steps": 30})), run)
  _truncate_data_files(os.path.join(run, "checkpoints", "30"))
  os.remove(os.path.join(run, "checkpoints", "20", "state", "_METADATA"))
  with caplog.at_level(logging.WARNING, logger="transformer"):
    step, _, _ = restore_and_evaluate(run)
  assert step == 10
  assert "the checkpoint at step 30" in caplog.text and "the checkpoint at step 20" in caplog.text
  assert "never retrieved" not in caplog.text  # one line per checkpoint, not tensorstore's dumps
  assert _steps(run) == [10, 20, 30]  # eval leaves the bad ones where they are
  resumed = cli.run("train.py", "--config", tiny_file, "--workdir", run)  # as a user resumes
  assert resumed.returncode == 0, resumed.stderr
  assert resumed.stderr == ""  # the failed reads' tracebacks went to the run's log
  assert "moved to 30.unrestorable for inspection" in resumed.stdout
  assert "moved to 20.unrestorable for inspection" in resumed.stdout
  assert "resuming from the checkpoint at step 10" in resumed.stdout
  assert {"30.unrestorable", "20.unrestorable"} <= set(os.listdir(os.path.join(run, "checkpoints")))
  with open(os.path.join(run, "train.log")) as f:
    details = f.read()
  assert "restoring the checkpoint at step 30 failed" in details and "Traceback" in details
  _assert_same(checkpoint_params(run, 40), checkpoint_params(straight, 40))


def test_no_checkpoint_that_restores_is_one_line(tmp_path, straight, cli, tiny_file):
  run = str(tmp_path / "run")
  shutil.copytree(straight, run)
  for step in _steps(run):
    _truncate_data_files(os.path.join(run, "checkpoints", str(step)))
  result = cli.run("train.py", "--config", tiny_file, "--workdir", run)
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr  # not thousands of lines of tensorstore's tracebacks
  assert lines[0].startswith(f"error: no checkpoint in {run}/checkpoints restores (steps 40, "
                             "30, 20, 10") and "train.log" in lines[0], lines[0]
  assert result.stdout.count("does not restore") == 4


@pytest.mark.parametrize("damage", ['{"loss": 0.7', '["loss", 0.7]'], ids=["cut", "a list"])
def test_a_garbled_metrics_item_does_not_stop_a_resume(tmp_path, tiny_config, straight, caplog,
                                                      damage):
  """orbax writes each step's rotation metrics (the training loss) beside its state, and
  reads them all when a manager starts: one garbled file stopped every resume and every
  evaluation. It ranks the checkpoint for rotation only: the step is used unranked."""
  run = str(tmp_path / "run")
  shutil.copytree(straight, run)
  shutil.rmtree(os.path.join(run, "checkpoints", "40"))  # as if stopped after step 30
  with open(os.path.join(run, "checkpoints", "30", "metrics", "metrics"), "w") as f:
    f.write(damage)
  with caplog.at_level(logging.INFO, logger="transformer"):
    assert restore_and_evaluate(run)[0] == 30
    assert train_and_evaluate(parse(tiny_config()), run) == 40
  assert "the rotation metrics of the checkpoint at step 30" in caplog.text
  assert "resuming from the checkpoint at step 30" in caplog.text
  _assert_same(checkpoint_params(run, 40), checkpoint_params(straight, 40))


# the save's other items (orbax coroutines) are never awaited, and closing them can raise
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_exception_during_a_save_keeps_the_previous_checkpoint(tmp_path, tiny_config,
                                                                   straight, monkeypatch):
  config = tiny_config()
  run = str(tmp_path / "run")
  real_save, calls = standard_checkpoint_handler.StandardCheckpointHandler.async_save, []

  def full_disk(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    return real_save(self, *args, **kwargs)

  with monkeypatch.context() as patch:
    patch.setattr(standard_checkpoint_handler.StandardCheckpointHandler, "async_save", full_disk)
    with pytest.raises(RunError, match=r"saving the checkpoint at step 20 .* No space left"):
      train_and_evaluate(parse(config), run)
  assert _steps(run) == [10]
  assert train_and_evaluate(parse(config), run) == 40
  _assert_same(checkpoint_params(run, 40), checkpoint_params(straight, 40))


NO_SPACE = """
import runpy, sys
from orbax.checkpoint._src.handlers import standard_checkpoint_handler as handler
real, calls = handler.StandardCheckpointHandler.async_save, []

class NoSpace:  # a write of the save that fails in orbax's background thread
  def result(self, timeout=None):
    raise OSError(28, "No space left on device")

async def async_save(self, *args, **kwargs):
  calls.append(1)
  futures = await real(self, *args, **kwargs)
  return [*(futures or []), NoSpace()] if len(calls) == {failing_save} else futures

handler.StandardCheckpointHandler.async_save = async_save
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_full_disk_is_one_line_naming_the_failed_save(tmp_path, cli, tiny_file, tiny_config,
                                                       straight):
  """The third save (step 30) fails while it is written, in the background: its error
  surfaces at the next save (step 40), which must not take the blame; orbax's tracebacks
  (dozens on a real full disk) go to the run's log, not the console."""
  wrapper = tmp_path / "train_on_a_full_disk.py"
  wrapper.write_text(NO_SPACE.format(failing_save=3, script=os.path.join(ROOT, "train.py")))
  run = str(tmp_path / "run")
  result = cli.run(str(wrapper), "--config", tiny_file, "--workdir", run)
  assert result.returncode == 1, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith(f"error: saving the checkpoint at step 30 in {run}/checkpoints "
                             "failed (OSError: [Errno 28] No space left on device)"), lines[0]
  assert lines[0].endswith(f"(details: {run}/train.log)"), lines[0]
  assert _steps(run) == [10, 20]
  with open(os.path.join(run, "train.log")) as f:
    details = f.read()
  assert "Traceback" in details and "OSError: [Errno 28] No space left on device" in details
  assert train_and_evaluate(parse(tiny_config()), run) == 40  # from step 20
  _assert_same(checkpoint_params(run, 40), checkpoint_params(straight, 40))


def test_an_exception_after_a_save_commits_it_and_a_rerun_only_evaluates(tmp_path, tiny_config,
                                                                         monkeypatch):
  config = tiny_config(**{"train.num_steps": 20, "train.checkpoint_every": 20})
  run = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    def broken(*args, **kwargs):
      raise RuntimeError("evaluation broke")
    patch.setattr(evaluator.Evaluator, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation broke"):  # the final save in flight
      train_and_evaluate(parse(config), run)
  assert _steps(run) == [20] and not glob.glob(os.path.join(run, "checkpoints", "*tmp*"))
  trained = [r for r in read_metrics(run) if r["split"] == "train"]
  assert train_and_evaluate(parse(config), run) == 20
  records = read_metrics(run)
  assert [r for r in records if r["split"] == "train"] == trained  # nothing trained again
  assert {r["split"] for r in records if r["step"] == 20} == {"train", "valid", "longer"}


def test_resuming_after_a_crash_records_each_step_once(tmp_path, tiny_config, straight):
  config = tiny_config()
  run = str(tmp_path / "run")
  shutil.copytree(straight, run)
  for step in (30, 40):  # as if the process died after logging step 40, before these saves
    os.rename(os.path.join(run, "checkpoints", str(step)),
              os.path.join(run, "checkpoints", f"{step}.orbax-checkpoint-tmp-1"))
  assert train_and_evaluate(parse(config), run) == 40
  records = [(r["step"], r["split"]) for r in read_metrics(run)]
  assert len(records) == len(set(records))
  assert [s for s, split in records if split == "train"] == list(range(10, 41, 10))


def test_a_final_evaluation_cut_short_is_done_again_not_taken_for_finished(tmp_path, tiny_config,
                                                                           straight, caplog):
  """A process killed while appending the final evaluation's records (one write, a record
  per split) leaves some of them: the run is not finished (compare has no results for it,
  instead of mixing an earlier evaluation's values in), and training it again evaluates it
  again, recording each split once."""
  run = str(tmp_path / "run")
  shutil.copytree(straight, run)
  path = os.path.join(run, METRICS_FILE)
  with open(path) as f:
    whole = f.read()
  last = whole.splitlines(keepends=True)[-1]
  assert (json.loads(last)["step"], json.loads(last)["split"]) == (40, "longer")
  with open(path, "w") as f:
    f.write(whole[:-len(last) // 2])  # valid is recorded, longer cut mid-line
  assert run_state(run).note == ("its final evaluation (step 40) was cut short (longer not "
                                 "recorded): training it again evaluates it again")
  with pytest.raises(ConfigError, match=r"run has no results: its final evaluation \(step 40\) "
                                        "was cut short"):
    compare.compare([run])
  with caplog.at_level(logging.INFO, logger="transformer"):
    assert train_and_evaluate(parse(tiny_config()), run) == 40
  assert "already finished at step 40; evaluating" in caplog.text
  with open(path) as f:
    assert f.read() == whole  # the same evaluation again, each split's record once
  assert run_state(run).finished


def test_a_run_trained_with_cudnn_evaluates_and_resumes_on_cpu(tmp_path, tiny_config, caplog):
  config = tiny_config(**{"train.num_steps": 20, "model.attention.kernel": "xla"})
  run = str(tmp_path / "run")
  train_and_evaluate(parse(config), run)
  _, expected, _ = restore_and_evaluate(run)
  path = os.path.join(run, CONFIG_FILE)
  with open(path) as f:
    saved = json.load(f)
  saved["model"]["attention"]["kernel"] = "cudnn"  # as written by a run on a GPU
  with open(path, "w") as f:
    json.dump(saved, f)
  with caplog.at_level(logging.INFO, logger="transformer"):
    _, results, _ = restore_and_evaluate(run)
  assert "kernel cudnn -> xla for 3 layers" in caplog.text and "stand-in 'xla'" in caplog.text
  for split in ("valid", "longer"):
    np.testing.assert_allclose(results[split]["loss"], expected[split]["loss"], rtol=1e-6)
  resumed = tiny_config(**{"train.num_steps": 30, "model.attention.kernel": "reference"})
  assert train_and_evaluate(parse(resumed), run) == 30  # the kernel is not the model's identity


# --------------------------------------------------------------------------- signals


def _start(args):
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text, timeout=120):
  deadline = time.time() + timeout
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if text in line or time.time() > deadline:
      return "".join(lines)
  return "".join(lines)


def test_sigterm_during_an_evaluation_stops_it_between_batches(tmp_path):
  workdir = str(tmp_path / "run")
  args = ["train.py", "--config", CONFIG, "--workdir", workdir, *TINY_FLAGS,
          "--config.train.num_steps=10"]
  big_eval = "--config.eval.num_examples=16384"  # 2 x 1024 batches: a long evaluation
  proc = _start([*args, big_eval])
  try:
    _wait_for(proc, "step 10/10")
    time.sleep(1.0)  # inside the final evaluation
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert time.time() - signalled < 30, "the evaluation did not stop between batches"
  assert "stopped during the evaluation at step 10" in out
  assert _steps(workdir) == [10]  # the final checkpoint was saved before the evaluation

  proc = _start(["eval.py", "--workdir", workdir])  # eval.py stops between batches too
  try:
    _wait_for(proc, "evaluating step 10")
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM and "metrics were not written" in out, out
  assert not glob.glob(os.path.join(workdir, "eval_step_*"))

  rerun = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)  # a smaller evaluation: eval settings are not the run's
  assert rerun.returncode == 0, rerun.stderr
  assert "resuming from the checkpoint at step 10" in rerun.stdout
  assert "eval valid step 10" in rerun.stdout and "step 10/10" not in rerun.stdout


def test_a_second_signal_exits_at_once():
  code = ("import os, signal, time\n"
          "from transformer.run.cli import StopSignals\n"
          "with StopSignals() as stop:\n"
          "  os.kill(os.getpid(), signal.SIGINT)\n"
          "  assert stop() and stop.exit_status == 130\n"
          "  os.kill(os.getpid(), signal.SIGINT)  # work that does not poll, e.g. a compile\n"
          "  time.sleep(60)\n")
  started = time.time()
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 128 + signal.SIGINT and time.time() - started < 30, result.stderr
  assert "SIGINT again: exiting at once" in result.stderr


@pytest.mark.parametrize("stderr_to_file", [False, True], ids=["2>&1 | tee", "2>err | tee"])
def test_ctrl_c_with_the_output_through_a_closed_pipe_saves_first(tmp_path, stderr_to_file):
  """`train.py ... 2>&1 | tee log` and Ctrl-C: tee dies of the same signal, and every later
  write to the pipe fails: the signal handler's message, the log lines, the flush at exit.
  None of them may lose the checkpoint or change the exit status. With stderr elsewhere
  (`| tee log` leaves it on the terminal; a file here), the lines after the pipe died go
  there, the save message included (not only the workdir's train.log)."""
  workdir, err_path = str(tmp_path / "run"), tmp_path / "err"
  with open(err_path, "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config", CONFIG, "--workdir", workdir, *TINY_FLAGS,
         "--config.train.num_steps=100000", "--config.train.checkpoint_every=100000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=err if stderr_to_file else subprocess.STDOUT,
        text=True)
    try:
      _wait_for(proc, "step 10/")
      proc.stdout.close()  # the reader is gone
      time.sleep(0.5)  # log lines fail meanwhile
      proc.send_signal(signal.SIGINT)
      proc.wait(timeout=120)
    finally:
      proc.kill()
  assert proc.returncode == 128 + signal.SIGINT
  steps = _steps(workdir)
  assert len(steps) == 1 and steps[0] >= 10
  with open(os.path.join(workdir, "train.log")) as f:
    assert f"stopped at step {steps[0]}; checkpoint saved" in f.read()  # what tee would show
  if stderr_to_file:
    err = err_path.read_text().splitlines()
    assert err[0] == "(the reader of <stdout> is gone; what follows is written here)", err
    assert "SIGINT: stopping at the next step or evaluation batch (send it again to exit at " \
        "once)" in err
    assert f"stopped at step {steps[0]}; checkpoint saved" in err[-1], err[-3:]


def test_a_closed_stdout_fails_no_write_and_not_the_exit():
  """Where the CLIs write (logs.unbreakable_streams): once the reader of stdout's pipe is
  gone, the writes and the interpreter's flush at exit (status 120 and a traceback, had it
  failed) go to stderr, which `| tee` leaves on the terminal; with stderr the same broken
  pipe (`2>&1 | tee`), to the terminal if there is one, else to /dev/null."""
  code = ("import sys, time\n"
          "from transformer.run import logs\n"
          "logs.unbreakable_streams()\n"
          "time.sleep(0.5)  # the reader closes the pipe\n"
          "print('x' * 100000)\n"
          "print('left in the buffer for the flush at exit', end='')\n"
          "print('still writing', file=sys.stderr)\n")
  buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=buffered)
  proc.stdout.close()
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-500:]
  # (the write that failed may lose what its buffer held: the lines after it arrive whole)
  assert err.startswith("(the reader of <stdout> is gone; what follows is written here)\n"
                        "xxxx"), err[:200]
  assert "still writing\n" in err and "Traceback" not in err, err[-200:]
  assert err.endswith("left in the buffer for the flush at exit"), err[-200:]
  both = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=buffered, start_new_session=True)
  both.stdout.close()  # start_new_session: no terminal to fall back to
  assert both.wait(timeout=60) == 0


def test_sigterm_stops_a_sweep_after_saving_its_current_run(tmp_path):
  sweep_file = tmp_path / "sweep.py"
  sweep_file.write_text(
      "from tests.support import make_tiny_config\n"
      "from transformer.api import axis\n"
      "def get_config():\n"
      "  return make_tiny_config(**{'train.num_steps': 100000, 'train.checkpoint_every': 100000})\n"
      "def get_sweep():\n"
      "  return axis('seed', [0, 1])\n")
  proc = _start(["sweep.py", "--config", str(sweep_file), "--sweep_dir", str(tmp_path / "s")])
  try:
    _wait_for(proc, "step 20/")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert "checkpoint saved" in out and "training seed=1" not in out
  assert _steps(str(tmp_path / "s" / "seed=0"))[0] >= 20
  assert not (tmp_path / "s" / "seed=1").exists()
