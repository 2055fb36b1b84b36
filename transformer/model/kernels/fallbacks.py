"""A kernel's fallbacks inside a traced program (a one-query decoding step computed another
way), logged once per process: the same in every layer and every retrace, they would
otherwise repeat once per layer each time a step is traced."""

import functools
import logging

log = logging.getLogger("transformer")


@functools.cache
def log_once(message: str) -> None:
  """Logs `message` at INFO the first time this process is given it (log_once.cache_clear()
  forgets what was said)."""
  log.info(message)
