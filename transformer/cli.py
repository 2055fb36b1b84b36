"""What the CLIs share: distributed start, progress logging, one-line errors, stop signals."""

import contextlib
import logging
import os
import re
import signal
import sys

import jax
from absl import flags
from absl import logging as absl_logging
from jax.experimental import multihost_utils

from transformer.errors import ConfigError, RunError


def define_distributed_flags() -> None:
  """The flags that start several processes (hosts) of one run: --distributed (the cluster
  environment: TPU pods, SLURM, Open MPI) or --coordinator_address/--num_processes/--process_id."""
  flags.DEFINE_bool("distributed", False, "jax.distributed.initialize() from the cluster "
                    "environment (TPU pod, SLURM, Open MPI).")
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, to start several "
                      "processes by hand (with --num_processes and --process_id).")
  flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
  flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")


def start_distributed() -> None:
  """jax.distributed.initialize as the distributed flags say; must precede any other JAX
  call. Also starts JAX's preemption service, which StopSignals uses."""
  f = flags.FLAGS
  if f.coordinator_address:
    jax.distributed.initialize(f.coordinator_address, f.num_processes, f.process_id,
                               heartbeat_timeout_seconds=30)
  elif f.distributed:
    jax.distributed.initialize()


def setup_logging() -> None:
  """Progress lines from the `transformer` logger to stdout (process 0 only; the others
  log warnings); libraries stay at warnings."""
  absl_logging.set_verbosity(absl_logging.ERROR)  # orbax logs every save step; jax its backends
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  logger = logging.getLogger("transformer")
  logger.addHandler(handler)
  logger.setLevel(logging.INFO if jax.process_index() == 0 else logging.WARNING)
  logger.propagate = False


@contextlib.contextmanager
def one_line_errors():
  """ConfigError (bad input: exit status 2) and RunError (a run that cannot go on: 1)
  become one `error: ...` line on stderr, without a traceback."""
  try:
    yield
  except ConfigError as e:
    _exit(str(e), 2)
  except RunError as e:
    _exit(str(e), 1)


def no_arguments(argv: list[str]) -> None:
  """Exits with one `error:` line if positional arguments follow the flags."""
  if len(argv) > 1:
    _exit(f"unexpected arguments: {' '.join(argv[1:])} (every option is a --flag)")


def _exit(message: str, status: int = 2) -> None:
  print(f"error: {' '.join(message.split())}", file=sys.stderr)
  sys.exit(status)


class StopSignals:
  """SIGINT and SIGTERM while in a `with` block: the first asks the work to stop (calling
  the object returns True; the work saves and returns), a second exits at once with
  status 128 + signal (a save in flight is abandoned; the previous checkpoints stay).

  With several processes, a signal reaches one host but every process must stop at the
  same step, or the others hang in the next collective: SIGTERM is left to JAX's
  preemption notifier (a Python handler would replace it), SIGINT is passed on to it as a
  SIGTERM, and each call is a poll of JAX's preemption sync point, which all processes
  reach at the same poll. The work polls at the same points on every process (each step,
  each evaluation batch, each run of a sweep), so the n-th poll is the same moment
  everywhere."""

  def __init__(self):
    self.received: list[int] = []
    self._previous = {}
    self.distributed = jax.process_count() > 1
    self._polls = 0

  def __call__(self) -> bool:
    if self.distributed and not self.received:
      self._polls += 1
      if multihost_utils.reached_preemption_sync_point(self._polls):
        self.received.append(signal.SIGTERM)
        print(f"process {jax.process_index()}: stopping with the others (a host got SIGTERM)",
              file=sys.stderr, flush=True)
    return bool(self.received)

  @property
  def exit_status(self) -> int | None:
    return 128 + self.received[0] if self.received else None

  def _handle(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.received or self._interrupted:
      print(f"{name} again: exiting at once", file=sys.stderr, flush=True)
      os._exit(128 + signum)
    if self.distributed:
      self._interrupted = True
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier: all processes stop together
    else:
      self.received.append(signum)
    print(f"{name}: stopping at the next step or evaluation batch (send it again to exit at "
          "once)", file=sys.stderr, flush=True)

  _interrupted = False

  def __enter__(self) -> "StopSignals":
    handled = (signal.SIGINT,) if self.distributed else (signal.SIGINT, signal.SIGTERM)
    for sig in handled:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if not self.received:  # once stopping, a second signal still exits at once
      for sig, handler in self._previous.items():
        signal.signal(sig, handler)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing for app.run(flags_parser=...): a bad flag, config file or override
  (`--config.model.positon=rotary`) prints one `error:` line and exits with status 2."""
  try:
    argv = flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - config_flags raises Attribute/Key/Value/OS errors
    path = _raised_in_config_file(e, argv)
    _exit(_config_file_error(path, e) if path else _flag_error(e, argv))
  if "config" in flags.FLAGS and not isinstance(flags.FLAGS.config, (str, type(None))):
    try:
      flags.FLAGS.config.keys()  # config_flags defers a config file's load error to first use
    except Exception as e:  # noqa: BLE001 - whatever the config file raised
      _exit(_config_file_error(flags.FLAGS["config"].config_filename, e))
  return argv


def _raised_in_config_file(e: BaseException, argv: list[str]) -> str | None:
  """The --config value if `e` was raised by the config file's own code, else None."""
  values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  values += [b for a, b in zip(argv, argv[1:]) if a == "--config"]
  for path in values:
    file = os.path.abspath(path.split(":")[0])
    seen = set()
    while e is not None and id(e) not in seen:
      seen.add(id(e))
      if isinstance(e, SyntaxError) and e.filename and os.path.abspath(e.filename) == file:
        return path
      tb = e.__traceback__
      while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == file:
          return path
        tb = tb.tb_next
      e = e.__cause__ or e.__context__
  return None


def _config_file_error(path: str, e: Exception) -> str:
  file = path.split(":")[0]
  if not os.path.isfile(file):
    return f"config file not found: {file}"
  cause = e.__cause__ or e
  if isinstance(cause, SyntaxError):
    return f"config file {file}, line {cause.lineno}: {cause.msg}"
  text = str(cause)
  if _WRAPPED in text:  # config_flags passes on get_config()'s error as traceback text
    last = text.strip().splitlines()[-1]
    return f"config file {path}: {last.removeprefix(f'{ConfigError.__module__}.ConfigError: ')}"
  return f"config file {path}: {type(cause).__name__}: {cause}"


_WRAPPED = "Error whilst parsing config file"


def _flag_error(e: Exception, argv: list[str]) -> str:
  if _WRAPPED in str(e):
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
                next((b for a, b in zip(argv, argv[1:]) if a == "--config"), "?"))
    return _config_file_error(path, e)
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], Exception):
    e = e.args[0]
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  message = " ".join(str(text).split())
  key = re.match(r"'(\w+)'", message)
  culprit = key and next((a for a in argv[1:] if a.startswith("--config.")
                          and re.search(rf"\.{key.group(1)}\b", a.split("=")[0])), None)
  if culprit and message == f"'{key.group(1)}'":  # a KeyError with no hint
    message = f"the config has no field {culprit[2:].split('=')[0][len('config.'):]!r}"
  return f"in {culprit}: {message}" if culprit else message
