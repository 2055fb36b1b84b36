"""What the test modules share. Not a test module (pytest collects test_*.py only): a test
module imports its helpers from here (or tests/clirun.py, tests/kernel_cases.py), never
from another test module; tests/test_layout.py holds that rule.

One tiny of each kind:
- TINY_MODEL: the ModelConfig fields of a model that computes in milliseconds. A unit test
  builds ModelConfig(**{**TINY_MODEL, <delta>}), its delta naming what the test depends on
  (and a comment why). TINY_WIDTH is its width, for a config shrunk to it.
- make_tiny_config: a whole config (the default's copy task) whose model (TINY_CONFIG_MODEL,
  twice as wide) trains in seconds; other configs' tests shrink their model to it.
- TINY_FLAGS: the same shrink on a CLI's command line.
Then the helpers more than one test module uses: small configs of other data, readers of a
run's workdir, runs written without training, decoding and sharding equivalences, a fake
bucket.
"""

import contextlib
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import default
from transformer.core.vocab import PAD_ID
from transformer.model.families import shift_right

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- tiny

# A model that computes (its width, for configs shrunk to it: TINY_WIDTH); the vocabulary
# holds family_batch's tokens (3..18).
TINY_WIDTH = dict(d_model=16, num_heads=2, d_ff=32)
TINY_MODEL = dict(vocab_size=19, **TINY_WIDTH, num_encoder_layers=1, num_decoder_layers=1,
                  dropout=0.0, max_len=32)
# A model that trains in seconds, in a whole config (make_tiny_config, TINY_FLAGS).
TINY_CONFIG_MODEL = dict(d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1,
                         num_decoder_layers=1)
TINY_TASK = dict(name="copy", num_symbols=6, max_len=5, longer_max_len=7)


def make_tiny_config(**overrides):
  """The default config shrunk to a model and task that train in seconds; `overrides` are
  {"section.field": value} (dotted paths into the ConfigDict)."""
  config = default.get_config()
  config.task.update(**TINY_TASK, min_len=1)
  config.model.update(**TINY_CONFIG_MODEL, max_len=16)
  config.train.update(batch_size=32, num_steps=40, warmup_steps=20, learning_rate=0.5,
                      label_smoothing=0.0,
                      log_every=10, eval_every=0, checkpoint_every=10, keep_checkpoints=10)
  config.eval.update(num_examples=64, batch_size=32)
  for key, value in overrides.items():
    *sections, field = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[field] = value
  return config


# Flags that shrink the default config (configs/default.py) to a model and task that train in
# seconds: make_tiny_config's task and model, smaller batches.
TINY_FLAGS = [*(f"--config.task.{k}={v}" for k, v in TINY_TASK.items()),
              *(f"--config.model.{k}={v}" for k, v in TINY_CONFIG_MODEL.items()),
              "--config.train.batch_size=16", "--config.train.log_every=5",
              "--config.train.eval_every=0", "--config.eval.num_examples=16",
              "--config.eval.batch_size=16"]

# --------------------------------------------------------------------------- other configs


def passkey_lm_config(directory, **passkey_fields) -> dict:
  """A tiny language model (a raw config dict: config.parse makes it typed) trained 2 steps
  at L = 64, evaluated at 64 and 128, on a corpus written into `directory` whose vocabulary
  writes the passkey prompt's words whole; data.passkey is `passkey_fields`."""
  from transformer.data.lm import passkey  # noqa: PLC0415 - support stays light to import

  corpus = [passkey.FILLER, passkey.HEAD + " 12345", passkey.REMEMBER, passkey.TAIL,
            passkey.QUESTION + " 4096"]
  for split, n in (("train", 200), ("valid", 40)):
    (directory / f"{split}.py").write_text("\n".join(
        f"# {corpus[i % len(corpus)]}\ndef f{i}(x):\n  return x * {i % 7} + {i % 5}"
        for i in range(n)))
  raw = make_tiny_config(**{"train.num_steps": 2, "train.log_every": 1,
                            "train.checkpoint_every": 2, "eval.num_examples": 2,
                            "eval.batch_size": 8, "train.batch_size": 4,
                            "model.max_len": 128}).to_dict()
  raw["data"] = dict(source="lm", corpus="files", dir=str(directory), train_files="train.py",
                     valid_files="valid.py", vocab_size=160, max_len=64, max_factor=2,
                     passkey=passkey_fields)
  raw["model"].update(arch="decoder")
  raw.pop("task", None)
  return raw


def listops_config(**overrides):
  """A tiny ListOps encoder (mean pooling) that trains in seconds."""
  config = make_tiny_config(**{"model.dropout": 0.0, "train.num_steps": 10, "train.log_every": 5,
                               **overrides})
  config.data.source = "labelled"
  config.task = dict(name="listops", min_len=5, max_len=16, max_depth=3, max_args=3)
  config.model.update(arch="encoder", pooling="mean")
  return config


