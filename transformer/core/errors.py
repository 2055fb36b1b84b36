"""The errors the CLIs turn into one `error:` line (cli.one_line_errors), and the stop request."""


class ConfigError(ValueError):
  """A bad value in the user's configuration or input; the CLIs print it as one line and
  exit with status 2, before anything is written."""


class RunError(RuntimeError):
  """A run that cannot go on (training diverged, the workdir is in use, no checkpoint
  restores); the CLIs print it as one line and exit with status 1."""


class Interrupted(Exception):  # noqa: N818 - a stop request, not a failure
  """A stop signal arrived during work that cannot be saved half-done (an evaluation)."""


# Said of an import of a transformer module that does not exist (a config file's, most often)
PUBLIC_API = ("config and sweep files import what they use (schema, with_source, axis, "
              "product, with_overrides, lookup, POSITIONS, SCORES) from transformer.api")


def one_line(e: BaseException, written_for_user: tuple[type, ...] = ()) -> str:
  """An exception in one line: the message alone where it is written for the user (a
  ConfigError, or one of `written_for_user`), else its type and its message's first line;
  for a transformer module that does not exist, where the public one is (PUBLIC_API)."""
  if isinstance(e, (ConfigError, *written_for_user)):
    return " ".join(str(e).split())
  lines = str(e).strip().splitlines()
  text = f"{type(e).__name__}: {lines[0] if lines else ''}"
  if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("transformer."):
    text += f"; {PUBLIC_API}"
  return text
