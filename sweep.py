"""Runs a sweep: python sweep.py --config configs/positions.py --sweep_dir DIR.

Checks every run's config, then trains every run of the config's get_sweep() into
DIR/<overrides>, skipping finished runs (and runs another process is training) and resuming
interrupted ones, then writes DIR/report.md and DIR/report.csv (mean ± std over seeds).
SIGINT/SIGTERM save the current run and exit with 128 + signal; a second signal exits at once. Across hosts or workers: --num_workers N --worker I runs every N-th run (or
--print_commands prints the N commands); --report_only rewrites the report.
"""

import shlex
import sys

from absl import app, flags

from transformer import cli, sweep

flags.DEFINE_string("config", None, "A sweep config file (get_config and get_sweep).")
flags.DEFINE_string("sweep_dir", None, "Directory holding one workdir per run and the report.")
flags.DEFINE_integer("worker", 0, "This worker's index.")
flags.DEFINE_integer("num_workers", 1, "Number of workers sharing the sweep.")
flags.DEFINE_bool("print_commands", False, "Print one command per worker and exit.")
flags.DEFINE_bool("report_only", False, "Only write the report of the finished runs.")
flags.mark_flags_as_required(["config", "sweep_dir"])


def main(argv):
  cli.no_arguments(argv)
  f = flags.FLAGS
  if f.print_commands:
    for worker in range(f.num_workers):
      print(shlex.join([sys.executable, "sweep.py", "--config", f.config, "--sweep_dir",
                        f.sweep_dir, f"--num_workers={f.num_workers}", f"--worker={worker}"]))
    return
  cli.setup_logging()
  failed = {}
  with cli.StopSignals() as stop, cli.one_line_errors():
    if not f.report_only:
      _, failed = sweep.run(f.config, f.sweep_dir, f.worker, f.num_workers, stop)
    if stop.exit_status:
      sys.exit(stop.exit_status)
    md_path, csv_path = sweep.report(f.config, f.sweep_dir)
  with open(md_path) as report:
    print(report.read())
  print(f"report written to {md_path} and {csv_path}")
  if failed:
    print("error: runs failed: " + "; ".join(f"{name}: {e}" for name, e in failed.items()),
          file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
