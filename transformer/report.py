"""The report of a sweep (transformer/sweep.py): a table of each variant's final held-out
metrics over its seeds, the state of every run without results (failed, with the reason;
stopped part-way; not trained yet), and plots of the training curves, the main metric and
length extrapolation."""

import csv
import io
import itertools
import os
import re
import subprocess
from collections.abc import Sequence

import numpy as np
from etils import epath

from transformer import checkpoint, pictures, storage, workdir as workdir_lib
from transformer.errors import ConfigError
from transformer.sweep import Run, is_finished, read_failure, runs as sweep_runs

# The main metric, the first found: the column after the run counts and the bar chart.
MAIN_METRICS = ("valid/bleu", "valid/exact_match", "valid/accuracy")
# The order of the metrics of a split in the table; others follow by name.
KEYS = ("bleu", "chrf", "exact_match", "accuracy", "macro_f1", "perplexity", "bits_per_token",
        "loss")
LOWER_IS_BETTER = ("perplexity", "bits_per_token", "loss")
SPLITS = ("valid", "test", "longer")


def final_metrics(workdir: str) -> dict[str, dict]:
  """The last evaluation record of each held-out split in a run's metrics.jsonl."""
  return {r["split"]: r for r in workdir_lib.read_metrics(workdir) if r["split"] != "train"}


def _train_curve(workdir: str) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in workdir_lib.read_metrics(workdir) if r["split"] == "train"}


def run_state(run: Run) -> tuple[str, str]:
  """("finished" | "failed" | "unfinished", what to say of a run without results)."""
  num_steps = run.config.train.num_steps
  if is_finished(run.workdir, num_steps):
    return "finished", ""
  failure = read_failure(run.workdir)
  if failure:
    return "failed", f"failed: {failure['error']}"
  steps = checkpoint.steps(run.workdir)
  if steps:
    return "unfinished", (f"checkpoint at step {steps[-1]} of {num_steps}: training, or "
                          "stopped (the sweep resumes it)")
  return "unfinished", "not trained yet"


def _split_rank(split: str) -> tuple:
  if split in SPLITS:
    return (SPLITS.index(split), 0, "")
  if match := re.fullmatch(r"len(\d+)(_sliding)?", split):  # language models: by length
    return (len(SPLITS), int(match[1]), match[2] or "")
  return (len(SPLITS) + 1, 0, split)


def order_metrics(names: set[str], train_length: int | None) -> tuple[list[str], str | None]:
  """(the `split/key` names in the table's order, the main metric): the main metric first
  (valid BLEU, exact match or accuracy; a language model's perplexity at its training
  length), then split by split (valid, test, longer, then by evaluation length), each
  split's metrics in KEYS' order."""
  main = next((n for n in MAIN_METRICS if n in names), None)
  if main is None:
    perplexities = sorted((n for n in names if n.endswith("/perplexity")),
                          key=lambda n: _split_rank(n.split("/")[0]))
    main = (f"len{train_length}/perplexity" if f"len{train_length}/perplexity" in names
            else next(iter(perplexities), None))

  def rank(name):
    split, key = name.split("/", 1)
    return (name != main, _split_rank(split), KEYS.index(key) if key in KEYS else len(KEYS), key)

  return sorted(names, key=rank), main


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


def _cell(text: str) -> str:
  return " ".join(str(text).split()).replace("|", "\\|")


STATES = ("finished", "failed", "unfinished")


