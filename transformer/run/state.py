"""The state of the run in a workdir, read from its files alone: finished, failed or
unfinished, and why a run has no results. Every reader asks here: a sweep deciding what to
train, its report, compare.py.

A run is finished when its metrics record its final held-out evaluation (at
train.num_steps) whole (workdir.evaluation) and it has trained no further (no record or
checkpoint past train.num_steps): its results are that evaluation's records. Its
checkpoints may have been deleted since; the metrics are what count. An evaluation cut
short (a process killed while appending its records) is not one: the run is unfinished,
and training it again evaluates it again. A failed run is one whose last failure is
recorded (FAILURE_FILE, which a sweep writes when a run fails and removes when it
finishes), whichever process reads it.
"""

import dataclasses
import json
import time

import jax
from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.run import checkpoint
from transformer.run import workdir as workdir_lib

FAILURE_FILE = "failed.json"
STATES = ("finished", "failed", "unfinished")


@dataclasses.dataclass(frozen=True)
class RunState:
  """A run's state (one of STATES) as a run of `num_steps` training steps; without results,
  what to say of it (`note`); finished, its final evaluation (`final`: {held-out split:
  record}, its results)."""

  state: str
  num_steps: int
  note: str = ""
  final: dict[str, dict] | None = None

  @property
  def finished(self) -> bool:
    return self.state == "finished"


def run_state(workdir: str, num_steps: int | None = None) -> RunState:
  """The state of the run in `workdir` (module docstring) trained to `num_steps` (None: its
  saved config's train.num_steps; a ConfigError if that config does not read)."""
  if num_steps is None:
    num_steps = workdir_lib.saved_config(workdir).train.num_steps
  records = workdir_lib.read_metrics(workdir)
  steps = checkpoint.steps(workdir)
  final, missing = workdir_lib.evaluation(records, num_steps)
  last = max([r["step"] for r in records] + steps[-1:], default=0)
  if final is not None and last <= num_steps:
    return RunState("finished", num_steps, final=final)
  if failure := read_failure(workdir):
    return RunState("failed", num_steps, f"failed: {failure['error']}")
  if last > num_steps:
    note = (f"trained to step {last}, past train.num_steps={num_steps}: it has no final "
            f"evaluation at step {num_steps}")
  elif missing:
    note = (f"its final evaluation (step {num_steps}) was cut short ({', '.join(missing)} not "
            "recorded): training it again evaluates it again")
  elif steps and steps[-1] == num_steps:
    note = (f"trained to step {num_steps}, its final evaluation not recorded: training it "
            "again evaluates it")
  elif steps:
    note = f"checkpoint at step {steps[-1]} of {num_steps}: training, or stopped (resumable)"
  elif records:
    note = f"its {workdir_lib.METRICS_FILE} has no final evaluation (step {num_steps})"
  else:
    note = "not trained yet"
  return RunState("unfinished", num_steps, note)


def record_failure(workdir: str, error: Exception) -> None:
  """Writes why the run in `workdir` failed (process 0), for the readers of every later
  invocation and worker; a run that finishes later removes it (clear_failure)."""
  if jax.process_index() != 0:
    return
  steps = checkpoint.steps(workdir)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  storage.write(storage.join(workdir, FAILURE_FILE), json.dumps({
      "error": " ".join(str(error).split()), "kind": type(error).__name__,
      "last_checkpoint": steps[-1] if steps else None,
      "time": time.strftime("%Y-%m-%d %H:%M:%S")}))


def read_failure(workdir: str) -> dict | None:
  """The record of the run's last failure ({"error", "kind", "last_checkpoint", "time"}),
  or None; a ConfigError naming the file if it is not such a record (a sweep writes it
  whole: storage.write)."""
  path = epath.Path(workdir) / FAILURE_FILE
  try:
    record = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    record = e
  if not (isinstance(record, dict) and isinstance(record.get("error"), str)):
    problem = (f"cannot be read ({type(record).__name__}: {record})"
               if isinstance(record, Exception) else "is not a record of a failure")
    raise ConfigError(f"{path} {problem}: the record of the run's failure is damaged; remove "
                      "it (the run is then unfinished, or finished if its metrics say so)")
  return record


def clear_failure(workdir: str) -> None:
  path = epath.Path(workdir) / FAILURE_FILE
  if jax.process_index() == 0 and path.exists():
    path.unlink()
