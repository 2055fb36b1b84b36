"""What train.py and eval.py share: progress logging and one-line errors."""

import contextlib
import logging
import sys

from absl import logging as absl_logging

from transformer.registry import ConfigError


def setup_logging() -> None:
  """Progress lines from the `transformer` logger to stdout; libraries stay at warnings."""
  handler = logging.StreamHandler(sys.stdout)
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  logger = logging.getLogger("transformer")
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  logger.propagate = False
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save step at INFO


@contextlib.contextmanager
def config_errors_exit():
  """A ConfigError becomes `error: ...` on stderr and exit status 2, without a traceback."""
  try:
    yield
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