def write(config_path: str, sweep_dir: str, overrides: dict | None = None,
          only: Sequence[str] = ()) -> tuple[str, str]:
  """Writes under sweep_dir report.md and report.csv over the sweep's runs (those `only`
  selects, see sweep.select): a title naming the sweep file, its training steps, the
  overrides and selection and the code's commit; a row per variant (the overrides other
  than the seed) with its finished, failed and unfinished runs and each final held-out
  metric as mean ± std over its finished seeds, the main metric first (order_metrics);
  then every run without results and why (run_state). And PNG plots of the finished runs:
  curves.png (training loss), final.png (the main metric) and, when runs report exact
  match per length, extrapolation.png; for language models (perplexity per evaluation
  length), perplexity.png (perplexity against the evaluation length, non-overlapping and
  sliding windows) and position_loss.png (the loss by position in the longest windows).
  Returns the table paths."""
  all_runs = sweep_runs(config_path, sweep_dir, overrides, only)
  if not epath.Path(sweep_dir).is_dir():
    raise ConfigError(f"--sweep_dir {sweep_dir} does not exist: no run of this sweep has "
                      "started there")
  states = {run.name: run_state(run) for run in all_runs}
  variants: dict[str, list[Run]] = {}
  for run in all_runs:
    variants.setdefault(run.variant, []).append(run)
  counts = {v: {s: sum(states[r.name][0] == s for r in rs) for s in STATES}
            for v, rs in variants.items()}
  finished = {v: [r.workdir for r in rs if states[r.name][0] == "finished"]
              for v, rs in variants.items()}
  finals = {v: [final_metrics(w) for w in workdirs] for v, workdirs in finished.items()}
  first = all_runs[0].config
  train_length = first.source.train_length(first.data, first.task)
  names, main = order_metrics({f"{split}/{key}" for runs in finals.values() for r in runs
                               for split, m in r.items() for key, value in m.items()
                               if isinstance(value, float) and key not in ("step", "eval_length")},
                              train_length)
  stats = _stats(finals, names)
  md_path, csv_path = storage.join(sweep_dir, "report.md"), storage.join(sweep_dir, "report.csv")
  columns = ["variant", "seeds", "failed", "unfinished"]
  lines = _header(config_path, all_runs, counts, main, overrides, only)
  lines += ["| " + " | ".join(columns + names) + " |", "|---" * (len(columns) + len(names)) + "|"]
  for variant in variants:
    cells = [str(counts[variant][s]) for s in STATES] + [_format(stats[variant, n]) for n in names]
    lines.append(f"| {_cell(variant)} | " + " | ".join(cells) + " |")
  without = [run for run in all_runs if states[run.name][0] != "finished"]
  if without:
    lines += ["", "## Runs without results", "", "| run | state |", "|---|---|"]
    lines += [f"| {_cell(run.name)} | {_cell(states[run.name][1])} |" for run in without]
  storage.write(md_path, "\n".join(lines) + "\n")
  table = io.StringIO()
  writer = csv.writer(table)
  writer.writerow(columns + [f"{n} {stat}" for n in names for stat in ("mean", "std")])
  for variant in variants:
    writer.writerow([variant, *(counts[variant][s] for s in STATES)]
                    + [x for n in names for x in (stats[variant, n] or ("", "", 0))[:2]])
  storage.write(csv_path, table.getvalue())
  with_results = {v: workdirs for v, workdirs in finished.items() if workdirs}
  if with_results:
    _plot(sweep_dir, with_results, {v: finals[v] for v in with_results}, stats, main,
          train_length)
  return md_path, csv_path


def _stats(finals: dict[str, list[dict]], names: list[str]) -> dict:
  """{(variant, name): (mean, std, seeds) of the metric over the variant's finished runs, or
  None}."""
  stats = {}
  for variant, runs in finals.items():
    for name in names:
      split, key = name.split("/")
      values = [r[split][key] for r in runs if key in r.get(split, {})]
      stats[variant, name] = ((float(np.mean(values)), float(np.std(values)), len(values))
                              if values else None)
  return stats


def _format(stat) -> str:
  if not stat:
    return ""
  mean, std, seeds = stat
  return f"{mean:.4f} ± {std:.4f}" if seeds > 1 else f"{mean:.4f}"  # one seed: no spread


def _header(config_path, all_runs, counts, main, overrides, only) -> list[str]:
  """The title and the facts that the table's numbers depend on."""
  total = {s: sum(c[s] for c in counts.values()) for s in STATES}
  steps = sorted({run.config.train.num_steps for run in all_runs})
  lines = [f"# Sweep {config_path}", "",
           f"- runs: {len(all_runs)} in {len(counts)} variant(s): "
           + ", ".join(f"{total[s]} {s}" for s in STATES),
           f"- training steps: {steps[0]}" if len(steps) == 1 else
           f"- training steps: {steps[0]} to {steps[-1]} (see the variants)"]
  if main:
    better = "lower" if main.split("/")[1] in LOWER_IS_BETTER else "higher"
    lines.append(f"- main metric: {main} ({better} is better); metrics are the final held-out "
                 "evaluation, mean ± std over the finished seeds")
  if overrides:
    lines.append("- every run: " + " ".join(f"--config.{k}={v}" for k, v in overrides.items()))
  if only:
    lines.append("- selected: " + " ".join(f"--only {o}" for o in only))
  if commit := _commit():
    lines.append(f"- written by the code at git commit {commit}")
  return lines + [""]


def curve_style(curves: list[list[float]]) -> tuple[str, str | None]:
  """(y scale, marker) for training-loss curves: a log axis only when the losses span a
  decade or more (else a linear one, on which a short run's few points are readable),
  markers when a curve has few points."""
  values = [v for c in curves for v in c if np.isfinite(v)]
  spans_a_decade = bool(values) and min(values) > 0 and max(values) >= 10 * min(values)
  few = max((len(c) for c in curves), default=0) <= 20
  return ("log" if spans_a_decade else "linear"), ("o" if few else None)


