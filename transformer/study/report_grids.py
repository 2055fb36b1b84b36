"""The grids of a report (transformer/study/report.py): split metrics that are tables {row:
{column: value}}, as the data sources declare them (data.base.Grid; e.g. passkey retrieval
by evaluation length × depth of the key, MQAR accuracy by sequence length × key-value
pairs). Each grid a run reports becomes a markdown table of each variant's mean over its
finished seeds, and KEY.png: a heatmap per variant and the mean over the columns by row
(e.g. retrieval by length), each variant's seeds' t interval as a band."""

import math

import numpy as np

from transformer.core import storage
from transformer.data.base import Grid
from transformer.data.sources import SOURCES
from transformer.study import figures, stats

_ANNOTATED = 12  # heatmaps up to this many rows and columns show their values


def declared() -> dict[str, Grid]:
  """{metric key: its Grid} over every registered data source."""
  return {key: grid for source in SOURCES.values() for key, grid in source.grids.items()}


def _order(labels) -> list[str]:
  """Labels by their numeric value where they have one (a JSON key "128" is a length)."""
  numeric = [x for x in labels if _is_number(x)]
  return sorted(numeric, key=float) + sorted(x for x in labels if not _is_number(x))


def _is_number(label: str) -> bool:
  try:
    float(label)
  except ValueError:
    return False
  return True


def _number(label: str, index: int) -> float:
  """A row label's value on a plot's axis: its number, else its place."""
  return float(label) if _is_number(label) else float(index)


def values(runs: list[dict], key: str) -> list[dict[str, dict[str, float]]]:
  """Per run ({split: metrics}), its grid `key` merged over its splits: {row: {column:
  value}} (keys as strings, as a run's records hold them)."""
  out = []
  for run in runs:
    merged: dict[str, dict[str, float]] = {}
    for metrics in run.values():
      for row, columns in (metrics.get(key) or {}).items():
        merged.setdefault(str(row), {}).update({str(c): v for c, v in columns.items()})
    out.append(merged)
  return out


def means(runs: list[dict], key: str) -> tuple[list[str], list[str], np.ndarray]:
  """(rows, columns, the mean over the runs that have each cell [rows, columns]: NaN where
  none has it) of grid `key`."""
  grids = values(runs, key)
  rows = _order({r for g in grids for r in g})
  columns = _order({c for g in grids for row in g.values() for c in row})
  table = np.full((len(rows), len(columns)), np.nan)
  for i, r in enumerate(rows):
    for j, c in enumerate(columns):
      cell = [g[r][c] for g in grids if c in g.get(r, {})]
      table[i, j] = np.mean(cell) if cell else np.nan
  return rows, columns, table


def present(finals: dict[str, list[dict]]) -> dict[str, Grid]:
  """The declared grids that some run in `finals` ({variant: [run's {split: metrics}]})
  reports."""
  return {key: grid for key, grid in declared().items()
          if any(m.get(key) for runs in finals.values() for r in runs for m in r.values())}


def markdown(finals: dict[str, list[dict]]) -> list[str]:
  """A section per grid in `finals`: a row per variant and grid row, the mean over the
  variant's seeds in each column."""
  lines = []
  for key, grid in present(finals).items():
    tables = {v: means(runs, key) for v, runs in finals.items() if any(values(runs, key))}
    columns = _order({c for _, cs, _ in tables.values() for c in cs})
    title = f"## {grid.title} by {grid.rows} × {grid.columns}: mean over seeds (`{key}`)"
    lines += ["", title, "",
              f"| variant | {grid.rows} | " + " | ".join(columns) + " |",
              "|---" * (len(columns) + 2) + "|"]
    for variant, (rows, cs, table) in tables.items():
      for i, row in enumerate(rows):
        cells = [table[i, cs.index(c)] if c in cs else math.nan for c in columns]
        lines.append(f"| {variant.replace('|', chr(92) + '|')} | {row} | " + " | ".join(
            "" if math.isnan(x) else f"{x:.4f}" for x in cells) + " |")
  return lines


def plot(out_dir: str, finals: dict[str, list[dict]]) -> list[str]:
  """Writes KEY.png for each grid in `finals` (module docstring); returns the names."""
  written = []
  for key, grid in present(finals).items():
    _plot_grid(storage.join(out_dir, f"{key}.png"), grid, key, finals)
    written.append(f"{key}.png")
  return written


def _plot_grid(path: str, grid: Grid, key: str, finals: dict[str, list[dict]]) -> None:
  plt = figures.pyplot()
  variants = [v for v, runs in finals.items() if any(values(runs, key))]
  n = len(variants) + 1  # a heatmap each, then the row means
  ncols = min(3, n)
  nrows = -(-n // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.8 * nrows), squeeze=False,
                           layout="constrained")
  for ax in axes.flat[n:]:
    ax.axis("off")
  image = None
  for ax, variant in zip(axes.flat, variants):
    rows, columns, table = means(finals[variant], key)
    image = ax.imshow(table, vmin=grid.low, vmax=grid.high, cmap="viridis", aspect="auto",
                      origin="lower")
    ax.set_xticks(range(len(columns)), columns, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xlabel(grid.columns, fontsize=8)
    ax.set_ylabel(grid.rows, fontsize=8)
    ax.set_title(variant, fontsize=8)
    if max(table.shape) <= _ANNOTATED:
      middle = (grid.low + grid.high) / 2
      for (i, j), x in np.ndenumerate(table):
        if not math.isnan(x):
          ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=6,
                  color="black" if x > middle else "white")
  if image is not None:
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label=grid.title)
  ax = axes.flat[len(variants)]
  for variant in variants:
    per_run = [{r: np.mean(list(cs.values())) for r, cs in g.items()}
               for g in values(finals[variant], key)]
    rows = _order({r for g in per_run for r in g})
    x = [_number(r, i) for i, r in enumerate(rows)]
    cells = [[g[r] for g in per_run if r in g] for r in rows]
    line, = ax.plot(x, [np.mean(c) for c in cells], marker="o", markersize=3, label=variant)
    cis = [stats.summary(c).ci for c in cells]
    if all(cis):  # an interval of a bounded value, clipped to its range
      ax.fill_between(x, *np.clip(np.array(cis).T, grid.low, grid.high),
                      color=line.get_color(), alpha=0.15)
  margin = 0.02 * (grid.high - grid.low)
  ax.set_ylim(grid.low - margin, grid.high + margin)
  ax.set_xlabel(grid.rows, fontsize=8)
  ax.set_ylabel(grid.title, fontsize=8)
  ax.set_title(f"mean over the {grid.columns} (seeds: mean, {stats.CONFIDENCE:.0%} t "
               "interval)", fontsize=8)
  labels = _order({r for v in variants for g in values(finals[v], key) for r in g})
  ticks = [_number(r, i) for i, r in enumerate(labels)]
  if len(ticks) > 1 and min(ticks) > 0 and max(ticks) / min(ticks) >= 4:
    ax.set_xscale("log", base=2)  # lengths L, 2L, 4L, ...: evenly spaced
  ax.set_xticks(ticks, labels, fontsize=7)
  ax.minorticks_off()
  ax.legend(fontsize=6)
  figures.save(fig, path, dpi=120, bbox_inches="tight")
