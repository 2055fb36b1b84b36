"""Where messages go: the console gets what a user acts on, a run's log file the details.

The console: progress lines on stdout (process 0; the other processes only warnings), one
line per warning, one `error:` line per failure (cli.one_line_errors). A run's log file,
WORKDIR/train.log (process I > 0 of a multi-host run: train.I.log), appended across
re-runs, gets the same lines and what the console leaves out: tracebacks, and what the
libraries report (orbax and absl, asyncio, tensorstore's callbacks through
sys.unraisablehook), which for one full disk or one damaged checkpoint runs to hundreds of
tracebacks that would bury the line that matters.

The console's streams outlive their reader. With `train.py ... | tee log`, a Ctrl-C also
kills tee; every later write to the pipe raises BrokenPipeError from wherever it happens (a
print, a logging handler, the signal handler, the interpreter's flush at exit), which would
lose the run or bury its last lines. A broken stream is pointed elsewhere instead, so that
what the run says after the Ctrl-C (that its checkpoint is saved) still reaches the person
at the terminal: stdout to stderr (which `| tee` leaves on the terminal), else (`2>&1 |
tee`) to the controlling terminal (/dev/tty), else to /dev/null.

Long passes (an evaluation) log plain progress lines every PROGRESS_EVERY seconds.
"""

import contextlib
import logging
import os
import sys
import time

import jax

from transformer.core import storage
from transformer.core.errors import ConfigError

log = logging.getLogger("transformer")


class _Unbreakable:
  """A text stream (sys.stdout, sys.stderr) whose writes never raise OSError: on a failure
  (a pipe whose reader exited, a closed terminal, a full disk under `> file`), its file
  descriptor is pointed at the next of its fallbacks (module docstring) and the write tried
  there; when none is left, at /dev/null, so this write and every later one, by Python or by
  C code, go nowhere instead of raising. Writing is the console's job, not the run's."""

  def __init__(self, stream, fallbacks: tuple[str, ...]):
    self._stream = stream
    self._fallbacks = list(fallbacks)  # "stderr" (for stdout), "/dev/tty"
    self._dead = False

  def write(self, text: str) -> int:
    while not self._dead:
      try:
        return self._stream.write(text)
      except OSError:
        self._redirect()
    return len(text)

  def writelines(self, lines) -> None:
    for line in lines:
      self.write(line)

  def flush(self) -> None:
    while not self._dead:
      try:
        return self._stream.flush()
      except OSError:
        self._redirect()

  def _redirect(self) -> None:
    """Points the stream's descriptor at its next fallback that is not the broken file
    itself, or at /dev/null (then the stream is dead); what is still buffered drains there."""
    try:
      fd = self._stream.fileno()
    except (OSError, ValueError):  # no file descriptor (a test's capture): dropped
      self._dead = True
      return
    while self._fallbacks:
      target = self._fallbacks.pop(0)
      try:
        new = os.dup(2) if target == "stderr" else os.open(target, os.O_WRONLY | os.O_NOCTTY)
      except OSError:  # no controlling terminal
        continue
      try:
        if _same_file(new, fd):
          continue  # 2>&1: stderr is the broken pipe too
        os.write(new, f"(the reader of {self._stream.name} is gone; what follows is "
                      f"written here)\n".encode())
        os.dup2(new, fd)
        return
      except OSError:
        continue
      finally:
        os.close(new)
    self._dead = True
    try:
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, fd)
      os.close(devnull)
    except OSError:
      pass

  def __getattr__(self, name):
    return getattr(self._stream, name)


def _same_file(a: int, b: int) -> bool:
  sa, sb = os.fstat(a), os.fstat(b)
  return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def unbreakable_streams() -> None:
  """Replaces sys.stdout and sys.stderr by streams whose writes never raise (idempotent):
  stdout falls back to stderr, then the terminal; stderr to the terminal."""
  for name, fallbacks in (("stdout", ("stderr", "/dev/tty")), ("stderr", ("/dev/tty",))):
    stream = getattr(sys, name)
    if stream is not None and not isinstance(stream, _Unbreakable):
      setattr(sys, name, _Unbreakable(stream, fallbacks))


def say(text: str) -> None:
  """Writes a line to file descriptor 2 with one system call: safe in a signal handler
  (no buffer that the interrupted code may be writing, nothing raised)."""
  try:
    os.write(2, (text + "\n").encode())
  except OSError:
    pass


class _OneLine(logging.Formatter):
  """A record as console lines: its message alone; a traceback goes to the run's log."""

  def format(self, record: logging.LogRecord) -> str:
    return super().format(logging.makeLogRecord(
        {**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None}))


def _ours(record: logging.LogRecord) -> bool:
  return record.name == "transformer" or record.name.startswith("transformer.")


class _RunLog(logging.Handler):
  """Appends the records it gets, tracebacks included, to the log file of the run in
  progress (`path`) and, in a command-line program, the libraries' records that arrive
  after the run to the last run's (`last`; see console()). A file starts with a line naming
  the command, is opened per record (nothing held open), and is created only when there is
  something to write (a refused input writes nothing); one that cannot be written is
  skipped, never an error."""

  def __init__(self):
    super().__init__()
    self.path: str | None = None
    self.last: str | None = None
    self.keep_last = False
    self.header: str | None = None  # written before the first record
    self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

  def destination(self, record: logging.LogRecord) -> str | None:
    return self.path or (None if _ours(record) else self.last)

  def emit(self, record: logging.LogRecord) -> None:
    path = self.destination(record)
    if path is None:
      return
    try:
      text = self.format(record)
      with open(path, "a", encoding="utf-8") as f:
        if self.header:
          f.write(self.header + "\n")
          self.header = None
        f.write(text + "\n")
    except Exception:  # noqa: BLE001 - a log that cannot be written must not stop the run
      pass


