"""An exclusive lock on a workdir, so that two runs never write into one.

The lock is a file, `train.lock` in the workdir, naming its owner (host, process, the pid
namespace and boot it ran in) with a heartbeat that a thread rewrites every
HEARTBEAT_SECONDS. A process that finds the file refuses to start unless the lock is
stale, and takes a stale lock over with a log line:
  * its owner ran on this machine, in this pid namespace, and that process is gone (or
    the pid now belongs to a process started later): known at once;
  * otherwise (another host, another container) its heartbeat is older than
    STALE_SECONDS: the owner's host died or lost the filesystem.
Creating the file is atomic (O_EXCL) on a local or network filesystem, and a takeover
first renames the stale file, which only one of several contenders can do. In a bucket
(gs://), which has neither, the lock is written and read back: two runs started within
the same second may both pass (start runs of one workdir from one place). fcntl/flock
locks (the `filelock` package) would free a dead process's lock by themselves, but they
do not hold across the hosts of a shared filesystem, and they cannot say who holds the
lock: the refusal names the owner.
"""

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError

log = logging.getLogger("transformer")

LOCK_FILE = "train.lock"
HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 300.0


class Locked(RunError):
  """The workdir is in use by another live process."""


def _read(path: str, default: str = "") -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return default


def _process_start(pid: int) -> str:
  """The start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or ""."""
  stat = _read(f"/proc/{pid}/stat")
  return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def _machine() -> dict:
  """What identifies this process's pid space: the same values mean a pid names the same
  process here and there."""
  try:
    namespace = os.readlink("/proc/self/ns/pid")
  except OSError:
    namespace = ""
  return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
          "pid_namespace": namespace}


def _alive(owner: dict) -> bool | None:
  """Whether the owner process runs: True/False when it shares this pid space, else None."""
  if any(owner.get(k) != v for k, v in _machine().items()):
    return None
  try:
    os.kill(int(owner["pid"]), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's process
  start = owner.get("process_start")
  return not start or start == _process_start(int(owner["pid"]))


def _describe(owner: dict) -> str:
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
  return f"pid {owner.get('pid')} on {owner.get('host')} (since {started})"


class WorkdirLock:
  """The lock on `workdir`: acquire() takes it or raises RunError, release() frees it."""

  def __init__(self, workdir: str):
    self.workdir, self.path = workdir, storage.join(workdir, LOCK_FILE)
    self.owner = {**_machine(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                  "started": time.time(), "token": uuid.uuid4().hex,
                  "command": " ".join(sys.argv)}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _write(self, path: str, exclusive: bool) -> None:
    data = json.dumps({**self.owner, "heartbeat": time.time()})
    if not exclusive:
      storage.write(path, data)
    elif storage.is_local(path):
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
      with os.fdopen(fd, "w") as f:
        f.write(data)
    else:  # an object store has no exclusive create: write, then see whose lock stands
      if epath.Path(path).exists():
        raise FileExistsError(path)
      storage.write(path, data)
      if (self._held_by() or {}).get("token") != self.owner["token"]:
        raise FileExistsError(path)

  def _held_by(self) -> dict | None:
    try:
      return json.loads(epath.Path(self.path).read_text())
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}  # unreadable or half-written: judged by the file's age

  def acquire(self) -> None:
    try:
      epath.Path(self.workdir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ConfigError(f"cannot create the workdir {self.workdir}: {e.strerror}") from None
    for _ in range(3):
      try:
        self._write(self.path, exclusive=True)
        break
      except FileExistsError:
        pass
      except OSError as e:
        raise ConfigError(f"cannot write into the workdir {self.workdir}: {e.strerror}") from None
      owner = self._held_by()
      if owner is None:
        continue  # released meanwhile
      alive = _alive(owner) if owner else None
      try:
        age = time.time() - float(owner.get("heartbeat")
                                  or epath.Path(self.path).stat().mtime)
      except OSError:
        continue
      if alive or (alive is None and age < STALE_SECONDS):
        raise Locked(
            f"the workdir {self.workdir} is in use by {_describe(owner)}, heartbeat {age:.0f} s "
            f"ago; wait for that run to end or use another --workdir (if it is gone, delete "
            f"{self.path})")
      aside = epath.Path(f"{self.path}.stale-{self.owner['token']}")
      try:
        epath.Path(self.path).rename(aside)  # locally, only one contender wins the stale file
      except FileNotFoundError:
        continue
      aside.unlink()
      why = "has exited" if alive is False else f"sent no heartbeat for {age:.0f} s"
      log.warning("took over the stale lock of %s in %s: that process %s",
                  _describe(owner), self.workdir, why)
    else:
      raise RunError(f"could not take the lock {self.path}: other processes keep taking it")
    self._thread = threading.Thread(target=self._heartbeat, name="workdir-lock", daemon=True)
    self._thread.start()

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      owner = self._held_by()
      if owner is not None and owner.get("token") != self.owner["token"]:
        log.warning("the lock %s was taken over by %s", self.path, _describe(owner))
        return
      with contextlib.suppress(OSError):
        self._write(self.path, exclusive=False)

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    owner = self._held_by()
    if owner and owner.get("token") == self.owner["token"]:
      with contextlib.suppress(OSError):
        epath.Path(self.path).unlink()

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


@contextlib.contextmanager
def hold(workdir: str):
  """Holds `workdir`'s lock for a run: process 0 takes it on behalf of all processes (one
  lock per run, not one per host); every process raises if it could not be taken."""
  lock, error = WorkdirLock(workdir), None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except (ConfigError, RunError) as e:
      error = e
  if jax.process_count() > 1:
    taken = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if not taken and error is None:
      error = RunError(f"process 0 could not lock the workdir {workdir} (see its error)")
  if error is not None:
    raise error
  try:
    yield lock
  finally:
    if jax.process_index() == 0:
      lock.release()
