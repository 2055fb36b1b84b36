"""What train.py and eval.py share: progress logging and one-line errors."""

import contextlib
import logging
import re
import sys

import jax
from absl import flags
from absl import logging as absl_logging

from transformer.registry import ConfigError


def start_distributed(from_environment: bool, coordinator_address: str | None,
                      num_processes: int | None, process_id: int | None) -> None:
  """jax.distributed.initialize for multi-process runs; must precede any other JAX call."""
  if coordinator_address:
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=30)
  elif from_environment:
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
def config_errors_exit():
  """A ConfigError becomes `error: ...` on stderr and exit status 2, without a traceback."""
  try:
    yield
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing for app.run(flags_parser=...): a bad flag, config file or override
  (`--config.model.positon=rotary`) prints one `error:` line and exits with status 2."""
  try:
    argv = flags.FLAGS(argv)
    if "config" in flags.FLAGS and not isinstance(flags.FLAGS.config, (str, type(None))):
      flags.FLAGS.config.keys()  # config_flags defers a config file's load error to first use
    return argv
  except Exception as e:  # noqa: BLE001 - config_flags raises Attribute/Key/Value/OS errors
    while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], Exception):
      e = e.args[0]
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    message = " ".join(str(text).split())
    key = re.match(r"'(\w+)'", message)
    culprit = key and next((a for a in argv[1:] if a.startswith("--config.")
                            and re.search(rf"\.{key.group(1)}\b", a.split("=")[0])), None)
    where = f"in {culprit}: " if culprit else ""
    print(f"error: {where}{message}", file=sys.stderr)
    sys.exit(2)
