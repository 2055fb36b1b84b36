"""Attention cost against sequence length: one multi-head self-attention layer, forward and
backward, for the reference kernel (an L×L matrix per head) and the blockwise kernel, with
full and local windows.

  python benchmarks/attention_scaling.py [--lengths 256,1024,4096,8192,16384] [--window 128]

Memory is what XLA allocates for the compiled step's temporaries (exact, from the compiled
program); a configuration whose temporaries would exceed --max_gib is compiled but not run.
Prints figures; asserts nothing.
"""

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from transformer.attention import AttentionConfig, MultiHeadAttention
from transformer.blocks import NO_POSITION
from transformer.masks import Mask

flags.DEFINE_list("lengths", ["256", "1024", "4096", "8192", "16384"], "Sequence lengths.")
flags.DEFINE_integer("window", 128, "Local window (±positions).")
flags.DEFINE_integer("d_model", 256, "Model width.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("block", 512, "Block size of the blockwise kernel.")
flags.DEFINE_float("max_gib", 12.0, "Skip running configurations needing more temporaries.")

def main(argv):
  del argv
  FLAGS = flags.FLAGS
  print(f"device {jax.devices()[0].device_kind}; d_model {FLAGS.d_model}, {FLAGS.heads} heads, "
        f"batch 1, forward + backward of one self-attention layer")
  print(f"{'length':>7} {'kernel':>10} {'window':>7} {'ms':>9} {'temp GiB':>9}")
  for length in map(int, FLAGS.lengths):
    x = jax.random.normal(jax.random.key(0), (1, length, FLAGS.d_model))
    pos = jnp.arange(length)[None]
    for kernel in ("reference", "blockwise"):
      for window in (None, FLAGS.window):
        cfg = AttentionConfig(kernel=kernel, block_size=FLAGS.block)
        attn = MultiHeadAttention(FLAGS.d_model, FLAGS.heads, cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(attn)
        mask = Mask(jnp.ones_like(pos), jnp.ones_like(pos), pos, pos, window=window)

        def loss(params, x, mask=mask, graphdef=graphdef):
          return jnp.sum(nnx.merge(graphdef, params).self_attend(x, mask, NO_POSITION) ** 2)

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        name = "full" if window is None else f"±{window}"
        if temp > FLAGS.max_gib:
          print(f"{length:>7} {kernel:>10} {name:>7} {'skipped':>9} {temp:>9.2f}")
          continue
        jax.block_until_ready(compiled(params, x))
        times = []
        for _ in range(3):
          start = time.perf_counter()
          jax.block_until_ready(compiled(params, x))
          times.append(time.perf_counter() - start)
        print(f"{length:>7} {kernel:>10} {name:>7} {1e3 * min(times):>9.1f} {temp:>9.3f}")


if __name__ == "__main__":
  app.run(main)
