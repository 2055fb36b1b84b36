"""Evaluation-time sweeps: a trained sweep's runs evaluated again from their final
checkpoints under overrides of execution fields (a RoPE scaling, the attention kernel, ...;
core/fields.py marks them), without retraining, and reported against each run's unmodified
evaluation (study/sweep_eval_report.py).

  python sweep.py --sweep_dir sweeps/lm \\
      --eval_sweep model.position_settings.rotary.scaling=linear,ntk,yarn \\
      --eval_sweep model.position_settings.rotary.factor=2,4 \\
      --eval_sweep model.position_settings.rotary.original_length=64

Each --eval_sweep FIELD=V1,V2,... is an axis; the evaluations are every combination of one
value per axis (one value: the same override in each). Every override is checked on every
run before any work, as eval.py's --config.FIELD=VALUE (run/overrides.py): the field exists,
the value parses and passes its section's checks, and it is not the run's identity. Runs
that do not read an axis's field (a rotary scaling of a run without rotary positions) are
left out and listed in the report. An evaluation goes to the run's
eval_step_N,FIELD=VALUE,....json (overrides.suffix), beside and never over the plain
eval_step_N.json; one found there already, under the same overrides and decoding, is read
instead of evaluated again, so an interrupted eval sweep goes on where it stopped. The
unmodified evaluation is the run's final evaluation, recorded in its metrics.jsonl when it
finished training; an override set equal to a run's own settings is that evaluation.
"""

import dataclasses
import itertools
import json
import logging
from collections.abc import Sequence

from etils import epath

from transformer.core import fields, storage
from transformer.core.errors import ConfigError, RunError
from transformer.run import checkpoint, restored_run
from transformer.run import config as config_lib
from transformer.run import overrides as overrides_lib
from transformer.run import workdir as workdir_lib
from transformer.run.state import run_state
from transformer.study import sweep

log = logging.getLogger("transformer")
FOLDER = "eval_sweep"  # SWEEP_DIR/eval_sweep,FIELD=V1+V2,...: its report


@dataclasses.dataclass(frozen=True)
class EvalSweep:
  """The axes of an evaluation-time sweep: {dotted field: [value texts]}, in the order given."""

  axes: dict[str, list[str]]

  @property
  def combinations(self) -> list[dict[str, str]]:
    """{field: text} of every evaluation: one value per axis, in the axes' order."""
    return [dict(zip(self.axes, values)) for values in itertools.product(*self.axes.values())]

  @property
  def folder(self) -> str:
    """The name of the folder of its report: FOLDER and the axes (overrides.suffix)."""
    return FOLDER + overrides_lib.suffix({f: "+".join(v) for f, v in self.axes.items()})

  def specs(self) -> list[str]:
    return [f"{field}={','.join(values)}" for field, values in self.axes.items()]


def parse(specs: Sequence[str]) -> EvalSweep:
  """The EvalSweep of --eval_sweep's FIELD=V1,V2,... specs; a ConfigError for a spec that
  is not one, or a field given twice."""
  axes: dict[str, list[str]] = {}
  for spec in specs:
    field, eq, texts = spec.partition("=")
    field = field.strip().removeprefix("--config.").removeprefix("config.")
    values = [t.strip() for t in texts.split(",")]
    if not eq or not field or "" in values:
      raise ConfigError(f"--eval_sweep {spec}: expected FIELD=VALUE[,VALUE...], e.g. "
                        "--eval_sweep model.position_settings.rotary.scaling=linear,yarn")
    if field in axes:
      raise ConfigError(f"--eval_sweep {spec}: {field} is given twice; list its values once "
                        f"({field}={','.join(axes[field] + values)})")
    if len(set(values)) < len(values):
      raise ConfigError(f"--eval_sweep {spec}: a value is listed twice")
    axes[field] = values
  if not axes:
    raise ConfigError("--eval_sweep: give at least one FIELD=VALUE[,VALUE...]")
  return EvalSweep(axes)


def label(texts: dict[str, str]) -> str:
  """An evaluation's name in the report: its overrides, each field by its last two names."""
  return ",".join(f"{'.'.join(f.split('.')[-2:])}={t}" for f, t in texts.items())


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """A run under one combination of the eval sweep: `texts` ({field: text}) and what
  changes (`applied`, overrides.apply's; {}: the run's own settings, its unmodified
  evaluation), the file its metrics go to (None for {}) and the run's final step."""

  run: sweep.Run
  config: config_lib.Config  # the run's, before the overrides: its saved one once trained
  texts: dict[str, str]
  applied: dict
  path: str | None
  step: int

  @property
  def label(self) -> str:
    return label(self.texts)


