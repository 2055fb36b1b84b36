"""Decoding throughput of a trained run: sentences/s and generated tokens/s, greedy and beam.

  python benchmarks/decoding.py --workdir workdirs/multi30k [--beam_sizes 1,4] [--split test]

Restores the latest checkpoint, decodes the split once to compile, then times a second pass
(KV-cached decoding, one jitted while-loop per batch). Generated tokens are those up to and
including EOS. Prints figures; asserts nothing.
"""

import dataclasses
import time

import jax
import numpy as np
from absl import app, flags

from transformer.core.vocab import PAD_ID
from transformer.run import config
from transformer.run.evaluation import restore_run
from transformer.run.evaluator import Evaluator

flags.DEFINE_string("workdir", None, "A workdir written by train.py.", required=True)
flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to time (1 = greedy).")
flags.DEFINE_string("split", "test", "Held-out split to decode.")
flags.DEFINE_integer("batch_size", 0, "Sentences per batch (0: config.eval.batch_size).")


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  run = restore_run(FLAGS.workdir)
  exp, params = run.experiment, run.params
  split = exp.source.eval_splits()[FLAGS.split]
  n, batch_size = len(split), FLAGS.batch_size or exp.eval.batch_size
  exp = dataclasses.replace(exp, config=config.replace(exp.config, "eval.batch_size", batch_size))
  print(f"device  {jax.devices()[0].device_kind}; step {run.steps[-1]}; {n} sentences of split "
        f"'{FLAGS.split}', batch {batch_size}, dtype {exp.model.dtype}")
  for beam in map(int, FLAGS.beam_sizes):
    evaluator = Evaluator(exp, beam_size=beam)
    decode_len = exp.source.decode_length(split)
    evaluator.predict(params, split.arrays, decode_len)  # compiles
    start = time.perf_counter()
    predictions = evaluator.predict(params, split.arrays, decode_len)
    seconds = time.perf_counter() - start
    tokens = int(np.sum(np.cumsum(predictions == PAD_ID, axis=1) == 0))  # up to EOS, inclusive
    name = "greedy" if beam == 1 else f"beam {beam}"
    print(f"{name:<8} {n / seconds:8.1f} sentences/s  {tokens / seconds:10,.0f} tokens/s  "
          f"({seconds:.2f} s for {n} sentences, {tokens / n:.1f} tokens each)")


if __name__ == "__main__":
  app.run(main)
