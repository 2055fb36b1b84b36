"""Statistics over seeds (transformer/stats.py) against direct computation."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from transformer import stats
from transformer.errors import ConfigError


def test_summary_is_the_t_interval_of_the_mean():
  s = stats.summary([1.0, 2.0, 3.0])  # by hand: s = 1, t(0.975, 2) = 4.302653 (tables)
  assert (s.n, s.mean, s.std, s.min, s.max) == (3, 2.0, 1.0, 1.0, 3.0)
  np.testing.assert_allclose(s.ci, (2 - 4.302653 / math.sqrt(3), 2 + 4.302653 / math.sqrt(3)),
                             rtol=1e-6)
  values = [0.61, 0.55, 0.70, 0.64, 0.58]
  s = stats.summary(values)
  assert s.values == tuple(values)
  np.testing.assert_allclose(s.std, np.std(values, ddof=1))
  np.testing.assert_allclose(s.ci, scipy_stats.t.interval(
      0.95, len(values) - 1, loc=np.mean(values), scale=scipy_stats.sem(values)))


def test_one_seed_has_no_spread():
  s = stats.summary([0.9])
  assert (s.n, s.mean, s.std, s.ci, s.max) == (1, 0.9, None, None, 0.9)


def test_paired_differences_over_shared_seeds_only():
  baseline = {0: 0.50, 1: 0.60, 2: 0.55, 3: 0.40}
  variant = {2: 0.80, 0: 0.70, 1: 0.75, 7: 0.99}  # seeds 3 and 7 have no partner
  pair = stats.paired(baseline, variant)
  assert pair.seeds == (0, 1, 2)
  np.testing.assert_allclose(pair.differences, [0.20, 0.15, 0.25])
  np.testing.assert_allclose(pair.mean, 0.20)
  expected = scipy_stats.t.interval(0.95, 2, loc=0.2, scale=scipy_stats.sem([0.2, 0.15, 0.25]))
  np.testing.assert_allclose(pair.ci, expected)
  assert pair.excludes_zero and expected[0] > 0
  # The same check as scipy's paired t test at 5%.
  assert scipy_stats.ttest_rel([0.7, 0.75, 0.8], [0.5, 0.6, 0.55]).pvalue < 0.05
  noisy = stats.paired({0: 0.5, 1: 0.6, 2: 0.55}, {0: 0.6, 1: 0.5, 2: 0.58})
  assert noisy.ci[0] < 0 < noisy.ci[1] and not noisy.excludes_zero
  single = stats.paired({0: 0.5, 1: 0.6}, {1: 0.9})
  assert single.seeds == (1,) and single.ci is None and not single.excludes_zero
  assert stats.paired({0: 0.5}, {1: 0.9}) is None


def test_success_thresholds():
  t = stats.parse_threshold("valid/exact_match>=0.9")
  assert (t.metric, t.op, t.value) == ("valid/exact_match", ">=", 0.9)
  assert stats.success_rate([0.9, 0.95, 0.5], t) == (2, 3)
  assert stats.success_rate([40.0, 70.0], stats.parse_threshold("len64/perplexity < 50")) == (
      1, 2)
  for bad in ("valid/exact_match=0.9", "valid/exact_match>=high", ">=0.9", "x>=nan"):
    with pytest.raises(ConfigError, match="expected METRIC>=VALUE"):
      stats.parse_threshold(bad)
