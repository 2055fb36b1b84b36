"""Session setup (a shared compilation cache, Hugging Face offline) and fixtures. The helpers
the test modules share live in tests/support.py."""

import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


def _share_compilations() -> None:
  """One JAX persistent compilation cache for the session's processes (this one, pytest-xdist's
  workers, the CLI forkserver's children, the multi-process tests' subprocesses: all inherit
  the environment). Most tests compile the same tiny model; on the 2-core machine a tiny
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

# On a GPU the suite's processes (pytest-xdist's workers, the CLIs' subprocesses) share one
# device: each allocates what it uses instead of JAX's default 75% of the device's memory,
# which the second process would not find. The caller's setting is kept.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from tests.support import make_tiny_config  # noqa: E402 - after the environment is set


# The modules holding the slowest tests of `python -m pytest -q tests --durations=40` (this
# 2-core machine, 2026-11-28: multi-process sweeps 72 + 70 + 45 s, a compilation-cache rerun
# 41 s, benchmark smokes 37 and 26 s, 8-device runs 32 s each, ...), slowest first. They are
# collected first, so pytest-xdist, which hands out whole modules in collection order, starts
# them first and ends the run on short modules instead of one worker finishing a long one
# alone (the suite's 26 min 54 s wall held 45 min 30 s of CPU on 2 cores).
FIRST = ["test_multiprocess", "test_benchmarks", "test_faults", "test_compile_cache",
         "test_sharding", "test_attention_variants", "test_text_training", "test_sweep",
         "test_cli", "test_model", "test_decoding", "test_lowering"]


def pytest_collection_modifyitems(items):
  """The modules of FIRST ahead of the others (each module's tests in their own order)."""
  rank = {name: i for i, name in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(FIRST))
             if item.module is not None else len(FIRST))


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

