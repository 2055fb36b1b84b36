"""Training throughput in real (non-padding) target tokens/s, with and without packing.

  python benchmarks/packing.py --config configs/multi30k.py --steps 20
  python benchmarks/packing.py --smoke            # seconds: does it still run

It reads Multi30k where configs/multi30k.py's data.dir says (--config.data.dir=DIR; where to
get it: docs/data.md); a missing corpus is one `error:` line.

Builds the config's text source (training the tokenizer into --workdir on first use), then
for pack = True and False times `--steps` train steps on the real batch stream, data loading
included. Prints figures; asserts nothing.
"""

import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

import harness
from transformer.model.embeddings import target_weights
from transformer.run import experiment
from transformer.run import step as step_lib
from transformer.run.config import parse

config_flags.DEFINE_config_file("config", "configs/multi30k.py", "Config with a text source.")
flags.DEFINE_string("workdir", "/tmp/packing_benchmark", "Where the tokenizer is kept.")
flags.DEFINE_integer("steps", 20, "Timed steps per setting (after two warm-up steps).")
harness.define_smoke(steps=1, config={
    "data.vocab_size": 256, "train.batch_size": 8, "model.d_model": 32, "model.num_heads": 2,
    "model.d_ff": 64, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1})


def report() -> None:
  config = flags.FLAGS.config
  print(f"device {jax.devices()[0].device_kind}; batch {config.train.batch_size} rows x "
        f"{config.data.max_len} tokens per side; dtype {config.model.dtype}")
  for pack in (True, False):
    config.data.pack = pack
    exp = experiment.build(parse(config), flags.FLAGS.workdir)
    exp.source.prepare()
    compiled = step_lib.compile_step(exp)  # the train step exactly as train.py runs it
    state, step_fn = compiled.init(), compiled.step
    batches = iter(exp.source.train_batches())
    for _ in range(2):
      state, metrics = step_fn(state, next(batches))
    jax.block_until_ready(metrics)
    real = 0
    start = time.perf_counter()
    for _ in range(flags.FLAGS.steps):
      batch = next(batches)
      real += int(np.sum(target_weights(batch)))
      state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    slots = flags.FLAGS.steps * batch["targets"].size
    print(f"pack={pack!s:<5}  {real / seconds:10,.0f} real target tok/s  "
          f"{1e3 * seconds / flags.FLAGS.steps:7.1f} ms/step  target fill {real / slots:.1%}  "
          f"{real / flags.FLAGS.steps:,.0f} real target tokens/step")


if __name__ == "__main__":
  harness.run(report)
