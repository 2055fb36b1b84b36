"""Runs a sweep: python sweep.py --config configs/positions.py --sweep_dir DIR.

Checks every run's config, then trains every run of the config's get_sweep() into
DIR/<overrides>, skipping finished runs (and runs another process is training) and resuming
interrupted ones, then writes DIR/report.md and DIR/report.csv (statistics over seeds: below).
`--config.FIELD=VALUE` applies to every run (e.g. a smoke sweep with fewer steps);
`--only FIELD=V1,V2` trains and reports the runs with those values of a swept field only
(repeatable: fields combine, e.g. --only model.position=rotary,alibi --only seed=0; `--only
all`: every run). A run that fails (it diverges, its data cannot be prepared) is recorded in
its workdir and shown in the report; the sweep goes on and exits with status 1 naming it.
SIGINT or SIGTERM saves the current run and exits with 128 + signal; a second signal exits
at once.

DIR remembers how it was run: DIR/sweep.json records the config file, the --config.FIELD
overrides and --only of the last invocation that trained. A later invocation (a re-run,
--report_only, a worker) may leave them out and runs with the recorded ones; another config
file or other overrides (given with --config or without it) are refused (they would give
other runs the same names); --only given again selects anew.

Sharing a sweep:
  * workers: --num_workers N --worker I runs every N-th run (--print_commands prints the N
    commands); in a SLURM job array (`sbatch --array=0-N-1`) the worker index and count come
    from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (and _MIN, _STEP) when the flags are
    not given;
  * hosts: with --distributed (or --coordinator_address ...) the processes of one
    multi-host job walk the same runs together, each run spanning all of them; process 0
    writes the report. A process that has not joined the others within --join_timeout
    seconds exits with one error line.
--report_only rewrites the report. The report gives each variant's mean and 95% t interval
of every metric over its seeds (inside the metric's declared range; none for one seed or a
value identical in every seed), the main metric's spread, and its paired differences
against --baseline VARIANT (default: the first variant with results; t interval over seeds,
and a paired bootstrap over seeds and examples where the runs recorded per-example results
of the same examples); --success 'METRIC>=VALUE' (repeatable) adds each variant's rate of
runs that meet it, failed runs counted as failures, with its Clopper–Pearson interval. The
report's header states every statistical choice.

Evaluation-time sweeps: --eval_sweep FIELD=V1,V2 (repeatable: every combination) evaluates
the finished runs again from their final checkpoints under those values of execution fields
(those eval.py's --config.FIELD=VALUE may override, e.g. a RoPE scaling), without retraining,
into each run's eval_step_N,FIELD=VALUE,....json, and writes DIR/eval_sweep,FIELD=V1+V2/
report.md and report.csv: every metric per variant and evaluation, and the paired
differences by seed against each run's unmodified final evaluation:
  python sweep.py --sweep_dir sweeps/lm --only model.position=rotary \\
      --eval_sweep model.position_settings.rotary.scaling=linear,yarn \\
      --eval_sweep model.position_settings.rotary.factor=4 \\
      --eval_sweep model.position_settings.rotary.original_length=64
"""

import os
import shlex
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from transformer.core import storage
from transformer.core.errors import ConfigError, Interrupted
from transformer.run import cli
from transformer.study import (
  report,
  stats,
  sweep,
  sweep_eval,
  sweep_eval_report,
  sweep_record,
  sweep_workers,
)

config_flags.DEFINE_config_file("config", None, "A sweep config file (get_config and "
                                "get_sweep); --config.FIELD=VALUE overrides every run. Default: "
                                "the one recorded in the sweep directory.")
flags.DEFINE_string("sweep_dir", None, "Directory holding one workdir per run and the report.")
flags.DEFINE_integer("worker", None, "This worker's index (default: from SLURM_ARRAY_TASK_ID, "
                     "else 0).")
flags.DEFINE_integer("num_workers", None, "Number of workers sharing the sweep (default: "
                     "SLURM_ARRAY_TASK_COUNT, else 1).")
flags.DEFINE_bool("print_commands", False, "Print one command per worker and exit.")
flags.DEFINE_bool("report_only", False, "Only write the report of the runs (with "
                  "--eval_sweep: of the evaluations made so far).")
flags.DEFINE_multi_string("only", [], "FIELD=VALUE[,VALUE...]: only the runs with one of "
                          "these values of a swept field (repeatable), for training and report; "
                          "`all`: every run. Default: the recorded selection.")
flags.DEFINE_multi_string("eval_sweep", [], "FIELD=VALUE[,VALUE...]: evaluate the trained runs "
                          "again under each value of this execution field (repeatable: every "
                          "combination) and report the paired differences; nothing trains.")
cli.define_report_flags()
cli.define_distributed_flags()
cli.define_cache_flag()
flags.mark_flags_as_required(["sweep_dir"])


RECORDED_CONFIG = []  # the --config FILE that parse_flags took from the sweep's record


