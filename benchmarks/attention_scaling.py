"""Attention cost against sequence length: one multi-head self-attention layer, forward and
forward + backward, per kernel, positional encoding and window.

  python benchmarks/attention_scaling.py --lengths 256,1024,4096,8192,16384 --windows full,128
  python benchmarks/attention_scaling.py --smoke                    # seconds: does it still run
  python benchmarks/attention_scaling.py --kernels cudnn,xla,pallas --dtype bfloat16 \
      --positions none,alibi,t5,kerple,fire --lengths 512,1024,2048,4096,8192,16384 \
      --block 64 --d_model 1024 --heads 16 --batch 4 --causal                # on a GPU

Memory is what XLA allocates for the compiled program's temporaries (exact, from the
compiled program); a configuration whose temporaries would exceed --max_gib is compiled but
not run. With a `cudnn` row without a bias at the same length (list `cudnn` first and
`none` first), every later row's time is also given as that row's throughput relative to it
(FlexAttention's yardstick: cuDNN's flash attention without a score modification). Each
row is a whole sequence at positions 0 … L − 1, declared so (Mask.padded), so cuDNN takes
its causal flag and lengths (kernels/cudnn_mask.py); `--packed` hands every kernel the same
mask as packed rows instead (cuDNN then gets it dense). With `none`, `--raw` adds the
`cudnn` kernel alone (no projections; `xla` without a GPU) against
jax.nn.dot_product_attention called with is_causal directly: how close the project's call
comes to cuDNN's own. On the
CPU the `pallas` kernel runs in Pallas' interpret mode, which is a correctness check
(tests/test_pallas_attention.py), not a speed figure: its rows are marked. Prints figures;
asserts nothing.
"""

import json
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
flags.DEFINE_integer("batch", 1, "Sequences per call.")
flags.DEFINE_bool("causal", False, "A causal mask (otherwise bidirectional).")
flags.DEFINE_bool("packed", False, "Hand the mask over as packed rows (not declared padded).")
flags.DEFINE_bool("raw", False, "With none: also the cudnn kernel (xla without a GPU) alone "
                  "against jax.nn.dot_product_attention(is_causal=...) called directly.")
flags.DEFINE_string("json", None, "Append one JSON line per measured row to this file.")
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
  encoding = make_positional_encoding(position, f.d_model, f.heads, length, causal=f.causal,
                                      rngs=rngs)
  attn = MultiHeadAttention(f.d_model, f.heads, AttentionConfig(kernel=kernel, block_size=f.block),
                            dtype=dtype, encoding=encoding, rngs=rngs)
  graphdef, params = nnx.split((attn, encoding))
  x = jax.random.normal(jax.random.key(0), (f.batch, length, f.d_model), dtype)
  mask = whole_rows(length, window)

  def loss(params, x):
    layer, enc = nnx.merge(graphdef, params)
    return jnp.sum(layer.self_attend(x, mask, enc).astype(jnp.float32) ** 2)

  out = {}
  for mode, fn in (("fwd", loss), ("fwd+bwd", jax.grad(loss, argnums=(0, 1)))):
    compiled = jax.jit(fn).lower(params, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    out[mode] = (None if temp > f.max_gib else timed(compiled, params, x), temp)
  return out


def whole_rows(length: int, window: int | None) -> Mask:
  """The mask of --batch rows, each one sequence at positions 0 … length − 1."""
  f = flags.FLAGS
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (f.batch, length))
  return Mask(jnp.ones_like(pos), jnp.ones_like(pos), pos, pos, causal=f.causal, window=window,
              padded=not f.packed)


def measure_raw(length: int, implementation: str):
  """{"kernel" | "own": {mode: (seconds, temporaries GiB)}}: the fused kernel function
  `implementation` (cudnn; xla where no GPU is) on q, k, v [batch, length, heads, d] (no
  projections, no bias) and jax.nn.dot_product_attention with its own is_causal on the
  same arrays."""
  from transformer.model.kernels.registry import fused_kernel  # noqa: PLC0415
  from transformer.model.positions import PositionalEncoding  # noqa: PLC0415
  from transformer.model.scores import ScaledDot  # noqa: PLC0415
  f = flags.FLAGS
  d = f.d_model // f.heads
  qkv = [jax.random.normal(jax.random.key(i), (f.batch, length, f.heads, d), jnp.dtype(f.dtype))
         for i in range(3)]
  mask, kernel = whole_rows(length, None), fused_kernel(implementation)
  score, none = ScaledDot(f.heads, d), PositionalEncoding()
  calls = {
      "kernel": lambda q, k, v: kernel(q, k, v, mask, none, score, 0.0, None),
      "own": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=f.causal, implementation=implementation)}
  out = {}
  for name, call in calls.items():
    loss = lambda *qkv, call=call: jnp.sum(call(*qkv).astype(jnp.float32) ** 2)  # noqa: E731
    out[name] = {}
    for mode, fn in (("fwd", loss), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)))):
      compiled = jax.jit(fn).lower(*qkv).compile()
      out[name][mode] = (timed(compiled, *qkv), compiled.memory_analysis().temp_size_in_bytes / 2**30)
  return out


def record(**row) -> None:
  """One JSON line in --json's file, if given."""
  if flags.FLAGS.json:
    with open(flags.FLAGS.json, "a") as file:
      file.write(json.dumps({"benchmark": "attention", **row}) + "\n")


def report() -> None:
  f = flags.FLAGS
  backend = jax.default_backend()
  print(f"device {jax.devices()[0].device_kind}; d_model {f.d_model}, {f.heads} heads, batch "
        f"{f.batch}, {f.dtype}, {'causal' if f.causal else 'bidirectional'}"
        f"{', packed rows' if f.packed else ''}; one self-attention layer")
  common = dict(device=jax.devices()[0].device_kind, d_model=f.d_model, heads=f.heads,
                head_dim=f.d_model // f.heads, batch=f.batch, dtype=f.dtype, causal=f.causal,
                packed=f.packed)
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
            record(**common, length=length, kernel=kernel, position=position,
                   window=window_name, refused=str(e))
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
          record(**common, length=length, kernel=kernel, position=position, window=window_name,
                 interpreted=bool(note),
                 **{f"{mode} ms": None if result[mode][0] is None else 1e3 * result[mode][0]
                    for mode in result},
                 **{f"{mode} GiB": result[mode][1] for mode in result})
    if f.raw and "none" in f.positions:
      implementation = "cudnn" if backend == "gpu" else "xla"
      raw = measure_raw(length, implementation)
      ratios = "; ".join(f"{mode} {1e3 * raw['kernel'][mode][0]:.2f} ms against "
                         f"{1e3 * raw['own'][mode][0]:.2f} ms"
                         f" ({raw['own'][mode][0] / raw['kernel'][mode][0]:.0%})"
                         for mode in ("fwd", "fwd+bwd"))
      print(f"{length:>7} {implementation} kernel alone vs dot_product_attention's own: {ratios}")
      record(**common, length=length, kernel=f"{implementation} (kernel alone)", position="none",
             window="full", **{f"{mode} ms": 1e3 * raw["kernel"][mode][0] for mode in raw["kernel"]},
             **{f"own {mode} ms": 1e3 * raw["own"][mode][0] for mode in raw["own"]})


if __name__ == "__main__":
  harness.run(report)
