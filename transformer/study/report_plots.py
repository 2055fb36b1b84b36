"""The plots of a report (transformer/study/report.py) over finished runs: training curves, the
main metric with its confidence intervals, exact match or accuracy against the input length
and, for language models, perplexity against the evaluation length and the loss by
position. A plot whose curves would have one point each is not drawn (nor left from an
earlier report)."""

import itertools

import numpy as np
from etils import epath

from transformer.core import storage
from transformer.core.metrics import BY_LENGTH, METRICS, shown
from transformer.run import workdir as workdir_lib
from transformer.study import figures, stats
from transformer.study.results import grid
from transformer.study.stats import CONFIDENCE

PLOTS = ("curves.png", "final.png", "extrapolation.png", "perplexity.png", "position_loss.png")


def _train_curve(workdir: str) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in workdir_lib.read_metrics(workdir) if r["split"] == "train"}


def curve_style(curves: list[list[float]]) -> tuple[str, str | None]:
  """(y scale, marker) for training-loss curves: a log axis only when the losses span a
  decade or more (else a linear one, on which a short run's few points are readable),
  markers when a curve has few points."""
  values = [v for c in curves for v in c if np.isfinite(v)]
  spans_a_decade = bool(values) and min(values) > 0 and max(values) >= 10 * min(values)
  few = max((len(c) for c in curves), default=0) <= 20
  return ("log" if spans_a_decade else "linear"), ("o" if few else None)


def plot(out_dir: str, workdirs: dict[str, list[str]], finals: dict[str, list[dict]],
         main: tuple[str, dict, bool] | None, train_length: int | None) -> list[str]:
  """Writes into out_dir curves.png (the mean training loss of each variant's `workdirs`),
  final.png (`main`: (metric, {variant: stats.Summary}, lower is better), as bars of the
  mean with the t interval), extrapolation.png when the `finals` (each variant's final
  held-out metrics per run) have a curve over the input length (plot_by_length; its bands
  within the metric's declared range), and for language models perplexity.png and
  position_loss.png (plot_lengths); each only with curves of several points. Removes the
  PLOTS it does not write. Returns the names written."""
  plt = figures.pyplot()
  written = []
  means = {}
  for variant, dirs in workdirs.items():
    curves = [_train_curve(w) for w in dirs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    means[variant] = (steps, [float(np.mean([c[s] for c in curves])) for s in steps])
  if any(len(steps) > 1 for steps, _ in means.values()):
    fig, ax = plt.subplots(figsize=(8, 5))
    yscale, marker = curve_style([loss for _, loss in means.values()])
    for variant, (steps, loss) in means.items():
      ax.plot(steps, loss, marker=marker, markersize=4, label=variant)
    ax.set(xlabel="step", ylabel="training loss (mean over seeds)", yscale=yscale,
           title="Learning curves")
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps, not 3.5
    ax.legend(fontsize=7)
    figures.save(fig, storage.join(out_dir, "curves.png"), dpi=120, bbox_inches="tight")
    written.append("curves.png")

  if main:
    name, summaries, lower = main
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = list(summaries)
    # Error bars only where there is an interval: one seed has none (not a zero-width one).
    yerr = [[s.mean - s.ci[0] if s.ci else np.nan for s in summaries.values()],
            [s.ci[1] - s.mean if s.ci else np.nan for s in summaries.values()]]
    ax.bar(range(len(labels)), [s.mean for s in summaries.values()], yerr=yerr, capsize=4)
    for i, s in enumerate(summaries.values()):
      ax.plot([i] * s.n, s.values, "k.", markersize=4)  # the seeds themselves
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel=f"{name} ({'lower' if lower else 'higher'} is better)",
           title=f"Final held-out metric: mean (bar), seeds (dots), {CONFIDENCE:.0%} t interval "
           "(within the metric's range)")
    figures.save(fig, storage.join(out_dir, "final.png"), dpi=120, bbox_inches="tight")
    written.append("final.png")

  curve = next((key for key in shown(BY_LENGTH) if len({length for runs in finals.values()
                                                   for r in runs for m in r.values()
                                                   for length in m.get(key, ())}) > 1), None)
  if curve:
    plot_by_length(plt, out_dir, finals, curve, train_length)
    written.append("extrapolation.png")

  lengths = {m["eval_length"] for runs in finals.values() for r in runs for m in r.values()
             if "eval_length" in m}
  if lengths:
    written += plot_lengths(plt, out_dir, finals, train_length)
  for name in PLOTS:
    if name not in written and (epath.Path(out_dir) / name).exists():
      (epath.Path(out_dir) / name).unlink()  # an earlier report's, of other runs
  return written


