"""The errors the CLIs turn into one `error:` line (cli.one_line_errors), and the stop request."""


class ConfigError(ValueError):
  """A bad value in the user's configuration or input; the CLIs print it as one line and
  exit with status 2, before anything is written."""


class RunError(RuntimeError):
  """A run that cannot go on (training diverged, the workdir is in use, no checkpoint
  restores); the CLIs print it as one line and exit with status 1."""


class Interrupted(Exception):  # noqa: N818 - a stop request, not a failure
  """A stop signal arrived during work that cannot be saved half-done (an evaluation)."""
