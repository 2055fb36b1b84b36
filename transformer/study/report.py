"""The report of a sweep (study/sweep.py) or of any runs (study/compare.py): a table of each
variant's final held-out metrics over its seeds with their statistics (study/stats.py), the
main metric's spread, success rates and paired differences against a baseline variant, the
grids of split metrics that are tables (study/report_grids.py: e.g. passkey retrieval by
length × depth), the state of every run without results (run/state.py: failed, with the
reason; stopped part-way; not trained yet), and plots (study/report_plots.py, report_grids.py)."""

import csv
import io
import json
import os
import subprocess
from collections.abc import Sequence

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.run.state import STATES, run_state
from transformer.study import report_grids, report_plots, stats
from transformer.study.results import Entry, Results, grid, lower_is_better, state_counts
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


def cell(text: str) -> str:
  """Text as one markdown table cell."""
  return " ".join(str(text).split()).replace("|", "\\|")


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


def baseline_of(baseline: str | None, variant: str, variants: Sequence[str]) -> str | None:
  """The variant that `variant` is compared with: `baseline` when it is a variant; when it
  is a FIELD=VALUE of the variants (e.g. model.random_positions=False), the variant equal
  to `variant` but for that field's value (None where there is none)."""
  if baseline is None or baseline in variants:
    return baseline
  field = baseline.split("=", 1)[0]
  parts = variant.split(",")
  if not any(p.split("=", 1)[0] == field for p in parts):
    return None
  match = ",".join(baseline if p.split("=", 1)[0] == field else p for p in parts)
  return match if match in variants else None


def check_thresholds(thresholds: Sequence[stats.Threshold], results: Results) -> None:
  """A ConfigError for a --success threshold on a metric no finished run reports."""
  for threshold in thresholds:
    if results.names and threshold.metric not in results.names:
      raise ConfigError(f"--success {threshold}: no run reports {threshold.metric}; the "
                        f"metrics are: {', '.join(results.names)}")


def statistics_lines(results: Results, baseline: str | None) -> list[str]:
  """The header's lines saying what the numbers are."""
  if not results.main:
    return []
  better = "lower" if lower_is_better(results.main) else "higher"
  lines = [f"- main metric: {results.main} ({better} is better); metrics are each run's final "
           "held-out evaluation",
           f"- statistics over a variant's finished seeds: mean [{stats.CONFIDENCE:.0%} "
           "confidence interval of the mean: Student t, n − 1 degrees of freedom; none for one "
           "seed]; std: the sample standard deviation (n − 1)"]
  if baseline and len(results.variants) > 1:
    against = (f"{baseline} (the baseline)" if baseline in results.variants else
               f"the same variant with {baseline}")
    lines.append(f"- paired differences: variant − {against} per shared seed, "
                 f"their mean and {stats.CONFIDENCE:.0%} t interval; * where it excludes 0")
  return lines


def default_baseline(results: Results, baseline: str | None) -> str | None:
  """The baseline variant: `baseline`, else the first variant with finished seeds."""
  return baseline or next((v for v, f in results.finals.items() if f), None)


def _num(x: float) -> str:
  return f"{x:.4f}"


def _interval(ci: tuple[float, float] | None) -> str:
  return f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci else ""


def _table_cell(summary: stats.Summary | None, seeds: int) -> str:
  """mean [interval], and n where fewer seeds than the variant's report the metric."""
  if summary is None:
    return ""
  text = f"{_num(summary.mean)} {_interval(summary.ci)}".strip()
  return text + (f" (n={summary.n})" if summary.n != seeds else "")


