"""Orbax checkpoints under `workdir/checkpoints`: each step holds the train state (a pytree
of arrays) as item `state` and the training data iterator's position as item `data`, so a
resumed run sees exactly the batches an uninterrupted run would.

Rotation keeps the latest `keep` checkpoints and, besides them, the one saved with the
lowest training loss (orbax's preservation policies), so a run that diverges cannot rotate
out the last good state. A checkpoint that does not restore (a truncated file, missing
metadata) is reported in one line and the one before it is used; training moves it aside
as STEP.unrestorable, where it stays for inspection and is never deleted. A step whose
rotation metrics do not read is used unranked. A save that fails (a full disk) is
reported under its own step, also when an asynchronous save's failure surfaces at the
next save; the details of failures go to the run's log (logs.py).
"""

import contextlib
import gc
import logging
import re

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError
from transformer.run import logs

log = logging.getLogger("transformer")
UNRESTORABLE = ".unrestorable"


def checkpoint_dir(workdir: str) -> str:
  return storage.join(storage.absolute(workdir), "checkpoints")


def steps(workdir: str) -> list[int]:
  """The finished checkpoint steps in `workdir`, ascending. Unlike a CheckpointManager
  (whose constructor all processes must call together), any one process may ask."""
  directory = checkpoint_dir(workdir)
  return sorted(ocp.utils.checkpoint_steps(directory)) if epath.Path(directory).is_dir() else []


def has_checkpoints(workdir: str) -> bool:
  return bool(steps(workdir))


class _Manager(ocp.CheckpointManager):
  """orbax's CheckpointManager, with three changes:

  * It never polls JAX's preemption sync point. cli.StopSignals owns that point: it is
    reached by the poll numbered one more than the highest number any process had passed
    when a SIGTERM's notice arrived, and orbax polls it with the number of the step it
    saves, a numbering of its own; its polls left a sync point that StopSignals' polls had
    already passed, and a distributed sweep ignored SIGTERM.
  * A step's `metrics` item (the training loss that ranks it for rotation) that does not
    read leaves the step unranked, with a warning, instead of failing the constructor:
    the state beside it is what matters, and restore() checks it.
  * It remembers the step of the save in flight (`in_flight`): an asynchronous save's
    failure surfaces at the next save or wait, and is reported under its own step."""

  in_flight: int | None = None

  def reached_preemption(self, step: int) -> bool:
    del step
    return False

  def metrics(self, step: int):
    try:
      metrics = super().metrics(step)
      if metrics is not None:
        float(_loss(metrics))
      return metrics
    except Exception as e:  # noqa: BLE001 - a truncated or edited JSON file, another layout
      log.warning("the rotation metrics of the checkpoint at step %d in %s do not read (%s: "
                  "%s); its state is used as it is, but it is not ranked for keeping", step,
                  self.directory, type(e).__name__, _one_line(e, 120))
      return None


def manager(workdir: str, *, keep: int | None = None, read_only: bool = False):
  """A CheckpointManager that saves asynchronously; with `keep`, rotation keeps the latest
  `keep` checkpoints and the one with the lowest `loss` metric (orbax writes the metrics
  beside each checkpoint only when best_fn is set)."""
  policy = None if keep is None else policies.AnyPreservationPolicy([
      policies.LatestN(keep),
      policies.BestN(get_metric_fn=_loss, reverse=True, n=1,
                     keep_checkpoints_without_metrics=False)])
  options = ocp.CheckpointManagerOptions(
      preservation_policy=policy, best_fn=_loss, best_mode="min", create=not read_only,
      read_only=read_only)
  return _Manager(checkpoint_dir(workdir), options=options)


def _loss(metrics) -> float:
  return metrics["loss"]


