"""Flax's examples/wmt train step at this project's dimensions, beside benchmarks/train_step.py:
ms/step and MFU on the same batch shape, vocabulary and matmul peak.

  python benchmarks/flax_wmt_step.py --models ~/flax/examples/wmt/models.py --dims=base \
      --dtype=bfloat16 --vocab_size=32000 --batch_size=128
  python benchmarks/flax_wmt_step.py --models PATH --smoke   # seconds: does it still run

--models is the path of flax's examples/wmt/models.py in a flax checkout
(github.com/google/flax): the file is loaded from there, never copied into this project.
Its Transformer (linen) is built with shared embeddings, dropout 0.1 and no attention
dropout (as this project's step), and trained by a jitted AdamW step on a cross-entropy
with label smoothing 0.1, weighted where the target is not padding (as examples/wmt's
train.py). Prints figures; asserts nothing.
"""

import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

import harness
from mfu import DIMS, LENGTHS, matmul_peak, model_flops
from transformer.core.errors import ConfigError

flags.DEFINE_string("models", None, "Path of flax's examples/wmt/models.py.")
flags.DEFINE_enum("dims", "small", list(DIMS), "Model dimensions (benchmarks/mfu.py).")
flags.DEFINE_integer("layers", 0, "Encoder and decoder layers each; 0: the dims' own.")
flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size.")
flags.DEFINE_integer("batch_size", 32, "Sequences per step.")
flags.DEFINE_integer("length", 0, "Source and target tokens per sequence; 0: the dims' own.")
flags.DEFINE_integer("steps", 10, "Timed steps (after one warm-up step).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Computation dtype.")
flags.DEFINE_integer("peak_size", 0, "Matmul size for the peak; 0: 2048 on CPU, 8192 else.")
flags.DEFINE_string("json", None, "Append the figures as one JSON line to this file.")
harness.define_smoke(dims="tiny", vocab_size=64, batch_size=4, length=8, steps=2,
                     peak_size=128, layers=1)


def load_models(path: str | None):
  """flax's examples/wmt/models.py as a module, or a ConfigError saying it is absent."""
  if not path or not os.path.isfile(path):
    raise ConfigError(f"--models={path!r}: flax's examples/wmt/models.py not found; give the "
                      "path of that file in a flax checkout (git clone "
                      "https://github.com/google/flax)")
  spec = importlib.util.spec_from_file_location("flax_wmt_models", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def smoothed_loss(logits, targets, smoothing: float = 0.1):
  """Σ cross-entropy against targets smoothed by `smoothing`, over non-padding targets."""
  vocab = logits.shape[-1]
  confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  loss = -jnp.sum(soft * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1)
  return jnp.sum(loss * (targets > 0))


def report() -> None:
  f = flags.FLAGS
  models = load_models(f.models)
  dims = dict(DIMS[f.dims])
  if f.layers:
    dims.update(num_encoder_layers=f.layers, num_decoder_layers=f.layers)
  b, t, v = f.batch_size, f.length or LENGTHS[f.dims], f.vocab_size
  dtype = jnp.dtype(f.dtype)
  cfg = models.TransformerConfig(
      vocab_size=v, output_vocab_size=v, share_embeddings=True, logits_via_embedding=True,
      dtype=dtype, emb_dim=dims["d_model"], num_heads=dims["num_heads"],
      num_layers=dims["num_encoder_layers"], qkv_dim=dims["d_model"], mlp_dim=dims["d_ff"],
      max_len=max(t, 256), dropout_rate=0.1, attention_dropout_rate=0.0, deterministic=False)
  model = models.Transformer(cfg)
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(3, v, (b, t)), jnp.int32)
  targets = jnp.asarray(rng.integers(3, v, (b, t)), jnp.int32)
  key = jax.random.key(0)
  params = jax.jit(model.init)({"params": key, "dropout": key}, inputs, targets)["params"]
  tx = optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-9)
  opt_state = tx.init(params)

  def step(params, opt_state, inputs, targets, key):
    def loss(params):
      logits = model.apply({"params": params}, inputs, targets, rngs={"dropout": key})
      return smoothed_loss(logits, targets) / jnp.sum(targets > 0)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, opt_state, inputs, targets, key).compile()
  compile_s = time.perf_counter() - start
  params, opt_state, value = compiled(params, opt_state, inputs, targets, key)
  jax.block_until_ready(value)
  times = []
  for i in range(f.steps):
    start = time.perf_counter()
    params, opt_state, value = compiled(params, opt_state, inputs, targets,
                                        jax.random.fold_in(key, i))
    jax.block_until_ready(value)
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))

  class Dims:  # model_flops reads attributes
    d_model, d_ff = dims["d_model"], dims["d_ff"]
    num_encoder_layers, num_decoder_layers = dims["num_encoder_layers"], dims["num_decoder_layers"]

  flops = model_flops(Dims, v, b, t, t)
  peak = matmul_peak(f.peak_size or (2048 if jax.default_backend() == "cpu" else 8192), dtype)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"device            {jax.devices()[0].device_kind} x{jax.device_count()}")
  print(f"model             flax examples/wmt ({f.models}), {f.dims}: {n_params:,} params, "
        f"vocab {v}, dtype={dtype.name}")
  print(f"batch             {b} x ({t} source + {t} target) tokens")
  print(f"compile           {compile_s:.1f} s")
  print(f"step              {1e3 * step_s:.1f} ms (median of {len(times)}; "
        f"min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})")
  print(f"MFU               {100 * flops / step_s / peak:.1f}% of a {peak / 1e12:.1f} TFLOP/s "
        f"matmul peak ({dtype.name}); loss {float(value):.3f}")
  if f.json:
    with open(f.json, "a") as file:
      file.write(json.dumps({
          "benchmark": "train_step", "model": "flax examples/wmt",
          "device": jax.devices()[0].device_kind, "dims": f.dims,
          "layers": dims["num_encoder_layers"], "batch": b, "length": t, "vocab": v,
          "dtype": dtype.name, "compile s": compile_s, "step ms": 1e3 * step_s,
          "MFU": flops / step_s / peak, "peak TFLOP/s": peak / 1e12}) + "\n")


if __name__ == "__main__":
  harness.run(report)