_PANEL_AT = 8  # more variants than this are split into panels by their first field


def panels(variants) -> dict[str, list[str]]:
  """{panel title: its variants}: one panel, or with more than _PANEL_AT variants that form
  a grid (results.grid, e.g. task × encoding) one per value of its first field."""
  table = grid(variants) if len(variants) > _PANEL_AT else None
  if table is None:
    return {"": list(variants)}
  field, rows = table
  return {f"{field}={value}": list(row.values()) for value, row in rows.items()}


def plot_by_length(plt, out_dir, finals, key, train_length) -> None:
  """extrapolation.png: each variant's metric `key` (declared shown BY_LENGTH) against the
  input length, mean over seeds over any split that has it, with its t interval (within its
  declared range) as a band where there are several seeds; the longest training length
  marked."""
  metric = METRICS[key]
  groups = panels(finals)
  fig, axes = plt.subplots(len(groups), 1, figsize=(8, 4.5 * len(groups)), squeeze=False)
  for ax, (title, variants) in zip(axes[:, 0], groups.items()):
    for variant in variants:
      by_length: dict[int, list[float]] = {}
      for r in finals[variant]:
        for m in r.values():
          for length, value in m.get(key, {}).items():
            by_length.setdefault(int(length), []).append(value)
      lengths = sorted(by_length)
      means = [np.mean(by_length[n]) for n in lengths]
      label = variant[len(title) + 1:] if title else variant
      line, = ax.plot(lengths, means, marker="o" if len(lengths) <= 30 else None,
                      markersize=3, label=label or variant)
      cis = [stats.summary(by_length[n], metric).ci for n in lengths]
      if all(cis):
        ax.fill_between(lengths, [c[0] for c in cis], [c[1] for c in cis],
                        color=line.get_color(), alpha=0.15)
    if train_length is not None:
      ax.axvline(train_length + 0.5, color="gray", linestyle="--",
                 label="longest training length")
    ax.set(xlabel="input length", ylabel=f"{metric.words} (mean over seeds)",
           title=f"Length extrapolation{': ' + title if title else ''}",
           ylim=(-0.02, 1.02))  # a fraction: a wide interval (2 seeds) is clipped, not scaled
    ax.legend(fontsize=7)
  figures.save(fig, storage.join(out_dir, "extrapolation.png"), dpi=120, bbox_inches="tight")


def plot_lengths(plt, out_dir, finals, train_length) -> list[str]:
  """perplexity.png (with several evaluation lengths) and position_loss.png (with several
  positions) of language-model runs (see plot); returns the names written."""
  written = []
  if len({m["eval_length"] for runs in finals.values() for r in runs for m in r.values()
          if "eval_length" in m}) > 1:
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
    figures.save(fig, storage.join(out_dir, "perplexity.png"), dpi=120, bbox_inches="tight")
    written.append("perplexity.png")

  curves = {}
  for variant, runs in finals.items():
    by_run = [max(((m["eval_length"], m["loss_by_position"]) for split, m in r.items()
                   if "eval_length" in m and not split.endswith("_sliding")),
                  key=lambda x: x[0])[1] for r in runs]
    positions = sorted(set.intersection(*(set(c) for c in by_run)), key=int)
    curves[variant] = ([int(p) for p in positions],
                       [np.mean([c[p] for c in by_run]) for p in positions])
  if any(len(positions) > 1 for positions, _ in curves.values()):
    fig, ax = plt.subplots(figsize=(8, 5))
    for variant, (positions, loss) in curves.items():
      ax.plot(positions, loss, label=variant)
    ax.axvline(train_length, color="gray", linestyle=":", label="training length")
    ax.set(xlabel="position in the window", ylabel="loss (nats, mean over seeds)",
           title="Loss by position, longest evaluation windows")
    ax.legend(fontsize=7)
    figures.save(fig, storage.join(out_dir, "position_loss.png"), dpi=120,
                  bbox_inches="tight")
    written.append("position_loss.png")
  return written
