"""The report of a sweep (study/sweep.py) or of any runs (study/compare.py): a header that
states what the numbers are and every statistical choice; a table of each variant's final
held-out metrics over its seeds with their statistics (study/stats.py), the main metric's
spread, success rates and paired differences against a baseline variant, over seeds and
over seeds and examples (study/bootstrap.py), the grids of split metrics that are tables
(study/report_grids.py: e.g. passkey retrieval by length × depth), the state of every run
without results (run/state.py: failed, with the reason; stopped part-way; not trained yet)
(study/report_tables.py), and plots (study/report_plots.py, report_grids.py)."""

import json
import math
import os
import subprocess
from collections.abc import Sequence

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.run.state import STATES, run_state
from transformer.study import bootstrap, report_grids, report_plots, stats
from transformer.study.report_tables import CLIPPED, markdown, table_csv
from transformer.study.results import Entry, Results, baseline_of, state_counts
from transformer.study.sweep import SEED, run_name
from transformer.study.sweep import runs as sweep_runs


def _commit() -> str | None:
  """The git commit of the code writing the report (its checkout), if it is one."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, timeout=30)
    if head.returncode:
      return None
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def check_baseline(baseline: str | None, variants: Sequence[str]) -> None:
  """A ConfigError for a --baseline that names none of the variants and is no FIELD=VALUE
  of theirs (listing the variants)."""
  if baseline is None or baseline in variants:
    return
  if "=" in baseline and any(baseline in v.split(",") for v in variants):
    if any(baseline_of(baseline, v, variants) not in (None, v) for v in variants):
      return
    raise ConfigError(f"--baseline {baseline}: no variant differs from another only in "
                      f"{baseline.split('=')[0]}; the variants are: {', '.join(variants)}")
  raise ConfigError(f"--baseline {baseline}: no such variant, nor a FIELD=VALUE of one; the "
                    f"variants are: {', '.join(variants)}")


def check_thresholds(thresholds: Sequence[stats.Threshold], results: Results) -> None:
  """A ConfigError for a --success threshold on a metric no finished run reports."""
  for threshold in thresholds:
    if results.names and threshold.metric not in results.names:
      raise ConfigError(f"--success {threshold}: no run reports {threshold.metric}; the "
                        f"metrics are: {', '.join(results.names)}")


def statistics_lines(results: Results, baseline: str | None,
                     thresholds: Sequence[stats.Threshold] = ()) -> list[str]:
  """The header's lines saying what the numbers are: every statistical choice."""
  if not results.main:
    return []
  confidence = f"{stats.CONFIDENCE:.0%}"
  better = "lower" if results.lower_is_better(results.main) else "higher"
  lines = [f"- main metric: {results.main} ({better} is better); metrics are each run's final "
           "held-out evaluation",
           f"- over a variant's finished seeds: mean [{confidence} confidence interval of the "
           "mean: Student t, n − 1 degrees of freedom]; std: the sample standard deviation "
           "(n − 1); one seed: no interval; \"identical in every seed\": every seed gave the "
           "same value, and no interval is given (a zero-width one would claim a certainty "
           "that few seeds cannot give)",
           f"- intervals stay inside the range each metric declares ({_ranges(results)}): a t "
           f"interval reaching past it is clipped to it and marked {CLIPPED} (the true mean "
           "lies in the range, so clipping keeps the interval's coverage; a bootstrap over so "
           "few seeds would cover less)"]
  undeclared = [n for n in results.names if not results.declared(n)]
  if undeclared:
    lines.append(f"- declaring no range (never clipped; higher taken as better): "
                 f"{', '.join(undeclared)}")
  lines.append("- each seed of a variant once (a repeated seed is refused); a failed run "
               "(e.g. diverged, or finished with a metric that is not finite) is counted as "
               "failed in every table and enters no mean")
  if thresholds:
    lines.append(f"- success rates: k of the n finished or failed runs meeting the threshold "
                 f"(a failed run meets none) [{confidence} Clopper–Pearson interval: the exact "
                 "binomial one, never below its confidence at few seeds]")
  if baseline and len(results.variants) > 1:
    against = (f"{baseline} (the baseline)" if baseline in results.variants else
               f"the same variant with {baseline}")
    lines += [f"- paired differences: variant − {against} per shared seed, their mean and "
              f"{confidence} t interval (inside ± the metric's range); * where it excludes 0; "
              "\"identical in every seed\": the same difference in each seed, not starred",
              f"- and where both variants recorded per-example results of the same examples in "
              f"every shared seed: a paired bootstrap over seeds and examples together "
              f"({bootstrap.RESAMPLES} resamples, generator seed {bootstrap.SEED}): the shared "
              "seeds drawn with replacement, then the examples (one draw for every seed where "
              "the seeds share the test set, a draw per seed otherwise; within each length "
              "for a mean over lengths), the same draws for both variants; the "
              f"{confidence} percentile interval of the mean difference, * where it excludes "
              "0. It adds the test set's evidence to the seeds'; with few seeds its seed "
              "stage is coarse, and the t interval stays the test of seed-to-seed variation"]
  return lines


def _ranges(results: Results) -> str:
  """The declared ranges of the report's metrics, e.g. "exact_match, accuracy [0, 1]; loss
  [0, ∞)"."""
  by_range: dict[str, list[str]] = {}
  for name in results.names:
    key, metric = name.split("/", 1)[1], results.metric(name)
    if math.isfinite(metric.low) or math.isfinite(metric.high):
      high = "∞)" if metric.high == math.inf else f"{metric.high:g}]"
      keys = by_range.setdefault(f"[{metric.low:g}, {high}", [])
      keys += [] if key in keys else [key]
  return "; ".join(f"{', '.join(keys)} {span}" for span, keys in by_range.items())


