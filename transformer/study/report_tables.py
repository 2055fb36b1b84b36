"""The tables of a report (transformer/study/report.py) as markdown and CSV: a row per variant
with its run counts and each metric's mean and interval; the main metric as a grid when the
variants form one; its spread over seeds with success rates; its paired differences
against a baseline, over seeds (t) and over seeds and examples (bootstrap); the runs
without results. A variant whose runs failed (e.g. diverged) says so in every table."""

import csv
import io
import json
from collections.abc import Sequence

from transformer.run.state import STATES
from transformer.study import bootstrap, report_grids, stats
from transformer.study.results import Results, baseline_of, grid

CLIPPED = "‡"  # after an interval the metric's range clipped
# A paired difference over one shared seed: the runs' training draws are one, so nothing
# tells the variants apart (the bootstrap over its examples tests these two runs only).
ONE_SEED = "none: one seed cannot show a difference between variants"
COUNTS = ("seeds", *STATES[1:])  # the columns of the run counts: finished ones are the seeds


def cell(text: str) -> str:
  """Text as one markdown table cell."""
  return " ".join(str(text).split()).replace("|", "\\|")


def _num(x: float) -> str:
  return f"{x:.4f}"


def interval(ci: tuple[float, float] | None, clipped: bool = False) -> str:
  return f"[{ci[0]:.4f}, {ci[1]:.4f}]" + (CLIPPED if clipped else "") if ci else ""


def _no_result(counts: dict[str, int]) -> str:
  return "failed" if counts["failed"] else ""


def summary_cell(summary: stats.Summary | None, counts: dict[str, int],
                 with_failed: bool = False) -> str:
  """mean [interval] (or "identical in every seed"), n where fewer seeds than the variant's
  finished ones report the metric, and with `with_failed` how many runs failed; "failed"
  without a value where runs failed."""
  if summary is None:
    return _no_result(counts)
  shown = "(identical in every seed)" if summary.identical else interval(summary.ci,
                                                                         summary.clipped)
  text = f"{_num(summary.mean)} {shown}".strip()
  text += f" (n={summary.n})" if summary.n != counts["finished"] else ""
  return text + (f" ({counts['failed']} failed)" if with_failed and counts["failed"] else "")


def rate_cell(rate: stats.Rate) -> str:
  return f"{rate.k}/{rate.n} [{rate.ci[0]:.2f}, {rate.ci[1]:.2f}]" if rate.n else ""


def _bootstrap_cells(test: bootstrap.Bootstrap | str) -> list[str]:
  """(interval, * where it excludes 0, the examples resampled) of a bootstrap, or why
  there is none."""
  if isinstance(test, str):
    return [test, "", ""]
  n = test.examples[0] if test.examples[0] == test.examples[1] else "{}–{}".format(
      *test.examples)
  examples = f"{n}, the same in every seed" if test.shared else f"{n} per seed"
  shown = interval(test.ci) if test.ci else "identical in every resample"
  return [shown, "*" if test.excludes_zero else "", examples]


def markdown(results: Results, header: list[str], baseline: str | None,
             thresholds: Sequence[stats.Threshold] = ()) -> str:
  """The report as markdown: `header`, a row per variant with its run counts and each
  metric's mean and interval; the main metric as a grid of the first field's values by the
  other fields' when the variants form one (results.grid); the main metric's spread per
  variant (n, failed, mean, std, interval, min, max, success rates, the values per seed);
  its paired differences against `baseline` (baseline_of); the runs without results."""
  names, main = results.names, results.main
  columns = ["variant", *COUNTS]
  lines = header + ["| " + " | ".join(columns + names) + " |",
                    "|---" * (len(columns) + len(names)) + "|"]
  for variant in results.variants:
    counts = results.counts(variant)
    cells = [str(counts[s]) for s in STATES]
    cells += [summary_cell(results.summary(variant, n), counts) for n in names]
    lines.append(f"| {cell(variant)} | " + " | ".join(cells) + " |")
  shown = [v for v in results.variants if results.finals[v] or results.counts(v)["failed"]]
  if main and any(results.finals.values()) and (table := grid(results.variants)):
    field, rows = table
    columns = list(dict.fromkeys(c for r in rows.values() for c in r))
    lines += ["", f"## {main} by {field}: mean [{stats.CONFIDENCE:.0%} CI]", "",
              f"| {field} | " + " | ".join(cell(c) for c in columns) + " |",
              "|---" * (len(columns) + 1) + "|"]
    for value, row in rows.items():
      lines.append(f"| {cell(value)} | " + " | ".join(
          summary_cell(results.summary(row[c], main), results.counts(row[c]), True)
          for c in columns) + " |")
  if main and any(results.finals.values()):
    lines += ["", f"## {main} over seeds", "",
              "| variant | n | failed | mean | std | {:.0%} CI | min | max | ".format(
                  stats.CONFIDENCE) + "".join(f"{cell(t)} | " for t in thresholds)
              + "per seed |", "|---" * (9 + len(thresholds)) + "|"]
    for variant in shown:
      s, values = results.summary(variant, main), results.values(variant, main)
      failed = results.counts(variant)["failed"]
      rates = "".join(f"{rate_cell(results.success(variant, t))} | " for t in thresholds)
      if s is None:  # its runs failed, or finished without this metric (another split)
        why = "failed" if failed else "not measured"
        lines.append(f"| {cell(variant)} | " + " | ".join(["0", str(failed), why]
                                                         + [""] * 4) + f" | {rates} |")
        continue
      lines.append(f"| {cell(variant)} | {s.n} | {failed} | {_num(s.mean)} | "
                   f"{_num(s.std) if s.std is not None else ''} | "
                   f"{'identical in every seed' if s.identical else interval(s.ci, s.clipped)}"
                   f" | {_num(s.min)} | {_num(s.max)} | {rates}"
                   + ", ".join(f"{seed}: {_num(v)}" for seed, v in values.items()) + " |")
    if baseline and len(results.variants) > 1:
      lines += _paired_lines(results, baseline)
  lines += report_grids.markdown({v: list(f.values()) for v, f in results.finals.items() if f})
  without = [e for e in results.entries if e.state != "finished"]
  if without:
    lines += ["", "## Runs without results", "", "| run | state |", "|---|---|"]
    lines += [f"| {cell(e.name)} | {cell(e.note)} |" for e in without]
  return "\n".join(lines) + "\n"


