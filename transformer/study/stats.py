"""Statistics of a metric over seeds: the summary of one variant's seeds (mean, sample
standard deviation, a confidence interval of the mean), paired differences between two
variants over the seeds they share, and success rates against a threshold.

The intervals are Student t intervals of the mean, mean ± t(1 − α/2, n − 1) · s / √n with
the sample standard deviation s (n − 1 in its denominator): exact for normally distributed
seed results, and the usual choice for the handful of seeds a sweep has (a bootstrap over 3
values cannot produce a useful interval). One value has no spread and no interval.
"""

import dataclasses
import math
import operator
import re
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

from transformer.core.errors import ConfigError

CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Summary:
  """A metric over the seeds of a variant: `values` in seed order, their mean, sample
  standard deviation (None for one value), the CONFIDENCE t interval of the mean (None for
  one value), minimum and maximum."""

  values: tuple[float, ...]
  mean: float
  std: float | None
  ci: tuple[float, float] | None
  min: float
  max: float

  @property
  def n(self) -> int:
    return len(self.values)


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


def summary(values: Sequence[float]) -> Summary:
  """The Summary of a non-empty sequence of values (a metric of each seed)."""
  if not values:
    raise ValueError("summary of no values")
  values = tuple(float(v) for v in values)
  return Summary(values, float(np.mean(values)),
                 float(np.std(values, ddof=1)) if len(values) > 1 else None,
                 t_interval(values), min(values), max(values))


@dataclasses.dataclass(frozen=True)
class Paired:
  """Differences variant − baseline of a metric over the seeds both have: `seeds` (sorted)
  and `differences` in that order, their mean and t interval (None for one shared seed)."""

  seeds: tuple
  differences: tuple[float, ...]
  mean: float
  ci: tuple[float, float] | None

  @property
  def excludes_zero(self) -> bool:
    """Whether the interval lies wholly above or below 0 (the difference is unlikely to be
    seed noise alone)."""
    return self.ci is not None and (self.ci[0] > 0 or self.ci[1] < 0)


def paired(baseline: Mapping, variant: Mapping) -> Paired | None:
  """The Paired differences of `variant` against `baseline`, both {seed: value}, over their
  shared seeds; None if they share none."""
  seeds = tuple(sorted(set(baseline) & set(variant)))
  if not seeds:
    return None
  differences = tuple(float(variant[s]) - float(baseline[s]) for s in seeds)
  return Paired(seeds, differences, float(np.mean(differences)), t_interval(differences))


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


def success_rate(values: Sequence[float], threshold: Threshold) -> tuple[int, int]:
  """(how many of the values meet the threshold, how many values)."""
  return sum(threshold.met(v) for v in values), len(values)
