"""A paired test over seeds and examples together: the two-stage bootstrap of the difference
variant − baseline of a metric computed from per-example results (core/metrics.py Metric's
parts), where both variants scored the same examples in each seed they share (the final
evaluation's per-example record, run/evaluator.py, names its examples by a digest).

Each resample draws the shared seeds with replacement, then the examples with replacement:
one draw for every seed when all the seeds scored the same test set (the examples are
crossed with the seeds: a text source's fixed test set), a draw per drawn seed otherwise
(each seed's own examples: a generated task draws its splits from the seed); a metric with
a stratum (e.g. input length) draws within each stratum, which keeps the split's design.
Both variants get the same draws (paired). The statistic is the mean over the drawn seeds
of the metric's difference, computed from the drawn examples' parts as the evaluation
computes it; the interval is the percentile one. Resampling both stages counts the
example noise within each seed again on top of the seeds' spread: slightly conservative.
With few seeds the seed stage is coarse (3 seeds: 10 distinct draws) and, unlike the t
interval, has no small-sample correction: it adds the test set's evidence, and the t
interval over seeds stays the test of seed-to-seed variation.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

from transformer.core.metrics import Metric
from transformer.run.evaluator import PER_EXAMPLE
from transformer.study.stats import CONFIDENCE, identical

RESAMPLES = 1000
SEED = 0  # of the resampling: a report is reproducible
_CELLS = 4_000_000  # resamples × examples drawn at once (memory)


@dataclasses.dataclass(frozen=True)
class Parts:
  """One run's per-example results for one metric, rows ordered by stratum: `columns`
  [n, 2] (numerator, denominator), the start of each stratum's rows, and the examples'
  digest."""

  columns: np.ndarray
  starts: np.ndarray
  digest: str

  @property
  def size(self) -> int:
    return len(self.columns)

  def value(self, metric: Metric, rows: np.ndarray | None = None) -> np.ndarray:
    """The metric of the examples `rows` [B, n] (indices, each a resample; None: every
    example once, B = 1): [B]."""
    drawn = self.columns[None] if rows is None else self.columns[rows]  # [B, n, 2]
    sums = np.add.reduceat(drawn, self.starts, axis=1)  # [B, strata, 2]
    with np.errstate(invalid="ignore", divide="ignore"):
      ratio = np.mean(sums[..., 0] / sums[..., 1], axis=1)
    return metric.of_mean(ratio) if metric.of_mean else ratio


def parts(record: dict, metric: Metric) -> Parts | None:
  """The Parts of `metric` in a split's record, or None if the record has no per-example
  results for it (a metric that is no function of them, an evaluation that kept none)."""
  examples = record.get(PER_EXAMPLE)
  if metric.parts is None or not isinstance(examples, dict) or not examples.get("digest"):
    return None
  numerator, denominator = metric.parts
  wanted = [numerator] + [k for k in (denominator, metric.stratum) if k]
  if any(k not in examples for k in wanted) or len({len(examples[k]) for k in wanted}) > 1:
    return None
  num = np.asarray(examples[numerator], np.float64)
  den = (np.ones_like(num) if denominator is None
         else np.asarray(examples[denominator], np.float64))
  stratum = (np.zeros(len(num), np.int64) if metric.stratum is None
             else np.asarray(examples[metric.stratum]))
  if not len(num):
    return None
  order = np.argsort(stratum, kind="stable")
  starts = np.flatnonzero(np.r_[True, stratum[order][1:] != stratum[order][:-1]])
  return Parts(np.stack([num, den], axis=1)[order], starts, str(examples["digest"]))


@dataclasses.dataclass(frozen=True)
class Bootstrap:
  """The paired bootstrap of a difference: its seeds, whether every seed scored the same
  examples (`shared`), how many per seed (`examples`: a range when they differ), the
  difference computed from the parts, the CONFIDENCE percentile interval (None when every
  resample gives the same difference) and the resamples."""

  seeds: tuple
  shared: bool
  examples: tuple[int, int]
  mean: float
  ci: tuple[float, float] | None
  resamples: int

  @property
  def excludes_zero(self) -> bool:
    return self.ci is not None and (self.ci[0] > 0 or self.ci[1] < 0)


def _draw(rng: np.random.Generator, parts: Parts, draws: int) -> np.ndarray:
  """[draws, n] indices of examples drawn with replacement within each stratum (its rows
  starts[i]..starts[i + 1]), as many as it has."""
  sizes = np.diff(np.r_[parts.starts, parts.size])
  first, width = (np.repeat(x, sizes).astype(np.int32) for x in (parts.starts, sizes))
  return first + rng.integers(0, width, size=(draws, parts.size), dtype=np.int32)


def replicates(baseline: Mapping, variant: Mapping, metric: Metric,
               resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
  """[resamples] bootstrap differences variant − baseline (module docstring) of `metric`
  over the shared seeds of baseline and variant, {seed: Parts} each; every shared seed's
  two Parts must hold the same examples (check)."""
  seeds = sorted(set(baseline) & set(variant))
  shared = len({baseline[s].digest for s in seeds}) == 1
  rng = np.random.default_rng(seed)
  drawn = rng.integers(0, len(seeds), size=(resamples, len(seeds)))  # [B, k] seed indices
  out = np.empty(drawn.shape)
  chunk = max(1, _CELLS // max(baseline[s].size for s in seeds))
  for start in range(0, resamples, chunk):
    rows = slice(start, min(start + chunk, resamples))
    if shared:  # one draw of the examples for every seed
      examples = _draw(rng, baseline[seeds[0]], rows.stop - rows.start)
      diff = np.stack([variant[s].value(metric, examples) - baseline[s].value(metric, examples)
                       for s in seeds], axis=1)  # [b, k]
      out[rows] = np.take_along_axis(diff, drawn[rows], axis=1)
      continue
    for i, s in enumerate(seeds):  # a draw per drawn seed
      where = np.nonzero(drawn[rows] == i)
      if len(where[0]):
        examples = _draw(rng, baseline[s], len(where[0]))
        out[rows][where] = (variant[s].value(metric, examples)
                            - baseline[s].value(metric, examples))
  return out.mean(axis=1)


def check(baseline: Mapping, variant: Mapping) -> str | None:
  """Why baseline and variant ({seed: Parts | None}) cannot be paired over examples, or
  None if they can."""
  seeds = sorted(set(baseline) & set(variant))
  if not seeds:
    return "no shared seed"
  if any(baseline[s] is None or variant[s] is None for s in seeds):
    return "no per-example results"
  if any(baseline[s].digest != variant[s].digest or baseline[s].size != variant[s].size
         or not np.array_equal(baseline[s].starts, variant[s].starts) for s in seeds):
    return "not the same test examples"
  return None


def paired_bootstrap(baseline: Mapping, variant: Mapping, metric: Metric,
                     resamples: int = RESAMPLES, seed: int = SEED) -> Bootstrap:
  """The Bootstrap of variant − baseline, {seed: Parts} each, that check() accepts."""
  seeds = tuple(sorted(set(baseline) & set(variant)))
  differences = replicates(baseline, variant, metric, resamples, seed)
  alpha = 1 - CONFIDENCE
  ci = (None if identical(differences) else
        tuple(float(q) for q in np.quantile(differences, [alpha / 2, 1 - alpha / 2])))
  sizes = [baseline[s].size for s in seeds]
  mean = float(np.mean([variant[s].value(metric)[0] - baseline[s].value(metric)[0]
                        for s in seeds]))
  return Bootstrap(seeds, len({baseline[s].digest for s in seeds}) == 1,
                   (min(sizes), max(sizes)), mean, ci, resamples)
