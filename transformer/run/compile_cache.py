"""JAX's persistent compilation cache, on by default for the CLIs: a program compiled once
(the train step, the initialisation, each evaluation program per shape) is loaded from disk
by every later process that compiles the same program — a re-run, a resumed run, every seed
of a sweep after the first, eval.py after training.

Where: $JAX_COMPILATION_CACHE_DIR if set (kept as the user set it), else
$XDG_CACHE_HOME/transformer-ablations/jax (~/.cache/... without XDG_CACHE_HOME). Off:
--nocompilation_cache, or JAX's own JAX_ENABLE_COMPILATION_CACHE=false.

What is kept: every program whose compilation took at least MIN_COMPILE_SECONDS (JAX's
default, 1 s, would keep none of a small CPU run's programs, which compile in 0.1–1 s each;
the many eager one-op programs below the threshold cost more to write than to compile), of
any size. The cache holds at most MAX_BYTES, least recently used programs evicted first.
JAX's own variables, set, win: JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS,
JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES, JAX_COMPILATION_CACHE_MAX_SIZE.

Processes sharing the cache (sweep workers, runs side by side): a size limit makes JAX's LRU
cache take a file lock (the `filelock` package) around every read and write of it, so no
process reads an entry half written. In a directory the user names (JAX_COMPILATION_CACHE_DIR,
perhaps shared with other JAX programs, whose entries JAX's eviction cannot read) or without
filelock, the cache is as JAX keeps it by default, unbounded and unlocked: JAX writes an entry in place, and two processes writing the same
program at the same moment could splice it; a damaged entry is never run (zlib's checksum or
the deserialisation fails; JAX warns and compiles again). Measured here without the lock: 4
processes compiling the same program at once, 5 times, left no damaged entry.

A cached program is the executable XLA compiled for the same computation, compile options,
backend, device kinds and JAX/XLA versions (the cache key holds them all): loading it gives
bit-identical results. The counters (counts) tell how many programs a process compiled and
how many it loaded from the cache.
"""

import os
import threading

import jax

MIN_COMPILE_SECONDS = 0.2
MAX_BYTES = 4 << 30
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"
ENV_MAX = "JAX_COMPILATION_CACHE_MAX_SIZE"
ENV_MIN_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
ENV_MIN_BYTES = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"


def directory(env=None) -> str:
  """Where the cache is: the user's JAX_COMPILATION_CACHE_DIR, else a user cache directory."""
  env = os.environ if env is None else env
  if env.get(ENV_DIR):
    return env[ENV_DIR]
  home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(home, "transformer-ablations", "jax")


def _off(env) -> bool:
  return env.get(ENV_ENABLE, "").strip().lower() in ("0", "false", "no", "off")


def enable(on: bool = True, env=None) -> str | None:
  """Turns the persistent compilation cache on (module docstring) before the first
  compilation; returns its directory, or None when it is off (`on` False, or JAX's
  JAX_ENABLE_COMPILATION_CACHE=false). Starts the counters either way."""
  env = os.environ if env is None else env
  _listen()
  if not on or _off(env):
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = directory(env)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  # A size limit only in our own directory: JAX's eviction expects every entry written with
  # one (it reads their access times), and a directory the user named may be shared with
  # JAX programs that write without (each write then failed with a warning).
  bounded = not env.get(ENV_DIR) and _can_lock()
  for name, value in ((ENV_MIN_SECONDS, MIN_COMPILE_SECONDS), (ENV_MIN_BYTES, -1),  # any size
                      (ENV_MAX, MAX_BYTES if bounded else -1)):
    jax.config.update(name.lower(), type(value)(env.get(name, value)))  # the user's first
  return path


def _can_lock() -> bool:
  """Whether JAX's LRU cache can lock (it needs the filelock package for eviction)."""
  try:
    import filelock  # noqa: F401, PLC0415 - JAX's optional dependency for a bounded cache
  except ImportError:
    return False
  return True


_COUNTS = {"programs": 0, "loaded": 0}
_LOCK = threading.Lock()
_LISTENING = False


def _on_event(event: str, **kwargs) -> None:
  if event == "/jax/compilation_cache/cache_hits":
    with _LOCK:
      _COUNTS["loaded"] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":  # compiled, or loaded
    with _LOCK:
      _COUNTS["programs"] += 1


def _listen() -> None:
  global _LISTENING
  if not _LISTENING:
    jax.monitoring.register_event_listener(_on_event)
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    _LISTENING = True


def counts() -> dict[str, int]:
  """{"compiled": programs XLA compiled, "loaded": programs loaded from the persistent
  cache} in this process since enable()."""
  with _LOCK:
    return {"compiled": _COUNTS["programs"] - _COUNTS["loaded"], "loaded": _COUNTS["loaded"]}
