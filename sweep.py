"""Runs a sweep: python sweep.py --config configs/positions.py --sweep_dir DIR.

Trains every run of the config's get_sweep() into DIR/<overrides>, skipping finished runs and
resuming interrupted ones, then writes DIR/report.md and DIR/report.csv (mean ± std over
seeds). Across hosts or workers: --num_workers N --worker I runs every N-th run (or
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
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  if f.print_commands:
    for worker in range(f.num_workers):
      print(shlex.join([sys.executable, "sweep.py", "--config", f.config, "--sweep_dir",
                        f.sweep_dir, f"--num_workers={f.num_workers}", f"--worker={worker}"]))
    return
  cli.setup_logging()
  with cli.config_errors_exit():
    if not f.report_only:
      sweep.run(f.config, f.sweep_dir, f.worker, f.num_workers)
    md_path, csv_path = sweep.report(f.config, f.sweep_dir)
  with open(md_path) as report:
    print(report.read())
  print(f"report written to {md_path} and {csv_path}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
