"""The project's packer against grain's: batches/s and the share of slots filled, on Multi30k.

  python benchmarks/packers.py --config configs/multi30k.py --batches 100
  python benchmarks/packers.py --smoke            # seconds: does it still run

Why the project packs with its own code (transformer/data/pipeline.py) and not grain's
FirstFitPackIterDataset / BestFitPackIterDataset: this script measures both on the same
encoded Multi30k pairs, the same rows (config.data.max_len tokens per side) and the same
batch size. The project's packer runs as training runs it, reading the encoded corpus
(data.source's train_batches); grain's get the pairs in memory, read from that corpus
beforehand. It trains the config's tokenizer and encodes the corpus into --workdir on first
use (Multi30k where the config's data.dir says: docs/data.md; a missing corpus is one
`error:` line). Prints figures; asserts nothing. The figures: docs/benchmarks.md.
"""

import time

import grain
import numpy as np
from absl import flags
from ml_collections import config_flags

import harness
from transformer.run import experiment
from transformer.run.config import parse

config_flags.DEFINE_config_file("config", "configs/multi30k.py", "Config with a text source.")
flags.DEFINE_string("workdir", "/tmp/packing_benchmark", "Where the tokenizer is kept.")
flags.DEFINE_integer("batches", 100, "Batches timed per packer (after one warm-up batch).")
harness.define_smoke(batches=3, config={"data.vocab_size": 256, "train.batch_size": 8})


def grain_packed(examples, packer, *, batch_size: int, max_len: int, seed: int):
  """grain's packer over the same shuffled pairs (num_packing_bins = batch_size rows)."""
  dataset = (grain.MapDataset.source(examples).shuffle(seed=seed).repeat()
             .map(lambda ex: {"inputs": ex[0], "targets": ex[1]}).to_iter_dataset())
  dataset = packer(dataset, length_struct={"inputs": max_len, "targets": max_len},
                   num_packing_bins=batch_size, seed=seed)
  return iter(dataset.batch(batch_size, drop_remainder=True))


def measure(name: str, batches, count: int) -> None:
  next(batches)
  filled = slots = 0
  start = time.perf_counter()
  for _ in range(count):
    batch = next(batches)
    filled += int(np.sum(batch["targets"] > 0))  # PAD_ID = 0 is padding, in both layouts
    slots += batch["targets"].size
  seconds = time.perf_counter() - start
  print(f"{name:<32} {count / seconds:10,.0f} batches/s  target fill {filled / slots:6.1%}")


def report() -> None:
  config, count = flags.FLAGS.config, flags.FLAGS.batches
  exp = experiment.build(parse(config), flags.FLAGS.workdir)
  exp.source.prepare()
  corpus = exp.source.encoded_corpus()
  tokens, starts, lengths = corpus.read(np.arange(len(corpus)))
  size, length, seed = config.train.batch_size, config.data.max_len, config.seed
  examples = [(tokens[a:a + n], tokens[b:b + m]) for (a, b), (n, m) in zip(starts, lengths)
              if n <= length and m <= length]
  print(f"{len(examples):,} pairs; batches of {size} rows x {length} tokens per side")
  measure("project (first fit, 8 open rows)", iter(exp.source.train_batches()), count)
  for packer in (grain.experimental.FirstFitPackIterDataset,
                 grain.experimental.BestFitPackIterDataset):
    measure(f"grain {packer.__name__.removesuffix('IterDataset')}",
            grain_packed(examples, packer, batch_size=size, max_len=length, seed=seed), count)


if __name__ == "__main__":
  harness.run(report)
