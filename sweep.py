"""Runs a sweep: python sweep.py --config configs/positions.py --sweep_dir DIR.

Checks every run's config, then trains every run of the config's get_sweep() into
DIR/<overrides>, skipping finished runs (and runs another process is training) and resuming
interrupted ones, then writes DIR/report.md and DIR/report.csv (mean ± std over seeds).
`--config.FIELD=VALUE` applies to every run (e.g. a smoke sweep with fewer steps);
`--only FIELD=V1,V2` trains and reports the runs with those values of a swept field only
(repeatable: fields combine, e.g. --only model.position=rotary,alibi --only seed=0). A run
that fails (it diverges, its data cannot be prepared) is recorded in its workdir and shown
in the report; the sweep goes on and exits with status 1 naming it. SIGINT or SIGTERM
saves the current run and exits with 128 + signal; a second signal exits at once.

Sharing a sweep:
  * workers: --num_workers N --worker I runs every N-th run (--print_commands prints the N
    commands); in a SLURM job array (`sbatch --array=0-N`) the worker index and count come
    from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT when the flags are not given;
  * hosts: with --distributed (or --coordinator_address ...) the processes of one
    multi-host job walk the same runs together, each run spanning all of them; process 0
    writes the report.
--report_only rewrites the report. The report gives each variant's mean and 95% t interval
of every metric over its seeds, the main metric's spread, and its paired differences
against --baseline VARIANT (default: the first variant with results); --success
'METRIC>=VALUE' (repeatable) adds each variant's rate of seeds that meet it.
"""

import os
import shlex
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from transformer.core import storage
from transformer.run import cli
from transformer.study import report, stats, sweep

config_flags.DEFINE_config_file("config", None, "A sweep config file (get_config and "
                                "get_sweep); --config.FIELD=VALUE overrides every run.")
flags.DEFINE_string("sweep_dir", None, "Directory holding one workdir per run and the report.")
flags.DEFINE_integer("worker", 0, "This worker's index (default: SLURM_ARRAY_TASK_ID, else 0).")
flags.DEFINE_integer("num_workers", 1, "Number of workers sharing the sweep (default: "
                     "SLURM_ARRAY_TASK_COUNT, else 1).")
flags.DEFINE_bool("print_commands", False, "Print one command per worker and exit.")
flags.DEFINE_bool("report_only", False, "Only write the report of the runs.")
flags.DEFINE_multi_string("only", [], "FIELD=VALUE[,VALUE...]: only the runs with one of "
                          "these values of a swept field (repeatable), for training and report.")
cli.define_report_flags()
cli.define_distributed_flags()
flags.mark_flags_as_required(["config", "sweep_dir"])


def workers() -> tuple[int, int]:
  """(worker, num_workers) from the flags, or from a SLURM job array's environment."""
  f, env = flags.FLAGS, os.environ
  if not f["worker"].present and not f["num_workers"].present and "SLURM_ARRAY_TASK_ID" in env:
    first = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
    return int(env["SLURM_ARRAY_TASK_ID"]) - first, int(env["SLURM_ARRAY_TASK_COUNT"])
  return f.worker, f.num_workers


def main(argv):
  cli.no_arguments(argv)
  f = flags.FLAGS
  path, overrides = f["config"].config_filename, f["config"].override_values
  worker, num_workers = workers()
  if f.print_commands:
    extra = [f"--config.{field}={value}" for field, value in overrides.items()]
    extra += [f"--only={spec}" for spec in f.only]
    extra += [f"--baseline={f.baseline}"] * (f.baseline is not None)
    extra += [f"--success={spec}" for spec in f.success]
    for i in range(num_workers):
      print(shlex.join([sys.executable, "sweep.py", "--config", path, "--sweep_dir",
                        f.sweep_dir, *extra, f"--num_workers={num_workers}", f"--worker={i}"]))
    return
  cli.start_distributed()
  cli.setup_logging()
  failed = {}
  with cli.StopSignals() as stop, cli.one_line_errors():
    thresholds = [stats.parse_threshold(spec) for spec in f.success]
    if f.baseline is not None:  # before anything trains
      report.check_baseline(f.baseline, list(dict.fromkeys(
          run.variant for run in sweep.runs(path, f.sweep_dir, overrides, f.only))))
    if not f.report_only:
      _, failed = sweep.run(path, f.sweep_dir, worker, num_workers, stop, overrides, f.only)
    if stop.exit_status:
      sys.exit(stop.exit_status)
    if jax.process_index() == 0:
      md_path, csv_path = report.write(path, f.sweep_dir, overrides, f.only, f.baseline,
                                       thresholds)
      print(storage.read_text(md_path))
      print(f"report written to {md_path} and {csv_path}")
  if failed:
    print(f"error: {len(failed)} run(s) failed (recorded in their workdirs, shown in the "
          "report): " + "; ".join(f"{name}: {' '.join(e.split())}" for name, e in failed.items()),
          file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
