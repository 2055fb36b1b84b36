"""--smoke, the flag every benchmark has: the benchmark at its smallest size, in seconds.

Its figures mean nothing; it proves that the benchmark still runs against today's code
(tests/test_benchmarks.py runs every benchmark's smoke mode, so none rots unseen). A size
flag given on the command line wins over its smoke value.
"""

from typing import Any

from absl import flags

_FLAGS: dict[str, Any] = {}
_CONFIG: dict[str, Any] = {}


def define(config: dict[str, Any] | None = None, **sizes: Any) -> None:
  """Defines --smoke: it sets the flags named in `sizes` and the --config fields (dotted
  paths) in `config` to these values, unless the command line gives them."""
  _FLAGS.update(sizes)
  _CONFIG.update(config or {})
  said = [f"--{name}={_text(value)}" for name, value in sizes.items()]
  said += [f"--config.{path}={value}" for path, value in (config or {}).items()]
  flags.DEFINE_bool("smoke", False, "The smallest size, in seconds: a check that the "
                    f"benchmark runs, not a figure ({' '.join(said)}; flags given win).")


def apply() -> bool:
  """Whether --smoke was given; if so, sets its sizes (define) that were not given."""
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


def _text(value: Any) -> str:
  return ",".join(map(str, value)) if isinstance(value, list) else str(value)
