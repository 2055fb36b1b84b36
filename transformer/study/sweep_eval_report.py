"""The report of an evaluation-time sweep (study/sweep_eval.py): for every variant of the
trained sweep and every evaluation (the unmodified one, then each override set), each
metric's mean and t interval over the seeds, and the paired differences by seed of each
override set against the unmodified evaluation of the same runs (study/stats.py), written as
SWEEP_DIR/eval_sweep,.../report.md (the main metric's kind across the splits, e.g.
perplexity at every evaluation length) and report.csv (every metric, one row per variant,
evaluation and metric)."""

import csv
import io
import json
from collections.abc import Sequence

from etils import epath

from transformer.core import storage
from transformer.run.state import run_state
from transformer.study import report, stats, sweep_eval
from transformer.study.report_tables import CLIPPED, cell, interval
from transformer.study.results import declared, lower_is_better, order_metrics

UNMODIFIED = "unmodified"  # the evaluation without overrides: each run's final one


def _metrics(results: dict) -> dict[str, float]:
  """{split/key: value} of the numeric metrics of an evaluation's {split: metrics}."""
  return {f"{split}/{key}": value for split, metrics in results.items()
          for key, value in metrics.items()
          if isinstance(value, float) and key not in ("step", "eval_length")}


def collect(evaluations: Sequence[sweep_eval.Evaluation]
            ) -> tuple[dict, list[tuple[str, str, str]]]:
  """({variant: {evaluation label: {seed: {metric: value}}}} with UNMODIFIED first in each
  variant, [(run, evaluation, why it has no results)])."""
  table: dict[str, dict[str, dict[int, dict]]] = {}
  missing = []
  for ev in evaluations:
    what, results = sweep_eval.state(ev)
    variant = table.setdefault(ev.run.variant, {UNMODIFIED: {}})
    seed = ev.run.config.seed
    if results is None:
      missing.append((ev.run.name, ev.label, "not evaluated yet" if what == "todo" else what))
      continue
    if seed not in variant[UNMODIFIED]:  # the run is finished: its final evaluation
      variant[UNMODIFIED][seed] = _metrics(run_state(ev.run.workdir, ev.step).final)
    label = ev.label if ev.applied else f"{ev.label} (the run's own settings)"
    variant.setdefault(label, {})[seed] = _metrics(results)
  return table, missing


def _cell(summary: stats.Summary | None, seeds: int) -> str:
  """mean [interval] (or "identical in every seed"), and n where fewer seeds than the row's
  have the metric."""
  if summary is None:
    return ""
  ci = (" (identical in every seed)" if summary.identical else
        f" {interval(summary.ci, summary.clipped)}" if summary.ci else "")
  return f"{summary.mean:.4f}{ci}" + (f" (n={summary.n})" if summary.n != seeds else "")


def _diff_cell(pair: stats.Paired | None, seeds: int) -> str:
  """mean difference [interval] (or "identical in every seed", never starred), * where it
  excludes 0, and n where fewer seeds pair."""
  if pair is None:
    return ""
  ci = (" (identical in every seed)" if pair.identical else
        f" [{pair.ci[0]:+.4f}, {pair.ci[1]:+.4f}]" + (CLIPPED if pair.clipped else "")
        if pair.ci else "")
  return f"{pair.mean:+.4f}{ci}" + (" *" if pair.excludes_zero else "") + (
      f" (n={len(pair.seeds)})" if len(pair.seeds) != seeds else "")


def _values(by_seed: dict[int, dict], metric: str) -> dict[int, float]:
  return {seed: m[metric] for seed, m in by_seed.items() if metric in m}


