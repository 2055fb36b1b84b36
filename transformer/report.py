"""The report of a sweep (transformer/sweep.py): a table of each variant's final held-out
metrics over its seeds, and plots of the training curves, the main metric and length
extrapolation."""

import csv
import io
import itertools

import numpy as np

from transformer import config as config_lib, pictures, storage, workdir as workdir_lib
from transformer.sweep import SEED, is_finished, load, run_name, with_overrides


def final_metrics(workdir: str) -> dict[str, dict]:
  """The last evaluation record of each held-out split in a run's metrics.jsonl."""
  return {r["split"]: r for r in workdir_lib.read_metrics(workdir) if r["split"] != "train"}


def _train_curve(workdir: str) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in workdir_lib.read_metrics(workdir) if r["split"] == "train"}


def write(config_path: str, sweep_dir: str, overrides: dict | None = None) -> tuple[str, str]:
  """Writes under sweep_dir: report.md and report.csv, one row per variant (the overrides
  other than the seed) with each final held-out metric as mean ± std over its finished
  seeds; and PNG plots: curves.png (training loss), final.png (the main held-out metric)
  and, when runs report exact match per length, extrapolation.png; for language models
  (perplexity per evaluation length), perplexity.png (perplexity against the evaluation
  length, non-overlapping and sliding windows) and position_loss.png (the loss by position
  in the longest windows). Returns the table paths."""
  base, sweep = load(config_path)
  base = with_overrides(base, overrides or {})
  cfg = config_lib.parse(base)
  train_length = cfg.source.train_length(cfg.data, cfg.task)
  variants: dict[str, list[str]] = {}
  for run_overrides in sweep:
    workdir = storage.join(sweep_dir, run_name(run_overrides))
    num_steps = config_lib.parse(with_overrides(base, run_overrides)).train.num_steps
    if is_finished(workdir, num_steps):
      variant = run_name({k: v for k, v in run_overrides.items() if k != SEED})
      variants.setdefault(variant, []).append(workdir)
  finals = {v: [final_metrics(w) for w in workdirs] for v, workdirs in variants.items()}
  names = sorted({f"{split}/{key}" for runs in finals.values() for r in runs
                  for split, m in r.items() for key, value in m.items()
                  if isinstance(value, float) and key not in ("step", "eval_length")})
  stats, counts = {}, {}
  for variant, runs in finals.items():
    for name in names:
      split, key = name.split("/")
      values = [r[split][key] for r in runs if key in r.get(split, {})]
      stats[variant, name] = (float(np.mean(values)), float(np.std(values))) if values else None
      counts[variant, name] = len(values)

  def cell(variant, name):  # one seed has no spread to show
    if not stats[variant, name]:
      return ""
    mean, std = stats[variant, name]
    return f"{mean:.4f} ± {std:.4f}" if counts[variant, name] > 1 else f"{mean:.4f}"

  md_path, csv_path = storage.join(sweep_dir, "report.md"), storage.join(sweep_dir, "report.csv")
  lines = ["| variant | seeds | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
  for variant, runs in finals.items():
    cells = [cell(variant, n) for n in names]
    lines.append(f"| {variant} | {len(runs)} | " + " | ".join(cells) + " |")
  storage.write(md_path, "\n".join(lines) + "\n")
  table = io.StringIO()
  writer = csv.writer(table)
  writer.writerow(["variant", "seeds"] + [f"{n} {stat}" for n in names for stat in ("mean", "std")])
  for variant, runs in finals.items():
    writer.writerow([variant, len(runs)]
                    + [x for n in names for x in (stats[variant, n] or ("", ""))])
  storage.write(csv_path, table.getvalue())
  _plot(sweep_dir, variants, finals, stats, names, train_length)
  return md_path, csv_path


def _plot(sweep_dir, variants, finals, stats, names, train_length) -> None:
  plt = pictures.pyplot()
  fig, ax = plt.subplots(figsize=(8, 5))
  for variant, workdirs in variants.items():
    curves = [_train_curve(w) for w in workdirs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    ax.plot(steps, [np.mean([c[s] for c in curves]) for s in steps], label=variant)
  ax.set(xlabel="step", ylabel="training loss (mean over seeds)", yscale="log",
         title="Learning curves")
  ax.legend(fontsize=7)
  pictures.save(fig, storage.join(sweep_dir, "curves.png"), dpi=120, bbox_inches="tight")

  main = next((n for n in ("valid/bleu", "valid/exact_match", "valid/accuracy") if n in names),
              None)
  if main:
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(finals)
    means = [stats[v, main][0] if stats[v, main] else 0.0 for v in labels]
    stds = [stats[v, main][1] if stats[v, main] else 0.0 for v in labels]
    ax.bar(range(len(labels)), means, yerr=stds, capsize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel=f"{main} (mean ± std over seeds)", title="Final held-out metric")
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
