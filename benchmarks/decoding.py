"""Decoding throughput of a trained run: sentences/s and generated tokens/s, greedy and beam.

  python benchmarks/decoding.py --workdir workdirs/default            # the Quick start's run
  python benchmarks/decoding.py --workdir workdirs/multi30k --split test --beam_sizes 1,4
  python benchmarks/decoding.py --workdir workdirs/default --smoke    # seconds: does it run

Restores the latest checkpoint, decodes the split once to compile, then times a second pass
(KV-cached decoding, one jitted while-loop per batch). Generated tokens are those up to and
including EOS. A run whose family does not decode, or a split it does not have, is one
`error:` line. Prints figures; asserts nothing.
"""

import dataclasses
import time

import jax
import numpy as np
from absl import flags

import harness
from transformer.core.errors import ConfigError
from transformer.core.vocab import PAD_ID
from transformer.run import config
from transformer.run.restored_run import restore_run
from transformer.run.evaluator import Evaluator

flags.DEFINE_string("workdir", None, "A workdir written by train.py.", required=True)
flags.DEFINE_list("beam_sizes", ["1", "4"], "Beam sizes to time (1 = greedy).")
flags.DEFINE_string("split", None, "Held-out split to decode (default: the run's first).")
flags.DEFINE_integer("batch_size", 0, "Sentences per batch (0: config.eval.batch_size).")
flags.DEFINE_integer("num_sentences", 0, "Decode the split's first N sentences (0: all).")
harness.define_smoke(beam_sizes=["1", "2"], batch_size=8, num_sentences=8)


def report() -> None:
  f = flags.FLAGS
  run = restore_run(f.workdir)
  exp, params = run.experiment, run.params
  if not exp.family.decodes:
    raise ConfigError(f"--workdir {f.workdir}: its family model.arch={exp.model.arch!r} does "
                      "not decode; decoding throughput needs a run that does "
                      "(model.arch=encoder_decoder)")
  splits = exp.source.eval_splits()
  name = f.split or next(iter(splits))
  if name not in splits:
    raise ConfigError(f"--split {name!r}: the run in {f.workdir} has the held-out splits "
                      f"{', '.join(splits)}")
  split = splits[name]
  if f.num_sentences:
    split = dataclasses.replace(split, arrays={k: v[:f.num_sentences]
                                               for k, v in split.arrays.items()})
  n = len(split.arrays["inputs"])
  batch_size = f.batch_size or exp.eval.batch_size
  exp = dataclasses.replace(exp, config=config.replace(exp.config, "eval.batch_size", batch_size))
  print(f"device  {jax.devices()[0].device_kind}; step {run.steps[-1]}; {n} sentences of split "
        f"'{name}', batch {batch_size}, dtype {exp.model.dtype}")
  decode_len = exp.source.decode_length(split)
  for beam in map(int, f.beam_sizes):
    evaluator = Evaluator(exp, beam_size=beam)
    evaluator.predict(params, split.arrays, decode_len)  # compiles
    start = time.perf_counter()
    predictions = evaluator.predict(params, split.arrays, decode_len)
    seconds = time.perf_counter() - start
    tokens = int(np.sum(np.cumsum(predictions == PAD_ID, axis=1) == 0))  # up to EOS, inclusive
    label = "greedy" if beam == 1 else f"beam {beam}"
    print(f"{label:<8} {n / seconds:8.1f} sentences/s  {tokens / seconds:10,.0f} tokens/s  "
          f"({seconds:.2f} s for {n} sentences, {tokens / n:.1f} tokens each)")


if __name__ == "__main__":
  harness.run(report)
