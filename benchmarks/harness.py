"""What every benchmark shares: --smoke, and running as the CLIs run (flags parsed by
cli.parse_flags, bad input one `error:` line, the CLIs' console).

--smoke runs the benchmark at its smallest size, in seconds. Its figures mean nothing; it
proves that the benchmark still runs against today's code (tests/test_benchmarks.py runs
every benchmark's smoke mode, so none rots unseen). A size flag given on the command line
wins over its smoke value.
"""

from collections.abc import Callable
from typing import Any

from absl import app, flags

from transformer.run import cli

_FLAGS: dict[str, Any] = {}
_CONFIG: dict[str, Any] = {}


def define_smoke(config: dict[str, Any] | None = None, **sizes: Any) -> None:
  """Defines --smoke: it sets the flags named in `sizes` and the --config fields (dotted
  paths) in `config` to these values, unless the command line gives them."""
  _FLAGS.update(sizes)
  _CONFIG.update(config or {})
  said = [f"--{name}={_text(value)}" for name, value in sizes.items()]
  said += [f"--config.{path}={value}" for path, value in (config or {}).items()]
  flags.DEFINE_bool("smoke", False, "The smallest size, in seconds: a check that the "
                    f"benchmark runs, not a figure ({' '.join(said)}; flags given win).")


def apply_smoke() -> bool:
  """Whether --smoke was given; if so, sets its sizes (define_smoke) that were not given."""
  f = flags.FLAGS
  if not f.smoke:
    return False
  for name, value in _FLAGS.items():
    if not f[name].present:
      setattr(f, name, value)
  if _CONFIG:
    given = f["config"].override_values
    for path, value in _CONFIG.items():
      if path not in given:
        *sections, field = path.split(".")
        node = f.config
        for section in sections:
          node = node[section]
        node[field] = value
  return True


def run(report: Callable[[], None]) -> None:
  """app.run of a benchmark: its flags parsed as the CLIs parse them, --smoke applied, then
  report() under the CLIs' console, a ConfigError (what the benchmark needs is missing or
  wrong) as one `error:` line, exit status 2."""

  def main(argv):
    cli.no_arguments(argv)
    apply_smoke()
    cli.setup_logging()
    with cli.one_line_errors():
      report()

  app.run(main, flags_parser=cli.parse_flags)


def _text(value: Any) -> str:
  return ",".join(map(str, value)) if isinstance(value, list) else str(value)
