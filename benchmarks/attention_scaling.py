"""Attention cost against sequence length: one multi-head self-attention layer, forward and
forward + backward, per kernel, positional encoding and window.

  python benchmarks/attention_scaling.py --lengths 256,1024,4096,8192,16384 --windows full,128
  python benchmarks/attention_scaling.py --smoke                    # seconds: does it still run
  python benchmarks/attention_scaling.py --kernels cudnn,xla,pallas --dtype bfloat16 \
      --positions none,alibi,t5,kerple,fire --lengths 512,1024,2048,4096,8192,16384 \
      --block 64 --d_model 1024 --heads 16                                   # on a GPU

Memory is what XLA allocates for the compiled program's temporaries (exact, from the
compiled program); a configuration whose temporaries would exceed --max_gib is compiled but
not run. With a `cudnn` row without a bias at the same length (list `cudnn` first and
`none` first), every later row's time is also given as that row's throughput relative to it
(FlexAttention's yardstick: cuDNN's flash attention without a score modification). On the
CPU the `pallas` kernel runs in Pallas' interpret mode, which is a correctness check
(tests/test_pallas_attention.py), not a speed figure: its rows are marked. Prints figures;
asserts nothing.
"""

import time

import jax
import jax.numpy as jnp
from absl import flags
from flax import nnx

import harness
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.masks import Mask
from transformer.model.positions import make_positional_encoding

flags.DEFINE_list("lengths", ["256", "1024", "4096", "8192", "16384"], "Sequence lengths.")
flags.DEFINE_list("kernels", ["reference", "blockwise"], "Kernels (model.attention.kernel).")
flags.DEFINE_list("positions", ["none"], "Positional encodings (model.position).")
flags.DEFINE_list("windows", ["full", "128"], "full, or ±positions of a local window.")
flags.DEFINE_integer("d_model", 256, "Model width.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("block", 512, "Block size of the blockwise and pallas kernels.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Computation dtype.")
flags.DEFINE_float("max_gib", 12.0, "Skip running configurations needing more temporaries.")
harness.define_smoke(lengths=["32"], kernels=["blockwise"], windows=["full", "8"], d_model=16,
                     heads=2, block=8)


def timed(compiled, *args, repeats: int = 3) -> float:
  """The fastest of `repeats` calls after a warm-up, seconds."""
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return min(times)


def measure(kernel: str, position: str, window: int | None, length: int):
  """{mode: (seconds or None if skipped, temporaries GiB)} for mode fwd and fwd+bwd; a
  ConfigError if the kernel cannot run this layer."""
  f = flags.FLAGS
  dtype = jnp.dtype(f.dtype)
  rngs = nnx.Rngs(0)
  encoding = make_positional_encoding(position, f.d_model, f.heads, length, rngs=rngs)
  attn = MultiHeadAttention(f.d_model, f.heads, AttentionConfig(kernel=kernel, block_size=f.block),
                            dtype=dtype, encoding=encoding, position=position, rngs=rngs)
  graphdef, params = nnx.split((attn, encoding))
  x = jax.random.normal(jax.random.key(0), (1, length, f.d_model), dtype)
  pos = jnp.arange(length)[None]
  mask = Mask(jnp.ones_like(pos), jnp.ones_like(pos), pos, pos, window=window)

  def loss(params, x):
    layer, enc = nnx.merge(graphdef, params)
    return jnp.sum(layer.self_attend(x, mask, enc).astype(jnp.float32) ** 2)

  out = {}
  for mode, fn in (("fwd", loss), ("fwd+bwd", jax.grad(loss, argnums=(0, 1)))):
    compiled = jax.jit(fn).lower(params, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    out[mode] = (None if temp > f.max_gib else timed(compiled, params, x), temp)
  return out


def report() -> None:
  f = flags.FLAGS
  backend = jax.default_backend()
  print(f"device {jax.devices()[0].device_kind}; d_model {f.d_model}, {f.heads} heads, batch 1, "
        f"{f.dtype}; one self-attention layer")
  print(f"{'length':>7} {'kernel':>10} {'position':>9} {'window':>7} {'fwd ms':>9} "
        f"{'vs cudnn':>8} {'f+b ms':>9} {'vs cudnn':>8} {'temp GiB':>9}")
  for length in map(int, f.lengths):
    anchor = None  # cuDNN without a bias at this length, full window
    for position in f.positions:
      for kernel in f.kernels:
        for window_name in f.windows:
          window = None if window_name == "full" else int(window_name)
          try:
            result = measure(kernel, position, window, length)
          except ConfigError as e:
            print(f"{length:>7} {kernel:>10} {position:>9} {window_name:>7} refused: {e}")
            continue
          if kernel == "cudnn" and position == "none" and window is None:
            anchor = result
          cells = []
          for mode in ("fwd", "fwd+bwd"):
            seconds = result[mode][0]
            ratio = (f"{anchor[mode][0] / seconds:>8.0%}" if anchor and seconds
                     and anchor[mode][0] else f"{'':>8}")
            cells.append(f"{'skipped' if seconds is None else f'{1e3 * seconds:.1f}':>9} {ratio}")
          note = " (interpret mode: not a speed figure)" if (
              kernel == "pallas" and backend == "cpu") else ""
          print(f"{length:>7} {kernel:>10} {position:>9} {window_name:>7} {' '.join(cells)} "
                f"{result['fwd+bwd'][1]:>9.3f}{note}")


if __name__ == "__main__":
  harness.run(report)