def _paired_lines(results: Results, baseline: str) -> list[str]:
  """The table of the main metric's paired differences against the baseline."""
  main, variants = results.main, list(results.variants)
  against = (cell(baseline) if baseline in variants else
             f"the same variant with {cell(baseline)}")
  lines = ["", f"## Paired differences against {against} ({main})", "",
           "| variant | shared seeds | mean difference | {0:.0%} CI (t, seeds) | excludes 0 | "
           "{0:.0%} CI (bootstrap, seeds × examples) | excludes 0 | examples |".format(
               stats.CONFIDENCE), "|---" * 8 + "|"]
  for variant in variants:
    base = baseline_of(baseline, variant, variants)
    if base in (None, variant):
      continue
    if not results.finals[variant] or not results.finals[base]:
      why = ("failed" if not results.finals[variant] and results.counts(variant)["failed"] else
             "baseline failed" if results.counts(base)["failed"] else "no results")
      lines.append(f"| {cell(variant)} | 0 | {why} | | | | | |")
      continue
    pair = results.paired(base, variant, main)
    if pair is None:
      lines.append(f"| {cell(variant)} | 0 | no shared seed | | | | | |")
      continue
    t = "identical in every seed" if pair.identical else interval(pair.ci, pair.clipped)
    test = _bootstrap_cells(results.paired_bootstrap(base, variant, main))
    if len(pair.seeds) == 1:  # said where the numbers are, not only in the header
      t = ONE_SEED
      test[1] = "* (of these two runs only)" if test[1] else ""
    cells = [str(len(pair.seeds)), f"{pair.mean:+.4f}", t, "*" if pair.excludes_zero else "",
             *test]
    lines.append(f"| {cell(variant)} | " + " | ".join(cells) + " |")
  return lines


def table_csv(results: Results, baseline: str | None,
              thresholds: Sequence[stats.Threshold] = ()) -> str:
  """The report as CSV, a row per variant: its run counts and finished seeds; for every
  metric the mean, sample std, interval (clipped: whether the metric's range clipped it;
  identical: every seed gave the same value, no interval), min, max, n and the values
  ({seed: value} as JSON); the baseline and, for every metric, the paired differences'
  mean, interval, identical and n, and the main metric's bootstrap interval over seeds and
  examples; every threshold's success rate, k, n and Clopper–Pearson interval. Empty where
  a statistic does not exist."""
  names, main = results.names, results.main
  table = io.StringIO()
  writer = csv.writer(table)
  stat_columns = ("mean", "std", "ci_low", "ci_high", "ci_clipped", "identical", "min", "max",
                  "n", "values")
  diff_columns = ("mean", "ci_low", "ci_high", "identical", "n")
  writer.writerow(["variant", *COUNTS, "seed ids"]
                  + [f"{n} {c}" for n in names for c in stat_columns] + ["baseline"]
                  + [f"{n} diff {c}" for n in names for c in diff_columns]
                  + ([f"{main} diff bootstrap {c}" for c in ("ci_low", "ci_high", "examples")]
                     if main else [])
                  + [f"success {t} {c}".rstrip() for t in thresholds
                     for c in ("", "k", "n", "ci_low", "ci_high")])
  for variant in results.variants:
    row = [variant, *results.counts(variant).values()]
    row.append(" ".join(str(seed) for seed in results.finals[variant]))
    for name in names:
      s, values = results.summary(variant, name), results.values(variant, name)
      row += ([s.mean, _blank(s.std), *(s.ci or ("", "")), s.clipped, s.identical, s.min,
               s.max, s.n, json.dumps({str(k): v for k, v in values.items()})]
              if s else [""] * 8 + [0, ""])
    base = baseline_of(baseline, variant, list(results.variants))
    row.append(base or "")
    paired = base and variant != base
    for name in names:
      pair = results.paired(base, variant, name) if paired else None
      row += ([pair.mean, *(pair.ci or ("", "")), pair.identical, len(pair.seeds)] if pair
              else [""] * 5)
    if main:
      test = (results.paired_bootstrap(base, variant, main)
              if paired and results.finals[variant] and results.finals[base] else "")
      row += (["", "", ""] if isinstance(test, str) else
              [*(test.ci or ("", "")), _bootstrap_cells(test)[2]])
    for t in thresholds:
      rate = results.success(variant, t)
      row += [_blank(rate.rate), rate.k, rate.n, *(rate.ci or ("", ""))]
    writer.writerow(row)
  return table.getvalue()


def _blank(x):
  return "" if x is None else x