def markdown(results: Results, header: list[str], baseline: str | None,
             thresholds: Sequence[stats.Threshold] = ()) -> str:
  """The report as markdown: `header`, a row per variant with its run counts and each
  metric's mean and interval; the main metric as a grid of the first field's values by the
  other fields' when the variants form one (results.grid); the main metric's spread per variant
  (n, mean, std, interval, min, max, success rates, the values per seed); its paired
  differences against `baseline` (baseline_of); the runs without results."""
  counts = {v: state_counts(es) for v, es in results.variants.items()}
  names, main = results.names, results.main
  columns = ["variant", "seeds", "failed", "unfinished"]
  lines = header + ["| " + " | ".join(columns + names) + " |",
                    "|---" * (len(columns) + len(names)) + "|"]
  for variant in results.variants:
    cells = [str(counts[variant][s]) for s in STATES]
    cells += [_table_cell(results.summary(variant, n), counts[variant]["finished"])
              for n in names]
    lines.append(f"| {cell(variant)} | " + " | ".join(cells) + " |")
  with_results = [v for v, f in results.finals.items() if f]
  if main and with_results and (table := grid(results.variants)):
    field, rows = table
    columns = list(dict.fromkeys(c for r in rows.values() for c in r))
    lines += ["", f"## {main} by {field}: mean [{stats.CONFIDENCE:.0%} CI]", "",
              f"| {field} | " + " | ".join(cell(c) for c in columns) + " |",
              "|---" * (len(columns) + 1) + "|"]
    for value, row in rows.items():
      lines.append(f"| {cell(value)} | " + " | ".join(
          _table_cell(results.summary(row[c], main), counts[row[c]]["finished"])
          if c in row else "" for c in columns) + " |")
  if main and with_results:
    lines += ["", f"## {main} over seeds", "",
              "| variant | n | mean | std | {:.0%} CI | min | max | ".format(stats.CONFIDENCE)
              + "".join(f"{cell(t)} | " for t in thresholds) + "per seed |",
              "|---" * (8 + len(thresholds)) + "|"]
    for variant in with_results:
      s, values = results.summary(variant, main), results.values(variant, main)
      if s is None:
        continue
      rates = [stats.success_rate(list(results.values(variant, t.metric).values()), t)
               for t in thresholds]
      lines.append(f"| {cell(variant)} | {s.n} | {_num(s.mean)} | "
                   f"{_num(s.std) if s.std is not None else ''} | {_interval(s.ci)} | "
                   f"{_num(s.min)} | {_num(s.max)} | "
                   + "".join(f"{k}/{n} | " for k, n in rates)
                   + ", ".join(f"{seed}: {_num(v)}" for seed, v in values.items()) + " |")
    if baseline and len(results.variants) > 1:
      variants = list(results.variants)
      against = (cell(baseline) if baseline in variants else
                 f"the same variant with {cell(baseline)}")
      lines += ["", f"## Paired differences against {against} ({main})", "",
                "| variant | shared seeds | mean difference | {:.0%} CI | excludes 0 |".format(
                    stats.CONFIDENCE), "|---|---|---|---|---|"]
      for variant in variants:
        base = baseline_of(baseline, variant, variants)
        if base in (None, variant):
          continue
        pair = stats.paired(results.values(base, main), results.values(variant, main))
        lines.append(f"| {cell(variant)} | " + (
            f"{len(pair.seeds)} | {pair.mean:+.4f} | {_interval(pair.ci)} | "
            f"{'*' if pair.excludes_zero else ''} |" if pair else "0 | | | |"))
  lines += report_grids.markdown({v: list(f.values()) for v, f in results.finals.items() if f})
  without = [e for e in results.entries if e.state != "finished"]
  if without:
    lines += ["", "## Runs without results", "", "| run | state |", "|---|---|"]
    lines += [f"| {cell(e.name)} | {cell(e.note)} |" for e in without]
  return "\n".join(lines) + "\n"


def table_csv(results: Results, baseline: str | None,
              thresholds: Sequence[stats.Threshold] = ()) -> str:
  """The report as CSV, a row per variant: its run counts and finished seeds; for every
  metric the mean, sample std, interval, min, max, n and the values ({seed: value} as
  JSON); the baseline and, for every metric, the paired differences' mean, interval and n;
  the success rate of every threshold. Empty where a statistic does not exist."""
  names = results.names
  table = io.StringIO()
  writer = csv.writer(table)
  stat_columns = ("mean", "std", "ci_low", "ci_high", "min", "max", "n", "values")
  writer.writerow(["variant", "seeds", "failed", "unfinished", "seed ids"]
                  + [f"{n} {c}" for n in names for c in stat_columns] + ["baseline"]
                  + [f"{n} diff {c}" for n in names for c in ("mean", "ci_low", "ci_high", "n")]
                  + [f"success {t}" for t in thresholds])
  for variant, entries in results.variants.items():
    row = [variant, *state_counts(entries).values()]
    row.append(" ".join(str(seed) for seed in results.finals[variant]))
    for name in names:
      s, values = results.summary(variant, name), results.values(variant, name)
      row += ([s.mean, _blank(s.std), *(s.ci or ("", "")), s.min, s.max, s.n,
               json.dumps({str(k): v for k, v in values.items()})] if s else [""] * 7 + [0, ""])
    base = baseline_of(baseline, variant, list(results.variants))
    row.append(base or "")
    for name in names:
      pair = (stats.paired(results.values(base, name), results.values(variant, name))
              if base and variant != base else None)
      row += [pair.mean, *(pair.ci or ("", "")), len(pair.seeds)] if pair else ["", "", "", ""]
    for t in thresholds:
      k, n = stats.success_rate(list(results.values(variant, t.metric).values()), t)
      row.append(k / n if n else "")
    writer.writerow(row)
  return table.getvalue()