def default_baseline(results: Results, baseline: str | None) -> str | None:
  """The baseline variant: `baseline`, else the first variant with finished seeds."""
  return baseline or next((v for v, f in results.finals.items() if f), None)


def save(out_dir: str, md: str, table: str, results: Results, train_length: int | None
         ) -> tuple[str, str]:
  """Writes report.md and report.csv into out_dir, and the plots of the finished runs
  (report_plots.plot; those it does not draw are removed). Returns the table paths."""
  md_path, csv_path = storage.join(out_dir, "report.md"), storage.join(out_dir, "report.csv")
  storage.write(md_path, md)
  storage.write(csv_path, table)
  workdirs = {v: [e.workdir for e in es if e.state == "finished"]
              for v, es in results.variants.items()}
  workdirs = {v: dirs for v, dirs in workdirs.items() if dirs}
  main = None
  if results.main:
    summaries = {v + (f" ({failed} failed)" if (failed := results.counts(v)["failed"]) else ""):
                 s for v in workdirs if (s := results.summary(v, results.main))}
    main = results.main, summaries, results.lower_is_better(results.main)
  finals = {v: list(results.finals[v].values()) for v in workdirs}
  report_plots.plot(out_dir, workdirs, finals, main if workdirs else None, train_length)
  if workdirs:
    report_grids.plot(out_dir, finals)
  return md_path, csv_path


def variant_names(runs: Sequence) -> dict[str, str]:
  """{a sweep run's variant: its name in the report}: its overrides less the seed and the
  fields every run shares (shared_fields)."""
  shared = shared_fields([run.overrides for run in runs])
  return {run.variant: run_name({k: v for k, v in run.overrides.items()
                                 if k != SEED and k not in shared}) for run in runs}


def sweep_baseline(baseline: str | None, runs: Sequence) -> str | None:
  """A sweep's --baseline as the report names it (a variant's name with or without the
  shared fields, or a FIELD=VALUE of the variants); a ConfigError (check_baseline)
  otherwise."""
  names = variant_names(runs)
  baseline = names.get(baseline, baseline)
  check_baseline(baseline, list(dict.fromkeys(names.values())))
  return baseline


def shared_fields(overrides: Sequence[dict]) -> dict:
  """{field: value} of the fields that every override set (less the seed) gives the same
  value: a narrowed sweep (--only) holds them constant, and variant names leave them out."""
  first, *others = [{k: v for k, v in o.items() if k != SEED} for o in overrides]
  return {k: v for k, v in first.items()
          if all(k in o and json.dumps(o[k], default=str) == json.dumps(v, default=str)
                 for o in others)}


def write(config_path: str, sweep_dir: str, overrides: dict | None = None,
          only: Sequence[str] = (), baseline: str | None = None,
          thresholds: Sequence[stats.Threshold] = ()) -> tuple[str, str]:
  """Writes under sweep_dir report.md and report.csv over the sweep's runs (those `only`
  selects, see sweep.select): a title naming the sweep file, its training steps, the
  overrides and selection, the fields every variant shares, what the statistics are and
  the code's commit; a row per variant (the overrides other than the seed and the shared
  fields) with its finished, failed and unfinished runs and each final held-out metric's
  mean and t interval over its finished seeds, the main metric first (order_metrics); the
  main metric's spread per variant, the success rates of `thresholds`, and its paired
  differences against `baseline` (a variant, by its name with or without the shared
  fields; default: the first variant with results); then every run without results and
  why (run_state). And PNG plots of the finished runs (report_plots.plot). Returns the
  table paths."""
  all_runs = sweep_runs(config_path, sweep_dir, overrides, only)
  if not epath.Path(sweep_dir).is_dir():
    raise ConfigError(f"--sweep_dir {sweep_dir} does not exist: no run of this sweep has "
                      "started there")
  shared = shared_fields([run.overrides for run in all_runs])
  names = variant_names(all_runs)
  baseline = sweep_baseline(baseline, all_runs)
  entries = [Entry.of(run.name, names[run.variant], run.config.seed, run.workdir,
                      run_state(run.workdir, run.config.train.num_steps)) for run in all_runs]
  first = all_runs[0].config
  train_length = first.source.train_length(first.data, first.task)
  results = Results.of(entries, train_length)
  check_thresholds(thresholds, results)
  baseline = default_baseline(results, baseline)
  header = [*_header(config_path, results.entries, overrides, only, shared),
            *statistics_lines(results, baseline, thresholds), *commit_line(), ""]
  md = markdown(results, header, baseline, thresholds)
  return save(sweep_dir, md, table_csv(results, baseline, thresholds), results, train_length)


def steps_line(entries: Sequence[Entry]) -> str:
  steps = sorted({e.steps for e in entries})
  return (f"- training steps: {steps[0]}" if len(steps) == 1 else
          f"- training steps: {steps[0]} to {steps[-1]} (see the variants)")


def commit_line() -> list[str]:
  commit = _commit()
  return [f"- written by the code at git commit {commit}"] if commit else []


def _header(config_path, entries, overrides, only, shared) -> list[str]:
  """The title and the facts that the table's numbers depend on."""
  total = state_counts(entries)
  variants = len({e.variant for e in entries})
  lines = [f"# Sweep {config_path}", "",
           f"- runs: {len(entries)} in {variants} variant(s): "
           + ", ".join(f"{total[s]} {s}" for s in STATES), steps_line(entries)]
  if overrides:
    lines.append("- every run: " + " ".join(f"--config.{k}={v}" for k, v in overrides.items()))
  if only:
    lines.append("- selected: " + " ".join(f"--only {o}" for o in only))
  if shared:
    lines.append(f"- every variant (left out of their names): {run_name(shared)}")
  return lines