_RUN_LOG = _RunLog()


def run_log_path(workdir: str) -> str | None:
  """This process's log file in `workdir`; None for a workdir that is not a local path (an
  object store has no append)."""
  if not storage.is_local(workdir):
    return None
  i = jax.process_index()
  return storage.join(storage.absolute(workdir), "train.log" if i == 0 else f"train.{i}.log")


def current_run_log() -> str | None:
  """The log file of the run in progress, or of the last one in a command-line program, if
  it was written; else None."""
  path = _RUN_LOG.path or _RUN_LOG.last
  return path if path and os.path.exists(path) else None


@contextlib.contextmanager
def run_log(workdir: str):
  """While in the block, `workdir`'s log file gets the records of the `transformer` logger
  (the levels the logger lets through) and of the libraries (those that reach the root
  logger), and the traceback of an exception that ends the block (but bad input's)."""
  root = logging.getLogger()
  if _RUN_LOG not in root.handlers:
    root.addHandler(_RUN_LOG)
  path = run_log_path(workdir)
  with _RUN_LOG.lock:
    previous = _RUN_LOG.path, _RUN_LOG.header
    _RUN_LOG.path = path
    _RUN_LOG.header = (f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                       f"{' '.join(sys.argv)}")
  try:
    yield
  except ConfigError:  # bad input: its one line says it all, and writes nothing
    raise
  except Exception as e:
    log.debug("stopped by %s: %s", type(e).__name__, e, exc_info=True)
    raise
  finally:
    with _RUN_LOG.lock:
      _RUN_LOG.path, _RUN_LOG.header = previous
      if _RUN_LOG.keep_last and path:
        _RUN_LOG.last = path


class _Console(logging.Filter):
  """Keeps off the console's library handler (absl's, on the root logger) the records of
  the `transformer` logger, which has its own, and those that a run's log takes."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (_ours(record) or _RUN_LOG.destination(record))


def _unraisable(unraisable) -> None:
  """sys.unraisablehook: an exception nobody could catch (a failed read's callback that
  tensorstore runs after the restore gave up, a __del__) is logged, so it goes to the run
  log rather than the console."""
  try:
    where = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}"
  except Exception:  # noqa: BLE001 - a repr that fails
    where = unraisable.err_msg or "Exception ignored"
  logging.getLogger("py.unraisable").error(
      "%s", where, exc_info=(unraisable.exc_type, unraisable.exc_value,
                             unraisable.exc_traceback))


def console(library_handler: logging.Handler | None = None) -> None:
  """The console of a command-line program: stdout and stderr that survive a closed pipe;
  progress on stdout (process 0; the others only warnings), one line per record (its
  traceback goes to the run log); library errors on stderr through `library_handler`
  (absl's) unless a run's log takes them; exceptions nobody could catch logged. After a
  run, its log still takes the libraries' records until another run starts: a damaged
  checkpoint's failed reads end in tensorstore's threads after the restore gave up, and
  orbax's asyncio tasks are collected later, some at exit."""
  unbreakable_streams()
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(_OneLine("%(asctime)s %(message)s", "%H:%M:%S"))
  handler.setLevel(logging.INFO if jax.process_index() == 0 else logging.WARNING)
  log.handlers = [handler]
  log.setLevel(logging.DEBUG)  # debug records (details) reach the run log only
  log.propagate = True  # to the run log, on the root logger
  if library_handler is not None and not any(
      isinstance(f, _Console) for f in library_handler.filters):
    library_handler.addFilter(_Console())
  _RUN_LOG.keep_last = True
  sys.unraisablehook = _unraisable


PROGRESS_EVERY = 5.0  # seconds between the progress lines of a long evaluation


class Progress:
  """Progress lines of long passes over the same `batches` batches, in turn ('eval valid:
  40/128 batches, 12 s'; of several named `passes`, 'eval valid: decoding 40/128 batches
  (pass 2/3), 75 s'): one every PROGRESS_EVERY seconds, none for passes that end sooner.
  Plain lines, readable in a log file (no carriage returns); the first batch's time
  includes compilation."""

  def __init__(self, what: str, batches: int, passes: tuple[str, ...] = ()):
    self.what, self.batches, self.passes, self.done = what, batches, passes, 0
    self.total = batches * max(len(passes), 1)
    self.start = self.last = time.monotonic()

  def advance(self) -> None:
    self.done += 1
    now = time.monotonic()
    if now - self.last >= PROGRESS_EVERY and self.done < self.total:
      number, batch = divmod(self.done - 1, self.batches)
      count = f"{batch + 1}/{self.batches} batches"
      if len(self.passes) > 1:
        count = f"{self.passes[number]} {count} (pass {number + 1}/{len(self.passes)})"
      log.info("%s: %s, %.0f s", self.what, count, now - self.start)
      self.last = now
