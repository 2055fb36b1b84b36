"""What the CLIs share: distributed start, the compilation cache, progress logging, one-line
errors, stop signals."""

import contextlib
import difflib
import importlib.machinery
import importlib.util
import os
import re
import signal
import sys

import jax
from absl import flags
from absl import logging as absl_logging
from jax.experimental import multihost_utils
from ml_collections import config_dict

from transformer.core import errors
from transformer.core.errors import ConfigError, RunError
from transformer.run import compile_cache, distributed, logs
from transformer.run import config as config_lib


def define_distributed_flags() -> None:
  """The flags that start several processes (hosts) of one run: --distributed (the cluster
  environment: TPU pods, SLURM, Open MPI) or --coordinator_address/--num_processes/--process_id."""
  flags.DEFINE_bool("distributed", False, "jax.distributed.initialize() from the cluster "
                    "environment (TPU pod, SLURM, Open MPI).")
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0, to start several "
                      "processes by hand (with --num_processes and --process_id).")
  flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
  flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
  flags.DEFINE_integer("join_timeout", distributed.JOIN_TIMEOUT_S, "Seconds a process waits "
                       "for the others to join the job before it exits with an error.")


def define_cache_flag() -> None:
  """--compilation_cache: JAX's persistent compilation cache (run/compile_cache.py)."""
  flags.DEFINE_bool("compilation_cache", True, "Keep compiled programs in JAX's persistent "
                    "compilation cache ($JAX_COMPILATION_CACHE_DIR, else "
                    "$XDG_CACHE_HOME/transformer-ablations/jax) and load them from it: a "
                    "re-run, a resumed run and every seed of a sweep after the first skip "
                    "their compilation. --nocompilation_cache compiles everything.")


def use_compilation_cache() -> None:
  """The persistent compilation cache as --compilation_cache says, before any compilation."""
  compile_cache.enable(flags.FLAGS.compilation_cache)


def define_report_flags() -> None:
  """The flags of a report's statistics (transformer/study/report.py): sweep.py and compare.py."""
  flags.DEFINE_string("baseline", None, "The variant that the report's paired differences "
                      "are against, e.g. model.position=sinusoidal (default: the first "
                      "variant with results); or a FIELD=VALUE of the variants: each against "
                      "the same variant with that value, e.g. model.random_positions=False.")
  flags.DEFINE_multi_string("success", [], "METRIC>=VALUE (or <=, >, <), e.g. "
                            "'valid/exact_match>=0.9': the report gives each variant's rate "
                            "of seeds that meet it (repeatable).")


def start_distributed() -> None:
  """jax.distributed.initialize as the distributed flags say (run/distributed.py: checked
  first, bounded by --join_timeout; one `error:` line otherwise); must precede any other
  JAX call. Also starts JAX's preemption service, which StopSignals uses."""
  f = flags.FLAGS
  with one_line_errors():
    distributed.initialize(f.coordinator_address, f.num_processes, f.process_id,
                           f.join_timeout, from_environment=f.distributed)


def setup_logging() -> None:
  """The console of the CLIs (logs.console): progress lines from the `transformer` logger
  on stdout (process 0 only; the others log warnings), library errors on stderr outside a
  run, details into the run's log file; stdout and stderr survive a closed pipe."""
  logs.unbreakable_streams()
  absl_logging.set_verbosity(absl_logging.ERROR)  # orbax logs every save step; jax its backends
  absl_handler = absl_logging.get_absl_handler()
  absl_handler.python_handler.setStream(sys.stderr)  # absl took the stream before us
  logs.console(absl_handler)


@contextlib.contextmanager
def one_line_errors():
  """ConfigError (bad input: exit status 2) and RunError (a run that cannot go on: 1)
  become one `error: ...` line on stderr, without a traceback."""
  try:
    yield
  except ConfigError as e:
    _exit(str(e), 2)
  except RunError as e:
    details = logs.current_run_log()
    _exit(f"{e}{f' (details: {details})' if details else ''}", 1)


def no_arguments(argv: list[str]) -> None:
  """Exits with one `error:` line if positional arguments follow the flags."""
  if len(argv) > 1:
    _exit(f"unexpected arguments: {' '.join(argv[1:])} (every option is a --flag)")


