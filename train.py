"""Trains a Transformer: python train.py --config configs/default.py --workdir DIR.

Re-running the same command resumes from the latest checkpoint in DIR that restores.
SIGINT/SIGTERM save a checkpoint and exit with status 128 + signal number (a second signal
exits at once). Bad input: one `error:` line, status 2, nothing written; a run that cannot
go on (the workdir in use, training diverged): one `error:` line, status 1.

Several processes (hosts): run the same command on each with --distributed (TPU pods, SLURM
and Open MPI are detected from the environment), or with --coordinator_address HOST:PORT
--num_processes N --process_id I. Each process reads its share of the data; process 0 logs
and holds the workdir's lock; a SIGTERM to any one host stops all of them at the same step.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import cli, config
from transformer.training import train_and_evaluate

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and metrics.")
cli.define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  cli.no_arguments(argv)
  cli.start_distributed()
  cli.setup_logging()
  with cli.StopSignals() as stop, cli.one_line_errors():
    cfg = config.parse(flags.FLAGS.config)  # the one parse: typed from here on
    train_and_evaluate(cfg, flags.FLAGS.workdir, should_stop=stop)
  if stop.exit_status:
    sys.exit(stop.exit_status)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
