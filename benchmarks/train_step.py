"""Train-step speed: ms/step, tokens/s, MFU against the measured matmul peak, peak memory.

  python benchmarks/train_step.py                 # "small": vocab 8192, d 256, 4 heads, ff 1024, 3+3
  python benchmarks/train_step.py --dims=base     # the paper's base model
  python benchmarks/train_step.py --dims=big --config.model.dtype=bfloat16
                                                # d 1024, 16 heads, ff 4096, 6+6, L 512: a GPU's
  python benchmarks/train_step.py --config.model.attention.score=additive   # any override

  python benchmarks/train_step.py --dims=base --config.model.dtype=bfloat16 \
      --config.model.attention.kernel=auto                     # on a GPU: cuDNN

  XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true python benchmarks/train_step.py --profile
                                                # where the step's time goes, op by op
  python benchmarks/train_step.py --smoke       # seconds: does it still run

Prints figures; asserts nothing. MFU = model FLOPs per step (the matmuls of the forward
pass, attention included, times 3 for forward + backward) / step time / the matmul peak of
this device in the model's dtype, measured in the same process. The FLOPs XLA counts in
the compiled step (elementwise work included; custom calls such as cuDNN attention not)
are printed beside it.
"""

import glob
import gzip
import json
import os
import re
import resource
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from ml_collections import config_flags

import harness
from mfu import DIMS, LENGTHS, matmul_peak, model_flops
from transformer.core.vocab import NUM_RESERVED
from transformer.run import experiment
from transformer.run import step as step_lib
from transformer.run.config import parse

config_flags.DEFINE_config_file("config", "configs/default.py", "Base config.")
flags.DEFINE_enum("dims", "small", list(DIMS), "Model dimensions.")
flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_integer("length", 0, "Source and target tokens per sequence; 0: the dims' own "
                     f"({', '.join(f'{k} {v}' for k, v in LENGTHS.items())}).")
flags.DEFINE_string("json", None, "Append the figures as one JSON line to this file.")
flags.DEFINE_integer("layers", 0, "Encoder and decoder layers each; 0: the dims' own.")
flags.DEFINE_integer("steps", 10, "Timed steps (after one warm-up step).")
flags.DEFINE_integer("peak_size", 0, "Matmul size for the peak; 0: 2048 on CPU, 8192 else.")
flags.DEFINE_bool("profile", False, "Trace 3 steps and print the time of the matmul ops (XLA "
                  "dot/YNNPACK fusions, cuBLAS/cuDNN kernels) against the rest, and the top ops.")

harness.define_smoke(dims="tiny", vocab_size=64, batch_size=4, length=8, steps=2,
                     peak_size=128, layers=1)

MATMUL_OPS = re.compile(r"dot|ynn_fusion|gemm|cublas|cutlass|xmma|fmha|flash", re.IGNORECASE)


def profile(step_fn, state, batch, steps: int = 3):
  """Traces `steps` steps; returns (state, {op name: (ms per step, calls per step)}) from the
  device/executor ops in the trace (XLA:CPU reports its ops with
  --xla_cpu_enable_xprof_traceme=true)."""
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(steps):
      state, metrics = step_fn(state, batch)
      jax.block_until_ready(metrics)
    jax.profiler.stop_trace()
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  ops: dict[str, list[float]] = {}
  for e in events:  # complete events, minus the Python, jit and executor wrappers around ops
    if e.get("ph") == "X" and not re.match(r"\$|PjitFunction|ThunkExecutor|Slinky", e["name"]):
      total = ops.setdefault(e["name"], [0.0, 0])
      total[0] += e.get("dur", 0) / 1e3 / steps
      total[1] += 1 / steps
  return state, ops


def print_profile(ops, flops: float, peak: float) -> None:
  if not ops:
    print("profile           no op events in the trace (on CPU set "
          "XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true)")
    return
  matmul = sum(ms for name, (ms, _) in ops.items() if MATMUL_OPS.search(name))
  rest = sum(ms for name, (ms, _) in ops.items() if not MATMUL_OPS.search(name))
  print(f"profile           matmul ops {matmul:.1f} ms/step ({flops / matmul / 1e6:.1f} GFLOP/s, "
        f"{100 * flops / matmul * 1e3 / peak:.0f}% of the peak while they run); other ops "
        f"{rest:.1f} ms/step in {sum(not MATMUL_OPS.search(n) for n in ops)} distinct ops "
        f"(times include the tracer's overhead)")
  for name, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]:
    print(f"  {ms:8.1f} ms  x{calls:<4.0f} {name[:90]}")