def chomsky_tiny_config(name="reverse_string", cast="decoder", arch="decoder", **task):
  """configs/chomsky.py:cpu at tiny size: task `name` (its fields `task`) in `cast`. Its own
  dims, smaller than TINY_MODEL (8 wide, 1 head), with a learning rate tuned to them:
  tests/test_decoder_cast.py steps it on every task of the registry and asserts that the
  second step's loss falls."""
  from configs import chomsky  # noqa: PLC0415

  config = chomsky.get_config("cpu")
  config.data.cast = cast
  config.model.update(arch=arch, num_decoder_layers=1, num_encoder_layers=1, d_model=8,
                      num_heads=1, d_ff=16, max_len=32, dropout=0.0, position="rotary")
  config.task.update(name=name, **{"min_len": 1, "max_len": 3, "test_max_len": 3, **task})
  config.train.update(batch_size=4, warmup_steps=1, learning_rate=1e-2)
  config.eval.update(num_examples=4, batch_size=4)
  return config


LM_CONFIG = """
from tests.support import make_tiny_config

def get_config():
  config = make_tiny_config(**{{"train.num_steps": 5, "train.log_every": 5,
                               "train.checkpoint_every": 5}})
  config.data = dict(source="lm", corpus="files", dir={corpus!r}, train_files="train.txt",
                     valid_files="valid.txt", vocab_size=48, max_len=8, max_factor=1,
                     sliding=False)
  config.model.update(arch="decoder", max_len=8)
  config.eval.update(num_examples=4, batch_size=4)
  del config.task
  return config
"""


def write_lm_config(root) -> str:
  """Writes root/lm.py (LM_CONFIG: a tiny language model on files) and its corpus
  (root/corpus); returns the file's path."""
  corpus = root / "corpus"
  corpus.mkdir()
  for name in ("train", "valid"):
    (corpus / f"{name}.txt").write_text("\n".join(f"def f{i}(x):\n  return x + {i}"
                                                  for i in range(60)))
  (root / "lm.py").write_text(LM_CONFIG.format(corpus=str(corpus)))
  return str(root / "lm.py")


# --------------------------------------------------------------------------- workdirs


def read_records(workdir) -> list[dict]:
  """The records of a run's metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(workdir) -> list[float]:
  """The training losses a run logged, in order."""
  return [r["loss"] for r in read_records(workdir) if r["split"] == "train"]


def checkpoint_params(workdir, step):
  """The parameters (a pure dict) of a run's checkpoint at `step`."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  from transformer.run import checkpoint  # noqa: PLC0415

  mngr = checkpoint.manager(workdir, read_only=True)
  try:
    return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))[
        "state"]["params"]
  finally:
    mngr.close()


def source_config(sections: dict, **overrides) -> dict:
  """The tiny test config (a few steps, small batches) with a data source's example sections
  (DataSource.example) in place of its data and task, as nested dicts for config.parse."""
  raw = make_tiny_config(**{"train.num_steps": 4, "train.log_every": 2,
                            "train.checkpoint_every": 2, "eval.num_examples": 8,
                            "eval.batch_size": 8, "train.batch_size": 8, **overrides}).to_dict()
  raw["data"] = sections["data"]
  raw["task"] = sections.get("task", {})
  raw["model"].update(sections.get("model", {}))
  return raw


def implied_structure(batch: dict) -> dict:
  """A batch of unpacked rows (data/pipeline.py unpacked) with the segment ids and positions
  its declaration implies: 1 where a token is not PAD_ID (a prefix of the row), positions
  0, 1, … there and 0 on padding."""
  out = dict(batch)
  for key in ("inputs", "targets"):
    segments = (np.asarray(batch[key]) != PAD_ID).astype(np.int32)
    out[f"{key}_segmentation"] = segments
    out[f"{key}_positions"] = np.arange(segments.shape[1], dtype=np.int32)[None] * segments
  return out


def restore_and_evaluate(workdir, step=None, average=1, **kwargs):
  """eval.py's work: restored_run.evaluate_run (kwargs: output, beam_size, alpha, files,
  sampling, seed) of the run restore_run(workdir, step, average) restores."""
  from transformer.run import restored_run  # noqa: PLC0415 - support stays light to import

  return restored_run.evaluate_run(restored_run.restore_run(workdir, step, average), **kwargs)


