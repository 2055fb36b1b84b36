import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


def _share_compilations() -> None:
  """One JAX persistent compilation cache for the session's processes (this one, the CLI
  forkserver's children, the multi-process tests' subprocesses: all inherit the
  environment). Most tests compile the same tiny model; on the 2-core machine a tiny
  train-and-evaluate takes 10.9 s cold and 2.6 s once the cache is warm. Fresh per session
  (nothing from another checkout is reused) and removed at exit; a cached executable is the
  one XLA would compile, so no result changes. JAX_COMPILATION_CACHE_DIR set by the caller
  is kept."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  directory = tempfile.mkdtemp(prefix="jax-compilations-")
  atexit.register(shutil.rmtree, directory, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=directory,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


_share_compilations()


def _offline_hugging_face() -> None:
  """Hugging Face datasets (data.source hf) never reach the network in the tests, and keep
  their cache in a directory of the session's, removed at exit (HF_HOME set by the caller
  is kept)."""
  os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
  if "HF_HOME" not in os.environ:
    directory = tempfile.mkdtemp(prefix="hf-home-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["HF_HOME"] = directory


_offline_hugging_face()

from configs import default  # noqa: E402


def make_tiny_config(**overrides):
  """The default config shrunk to a model and task that train in seconds."""
  config = default.get_config()
  config.task.update(name="copy", num_symbols=6, min_len=1, max_len=5, longer_max_len=7)
  config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                      num_decoder_layers=1, max_len=16)
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


def passkey_lm_config(directory, **passkey_fields) -> dict:
  """A tiny language model (a raw config dict: config.parse makes it typed) trained 2 steps
  at L = 64, evaluated at 64 and 128, on a corpus written into `directory` whose vocabulary
  writes the passkey prompt's words whole; data.passkey is `passkey_fields`."""
  from transformer.data import passkey  # noqa: PLC0415 - conftest stays light to import

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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops the compiled programs of each test module when it ends. XLA:CPU maps every
  compiled program's code into the process (about 3 memory maps per small program, measured:
  300 jitted functions took /proc/self/maps from 438 to 1405 lines, and jax.clear_caches()
  back to 513), and the suite's thousands of compilations in one process reached the
  kernel's limit (vm.max_map_count, 65530 here): XLA's compiler segfaulted at the same
  point of the suite, whatever it compiled there. The persistent compilation cache makes
  the recompilations of later modules cheap."""
  yield
  import gc  # noqa: PLC0415

  import jax  # noqa: PLC0415

  jax.clear_caches()
  gc.collect()


@pytest.fixture
def tiny_config():
  return make_tiny_config


def restore_and_evaluate(workdir, step=None, average=1, **kwargs):
  """eval.py's work: evaluation.evaluate_run (kwargs: output, beam_size, alpha, files,
  sampling, seed) of the run restore_run(workdir, step, average) restores."""
  from transformer.run import evaluation  # noqa: PLC0415 - conftest stays light to import

  return evaluation.evaluate_run(evaluation.restore_run(workdir, step, average), **kwargs)
