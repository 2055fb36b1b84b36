"""Training: one jitted train step over a device mesh (step.py; its loss: batch_sums),
orbax checkpoints, exact resume.

What a run guarantees, whatever fails:
  * the config is validated whole (experiment.build), the run it starts from checked
    (train.init_from: init_from.py), and the data read and checked (DataSource.load),
    before anything is written;
  * the workdir is locked (lock.py), so two runs never write into one;
  * a step whose loss, gradient or update is not finite is not applied; more than
    `train.skip_nonfinite` of them in a row stop the run (RunError) before anything
    trained after them is saved, and rotation keeps the lowest-loss checkpoint;
  * a checkpoint in flight is committed (or cleanly abandoned) on every way out, and the
    final one is saved before the final evaluation;
  * a stop request (signal) is honoured between steps and between evaluation batches, and
    reported once its checkpoint is committed: the loop dispatches a step only once the one
    before the last has finished, so the step it stops at is at most one step ahead of the
    device (JAX's asynchronous dispatch would otherwise run it up to train.log_every steps
    ahead, and "the next step" would come that many steps later);
  * metrics.jsonl and the trackers record each step once: a run that goes on from its
    newest checkpoint, or begins again from scratch without one, first drops the records
    after it, and an evaluation cut short there is done again (workdir.truncate_metrics);
  * WORKDIR/train.log holds the run's log lines and the details of what failed (logs.py).
"""

import logging
import time
from collections.abc import Callable

import jax

from transformer.core import storage
from transformer.core.errors import Interrupted, RunError
from transformer.run import (checkpoint, compile_cache, experiment, init_from, lock, logs,
                             sharding, tracking)
from transformer.run import workdir as workdir_lib
from transformer.run.config import Config
from transformer.run.evaluator import Evaluator, check_split_lengths
from transformer.run.progress import log_eval, log_eval_start, log_train, timing_first_call
from transformer.run.step import compile_step

log = logging.getLogger("transformer")


def train_and_evaluate(cfg: Config, workdir: str,
                       should_stop: Callable[[], bool] = lambda: False) -> int:
  """Trains to cfg.train.num_steps, resuming from the newest checkpoint in `workdir` that
  restores, and evaluates at the end (and every train.eval_every steps).

  `should_stop` is polled between steps and between evaluation batches; once it returns
  True the state is saved and training returns early. Returns the step reached. Raises
  ConfigError for a bad config or workdir (before anything is written) and RunError when
  the run cannot go on (the workdir is locked, training diverged, no checkpoint restores).
  """
  exp = experiment.build(cfg, workdir, announce=False)  # said once every check has passed
  workdir_lib.check_usable(workdir)
  has_checkpoints = checkpoint.has_checkpoints(workdir)
  workdir_lib.check_identity(cfg, workdir, has_checkpoints)
  workdir_lib.read_metrics(workdir)  # a damaged metrics log: its error before any writing
  # the parameters to start from, checked (once the run has a checkpoint: its own)
  source = None if has_checkpoints else init_from.check(exp, workdir)
  # The data is read and checked before anything is written (the workdir and its lock
  # included): a tokenizer is trained in memory, from a pass over the corpus that checks it.
  exp.source.load(has_checkpoints)
  splits = exp.source.eval_splits(exp.train.eval_examples)
  check_split_lengths(exp, splits)
  with lock.hold(workdir):
    experiment.announce_kernels(exp)  # the run begins: nothing was said before a refusal
    exp.source.prepare()  # writes the tokenizer it trained, encodes the training corpus
    workdir_lib.write_config(cfg, workdir)
    with logs.run_log(workdir):  # from the first file of the run on: WORKDIR/train.log
      return _run(exp, workdir, splits, should_stop, source)


def _run(exp: experiment.Experiment, workdir: str, splits: dict,
         should_stop: Callable[[], bool], source: init_from.Source | None) -> int:
  mngr = checkpoint.manager(workdir, keep=exp.train.keep_checkpoints)
  loop, finished, before = None, False, compile_cache.counts()
  try:
    loop = _Loop(exp, workdir, mngr, splits, should_stop, source)
    step = loop.run()
    finished = True
    return step
  finally:
    checkpoint.finish(mngr)
    if loop is not None:
      loop.writers.close(failed=not finished)
    after = compile_cache.counts()  # in the run's log: whether the cache served this run
    log.debug("compilation: %d program(s) compiled, %d loaded from the persistent cache",
              after["compiled"] - before["compiled"], after["loaded"] - before["loaded"])


