"""Statistics of a metric over seeds: the summary of one variant's seeds (mean, sample
standard deviation, a confidence interval of the mean), paired differences between two
variants over the seeds they share, and success rates against a threshold with their
interval. (Paired tests over the examples of a shared test set: study/bootstrap.py.)

The intervals of a mean are Student t intervals, mean ± t(1 − α/2, n − 1) · s / √n with
the sample standard deviation s (n − 1 in its denominator): exact for normally distributed
seed results, and the usual choice for the handful of seeds a sweep has. One value has no
spread and no interval; values identical in every seed (up to float rounding) have none
either: a zero-width interval would claim a certainty that n seeds cannot give.

A metric's declared range (core/metrics.py Metric) bounds its intervals: a t interval is
clipped to [low, high] (a difference's to [low − high, high − low]) and says so. Clipping,
not a bootstrap over seeds: the true mean lies in the range, so clipping never lowers the
t interval's coverage, while a bootstrap over 3 to 5 seeds has 10 to 126 distinct
resamples and covers too little.

Success rates k/n carry the Clopper–Pearson interval (the exact binomial one): it never
covers less than its confidence, which matters at the few seeds of a sweep, where Wilson's
may (3/3: Clopper–Pearson [0.29, 1], Wilson [0.44, 1]).
"""

import dataclasses
import math
import operator
import re
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from transformer.core.errors import ConfigError
from transformer.core.metrics import Metric

CONFIDENCE = 0.95
UNBOUNDED = Metric()  # a metric that declares no range


def identical(values: Sequence[float]) -> bool:
  """Whether the values are equal up to float rounding (e.g. 0.7 − 0.5 and 0.75 − 0.55)."""
  return len(values) > 0 and float(np.ptp(values)) <= 1e-12 * max(1.0, *map(abs, values))


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE
               ) -> tuple[float, float] | None:
  """The Student t interval of the mean of `values` (module docstring); None for fewer than
  two values."""
  n = len(values)
  if n < 2:
    return None
  mean, std = float(np.mean(values)), float(np.std(values, ddof=1))
  half = float(scipy_stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
  return mean - half, mean + half


def clip(interval: tuple[float, float] | None, low: float, high: float
         ) -> tuple[tuple[float, float] | None, bool]:
  """(the interval within [low, high], whether that moved an end)."""
  if interval is None:
    return None, False
  inside = (max(interval[0], low), min(interval[1], high))
  return inside, inside != tuple(interval)


@dataclasses.dataclass(frozen=True)
class Summary:
  """A metric over the seeds of a variant: `values` in seed order, their mean, sample
  standard deviation (None for one value), the CONFIDENCE t interval of the mean within the
  metric's range (None for one value, or values identical in every seed), whether the range
  clipped it, minimum and maximum."""

  values: tuple[float, ...]
  mean: float
  std: float | None
  ci: tuple[float, float] | None
  min: float
  max: float
  clipped: bool = False

  @property
  def n(self) -> int:
    return len(self.values)

  @property
  def identical(self) -> bool:
    """Several seeds, every one with the same value: no interval (module docstring)."""
    return self.n > 1 and identical(self.values)


def summary(values: Sequence[float], metric: Metric = UNBOUNDED) -> Summary:
  """The Summary of a non-empty sequence of values (a metric of each seed) of `metric`."""
  if not values:
    raise ValueError("summary of no values")
  values = tuple(float(v) for v in values)
  interval = None if identical(values) else t_interval(values)
  ci, clipped = clip(interval, metric.low, metric.high)
  return Summary(values, float(np.mean(values)),
                 float(np.std(values, ddof=1)) if len(values) > 1 else None,
                 ci, min(values), max(values), clipped)


@dataclasses.dataclass(frozen=True)
class Paired:
  """Differences variant − baseline of a metric over the seeds both have: `seeds` (sorted)
  and `differences` in that order, their mean and t interval within the differences' range
  (None for one shared seed, or a difference identical in every seed), whether the range
  clipped it."""

  seeds: tuple
  differences: tuple[float, ...]
  mean: float
  ci: tuple[float, float] | None
  clipped: bool = False

  @property
  def identical(self) -> bool:
    """Several shared seeds, the same difference in each: no interval, and no claim that
    the difference excludes 0 (a zero-width interval would make one)."""
    return len(self.seeds) > 1 and identical(self.differences)

  @property
  def excludes_zero(self) -> bool:
    """Whether the interval lies wholly above or below 0 (the difference is unlikely to be
    seed noise alone)."""
    return self.ci is not None and (self.ci[0] > 0 or self.ci[1] < 0)


def paired(baseline: Mapping, variant: Mapping, metric: Metric = UNBOUNDED) -> Paired | None:
  """The Paired differences of `variant` against `baseline`, both {seed: value} of
  `metric`, over their shared seeds; None if they share none."""
  seeds = tuple(sorted(set(baseline) & set(variant)))
  if not seeds:
    return None
  differences = tuple(float(variant[s]) - float(baseline[s]) for s in seeds)
  interval = None if identical(differences) else t_interval(differences)
  width = metric.high - metric.low
  ci, clipped = clip(interval, -width, width)
  return Paired(seeds, differences, float(np.mean(differences)), ci, clipped)


_COMPARISONS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclasses.dataclass(frozen=True)
class Threshold:
  """A run succeeds when its `metric` compares (`op`: >=, <=, > or <) with `value`."""

  metric: str
  op: str
  value: float

  def __str__(self) -> str:
    return f"{self.metric}{self.op}{self.value:g}"

  def met(self, x: float) -> bool:
    return bool(_COMPARISONS[self.op](x, self.value))


def parse_threshold(text: str) -> Threshold:
  """A Threshold from `METRIC>=VALUE` (or <=, >, <), e.g. `valid/exact_match>=0.9`; a
  ConfigError naming the text otherwise."""
  match = re.fullmatch(r"\s*([^<>=\s]+)\s*(>=|<=|>|<)\s*(\S+)\s*", text)
  try:
    value = float(match[3]) if match else math.nan
  except ValueError:
    value = math.nan
  if not match or not math.isfinite(value):
    raise ConfigError(f"--success {text!r}: expected METRIC>=VALUE (or <=, >, <) with a "
                      "number, e.g. --success 'valid/exact_match>=0.9'")
  return Threshold(match[1], match[2], value)


@dataclasses.dataclass(frozen=True)
class Rate:
  """`k` successes of `n` runs and the CONFIDENCE Clopper–Pearson interval of the rate
  (None for no runs)."""

  k: int
  n: int
  ci: tuple[float, float] | None

  @property
  def rate(self) -> float | None:
    return self.k / self.n if self.n else None


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
  """The exact binomial interval of a rate of k successes in n trials: the α/2 quantile of
  Beta(k, n − k + 1) and the 1 − α/2 quantile of Beta(k + 1, n − k) (0 and 1 at k = 0 and
  k = n)."""
  alpha = 1 - confidence
  low = float(scipy_stats.beta.ppf(alpha / 2, k, n - k + 1)) if k > 0 else 0.0
  high = float(scipy_stats.beta.ppf(1 - alpha / 2, k + 1, n - k)) if k < n else 1.0
  return low, high


def success_rate(values: Sequence[float], threshold: Threshold, failed: int = 0) -> Rate:
  """The Rate of the values that meet the threshold among the values and `failed` runs
  (a failed run, e.g. diverged, meets no threshold)."""
  k, n = sum(threshold.met(v) for v in values), len(values) + failed
  return Rate(k, n, clopper_pearson(k, n) if n else None)