def plan(runs: Sequence[sweep.Run], eval_sweep: EvalSweep
         ) -> tuple[list[Evaluation], dict[str, str]]:
  """(every evaluation of every run that reads the axes' fields, {run name: why it is left
  out}); a ConfigError, before any work, for an override that a run may not take (module
  docstring), an axis that no run reads, or a workdir holding another run than the sweep's."""
  planned, left_out = [], {}
  for run in runs:
    saved = epath.Path(storage.join(run.workdir, workdir_lib.CONFIG_FILE)).exists()
    try:  # the workdir holds this run, not another one of the same name
      workdir_lib.check_identity(run.config, run.workdir, has_checkpoints=True)
    except ConfigError as e:
      raise ConfigError(f"sweep run {run.name}: {e}") from None
    cfg = workdir_lib.saved_config(run.workdir) if saved else run.config
    read = fields.in_use(cfg)
    unread = [f for f in eval_sweep.axes if f not in read]
    if unread:
      left_out[run.name] = f"does not read {unread[0]}"
      continue
    step = run.config.train.num_steps  # the sweep's: what finishes the run
    for texts in eval_sweep.combinations:
      try:
        _, applied = overrides_lib.apply(cfg, texts)
      except ConfigError as e:
        raise ConfigError(f"--eval_sweep {label(texts)} on run {run.name}: {e}") from None
      path = (storage.join(run.workdir, f"eval_step_{step}{overrides_lib.suffix(applied)}.json")
              if applied else None)
      planned.append(Evaluation(run, cfg, texts, applied, path, step))
  if not planned:
    field = next(iter(eval_sweep.axes))
    raise ConfigError(f"--eval_sweep {field}: no run of the sweep reads it (" + "; ".join(
        f"{name} {why}" for name, why in list(left_out.items())[:3]) + "); narrow the sweep "
        "to the runs that do with --only")
  return planned, left_out


def recorded(ev: Evaluation) -> dict | None:
  """The results ({split: metrics}) of `ev` that an earlier evaluation left in its file, or
  None if there is no file; a ConfigError if the file holds an evaluation that is not this
  one (another step, overrides or decoding: eval.py's by hand), which is not replaced."""
  file = epath.Path(ev.path)
  if not file.exists():
    return None
  try:
    record = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise ConfigError(f"{ev.path} is not an evaluation's JSON ({e}); move it away to evaluate "
                      f"{ev.run.name} under {ev.label}") from None
  sampling, seed = restored_run.chosen_sampling(ev.config.eval, {})
  expected = {"step": ev.step, "averaged_steps": [ev.step], "beam_size": 1,
              "overrides": json.loads(json.dumps(ev.applied)),
              "sampling": {**dataclasses.asdict(sampling), "seed": seed}}
  found = {key: record.get(key) for key in expected} if isinstance(record, dict) else {}
  if found != expected or not isinstance(record.get("splits"), dict):
    differs = [k for k in expected if found.get(k) != expected[k]] or ["splits"]
    raise ConfigError(f"{ev.path} holds another evaluation (its {', '.join(differs)} differ "
                      "from this sweep's: the final step, greedy or the config's decoding, "
                      f"the overrides); move it away to evaluate {ev.run.name} under {ev.label}")
  return record["splits"]


def state(ev: Evaluation) -> tuple[str, dict | None]:
  """(what to do or why not, results if they exist): 'done' (the run's unmodified
  evaluation, or its file, with results), 'todo', or why the run has none."""
  run_now = run_state(ev.run.workdir, ev.step)
  if not run_now.finished:
    return f"the run is {run_now.state}: {run_now.note or 'no final evaluation'}", None
  if not ev.applied:
    return "done", run_now.final
  if (found := recorded(ev)) is not None:
    return "done", found
  if ev.step not in checkpoint.steps(ev.run.workdir):
    return (f"no checkpoint at its final step {ev.step} to evaluate (steps: "
            f"{checkpoint.steps(ev.run.workdir) or 'none'})"), None
  return "todo", None


def run(evaluations: Sequence[Evaluation], worker: int = 0, num_workers: int = 1,
        should_stop=lambda: False) -> tuple[list[str], dict[str, str]]:
  """Evaluates this worker's share (every num_workers-th) of the evaluations that are to do
  (state), after checking that every file found holds what it is named for. Returns
  (evaluated, {what: error} failed). A stop request raises Interrupted from the evaluation
  in progress; the ones done are kept."""
  todo = [state(ev)[0] == "todo" for ev in evaluations]  # checks every file first
  # the share of the whole list, as every worker sees it whatever the others have done
  share = [ev for ev, to_do in list(zip(evaluations, todo))[worker::num_workers] if to_do]
  done, failed = [], {}
  for i, ev in enumerate(share):
    if should_stop():
      break
    what = f"{ev.run.name} under {ev.label}"
    log.info("eval sweep: %d/%d: evaluating %s", i + 1, len(share), what)
    try:
      restored = restored_run.restore_run(ev.run.workdir, ev.step, 1, ev.texts)
      sampling, seed = restored_run.chosen_sampling(restored.experiment.eval, {})
      restored_run.evaluate_run(restored, ev.path, should_stop=should_stop, sampling=sampling,
                              seed=seed)
    except (RunError, ConfigError) as e:
      log.error("eval sweep: %s failed: %s", what, e)
      failed[what] = str(e)
      continue
    done.append(what)
  return done, failed