def _exit(message: str, status: int = 2) -> None:
  logs.unbreakable_streams()  # the line must not fail on a closed stderr, nor replace status
  print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  sys.exit(status)


class StopSignals:
  """SIGINT and SIGTERM while in a `with` block: the first asks the work to stop (calling
  the object returns True; the work saves and returns), a second exits at once with
  status 128 + signal (a save in flight is abandoned; the previous checkpoints stay).

  With several processes, a signal reaches one host but every process must stop at the
  same step, or the others hang in the next collective: SIGTERM is left to JAX's
  preemption notifier (a Python handler would replace it), SIGINT is passed on to it as a
  SIGTERM, and each call is a poll of JAX's preemption sync point. That point is the poll
  numbered one more than the highest number any process had passed when the notice
  arrived, so its numbers must count the same polls everywhere and have one owner: this
  object numbers its polls 1, 2, 3, ... (orbax's CheckpointManager, which would poll with
  step numbers of its own, is kept from it: checkpoint.manager), and the work polls at the
  same points on every process (each step, each evaluation batch, each run of a sweep), so
  the n-th poll is the same moment everywhere."""

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
        logs.say(f"process {jax.process_index()}: stopping with the others (a host got "
                 "SIGTERM)")
    return bool(self.received)

  @property
  def exit_status(self) -> int | None:
    return 128 + self.received[0] if self.received else None

  def _handle(self, signum, frame) -> None:
    """Records the request; its message is one system call that cannot raise (logs.say):
    a print here raised BrokenPipeError into the training loop when the reader of a pipe
    died of the same Ctrl-C, and the run was lost unsaved."""
    del frame
    name = signal.Signals(signum).name
    if self.received or self._interrupted:
      logs.say(f"{name} again: exiting at once")
      os._exit(128 + signum)
    if self.distributed:
      self._interrupted = True
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier: all processes stop together
    else:
      self.received.append(signum)
    logs.say(f"{name}: stopping at the next step or evaluation batch (send it again to exit "
             "at once)")

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


_HELP_FLAGS = {"help": False, "h": False, "?": False, "helpshort": False, "helpfull": True}
CONFIG_HELP = """
Config fields: --config FILE gives them (FILE's get_config(); FILE:ARG calls get_config(ARG)).
Set any field on the command line with --config.SECTION.FIELD=VALUE, e.g.
  --config.model.position=rotary --config.train.num_steps=500
Every field of a config, its value and what it allows (choices, ranges):
  python train.py --config FILE [--config.SECTION.FIELD=VALUE ...] --show_config
"""


def help_requested(argv: list[str]) -> bool | None:
  """None without a help flag before `--`; else whether all flags are asked for
  (--helpfull) rather than the script's own (--help, -h, -?, --helpshort)."""
  for arg in argv[1:]:
    if arg == "--":
      break
    name = arg.lstrip("-").partition("=")[0]
    if arg.startswith("-") and name in _HELP_FLAGS:
      return _HELP_FLAGS[name]
  return None


def print_help(full: bool = False) -> None:
  """The script's docstring, its flags and the distributed ones (every flag with `full`),
  and for a script with --config how to set a config's fields and list them."""
  main = sys.modules["__main__"]
  f = flags.FLAGS
  parts = [(main.__doc__ or "").rstrip(), "\nflags:"]
  if full:
    parts.append(f.get_help())
  else:
    parts.append(f.main_module_help())
    if f.get_flags_for_module(sys.modules[__name__]):
      parts.append(f.module_help(sys.modules[__name__]))
    parts.append("\n(--helpfull: every flag, absl's and JAX's included)")
  if "config" in f:
    parts.append(CONFIG_HELP.rstrip())
  print("\n".join(p for p in parts if p))


