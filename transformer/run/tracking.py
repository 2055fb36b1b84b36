"""Where a run's scalars go besides metrics.jsonl: TensorBoard always (summaries.py) and,
with train.wandb_project set, Weights & Biases (`pip install -e '.[wandb]'`).

Both get the same scalars of the same records at the same steps: W&B names them
`SPLIT/METRIC` (`train/loss`, `valid/bleu`) against the training step (the `step` metric,
not W&B's own counter). A workdir is one W&B run: its id is made once and kept in
WORKDIR/wandb_run_id, and every later invocation on the workdir (a resume, more steps)
continues that run. A W&B run begun part-way through (the project set on a resumed run) is
first given the records metrics.jsonl already holds; steps trained again after a crash are
not sent again (metrics.jsonl rewrites them; W&B's history only grows), so each (split,
step) is sent once, and the values an exact resume reproduces. The typed config is the run's
config (its values of the latest invocation). Process 0 only. W&B's own files go under
WORKDIR/wandb (a local workdir; for a bucket workdir, wandb's default: WANDB_DIR or
./wandb). WANDB_MODE=offline logs without a network (`wandb sync WORKDIR/wandb/offline-run-*`
uploads later); WANDB_API_KEY or `wandb login` for online runs.
"""

import logging
import os
import uuid

import jax
from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError, one_line
from transformer.run import config as config_lib
from transformer.run import summaries

log = logging.getLogger("transformer")
RUN_ID_FILE = "wandb_run_id"
INSTALL = "pip install -e '.[wandb]'"


def check(train) -> None:
  """A ConfigError if train.wandb_project is set and wandb does not import (before anything
  is written)."""
  if not train.wandb_project:
    return
  try:
    import wandb  # noqa: F401, PLC0415 - optional: only with train.wandb_project
  except ImportError as e:
    raise ConfigError(f"train.wandb_project={train.wandb_project!r} logs to Weights & Biases, "
                      f"but wandb does not import ({one_line(e)}); install it: {INSTALL}, or "
                      "leave train.wandb_project empty") from None


def run_id(workdir: str) -> str | None:
  """The W&B run id of the run in `workdir`, or None if it has none yet."""
  path = epath.Path(workdir) / RUN_ID_FILE
  if not path.exists():
    return None
  return path.read_text().strip() or None


class WandB:
  """Scalars and the config of the run in `workdir` to its W&B run (module docstring); a
  no-op on processes > 0. `logged`: metrics.jsonl's records before this invocation trimmed
  them on resuming from the checkpoint at `resumed_at`."""

  def __init__(self, cfg, workdir: str, resumed_at: int = 0, logged: tuple[dict, ...] = ()):
    self.run, self.splits, self.sent = None, set(), set()
    if jax.process_index() != 0:
      return
    import wandb  # noqa: PLC0415 - optional: only with train.wandb_project

    train = cfg.train
    known = run_id(workdir)
    new = known is None
    if new:
      known = uuid.uuid4().hex[:12]  # what wandb makes, longer: unique in a project
    local, name = storage.is_local(workdir), os.path.basename(storage.absolute(workdir).rstrip("/"))
    try:
      self.run = wandb.init(
          project=train.wandb_project, entity=train.wandb_entity or None,
          group=train.wandb_group or None, name=name, id=known,
          resume="allow", dir=os.path.abspath(workdir) if local else None,
          config=config_lib.to_dict(cfg))
    except wandb.errors.Error as e:
      reason = one_line(e, (wandb.errors.Error,)).rstrip(".")
      raise RunError(f"Weights & Biases (train.wandb_project={train.wandb_project!r}): "
                     f"{reason}; log in (`wandb login` or WANDB_API_KEY), or set "
                     "WANDB_MODE=offline to log locally and `wandb sync` later") from None
    if new:  # once the run exists: every later invocation continues it
      storage.write(storage.join(workdir, RUN_ID_FILE), known + "\n")
    self.run.define_metric("step")
    log.info("W&B run %s (%s) in project %s%s", known, "new" if new else "continued",
             train.wandb_project, f", group {train.wandb_group}" if train.wandb_group else "")
    if new:  # a run begun part-way: the history so far
      for record in logged:
        if record["step"] <= resumed_at:
          self.scalars(record["split"], record["step"], record)
    else:  # already sent by the invocations before: not twice
      self.sent = {(r["split"], r["step"]) for r in logged}

  def scalars(self, split: str, step: int, values: dict) -> None:
    if self.run is None or (split, step) in self.sent:
      return
    if split not in self.splits:
      self.run.define_metric(f"{split}/*", step_metric="step")
      self.splits.add(split)
    self.run.log({"step": step, **{f"{split}/{name}": value
                                   for name, value in summaries.numbers(values).items()}})

  def close(self, failed: bool = False) -> None:
    if self.run is not None:
      self.run.finish(exit_code=1 if failed else 0)
      self.run = None


class Writers:
  """Every writer of a run's scalars: TensorBoard, and W&B with train.wandb_project (the
  arguments: WandB's)."""

  def __init__(self, cfg, workdir: str, resumed_at: int = 0, logged: tuple[dict, ...] = ()):
    self.writers = [summaries.TensorBoard(workdir, resumed_at=resumed_at)]
    if cfg.train.wandb_project:
      self.writers.append(WandB(cfg, workdir, resumed_at, logged))

  def scalars(self, split: str, step: int, values: dict) -> None:
    for writer in self.writers:
      writer.scalars(split, step, values)

  def close(self, failed: bool = False) -> None:
    """Closes every writer; `failed`: the run stopped on an error (W&B marks it failed)."""
    for writer in self.writers:
      writer.close(failed)
