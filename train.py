"""Trains a Transformer: python train.py --config configs/default.py --workdir DIR.

Re-running the same command resumes from the latest checkpoint in DIR. SIGINT/SIGTERM save
a checkpoint and exit with status 128 + signal number.
"""

import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from transformer import cli
from transformer.training import train_and_evaluate

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.setup_logging()
  received = []
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda signum, _: received.append(signum))
  with cli.config_errors_exit():
    train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir, should_stop=lambda: bool(received))
  if received:
    sys.exit(128 + received[0])


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