class _Loop:
  """The training loop of one run, with its bookkeeping between steps."""

  def __init__(self, exp: experiment.Experiment, workdir: str, mngr, splits, should_stop,
               source: init_from.Source | None = None):
    self.exp, self.cfg, self.workdir, self.mngr = exp, exp.train, workdir, mngr
    self.splits, self.should_stop = splits, should_stop
    compiled = compile_step(exp)
    self.batch_sharding = compiled.batch_sharding
    self.train_step = timing_first_call(compiled.step, "the train step")
    abstract = jax.eval_shape(exp.init)
    # said before the initialisation compiles, a wait of its own
    n_params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    log.info("model: %s parameters; %d device(s)", f"{n_params:,}", exp.mesh.size)
    self.step, self.state, self.batches = checkpoint.restore(
        mngr, abstract, compiled.state_sharding,
        make_iterator=lambda: iter(exp.source.train_batches()))
    logged = workdir_lib.whole(workdir_lib.read_metrics(workdir))  # given to the trackers
    if self.step is None:  # also a run killed before its first checkpoint: from scratch
      self.state = (timing_first_call(compiled.init, "the initialisation")() if source is None
                    else init_from.initial_state(exp, compiled, source))
      self.step = 0
    else:
      log.info("resuming from the checkpoint at step %d in %s", self.step, mngr.directory)
    # the records of the steps to be trained (and of an evaluation cut short) go: each once
    workdir_lib.truncate_metrics(workdir, self.step)
    self.saved = self.step  # the newest step with a checkpoint (0: none yet)
    self.writers = tracking.Writers(exp.config, workdir, resumed_at=self.step, logged=logged)
    self.trace_from = self.step + self.cfg.log_every - self.step % self.cfg.log_every
    self.tracing = False
    self.pending: list[dict] = []  # metric sums of the steps not yet logged
    self.unchecked: list[tuple[int, dict]] = []  # steps not yet checked for non-finite sums
    self.in_a_row = 0  # non-finite steps in a row
    self.last_loss = float("inf")
    self.evaluator = Evaluator(exp, sampling=exp.eval.sampling, seed=exp.eval.sample_seed)

  def run(self) -> int:
    cfg = self.cfg
    self._log_finished()
    try:
      if 0 < self.step < cfg.num_steps and self._is_eval_step(self.step):
        self._evaluate_if_missing()  # an evaluation that a stop interrupted
      self._train()
      if self.step == cfg.num_steps:
        checkpoint.wait(self.mngr)  # the final checkpoint exists before the evaluation
        self._evaluate_if_missing()
    except Interrupted:
      self._save(wait=True)
      log.warning("stopped during the evaluation at step %d; the checkpoint of that step is "
                  "saved; re-run the same command to resume (the evaluation runs again)",
                  self.step)
    finally:
      self._stop_trace()
    return self.step

  def _log_finished(self) -> None:
    """Says so when the run in the workdir has already trained train.num_steps (or more,
    when num_steps was lowered), and what is left to do."""
    if self.step < self.cfg.num_steps:
      return
    evaluated = workdir_lib.has_evaluation(self.workdir, self.step)
    todo = ("evaluating" if self.step == self.cfg.num_steps and not evaluated
            else "nothing to do")
    past = (f", past train.num_steps={self.cfg.num_steps}" if self.step > self.cfg.num_steps
            else "")
    log.info("already finished at step %d%s; %s", self.step, past, todo)

  def _is_eval_step(self, step: int) -> bool:
    return step == self.cfg.num_steps or bool(self.cfg.eval_every
                                                and step % self.cfg.eval_every == 0)

  def _train(self) -> None:
    cfg = self.cfg
    interval_start, interval_steps, timed_steps, timed_seconds = time.time(), 0, 0, 0.0
    compiling = True  # the first call compiles the step (or loads it): not training time
    previous = None  # the metrics of the step dispatched before the last
    while self.step < cfg.num_steps:
      if self.should_stop():
        self._save(wait=True)
        log.warning("stopped at step %d; %s; re-run the same command to resume", self.step,
                    "checkpoint saved" if self.saved else "nothing trained yet")
        return
      self._profile()
      batch = jax.make_array_from_process_local_data(self.batch_sharding, next(self.batches))
      self.state, metrics = self.train_step(self.state, batch)
      if compiling:  # its compilation returned once the step was dispatched
        interval_start, compiling = time.time(), False
      if previous is not None:
        jax.block_until_ready(previous)  # one step in flight at most (module docstring)
      previous = metrics
      self.step += 1
      self.pending.append(metrics)
      self.unchecked.append((self.step, metrics))
      interval_steps += 1
      if self.step % cfg.log_every == 0 or self.step == cfg.num_steps:
        self._check_finite()  # also waits for the dispatched steps: time them to completion
        elapsed = time.time() - interval_start
        timed_steps, timed_seconds = timed_steps + interval_steps, timed_seconds + elapsed
        record = log_train(self.step, cfg.num_steps, self.pending, elapsed, interval_steps,
                           eta_seconds=timed_seconds / timed_steps * (cfg.num_steps - self.step))
        self._write(record)
        if record["skipped_steps"] < interval_steps:
          self.last_loss = record["loss"]
        self.pending, interval_start, interval_steps = [], time.time(), 0
      if self.step % cfg.checkpoint_every == 0 or self.step == cfg.num_steps:
        self._save()
      if self.step < cfg.num_steps and self._is_eval_step(self.step):
        eval_start = time.time()
        self._evaluate()
        interval_start += time.time() - eval_start  # evaluation time is not training throughput

  def _profile(self) -> None:
    """train.profile_steps > 0: traces that many steps, from the end of the first logging
    interval (past compilation), into WORKDIR/profile (TensorBoard's profile plugin or
    Perfetto read it); process 0."""
    if not self.cfg.profile_steps or jax.process_index() != 0:
      return
    if self.step == self.trace_from:
      jax.profiler.start_trace(storage.join(self.workdir, "profile"))
      self.tracing = True
    elif self.tracing and self.step == self.trace_from + self.cfg.profile_steps:
      self._stop_trace()

  def _stop_trace(self) -> None:
    if self.tracing:
      jax.block_until_ready(self.state)
      jax.profiler.stop_trace()
      self.tracing = False
      log.info("profile of steps %d-%d written to %s", self.trace_from + 1,
               self.step, storage.join(self.workdir, "profile"))

  def _check_finite(self) -> None:
    """Raises RunError once more than train.skip_nonfinite steps in a row were not finite."""
    flags = jax.device_get([m["nonfinite"] for _, m in self.unchecked])
    for (step, _), bad in zip(self.unchecked, flags):
      if not bad:
        self.in_a_row = 0
        continue
      self.in_a_row += 1
      if self.in_a_row > self.cfg.skip_nonfinite:
        last = f"step {self.saved}" if self.saved else "none"
        raise RunError(
            f"training diverged at step {step}: the loss, a gradient or the update is not "
            f"finite (NaN or inf); that update was not applied and nothing trained since "
            f"was saved (last checkpoint: {last}). Lower train.learning_rate (now "
            f"{self.cfg.learning_rate}), raise train.warmup_steps or set "
            f"train.grad_clip_norm; train.skip_nonfinite=N skips up to N such steps in a row")
      log.warning("step %d: the loss or a gradient is not finite; the update was skipped "
                  "(%d in a row; train.skip_nonfinite=%d)", step, self.in_a_row,
                  self.cfg.skip_nonfinite)
    self.unchecked = []

  def _save(self, wait: bool = False) -> None:
    """Saves the state at the current step unless it is saved: only after checking the
    steps since the last check (a diverged state is never saved). The training loss since
    the last log line ranks the checkpoint for rotation. `wait`: until it is committed
    (before a stop is reported as saved; RunError if it failed)."""
    if self.step != self.saved:
      self._check_finite()
      totals = jax.device_get([(m["loss"], m["tokens"]) for m in self.pending])
      tokens = sum(float(t) for _, t in totals)
      loss = sum(float(x) for x, _ in totals) / tokens if tokens else self.last_loss
      checkpoint.save(self.mngr, self.step, self.state, self.batches, loss)
      self.saved = self.step
    if wait:
      checkpoint.wait(self.mngr)

  def _evaluate(self) -> None:
    log_eval_start(self.step, self.splits)
    results, _ = self.evaluator.evaluate(  # the final one with per-example results
        self.state["params"], self.splits, self.should_stop,
        per_example=self.step == self.cfg.num_steps)
    log_eval(self.step, results)
    self._write(*workdir_lib.evaluation_records(self.step, results))

  def _write(self, *records: dict) -> None:
    workdir_lib.append_metrics(self.workdir, *records)
    for record in records:
      self.writers.scalars(record["split"], record["step"], record)

  def _evaluate_if_missing(self) -> None:
    if not sharding.process0_decides(workdir_lib.has_evaluation(self.workdir, self.step)):
      self._evaluate()