def fake_run(path, exact: float, seed: int = 0, steps: int = 40, final: bool = True,
             examples: dict | None = None, **overrides) -> str:
  """A run's workdir as training leaves it, without training: config.json and
  metrics.jsonl (training losses; the final evaluation unless not `final`) of the tiny
  config with `overrides`, its valid exact match `exact` (`examples`: the valid split's
  per-example results, as the final evaluation records them)."""
  from transformer.run import config as config_lib  # noqa: PLC0415
  from transformer.run import workdir as workdir_lib  # noqa: PLC0415
  from transformer.run.evaluator import PER_EXAMPLE  # noqa: PLC0415

  cfg = config_lib.parse(make_tiny_config(**{"seed": seed, "train.num_steps": steps,
                                             **overrides}))
  path = str(path)
  os.makedirs(path, exist_ok=True)
  workdir_lib.write_config(cfg, path)
  workdir_lib.append_metrics(path, *({"step": s, "split": "train", "loss": 2.0 - exact * s / steps}
                                     for s in range(10, steps + 1, 10)))
  if final:
    valid = {"step": steps, "split": "valid", "loss": 1.0 - exact, "accuracy": 0.5 + exact / 2,
             "exact_match": exact, "exact_match_by_length": {"3": exact}, "examples": 64}
    if examples is not None:
      valid[PER_EXAMPLE] = examples
    workdir_lib.append_metrics(
        path, valid,
        {"step": steps, "split": "longer", "loss": 2.0 - exact, "accuracy": exact / 2,
         "exact_match": exact / 4, "exact_match_by_length": {"6": exact / 4}, "examples": 64})
  return path


def write_evaluation(path, hypotheses: list[str], references: list[str]) -> str:
  """eval.py's output for a text split `valid`: the metrics JSON at `path` and the files
  beside it; returns the JSON's path."""
  from transformer.run.eval_files import text_paths  # noqa: PLC0415

  hyp_path, ref_path = text_paths(str(path), "valid")
  for file, lines in ((hyp_path, hypotheses), (ref_path, references)):
    with open(file, "w", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in lines))
  path.write_text(json.dumps({"step": 10, "splits": {"valid": {"bleu": 0.0,
                                                               "predictions": hyp_path}}}))
  return str(path)


# --------------------------------------------------------------------------- models

# Two source rows (one with padding) for an encoder-decoder, and how many target tokens to
# decode from them. NumPy: a JAX array here would start JAX's backend when conftest imports.
DECODE_BATCH = {"inputs": np.array([[3, 4, 5, 6, 2, 0], [7, 8, 9, 10, 11, 2]], np.int32)}
DECODE_LEN = 7


@nnx.jit
def full_logits(model, batch, targets):
  """An encoder-decoder's teacher-forced logits [batch, len, vocab] of `targets`, in one pass."""
  positions = jnp.broadcast_to(jnp.arange(targets.shape[1]), targets.shape)
  encoded = model.encode(batch["inputs"])
  return model.decode(encoded, (batch["inputs"] != PAD_ID).astype(jnp.int32),
                      shift_right(targets, positions), positions,
                      jnp.ones_like(targets))


@nnx.jit
def cached_logits(model, batch, targets):
  """The same logits as full_logits from decode_step, one position at a time (a copy of
  the model holds the cache)."""
  model = nnx.clone(model)
  model.init_decoding(batch, targets.shape[1])
  decoder_inputs = shift_right(targets, jnp.broadcast_to(jnp.arange(targets.shape[1]),
                                                         targets.shape))
  return jnp.concatenate([model.decode_step(decoder_inputs[:, t:t + 1], t)
                          for t in range(targets.shape[1])], axis=1)


def family_batch(arch, b=2, t=8):
  """A training batch [b, t] for a model of family `arch` built from TINY_MODEL (tokens
  3..18; an encoder's targets are labels 0..4 of 5 classes)."""
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, 19, (b, t)).astype(np.int32)
  targets = (rng.integers(0, 5, (b, t)) if arch == "encoder" else
             rng.integers(3, 19, (b, t))).astype(np.int32)
  return {"inputs": inputs, "targets": targets, "targets_segmentation": np.ones((b, t), np.int32)}


def assert_generation_is_the_full_pass(model):
  """A decoder-only `model`'s logits while generating 12 tokens from 3 prompts (of 1, 3, 5
  tokens) with its cache equal its one full pass over the generated rows."""
  from flax import nnx  # noqa: PLC0415

  from transformer.model.decoding import generate  # noqa: PLC0415

  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (3, 5)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p, n: generate(m, p, n, 12))(model, prompts,
                                                                  jnp.array([1, 3, 5]))
  ones = jnp.ones_like(tokens)
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens, "inputs_segmentation": ones})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5, rtol=1e-4)