def _blank(x):
  return "" if x is None else x


def save(out_dir: str, md: str, table: str, results: Results, train_length: int | None
         ) -> tuple[str, str]:
  """Writes report.md and report.csv into out_dir, and the plots of the finished runs
  (report_plots.plot). Returns the table paths."""
  md_path, csv_path = storage.join(out_dir, "report.md"), storage.join(out_dir, "report.csv")
  storage.write(md_path, md)
  storage.write(csv_path, table)
  workdirs = {v: [e.workdir for e in es if e.state == "finished"]
              for v, es in results.variants.items()}
  workdirs = {v: dirs for v, dirs in workdirs.items() if dirs}
  if workdirs:
    main = None
    if results.main:
      summaries = {v: s for v in workdirs if (s := results.summary(v, results.main))}
      main = results.main, summaries, lower_is_better(results.main)
    report_plots.plot(out_dir, workdirs, {v: list(results.finals[v].values()) for v in workdirs},
                      main, train_length)
    report_grids.plot(out_dir, {v: list(results.finals[v].values()) for v in workdirs})
  return md_path, csv_path


def write(config_path: str, sweep_dir: str, overrides: dict | None = None,
          only: Sequence[str] = (), baseline: str | None = None,
          thresholds: Sequence[stats.Threshold] = ()) -> tuple[str, str]:
  """Writes under sweep_dir report.md and report.csv over the sweep's runs (those `only`
  selects, see sweep.select): a title naming the sweep file, its training steps, the
  overrides and selection, what the statistics are and the code's commit; a row per
  variant (the overrides other than the seed) with its finished, failed and unfinished
  runs and each final held-out metric's mean and t interval over its finished seeds, the
  main metric first (order_metrics); the main metric's spread per variant, the success
  rates of `thresholds`, and its paired differences against `baseline` (default: the
  first variant with results); then every run without results and why (run_state). And
  PNG plots of the finished runs (report_plots.plot). Returns the table paths."""
  all_runs = sweep_runs(config_path, sweep_dir, overrides, only)
  if not epath.Path(sweep_dir).is_dir():
    raise ConfigError(f"--sweep_dir {sweep_dir} does not exist: no run of this sweep has "
                      "started there")
  check_baseline(baseline, list(dict.fromkeys(run.variant for run in all_runs)))
  entries = [Entry.of(run.name, run.variant, run.config.seed, run.workdir,
                     run_state(run.workdir, run.config.train.num_steps)) for run in all_runs]
  first = all_runs[0].config
  train_length = first.source.train_length(first.data, first.task)
  results = Results.of(entries, train_length)
  check_thresholds(thresholds, results)
  baseline = default_baseline(results, baseline)
  header = [*_header(config_path, entries, overrides, only),
            *statistics_lines(results, baseline), *commit_line(), ""]
  md = markdown(results, header, baseline, thresholds)
  return save(sweep_dir, md, table_csv(results, baseline, thresholds), results, train_length)


def steps_line(entries: Sequence[Entry]) -> str:
  steps = sorted({e.steps for e in entries})
  return (f"- training steps: {steps[0]}" if len(steps) == 1 else
          f"- training steps: {steps[0]} to {steps[-1]} (see the variants)")


def commit_line() -> list[str]:
  commit = _commit()
  return [f"- written by the code at git commit {commit}"] if commit else []


def _header(config_path, entries, overrides, only) -> list[str]:
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
  return lines