def peak_memory() -> str:
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return f"{stats['peak_bytes_in_use'] / 2**30:.2f} GiB on {jax.devices()[0].platform}"
  return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS"


def report() -> None:
  FLAGS = flags.FLAGS
  config = FLAGS.config
  config.model.update(DIMS[FLAGS.dims], dropout=0.1)
  if FLAGS.layers:
    config.model.update(num_encoder_layers=FLAGS.layers, num_decoder_layers=FLAGS.layers)
  b, t, v = FLAGS.batch_size, FLAGS.length or LENGTHS[FLAGS.dims], FLAGS.vocab_size
  config.train.batch_size = b
  config.task.update(num_symbols=v - NUM_RESERVED, max_len=t - 1, longer_max_len=t - 1)
  exp = experiment.build(parse(config))
  step = step_lib.compile_step(exp)  # the train step exactly as train.py runs it
  state = step.init()
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  rng = np.random.default_rng(0)
  # No segment ids or positions: one full sequence per row, which declares the rows padded
  # (embeddings.inputs_mask), so cuDNN takes its causal flag and lengths, not a dense mask.
  batch = {"inputs": rng.integers(3, v, (b, t)).astype(np.int32),
           "targets": rng.integers(3, v, (b, t)).astype(np.int32)}
  batch = jax.device_put(batch, step.batch_sharding)

  start = time.perf_counter()
  compiled = step.step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  xla_flops = float(cost.get("flops", 0.0))
  flops = model_flops(config.model, v, b, t, t)
  uses_cudnn = "cudnn" in compiled.as_text() and "fmha" in compiled.as_text()

  state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  dtype = jnp.dtype(config.model.dtype)
  peak = matmul_peak(FLAGS.peak_size or (2048 if jax.default_backend() == "cpu" else 8192), dtype)
  print(f"device            {jax.devices()[0].device_kind} x{jax.device_count()}")
  print(f"model             {FLAGS.dims}: {n_params:,} params, vocab {v}, "
        f"score={config.model.attention.score}, position={config.model.position}, "
        f"dtype={dtype.name}, kernel={config.model.attention.kernel}"
        f"{' (cuDNN fused attention in the compiled step)' if uses_cudnn else ''}")
  print(f"batch             {b} x ({t} source + {t} target) tokens")
  print(f"compile           {compile_s:.1f} s")
  print(f"step              {1e3 * step_s:.1f} ms (median of {len(times)}; "
        f"min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})")
  print(f"throughput        {b * t / step_s:,.0f} target tok/s, {2 * b * t / step_s:,.0f} tok/s")
  print(f"model FLOPs       {flops / 1e9:.1f} GFLOP/step -> {flops / step_s / 1e9:.1f} GFLOP/s")
  loops = config.model.scan_layers or config.train.loss_chunks > 1
  print(f"XLA-counted FLOPs {xla_flops / 1e9:.1f} GFLOP/step -> {xla_flops / step_s / 1e9:.1f} GFLOP/s")
  print(f"matmul peak       {peak / 1e9:.1f} GFLOP/s ({dtype.name})")
  print(f"MFU               {100 * flops / step_s / peak:.1f}% "
        f"(XLA-counted: {100 * xla_flops / step_s / peak:.1f}%"
        f"{', which counts a loop body once (scanned layers, loss chunks)' if loops else ''})")
  temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
  print(f"peak memory       {peak_memory()}; XLA temporaries of the step {temp:.2f} GiB")
  if FLAGS.json:
    with open(FLAGS.json, "a") as file:
      file.write(json.dumps({
          "benchmark": "train_step", "model": "this project", "device": jax.devices()[0].device_kind,
          "dims": FLAGS.dims, "layers": config.model.num_encoder_layers, "batch": b, "length": t,
          "vocab": v, "dtype": dtype.name, "kernel": config.model.attention.kernel,
          "cudnn": uses_cudnn, "compile s": compile_s, "step ms": 1e3 * step_s,
          "MFU": flops / step_s / peak, "peak TFLOP/s": peak / 1e12}) + "\n")
  if FLAGS.profile:
    print_profile(profile(compiled, state, batch)[1], flops, peak)


if __name__ == "__main__":
  harness.run(report)
