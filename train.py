"""Trains a Transformer: python train.py --config configs/default.py --workdir DIR.

The loop: transformer/run/training.py; the loss it minimises, from the logits to the metrics
it logs, in one function: transformer/run/step.py batch_sums.

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

from transformer.run import cli, config, config_help
from transformer.run.training import train_and_evaluate

config_flags.DEFINE_config_file("config", None, "A config file (e.g. configs/default.py; "
                                "FILE:ARG calls its get_config(ARG)); set its fields with "
                                "--config.SECTION.FIELD=VALUE.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and metrics.")
flags.DEFINE_bool("show_config", False, "Print every field of --config (overrides applied): "
                  "its value and what it allows; then exit.")
cli.define_distributed_flags()
cli.define_cache_flag()
flags.mark_flags_as_required(["config"])
flags.register_multi_flags_validator(
    ["workdir", "show_config"], lambda f: f["workdir"] is not None or f["show_config"],
    "--workdir is required (unless --show_config)")


def show_config() -> None:
  flag = flags.FLAGS["config"]
  fields = config_help.describe(flag.value)  # a bad config: its error line, nothing else
  print(f"{flag.config_filename} (with the overrides given); set a field with "
        f"--config.FIELD=VALUE\n{config_help.render(fields)}")


def main(argv):
  cli.no_arguments(argv)
  if flags.FLAGS.show_config:
    with cli.one_line_errors():
      show_config()
    return
  cli.use_compilation_cache()
  cli.start_distributed()
  cli.setup_logging()
  with cli.StopSignals() as stop, cli.one_line_errors():
    cfg = config.parse(flags.FLAGS.config)  # the one parse: typed from here on
    train_and_evaluate(cfg, flags.FLAGS.workdir, should_stop=stop)
  if stop.exit_status:
    sys.exit(stop.exit_status)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