def _plot(sweep_dir, variants, finals, stats, main, train_length) -> None:
  plt = pictures.pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  means = {}
  for variant, workdirs in variants.items():
    curves = [_train_curve(w) for w in workdirs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    means[variant] = (steps, [float(np.mean([c[s] for c in curves])) for s in steps])
  yscale, marker = curve_style([loss for _, loss in means.values()])
  for variant, (steps, loss) in means.items():
    ax.plot(steps, loss, marker=marker, markersize=4, label=variant)
  ax.set(xlabel="step", ylabel="training loss (mean over seeds)", yscale=yscale,
         title="Learning curves")
  ax.xaxis.get_major_locator().set_params(integer=True)  # steps, not 3.5
  ax.legend(fontsize=7)
  pictures.save(fig, storage.join(sweep_dir, "curves.png"), dpi=120, bbox_inches="tight")

  if main:
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [v for v in finals if stats[v, main]]
    ax.bar(range(len(labels)), [stats[v, main][0] for v in labels],
           yerr=[stats[v, main][1] for v in labels], capsize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    better = "lower" if main.split("/")[1] in LOWER_IS_BETTER else "higher"
    ax.set(ylabel=f"{main} (mean ± std over seeds; {better} is better)",
           title="Final held-out metric")
    pictures.save(fig, storage.join(sweep_dir, "final.png"), dpi=120, bbox_inches="tight")

  if any("exact_match_by_length" in m
         for runs in finals.values() for r in runs for m in r.values()):
    fig, ax = plt.subplots(figsize=(8, 5))
    for variant, runs in finals.items():
      by_length: dict[int, list[float]] = {}
      for r in runs:
        for m in r.values():
          for length, value in m.get("exact_match_by_length", {}).items():
            by_length.setdefault(int(length), []).append(value)
      lengths = sorted(by_length)
      ax.plot(lengths, [np.mean(by_length[n]) for n in lengths], marker="o", label=variant)
    if train_length is not None:
      ax.axvline(train_length + 0.5, color="gray", linestyle="--",
                 label="longest training length")
    ax.set(xlabel="input length", ylabel="exact match (mean over seeds)",
           title="Length extrapolation")
    ax.legend(fontsize=7)
    pictures.save(fig, storage.join(sweep_dir, "extrapolation.png"), dpi=120, bbox_inches="tight")

  if any("eval_length" in m for runs in finals.values() for r in runs for m in r.values()):
    _plot_lengths(plt, sweep_dir, finals, train_length)


def _plot_lengths(plt, sweep_dir, finals, train_length) -> None:
  """perplexity.png and position_loss.png of language-model runs (see report)."""
  fig, ax = plt.subplots(figsize=(8, 5))
  for (variant, runs), color in zip(finals.items(), itertools.cycle(plt.cm.tab10.colors)):
    for sliding, style in ((False, "-"), (True, "--")):
      by_length: dict[float, list[float]] = {}
      for r in runs:
        for split, m in r.items():
          if "eval_length" in m and split.endswith("_sliding") == sliding:
            by_length.setdefault(m["eval_length"], []).append(m["perplexity"])
      lengths = sorted(by_length)
      if lengths:
        ax.plot(lengths, [np.mean(by_length[n]) for n in lengths], style, marker="o",
                color=color, label=f"{variant}{' (sliding)' if sliding else ''}")
  ax.axvline(train_length, color="gray", linestyle=":", label="training length")
  ax.set(xlabel="evaluation length (tokens)", ylabel="perplexity (mean over seeds)",
         xscale="log", yscale="log", title="Length extrapolation")
  ax.legend(fontsize=6, ncol=2)
  pictures.save(fig, storage.join(sweep_dir, "perplexity.png"), dpi=120, bbox_inches="tight")

  fig, ax = plt.subplots(figsize=(8, 5))
  for variant, runs in finals.items():
    curves = [max(((m["eval_length"], m["loss_by_position"]) for split, m in r.items()
                   if "eval_length" in m and not split.endswith("_sliding")),
                  key=lambda x: x[0])[1] for r in runs]
    positions = sorted(set.intersection(*(set(c) for c in curves)), key=int)
    ax.plot([int(p) for p in positions], [np.mean([c[p] for c in curves]) for p in positions],
            label=variant)
  ax.axvline(train_length, color="gray", linestyle=":", label="training length")
  ax.set(xlabel="position in the window", ylabel="loss (nats, mean over seeds)",
         title="Loss by position, longest evaluation windows")
  ax.legend(fontsize=7)
  pictures.save(fig, storage.join(sweep_dir, "position_loss.png"), dpi=120, bbox_inches="tight")