def markdown(title: list[str], table: dict, missing: list, left_out: dict[str, str],
             train_length: int | None) -> str:
  """The report as markdown (module docstring); the declared ranges of the metrics
  (core/metrics.py METRICS) bound the intervals."""
  names, main = order_metrics({m for evs in table.values() for seeds in evs.values()
                               for ms in seeds.values() for m in ms}, train_length)
  lines = list(title)
  if main:
    key = main.split("/", 1)[1]
    columns = [n for n in names if n.split("/", 1)[1] == key]
    better = "lower" if lower_is_better(main) else "higher"
    header = "| variant | evaluation | seeds | " + " | ".join(c.split("/")[0] for c in columns)
    rule = "|---" * (3 + len(columns)) + "|"
    lines += ["", f"## {key} ({better} is better): mean [{stats.CONFIDENCE:.0%} CI] over seeds",
              "", header + " |", rule]
    for variant, evs in table.items():
      for name, by_seed in evs.items():
        lines.append(f"| {cell(variant)} | {cell(name)} | {len(by_seed)} | "
                     + " | ".join(_cell(stats.summary(list(v.values()), declared(c))
                                        if (v := _values(by_seed, c)) else None, len(by_seed))
                                  for c in columns) + " |")
    lines += ["", f"## Paired differences of {key}: evaluation − {UNMODIFIED}, by seed", "",
              header + " |", rule]
    for variant, evs in table.items():
      plain = evs[UNMODIFIED]
      for name, by_seed in evs.items():
        if name != UNMODIFIED:
          lines.append(f"| {cell(variant)} | {cell(name)} | {len(by_seed)} | "
                       + " | ".join(_diff_cell(stats.paired(_values(plain, c),
                                                            _values(by_seed, c),
                                                            declared(c)), len(by_seed))
                                    for c in columns) + " |")
  if missing or left_out:
    lines += ["", "## Runs and evaluations without results", "", "| run | evaluation | why |",
              "|---|---|---|"]
    lines += [f"| {cell(r)} | {cell(e)} | {cell(w)} |" for r, e, w in missing]
    lines += [f"| {cell(r)} | all | {cell(w)}: left out |" for r, w in left_out.items()]
  return "\n".join(lines) + "\n"


def table_csv(table: dict) -> str:
  """A row per variant, evaluation and metric: the statistics of the values over seeds and
  of the paired differences against UNMODIFIED (empty where none), intervals within the
  metrics' declared ranges."""
  out = io.StringIO()
  writer = csv.writer(out)
  writer.writerow(["variant", "evaluation", "metric", "n", "mean", "std", "ci_low", "ci_high",
                   "values", "diff n", "diff mean", "diff ci_low", "diff ci_high",
                   "diff values"])
  for variant, evs in table.items():
    names = sorted({m for by_seed in evs.values() for ms in by_seed.values() for m in ms})
    for name, by_seed in evs.items():
      for metric in names:
        values = _values(by_seed, metric)
        if not values:
          continue
        s = stats.summary(list(values.values()), declared(metric))
        row = [variant, name, metric, s.n, s.mean, "" if s.std is None else s.std,
               *(s.ci or ("", "")), json.dumps({str(k): v for k, v in values.items()})]
        pair = (stats.paired(_values(evs[UNMODIFIED], metric), values, declared(metric))
                if name != UNMODIFIED else None)
        row += ([len(pair.seeds), pair.mean, *(pair.ci or ("", "")),
                 json.dumps(dict(zip(map(str, pair.seeds), pair.differences)))]
                if pair else [""] * 5)
        writer.writerow(row)
  return out.getvalue()


def write(sweep_dir: str, invocation_flags: list[str], eval_sweep: sweep_eval.EvalSweep,
          evaluations: Sequence[sweep_eval.Evaluation], left_out: dict[str, str],
          train_length: int | None) -> tuple[str, str]:
  """Writes report.md and report.csv into SWEEP_DIR/<eval_sweep.folder>; returns their paths."""
  table, missing = collect(evaluations)
  runs = {ev.run.name for ev in evaluations}
  axes = " ".join(f"--eval_sweep {s}" for s in eval_sweep.specs())
  title = [f"# Evaluation-time sweep of {sweep_dir}", "",
           (f"- the runs: `sweep.py {' '.join(invocation_flags)}`: {len(runs)} run(s) in "
            f"{len(table)} variant(s), evaluated again from their final checkpoints "
            "(no retraining)"),
           (f"- evaluations: {axes}, each combination; and {UNMODIFIED}: each run's final "
            "evaluation (its metrics.jsonl)"),
           (f"- statistics over a variant's seeds: mean [{stats.CONFIDENCE:.0%} confidence "
            "interval of the mean: Student t, n − 1 degrees of freedom; none for one seed, "
            "none where every seed gives the same value: \"identical in every seed\"], "
            f"clipped to the metric's declared range and marked {CLIPPED} where it reached "
            "past it"),
           (f"- paired differences: the evaluation − {UNMODIFIED} of the same run, per seed; "
            f"their mean [{stats.CONFIDENCE:.0%} t interval]; * where it excludes 0 (never "
            "for a difference identical in every seed)"),
           *report.commit_line()]
  folder = storage.join(sweep_dir, eval_sweep.folder)
  md_path, csv_path = storage.join(folder, "report.md"), storage.join(folder, "report.csv")
  epath.Path(folder).mkdir(parents=True, exist_ok=True)
  storage.write(md_path, markdown(title, table, missing, left_out, train_length))
  storage.write(csv_path, table_csv(table))
  return md_path, csv_path