def parse_flags(argv: list[str], takes_overrides: bool | None = None) -> list[str]:
  """absl flag parsing for app.run(flags_parser=...): a bad flag, config file or override
  prints one `error:` line, status 2. The line comes from redoing the config's steps here
  (config_error), not from the wording of absl's or config_flags' errors: theirs to change.
  --help and the like print the help (print_help) and exit 0: the help is what was asked.
  `takes_overrides` (default: whether the script defines --config): an unknown flag named
  like a config field (--model.position) is answered with the override it may mean."""
  if (full := help_requested(argv)) is not None:
    print_help(full)
    sys.exit(0)
  if takes_overrides is None:
    takes_overrides = "config" in flags.FLAGS
  try:
    rest = flags.FLAGS(argv)
    if "config" in flags.FLAGS and not isinstance(flags.FLAGS.config, (str, type(None))):
      flags.FLAGS.config.keys()  # config_flags defers a config file's load error to first use
  except Exception as e:  # noqa: BLE001 - absl, config_flags and the config file raise anything
    _exit(("config" in flags.FLAGS and config_error(argv))
          or (takes_overrides and _meant_override(e, argv)) or one_line(e))
  return rest


def flag_value(argv: list[str], name: str) -> str | None:
  """The value of --NAME (--NAME=V or --NAME V, one dash or two) in argv, up to a `--`;
  None if it is not given."""
  for arg, following in zip(argv, [*argv[1:], None]):
    if arg == "--":
      break
    if match := re.match(rf"--?{re.escape(name)}(=|$)", arg):
      return arg[match.end():] if match[1] else following
  return None


def _meant_override(e: Exception, argv: list[str]) -> str | None:
  """For an unknown flag named like a config field (its first name a config section): the
  override it may mean, --config.FIELD=VALUE."""
  name = getattr(e, "flagname", None) if isinstance(e, flags.UnrecognizedFlagError) else None
  negated = bool(name) and name.startswith("no") and name[2:].split(".")[0] in config_lib.SECTIONS
  field = name[2:] if negated else name
  if not field or field.split(".")[0] not in config_lib.SECTIONS:
    return None
  given = next((a for a in argv if re.match(rf"--?{re.escape(name)}(=|$)", a)), f"--{name}")
  meant = f"--{'no' * negated}config.{field}" + given[len(given.partition("=")[0]):]
  return (f"unknown flag {given}: a config field is set as --config.FIELD=VALUE; did you mean "
          f"{meant}?")


def config_error(argv: list[str]) -> str | None:
  """What is wrong with argv's --config file (path[:arg]) or --config.a.b=value overrides,
  found by loading the file here, so that its own exception is at hand; an override given
  without --config; None if nothing."""
  path = flag_value(argv, "config") or ""
  if not path:
    given = next((a for a in argv if re.match(r"--?(no)?config\.", a)), None)
    return given and (f"{given} sets a field of the config that --config FILE gives, and "
                      "no --config is given: e.g. --config configs/default.py "
                      f"{given}")
  file, *arg = path.split(":", 1)
  if not os.path.isfile(file):
    return f"config file not found: {file}"
  try:
    loader = importlib.machinery.SourceFileLoader("config_file", file)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    config = module.get_config(*arg)
  except SyntaxError as e:
    return f"config file {e.filename}, line {e.lineno}: {e.msg}"
  except Exception as e:  # noqa: BLE001 - whatever the config file raises
    return f"config file {path}: {one_line(e)}"
  for flag, following in zip(argv, [*argv[1:], None]):
    if match := re.match(r"--?(?:no)?config\.([^=]+)(?:=(.*))?$", flag, re.DOTALL):
      if error := _override_error(config, *match.groups(), following):
        return f"--config.{match[1]}: {error}"
  return None


_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser()}


def _override_error(config: config_dict.ConfigDict, name: str, value: str | None,
                    following: str | None) -> str | None:
  """Why --config.NAME[=VALUE] fails: no such field, or a value that config_flags' parser
  for the field's type rejects (without `=`, the following argument, unless a bool field)."""
  node, keys = config, name.split(".")
  for depth, key in enumerate(keys):
    fields = node.keys() if isinstance(node, config_dict.ConfigDict) else []
    if key not in fields:
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f'. Did you mean "{close[0]}"?' if close else ""
      return f"the config has no field {'.'.join(keys[:depth + 1])!r}{hint}"
    node, kind = node[key], node.get_type(key)
  if value is None and kind is not bool:
    value = following
  try:
    if value is not None and kind in _PARSERS:  # a str takes any value; the rest are left alone
      _PARSERS[kind].parse(value)
  except ValueError:
    return f"{value!r} is not a valid {kind.__name__}"
  return None


def one_line(e: BaseException) -> str:
  """errors.one_line, with absl's flag errors written for the user too."""
  return errors.one_line(e, (flags.Error,))
