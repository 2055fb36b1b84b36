"""Train-step speed: ms/step, tokens/s, MFU against the measured matmul peak, peak memory.

  python benchmarks/train_step.py                 # "small": vocab 8192, d 256, 4 heads, ff 1024, 3+3
  python benchmarks/train_step.py --dims=base     # the paper's base model
  python benchmarks/train_step.py --config.model.attention.score=additive   # any override

Prints figures; asserts nothing. MFU = (FLOPs of one compiled step, as counted by XLA)
/ step time / (the f32 matmul peak measured in the same process).
"""

import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from transformer import experiment
from transformer.training import make_train_step

DIMS = {
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6),
}
config_flags.DEFINE_config_file("config", "configs/default.py", "Base config.")
flags.DEFINE_enum("dims", "small", list(DIMS), "Model dimensions.")
flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_integer("length", 64, "Source and target tokens per sequence.")
flags.DEFINE_integer("steps", 10, "Timed steps (after one warm-up step).")


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
  """Best f32 n×n matmul throughput of this machine, FLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def main(argv):
  del argv
  FLAGS = flags.FLAGS
  config = FLAGS.config
  config.model.update(DIMS[FLAGS.dims], dropout=0.1)
  b, t, v = FLAGS.batch_size, FLAGS.length, FLAGS.vocab_size
  optimizer = experiment.make_optimizer(config)
  graphdef, init = experiment.make_init(config, v, optimizer)
  state = jax.jit(init)()
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  rng = np.random.default_rng(0)
  ones = np.ones((b, t), np.int32)
  batch = {"inputs": rng.integers(3, v, (b, t)).astype(np.int32),
           "targets": rng.integers(3, v, (b, t)).astype(np.int32),
           "inputs_segmentation": ones, "targets_segmentation": ones,
           "inputs_positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}
  batch["targets_positions"] = batch["inputs_positions"]
  step_fn = jax.jit(make_train_step(graphdef, optimizer, experiment.make_schedule(config),
                                    label_smoothing=0.1, seed=0), donate_argnums=0)

  start = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  flops = float(cost.get("flops", 0.0))

  state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  peak = matmul_peak()
  print(f"device            {jax.devices()[0].device_kind} x{jax.device_count()}")
  print(f"model             {FLAGS.dims}: {n_params:,} params, vocab {v}, "
        f"score={config.model.attention.score}, position={config.model.position}")
  print(f"batch             {b} x ({t} source + {t} target) tokens")
  print(f"compile           {compile_s:.1f} s")
  print(f"step              {1e3 * step_s:.1f} ms (median of {len(times)}; "
        f"min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})")
  print(f"throughput        {b * t / step_s:,.0f} target tok/s, {2 * b * t / step_s:,.0f} tok/s")
  print(f"step FLOPs (XLA)  {flops / 1e9:.1f} GFLOP -> {flops / step_s / 1e9:.1f} GFLOP/s")
  print(f"matmul peak       {peak / 1e9:.1f} GFLOP/s (f32 2048^2)")
  print(f"MFU               {100 * flops / step_s / peak:.1f}%")
  print(f"peak RSS          {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
  app.run(main)