def save(mngr: _Manager, step: int, state, data_iterator, loss: float) -> None:
  """Starts an asynchronous save of `state` and the data iterator's position at `step`
  (never replaces an existing step), after the save before it has committed; `loss` ranks
  it for rotation. RunError if this save or the one before failed."""
  if step in mngr.all_steps():
    return
  wait(mngr)  # orbax would wait too, and report the failure of the save before as this one's
  try:
    mngr.save(step, force=True, metrics={"loss": loss}, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)))
  except Exception as e:  # noqa: BLE001 - a full disk, a lost mount, ...
    raise _save_failed(mngr, step, e) from None
  mngr.in_flight = step


def wait(mngr: _Manager) -> None:
  """Waits for the save in flight to commit; RunError naming its step if it failed (the
  previous checkpoints stay whole: orbax writes a step into a temporary directory and
  renames it when done)."""
  step, mngr.in_flight = mngr.in_flight, None
  try:
    mngr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 - whatever the writers raised in their threads
    raise _save_failed(mngr, step, e) from None


def _save_failed(mngr: _Manager, step: int | None, e: Exception) -> RunError:
  """The RunError of a failed save, its traceback logged as details (the run's log)."""
  log.debug("saving the checkpoint at step %s failed", step, exc_info=e)
  which = f"the checkpoint at step {step}" if step is not None else "a checkpoint"
  return RunError(f"saving {which} in {mngr.directory} failed ({type(e).__name__}: "
                  f"{_one_line(e)}); the previous checkpoints are unaffected: re-run the same "
                  "command to resume from the last one")


def finish(mngr: _Manager) -> None:
  """Waits for the save in flight, then closes the manager; on the way out of a run that
  failed otherwise: a failed save is logged beside the failure that brought us here."""
  try:
    wait(mngr)
  except RunError as e:
    log.error("%s", e)
  finally:
    mngr.close()


def _one_line(e: Exception, limit: int = 240) -> str:
  """The message on one line, without tensorstore's payloads ([tensorstore_spec='{...}'],
  kilobytes of JSON: the run's log has them); a long one keeps its start and its end,
  where chained messages name the cause ("...: No space left on device")."""
  text = " ".join(re.sub(r" ?\[\w+(?:\[\d+\])?='[^']*'\]", "", str(e)).split())
  return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"


class _FailedReads(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for tensorstore reads."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    return not ("exception was never retrieved" in record.getMessage()
                and "tensorstore_spec" in str(error))


_FAILED_READS = _FailedReads()


def _quiet_failed_reads() -> None:
  """When one read of a damaged checkpoint fails, tensorstore's other reads end as asyncio
  tasks whose exceptions nobody retrieves, and asyncio logs each (kilobytes of spec) when
  it is collected, some at exit. The failure is reported in one line: from the first one
  on, those logs are dropped, and what is already done is collected now."""
  asyncio_log = logging.getLogger("asyncio")
  if _FAILED_READS not in asyncio_log.filters:
    asyncio_log.addFilter(_FAILED_READS)
  gc.collect()


def _target(abstract_state, shardings):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      abstract_state, shardings)


