"""Evaluates a trained run: python eval.py --workdir DIR [--step N] [--output FILE].

Restores the config saved in DIR and its checkpoint (the latest by default), reports loss,
token accuracy, exact match and (text) sacreBLEU/chrF on every held-out split, and writes
them as JSON, with the detokenized predictions beside it. --beam_size 4 --alpha 0.6 decodes
as the paper does.
"""

from absl import app, flags

from transformer import cli
from transformer.evaluation import format_table, restore_and_evaluate

flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest).")
flags.DEFINE_string("output", None, "Metrics JSON path (default: DIR/eval_step_N.json).")
flags.DEFINE_integer("beam_size", 1, "1: greedy decoding; k > 1: beam search with k beams.")
flags.DEFINE_float("alpha", 0.6, "GNMT length-penalty exponent for beam search.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  cli.setup_logging()
  with cli.config_errors_exit():
    step, results, path = restore_and_evaluate(
        flags.FLAGS.workdir, flags.FLAGS.step, flags.FLAGS.output, flags.FLAGS.beam_size,
        flags.FLAGS.alpha)
  print(f"step {step}")
  print(format_table(results))
  print(f"metrics written to {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
