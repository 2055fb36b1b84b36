"""Checks one documented command without running it: python tests/docs_check.py SCRIPT [ARG ...]

Runs SCRIPT (train.py, eval.py, sweep.py, compare.py, benchmarks/*.py) as __main__ with a
stand-in for absl.app.run that only notes the flags parser it is given: the script's flags
are defined and nothing has run. Then parses ARG with that parser (cli.parse_flags or the
script's own: the flags, the config file with its `:arg`, every --config.FIELD override),
and parses what the script would parse next without reading or training anything: the
config into its typed tree (config.parse), a sweep's every run (sweep.runs) and --baseline,
--success thresholds, eval.py's flag combinations. Exit 0, or one `error:` line and status
2, as the script would give it. tests/test_docs.py runs this for every command in README.md
and docs/*.md (through tests/clirun.py's forkserver: ~0.2 s each).
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(script: str, args: list[str]) -> None:
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_dict  # noqa: PLC0415

  from transformer.core.errors import ConfigError  # noqa: PLC0415
  from transformer.run import cli, config  # noqa: PLC0415
  from transformer.study import stats  # noqa: PLC0415

  path = os.path.join(ROOT, script)
  if not os.path.isfile(path):
    with cli.one_line_errors():
      raise ConfigError(f"no such script: {script}")
  sys.path.insert(0, os.path.dirname(path))  # as `python SCRIPT` does (benchmarks' helpers)
  namespace, parse_flags = load(path)
  rest = parse_flags([path, *args])  # a bad flag, config file or override: exits 2
  f = flags.FLAGS
  with open(path, encoding="utf-8") as source:  # compare.py reads its run directories so
    takes_arguments = "argv[1:]" in source.read()
  with cli.one_line_errors():
    if rest[1:] and not takes_arguments:
      raise ConfigError(f"unexpected arguments: {' '.join(rest[1:])} (every option is a --flag)")
    if "config" in f and isinstance(f.config, config_dict.ConfigDict):
      if "sweep_dir" in f:
        check_sweep(f)
      else:
        config.parse(f.config)
    for spec in (f.success if "success" in f else []):
      stats.parse_threshold(spec)
    for name in SCRIPT_CHECKS.get(script, []):
      if name not in namespace:
        raise AssertionError(f"{script} has no {name}(): tests/docs_check.py needs updating")
      namespace[name]()


def load(path: str):
  """(the script's globals, the flags parser it gives absl.app.run): the script runs as
  __main__ with a stand-in for app.run that only notes the parser, so nothing is parsed and
  its main is not called."""
  from absl import app  # noqa: PLC0415

  from transformer.run import cli  # noqa: PLC0415

  parsers = []
  run, app.run = app.run, lambda main, argv=None, flags_parser=None: parsers.append(flags_parser)
  try:
    namespace = runpy.run_path(path, run_name="__main__")
  finally:
    app.run = run
  if not parsers:
    raise AssertionError(f"{path} never calls absl.app.run: tests/docs_check.py cannot check it")
  return namespace, parsers[0] or cli.parse_flags


def check_sweep(f) -> None:
  """What sweep.py checks before anything trains: every run's config, --only, --baseline."""
  from transformer.study import report, sweep  # noqa: PLC0415

  runs = sweep.runs(f["config"].config_filename, f.sweep_dir, f["config"].override_values,
                    f.only)
  if f.baseline is not None:
    report.check_baseline(f.baseline, list(dict.fromkeys(run.variant for run in runs)))


# A script's own checks of its flags that need no workdir: called after the flags parse.
SCRIPT_CHECKS = {"eval.py": ["check_metrics_flags"]}


if __name__ == "__main__":
  check(sys.argv[1], sys.argv[2:])