def _quarantine(mngr: ocp.CheckpointManager, step: int) -> str:
  """Renames step's directory to STEP.unrestorable (orbax then ignores it); returns the name."""
  source = epath.Path(mngr.directory) / str(step)
  target, n = source.with_name(f"{step}{UNRESTORABLE}"), 1
  while target.exists():
    n += 1
    target = source.with_name(f"{step}{UNRESTORABLE}-{n}")
  if jax.process_index() == 0:
    source.rename(target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("checkpoint-quarantine")
  mngr.reload()
  return target.name


def restore(mngr: ocp.CheckpointManager, abstract_state, shardings, make_iterator=None,
            quarantine: bool = True):
  """Restores the newest checkpoint that restores into the structure and shapes of
  `abstract_state` (e.g. from jax.eval_shape), placed with `shardings` (a matching pytree),
  so a checkpoint loads onto whatever mesh the current run has. `make_iterator()` gives a
  fresh grain iterator to move to the saved data position. A checkpoint that fails is
  reported and, with `quarantine`, moved aside. Returns (step, state, data iterator), or
  (None, None, a fresh iterator) when there is no checkpoint; RunError when none restores."""
  failures = []
  for step in sorted(mngr.all_steps(), reverse=True):
    iterator = make_iterator() if make_iterator else None
    items = {"state": ocp.args.StandardRestore(_target(abstract_state, shardings))}
    if iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(iterator)
    try:
      return step, mngr.restore(step, args=ocp.args.Composite(**items))["state"], iterator
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
      _quiet_failed_reads()
      log.debug("restoring the checkpoint at step %d failed", step, exc_info=e)
      failures.append(step)
      moved = f"; moved to {_quarantine(mngr, step)} for inspection" if quarantine else ""
      log.warning("the checkpoint at step %d in %s does not restore (%s: %s)%s; trying the "
                  "one before", step, mngr.directory, type(e).__name__, _one_line(e), moved)
  if failures:
    steps = ", ".join(map(str, failures))
    raise RunError(f"no checkpoint in {mngr.directory} restores (steps {steps}, each reported "
                   "above); " + ("they were moved aside as STEP.unrestorable: re-running starts "
                                 "the run again from step 0" if quarantine else
                                 "move them aside to start again"))
  return None, None, make_iterator() if make_iterator else None


def restore_params(workdir: str, abstract_params, shardings, step: int | None = None,
                   count: int = 1, own_log: bool = True):
  """The parameters (only: no optimizer state is read) of checkpoint `step`, or of the
  newest one that restores; with count > 1 their mean over the last `count` checkpoints up
  to it, as the paper averages its last 5. Checkpoints that do not restore are reported and
  skipped (the details in `workdir`'s log; not `own_log`: in the log already open, another
  run's). Returns (steps averaged, params)."""
  if not epath.Path(checkpoint_dir(workdir)).is_dir():
    raise ConfigError(f"no checkpoints in {checkpoint_dir(workdir)}")
  # the details of checkpoints that do not restore
  with logs.run_log(workdir) if own_log else contextlib.nullcontext():
    mngr = _Manager(  # a PyTree handler reads a part of the saved state
        checkpoint_dir(workdir), item_handlers={"state": ocp.PyTreeCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    try:
      return _restore_params(mngr, abstract_params, shardings, step, count)
    finally:
      mngr.close()


def _restore_params(mngr, abstract_params, shardings, step, count):
  steps = sorted(mngr.all_steps())
  if not steps:
    raise ConfigError(f"no checkpoints in {mngr.directory}")
  if step is not None and step not in steps:
    raise ConfigError(f"no checkpoint at step {step} in {mngr.directory}; steps: {steps}")
  candidates = [s for s in steps if step is None or s <= step][::-1]
  target = {"params": _target(abstract_params, shardings)}
  restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
  used, total = [], None
  for s in candidates:
    try:
      params = mngr.restore(s, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          target, restore_args=restore_args, partial_restore=True)))["state"]["params"]
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for bad files
      _quiet_failed_reads()
      log.debug("restoring the checkpoint at step %d failed", s, exc_info=e)
      if s == step:
        raise RunError(f"the checkpoint at step {s} in {mngr.directory} does not restore "
                       f"({type(e).__name__}: {_one_line(e)})") from None
      log.warning("the checkpoint at step %d in %s does not restore (%s: %s); skipped", s,
                  mngr.directory, type(e).__name__, _one_line(e))
      continue
    total = params if total is None else jax.tree.map(jnp.add, total, params)
    used.append(s)
    if len(used) == count:
      return used[::-1], jax.tree.map(lambda x: x / count if count > 1 else x, total)
  if not used:
    raise RunError(f"no checkpoint in {mngr.directory} restores")
  raise ConfigError(f"cannot average {count} checkpoints: {mngr.directory} holds {len(used)} "
                    f"(that restore) up to step {used[0]}: {used[::-1]}")