def randomise(module, seed=7):
  """Every parameter of `module` moved by 0.5·N(0, 1) (norm scales and biases start at 1
  and 0, where formulas would not tell them apart); returns it."""
  import jax  # noqa: PLC0415 - support stays light to import
  from flax import nnx  # noqa: PLC0415

  state = nnx.state(module, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  nnx.update(module, jax.tree.unflatten(tree, [
      leaf + 0.5 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]))
  return module


def adam_losses(model, arch, steps=6, learning_rate=3e-2):
  """The per-token losses of `steps` Adam steps of `model` (family `arch`) on one
  family_batch: a variant that learns lowers them."""
  import jax  # noqa: PLC0415 - support stays light to import
  import optax  # noqa: PLC0415

  from transformer.run import step as step_lib  # noqa: PLC0415

  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  optimizer = optax.adam(learning_rate)
  step = jax.jit(step_lib.make_train_step(graphdef, optimizer, lambda s: learning_rate,
                                          label_smoothing=0.0, seed=0))
  state = {"step": jnp.zeros((), jnp.int32), "params": params,
           "opt_state": optimizer.init(params)}
  batch, losses = family_batch(arch), []
  for _ in range(steps):
    state, sums = step(state, batch)
    losses.append(float(sums["loss"]) / float(sums["tokens"]))
  return losses


def randomised(model, seed=3, scale=0.3):
  """model with scale·N(0, 1) added to every parameter (norm scales and biases start at 1
  and 0, gates' and sinks' at their inits), so that every part acts in an equivalence."""
  import jax  # noqa: PLC0415

  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  nnx.update(model, jax.tree.unflatten(tree, [
      leaf + scale * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]))
  return model


def jaxpr_equations(jaxpr, primitive):
  """The equations applying `primitive` in jaxpr and in the jaxprs nested in it (jit, ...)."""
  found = []
  for eqn in jaxpr.eqns:
    found += [eqn] if eqn.primitive.name == primitive else []
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        found += jaxpr_equations(inner, primitive)
  return found


# --------------------------------------------------------------------------- devices

SHARDED_RUN = """
import json, sys
import jax
from tests.support import make_tiny_config
from transformer.run import sharding
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
config = make_tiny_config(**json.loads(sys.argv[2]))
train_and_evaluate(parse(config), sys.argv[1])
mesh = sharding.make_mesh(config.mesh.to_dict())
print("MESH", dict(mesh.shape), "DEVICES", jax.device_count())
"""


def eight_devices() -> dict:
  """The environment of a subprocess with 8 CPU devices."""
  return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
          "JAX_PLATFORMS": "cpu"}


def sharded_matches_single(tmp_path, overrides: dict, mesh: dict) -> tuple[str, str]:
  """Trains make_tiny_config(**overrides) on one device and, in a subprocess of 8 CPU
  devices, with `mesh` (and any other overrides) added; asserts the 2x2x2 mesh was used and
  the training losses agree. Returns (single workdir, sharded workdir)."""
  from transformer.run.config import parse  # noqa: PLC0415
  from transformer.run.training import train_and_evaluate  # noqa: PLC0415

  single = str(tmp_path / "single")
  train_and_evaluate(parse(make_tiny_config(**overrides)), single)
  sharded = str(tmp_path / "sharded")
  proc = subprocess.run([sys.executable, "-c", SHARDED_RUN, sharded,
                         json.dumps({**overrides, **mesh})],
                        cwd=ROOT, env=eight_devices(), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "MESH {'data': 2, 'fsdp': 2, 'tensor': 2} DEVICES 8" in proc.stdout
  np.testing.assert_allclose(train_losses(sharded), train_losses(single), rtol=1e-5)
  return single, sharded


# --------------------------------------------------------------------------- storage


@contextlib.contextmanager
def fake_bucket(root):
  """gs://NAME/... is ROOT/NAME/... for every epath call; writing an object makes its folder."""
  from etils.epath import testing as epath_testing  # noqa: PLC0415

  def local(path):
    path = os.fspath(path)
    return os.path.join(root, path[len("gs://"):]) if path.startswith("gs://") else path

  def one(fn, path, *args, **kwargs):
    return fn(local(path), *args, **kwargs)

  def two(fn, path, destination, *args, **kwargs):
    return fn(local(path), local(destination), *args, **kwargs)

  def open_object(fn, path, mode, *args, **kwargs):  # an object store has no folders to make
    if any(m in mode for m in "wax"):
      os.makedirs(os.path.dirname(local(path)), exist_ok=True)
    return fn(local(path), mode, *args, **kwargs)

  with epath_testing.mock_epath(
      open=open_object, exists=one, glob=one, isdir=one, listdir=one, makedirs=one, mkdir=one,
      remove=one, rmtree=one, stat=one, walk=one, rename=two, replace=two, copy=two):
    yield