def parse_flags(argv: list[str]) -> list[str]:
  """cli.parse_flags; --config.FIELD=VALUE overrides given without --config on a recorded
  sweep are read as fields of the recorded config file (which --config may be left out
  for), so that invocation() compares them with the recorded ones."""
  sweep_dir = cli.flag_value(argv, "sweep_dir")
  override = next((arg for arg in argv if arg.startswith(("--config.", "--noconfig."))), None)
  if cli.flag_value(argv, "config") is None and sweep_dir and override:
    with cli.one_line_errors():
      recorded = sweep_record.read(sweep_dir)
      if recorded is None:
        raise ConfigError(f"{override} sets a field of the sweep's config, and no --config "
                          f"FILE is given nor recorded ({sweep_record.path(sweep_dir)} does "
                          "not exist): give --config FILE")
    RECORDED_CONFIG.append(recorded.config)
    argv = [argv[0], "--config", recorded.config, *argv[1:]]
  return cli.parse_flags(argv)


def invocation() -> tuple[sweep_record.Invocation, bool]:
  """The runs' invocation: the flags given, completed from the sweep directory's record."""
  f = flags.FLAGS
  given = f.config is not None
  run, recorded = sweep_record.resolve(
      f.sweep_dir, f["config"].config_filename if given else None,
      f["config"].override_values if given else {}, f.only)
  return run, recorded or bool(RECORDED_CONFIG)


def print_commands(run: sweep_record.Invocation, num_workers: int) -> None:
  f = flags.FLAGS
  extra = [f"--baseline={f.baseline}"] * (f.baseline is not None)
  extra += [f"--success={spec}" for spec in f.success]
  extra += [f"--eval_sweep={spec}" for spec in f.eval_sweep]
  for i in range(num_workers):
    print(shlex.join([sys.executable, "sweep.py", *run.flags(), "--sweep_dir", f.sweep_dir,
                      *extra, f"--num_workers={num_workers}", f"--worker={i}"]))


def evaluate(run: sweep_record.Invocation, worker: int, num_workers: int, stop) -> dict:
  """The evaluation-time sweep (--eval_sweep) of the runs; returns the failed evaluations."""
  f = flags.FLAGS
  eval_sweep = sweep_eval.parse(f.eval_sweep)
  runs = sweep.runs(run.config, f.sweep_dir, run.overrides, run.only)
  evaluations, left_out = sweep_eval.plan(runs, eval_sweep)
  failed = {}
  if not f.report_only:
    try:
      _, failed = sweep_eval.run(evaluations, worker, num_workers, stop)
    except Interrupted:
      pass  # the evaluations done are kept; the signal's status below
  if stop.exit_status:
    sys.exit(stop.exit_status)
  first = runs[0].config
  md_path, csv_path = sweep_eval_report.write(
      f.sweep_dir, run.flags(), eval_sweep, evaluations, left_out,
      first.source.train_length(first.data, first.task))
  print(storage.read_text(md_path))
  print(f"report written to {md_path} and {csv_path}")
  return failed


def check_eval_flags() -> None:
  """A ConfigError for --eval_sweep's axes, or a flag it does not take."""
  f = flags.FLAGS
  if not f.eval_sweep:
    return
  sweep_eval.parse(f.eval_sweep)
  if f.baseline is not None or f.success:
    raise ConfigError(f"--{'baseline' if f.baseline is not None else 'success'} is for the "
                      "report of the trained runs; --eval_sweep reports each evaluation "
                      "against the same runs' unmodified one")
  if f.coordinator_address or f.distributed:
    raise ConfigError("--eval_sweep evaluates in one process per worker: give --num_workers N "
                      "--worker I to share it, without --coordinator_address or --distributed")


def main(argv):
  cli.no_arguments(argv)
  f = flags.FLAGS
  with cli.one_line_errors():  # before anything starts
    worker, num_workers = sweep_workers.assignment(f.worker, f.num_workers, os.environ)
    run, recorded = invocation()
    check_eval_flags()
  if f.print_commands:
    print_commands(run, num_workers)
    return
  cli.use_compilation_cache()
  cli.start_distributed()
  cli.setup_logging()
  if recorded:
    print(f"sweep: as recorded in {sweep_record.path(f.sweep_dir)}: {' '.join(run.flags())}")
  failed = {}
  with cli.StopSignals() as stop, cli.one_line_errors():
    thresholds = [stats.parse_threshold(spec) for spec in f.success]
    if f.eval_sweep:
      failed = evaluate(run, worker, num_workers, stop)
    else:
      if f.baseline is not None:  # before anything trains
        report.sweep_baseline(f.baseline, sweep.runs(run.config, f.sweep_dir, run.overrides,
                                                     run.only))
      if not f.report_only:
        _, failed = sweep.run(run.config, f.sweep_dir, worker, num_workers, stop, run.overrides,
                              run.only)
      if stop.exit_status:
        sys.exit(stop.exit_status)
      if jax.process_index() == 0:
        md_path, csv_path = report.write(run.config, f.sweep_dir, run.overrides, run.only,
                                         f.baseline, thresholds)
        print(storage.read_text(md_path))
        print(f"report written to {md_path} and {csv_path}")
  if failed:
    what = ("evaluation(s) failed" if f.eval_sweep else
            "run(s) failed (recorded in their workdirs, shown in the report)")
    print(f"error: {len(failed)} {what}: "
          + "; ".join(f"{name}: {' '.join(e.split())}" for name, e in failed.items()),
          file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
