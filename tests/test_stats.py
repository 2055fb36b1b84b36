"""Statistics over seeds (transformer/study/stats.py) against direct computation; the report's
tables of them over run directories written as training writes them (compare.py, no
training); paired bootstrap resampling of translation hypotheses (sacreBLEU)."""

import csv
import dataclasses
import io
import itertools
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu
from scipy import stats as scipy_stats

from tests.support import chomsky_tiny_config, fake_run, write_evaluation
from transformer.core.errors import ConfigError
from transformer.run import experiment
from transformer.run.config import parse
from transformer.core import metrics as metrics_lib
from transformer.core.metrics import METRICS
from transformer.run.eval_files import text_paths
from transformer.run.evaluator import PER_EXAMPLE, Evaluator, scored_row_sums
from transformer.run.state import record_failure
from transformer.study import bootstrap, compare, report_plots, stats
from transformer.study.results import Entry, Results


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
  rate = stats.success_rate([0.9, 0.95, 0.5], t)
  assert (rate.k, rate.n) == (2, 3)
  rate = stats.success_rate([40.0, 70.0], stats.parse_threshold("len64/perplexity < 50"))
  assert (rate.k, rate.n) == (1, 2)
  for bad in ("valid/exact_match=0.9", "valid/exact_match>=high", ">=0.9", "x>=nan"):
    with pytest.raises(ConfigError, match="expected METRIC>=VALUE"):
      stats.parse_threshold(bad)


EXACT = {"sinusoidal": [0.50, 0.60, 0.55], "rotary": [0.70, 0.75, 0.80], "alibi": [0.90]}


@pytest.fixture
def runs(tmp_path):
  """Three variants (model.position) of fake runs: 3, 3 and 1 seed(s); paths in that order."""
  return [fake_run(tmp_path / f"{position}-{seed}", exact, seed, **{"model.position": position})
          for position, values in EXACT.items() for seed, exact in enumerate(values)]


def _rows(markdown: str, title: str) -> dict[str, list[str]]:
  """{first cell: the other cells} of the markdown table after the line `title`."""
  lines = markdown.split(title + "\n", 1)[1].splitlines()
  table = [line for line in lines[next(i for i, x in enumerate(lines) if x.startswith("|")):]]
  table = table[:next((i for i, x in enumerate(table) if not x.startswith("|")), len(table))]
  cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in table[2:]]
  return {row[0]: row[1:] for row in cells}


def test_comparison_reports_statistics_against_direct_computation(runs, tmp_path):
  out = tmp_path / "out"
  md = compare.compare(runs, str(out), thresholds=[stats.parse_threshold(
      "valid/exact_match>=0.6")])
  assert md.startswith("# Comparison of 7 runs\n") and (out / "report.md").read_text() == md
  assert "- variants differ in: model.position\n" in md and "- training steps: 40\n" in md
  assert "Student t" in md and "variant − model.position=sinusoidal (the baseline)" in md
  rotary, sinusoidal = EXACT["rotary"], EXACT["sinusoidal"]
  lo, hi = scipy_stats.t.interval(0.95, 2, loc=np.mean(rotary), scale=scipy_stats.sem(rotary))
  table = _rows(md, "")
  assert table["model.position=rotary"][:4] == ["3", "0", "0", f"{np.mean(rotary):.4f} "
                                                 f"[{lo:.4f}, {hi:.4f}]"]
  alibi = table["model.position=alibi"]
  assert alibi[:4] == ["1", "0", "0", "0.9000"]  # one seed: the mean alone, no interval
  assert "[" not in " ".join(alibi) and "±" not in " ".join(alibi)

  spread = _rows(md, "## valid/exact_match over seeds")
  assert spread["model.position=rotary"] == [
      "3", "0", f"{np.mean(rotary):.4f}", f"{np.std(rotary, ddof=1):.4f}",
      f"[{lo:.4f}, {hi:.4f}]", "0.7000", "0.8000", "3/3 [0.29, 1.00]",
      "0: 0.7000, 1: 0.7500, 2: 0.8000"]
  assert spread["model.position=sinusoidal"][7] == "1/3 [0.01, 0.91]"  # 0.5, 0.6, 0.55 ≥ 0.6
  assert spread["model.position=alibi"][1:8] == ["0", "0.9000", "", "", "0.9000", "0.9000",
                                                 "1/1 [0.03, 1.00]"]

  paired = _rows(md, "## Paired differences against model.position=sinusoidal "
                     "(valid/exact_match)")
  differences = np.subtract(rotary, sinusoidal)
  d_lo, d_hi = scipy_stats.t.interval(0.95, 2, loc=differences.mean(),
                                      scale=scipy_stats.sem(differences))
  # fake runs record no per-example results: no bootstrap, and the report says why
  assert paired["model.position=rotary"] == [
      "3", f"{differences.mean():+.4f}", f"[{d_lo:.4f}, {d_hi:.4f}]", "*",
      "no per-example results", "", ""]
  assert paired["model.position=alibi"][:4] == [  # seed 0 alone: no interval, and why
      "1", "+0.4000", "none: one seed cannot show a difference between variants", ""]
  assert "model.position=sinusoidal" not in paired

  with open(out / "report.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  row = rows["model.position=rotary"]
  for column, expected in [("mean", np.mean(rotary)), ("std", np.std(rotary, ddof=1)),
                           ("ci_low", lo), ("ci_high", hi), ("min", 0.7), ("max", 0.8),
                           ("n", 3), ("diff mean", differences.mean()), ("diff ci_low", d_lo),
                           ("diff ci_high", d_hi), ("diff n", 3)]:
    np.testing.assert_allclose(float(row[f"valid/exact_match {column}"]), expected)
  assert json.loads(row["valid/exact_match values"]) == {"0": 0.7, "1": 0.75, "2": 0.8}
  assert row["baseline"] == "model.position=sinusoidal" and row["seed ids"] == "0 1 2"
  assert float(row["success valid/exact_match>=0.6"]) == 1.0
  assert [row[f"success valid/exact_match>=0.6 {c}"] for c in ("k", "n")] == ["3", "3"]
  np.testing.assert_allclose([float(row[f"success valid/exact_match>=0.6 ci_{end}"])
                              for end in ("low", "high")], [0.2924018, 1.0], rtol=1e-6)
  one = rows["model.position=alibi"]
  assert [one[f"valid/exact_match {c}"] for c in ("mean", "std", "ci_low", "ci_high", "n")] == [
      "0.9", "", "", "", "1"]
  assert rows["model.position=sinusoidal"]["valid/exact_match diff mean"] == ""  # the baseline
  header = next(csv.reader(io.StringIO((out / "report.csv").read_text())))
  assert header[5] == "valid/exact_match mean"  # the main metric first
  for picture in ("curves.png", "final.png", "extrapolation.png"):
    assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variants_baseline_and_ignored_fields(runs, tmp_path):
  md = compare.compare(runs, baseline="model.position=rotary")
  paired = _rows(md, "## Paired differences against model.position=rotary (valid/exact_match)")
  assert set(paired) == {"model.position=sinusoidal", "model.position=alibi"}
  assert paired["model.position=alibi"][:2] == ["1", "+0.2000"]
  # A learning rate is not an identity field of a run, but it makes another variant.
  other = fake_run(tmp_path / "lr", 0.3, 0, **{"model.position": "rotary",
                                              "train.learning_rate": 0.25})
  md = compare.compare(runs[3:6] + [other])
  assert "- variants differ in: train.learning_rate\n" in md
  assert set(_rows(md, "")) == {"train.learning_rate=0.5", "train.learning_rate=0.25"}
  md = compare.compare(runs[3:6] + [fake_run(tmp_path / "batch", 0.3, 3, **{
      "model.position": "rotary", "eval.batch_size": 16})], ignore=["eval.batch_size"])
  assert "- one variant: the runs differ only in their seed\n" in md
  assert _rows(md, "")["all runs"][0] == "4"


def test_a_field_baseline_pairs_each_variant_with_its_twin_and_grids_the_main_metric(tmp_path):
  # position × norm, 3 seeds each
  exact = {("rotary", "post"): [0.5, 0.6, 0.7], ("rotary", "pre"): [0.55, 0.75, 0.95],
           ("alibi", "post"): [0.4, 0.5, 0.45], ("alibi", "pre"): [0.42, 0.52, 0.47]}
  paths = [fake_run(tmp_path / f"{p}-{n}-{seed}", value, seed,
                    **{"model.position": p, "model.norm": n})
           for (p, n), values in exact.items() for seed, value in enumerate(values)]
  out = tmp_path / "out"
  md = compare.compare(paths, str(out), baseline="model.norm=post")
  assert "variant − the same variant with model.norm=post per shared seed" in md
  paired = _rows(md, "## Paired differences against the same variant with model.norm=post "
                     "(valid/exact_match)")
  assert len(paired) == 2 and all("model.norm=pre" in v for v in paired)
  for position in ("rotary", "alibi"):
    d = np.subtract(exact[(position, "pre")], exact[(position, "post")])
    row = next(cells for v, cells in paired.items() if f"model.position={position}" in v)
    assert row[:2] == ["3", f"{d.mean():+.4f}"]
    if position == "rotary":
      lo, hi = scipy_stats.t.interval(0.95, 2, loc=d.mean(), scale=scipy_stats.sem(d))
      assert row[2:4] == [f"[{lo:.4f}, {hi:.4f}]", ""]
    else:  # +0.02 in each seed (up to float rounding): no zero-width interval, no star
      assert 0 < d.std() < 1e-15 and row[2:4] == ["identical in every seed", ""]
  with open(out / "report.csv") as f:
    rows = {r["variant"]: r for r in csv.DictReader(f)}
  for variant, row in rows.items():
    twin = variant.replace("model.norm=pre", "model.norm=post")
    assert row["baseline"] == twin
    assert (row["valid/exact_match diff n"] == "") == (twin == variant)
  grid = _rows(md, "## valid/exact_match by model.position: mean [95% CI]")
  for position in ("rotary", "alibi"):
    for cell, norm in zip(grid[position], ("post", "pre")):
      values = exact[(position, norm)]
      lo, hi = scipy_stats.t.interval(0.95, 2, loc=np.mean(values),
                                      scale=scipy_stats.sem(values))
      clipped = "‡" if hi > 1 else ""  # exact match is a fraction: [0.25, 1.25] stops at 1
      assert cell == f"{np.mean(values):.4f} [{lo:.4f}, {min(hi, 1):.4f}]{clipped}"
  assert grid["rotary"][1] == "0.7500 [0.2532, 1.0000]‡"
  with pytest.raises(ConfigError, match="--baseline model.norm=mid: no such variant"):
    compare.compare(paths, baseline="model.norm=mid")


def test_runs_that_cannot_be_compared_are_refused(runs, tmp_path):
  unfinished = fake_run(tmp_path / "unfinished", 0.5, 5, final=False)
  with pytest.raises(ConfigError, match="unfinished has no results: its metrics.jsonl has no "
                                        r"final evaluation \(step 40\)"):
    compare.compare(runs + [unfinished])
  with pytest.raises(ConfigError, match="sinusoidal-0 and .*copy-0 are the same run"):
    compare.compare([runs[0], fake_run(tmp_path / "copy-0", 0.5, 0)])
  reverse = fake_run(tmp_path / "reverse", 0.5, 0, **{"task.name": "reverse_string"})
  with pytest.raises(ConfigError, match=r"different tasks \(copy and reverse_string\)"):
    compare.compare([runs[0], reverse])
  with pytest.raises(ConfigError, match="--baseline rope: no such variant, nor a FIELD=VALUE "
                                        "of one; the variants are: model.position=sinusoidal, "
                                        "model.position=rotary"):
    compare.compare(runs, baseline="rope")
  sweep_report = tmp_path / "sweep"
  sweep_report.mkdir()
  (sweep_report / "report.md").write_text("# Sweep configs/positions.py\n")
  with pytest.raises(ConfigError, match="holds another report"):
    compare.compare(runs, str(sweep_report))
  assert os.listdir(sweep_report) == ["report.md"]


REFERENCES = ["the cat sat on the mat", "a dog runs in the park", "hello world",
              "good morning to all of you", "it is raining again today"] * 8


def test_paired_bootstrap_of_two_translation_runs(tmp_path):
  worse = [r.replace("the", "a").replace("o", "0") for r in REFERENCES[:20]] + REFERENCES[20:]
  better = [r.replace("again", "") for r in REFERENCES]
  a = write_evaluation(tmp_path / "a.json", worse, REFERENCES)
  b = write_evaluation(tmp_path / "b.json", better, REFERENCES)
  text = compare.paired_bootstrap([a, b])
  row = _rows(text, "## valid (40 sentences, the same references in every file)")
  expected = sacrebleu.significance.PairedTest(
      [("a", worse), ("b", better)], {"BLEU": sacrebleu.BLEU(), "chrF": sacrebleu.CHRF()},
      [REFERENCES], test_type="bs", n_samples=1000)()[1]
  bleu_a, bleu_b = (sacrebleu.BLEU().corpus_score(h, [REFERENCES]).score for h in (worse, better))
  assert row[a][0] == f"{bleu_a:.2f}" and row[b][0] == f"{bleu_b:.2f}"
  assert row[b][2] == f"{bleu_b - bleu_a:+.2f}" + (" *" if expected["BLEU"][1].p_value < 0.05
                                                    else "")
  assert row[b][3] == f"{expected['BLEU'][1].p_value:.4f}"
  assert row[b][1] == f"{expected['BLEU'][1].mean:.2f} ± {expected['BLEU'][1].ci:.2f}"
  assert row[b][6] == f"{expected['chrF2'][1].score - expected['chrF2'][0].score:+.2f}" + (
      " *" if expected["chrF2"][1].p_value < 0.05 else "")
  assert "BLEU signature: nrefs:1|bs:1000|seed:12345" in text

  shifted = write_evaluation(tmp_path / "c.json", better, REFERENCES[1:] + REFERENCES[:1])
  with pytest.raises(ConfigError, match="scored different valid sets"):
    compare.paired_bootstrap([a, shifted])
  os.remove(text_paths(b, "valid")[1])  # written before eval.py saved references
  with pytest.raises(ConfigError, match="references .* are missing"):
    compare.paired_bootstrap([a, b])


# ----------------------------------------------------------------- statistics without blind spots


def test_a_repeated_seed_is_refused_in_sweeps_and_comparisons_alike(runs, tmp_path):
  """Results.of (every report: a sweep's and compare's) refuses two runs of one variant with
  one seed; before, it kept one of them and the table said "seeds 3" over 2 values."""
  final = {"valid": {"exact_match": 0.5}}
  entries = [Entry(f"run{i}", "model.position=rotary", seed, f"w{i}", 40, "finished",
                   final=final) for i, seed in enumerate((0, 1, 1))]
  with pytest.raises(ConfigError, match=r"run1 and run2 are the same run \(the same config "
                                        r"and seed 1\) of variant model.position=rotary"):
    Results.of(entries, None)
  with pytest.raises(ConfigError, match=r"sinusoidal-0 and .*copy-0 are the same run \("):
    compare.compare([runs[0], fake_run(tmp_path / "copy-0", 0.5, 0)])
  assert Results.of(entries[:2], None).summary("model.position=rotary", "valid/exact_match").n == 2


def test_a_difference_with_no_variance_is_identical_in_every_seed_never_starred(tmp_path):
  base, plus, ones = [0.50, 0.60, 0.55], [0.51, 0.61, 0.56], [1.0, 1.0, 1.0]
  pair = stats.paired(dict(enumerate(base)), dict(enumerate(plus)), METRICS["exact_match"])
  assert pair.identical and pair.ci is None and not pair.excludes_zero
  np.testing.assert_allclose(pair.mean, 0.01)
  same = stats.summary(ones, METRICS["exact_match"])
  assert same.identical and same.ci is None and same.std == 0.0
  assert not stats.summary([1.0]).identical  # one seed: no spread, nothing to call identical
  paths = [fake_run(tmp_path / f"{p}-{seed}", value, seed, **{"model.position": p})
           for p, values in (("sinusoidal", base), ("rotary", plus), ("alibi", ones))
           for seed, value in enumerate(values)]
  md = compare.compare(paths)
  paired = _rows(md, "## Paired differences against model.position=sinusoidal "
                     "(valid/exact_match)")
  assert paired["model.position=rotary"][:4] == ["3", "+0.0100", "identical in every seed", ""]
  assert _rows(md, "")["model.position=alibi"][3] == "1.0000 (identical in every seed)"
  assert _rows(md, "## valid/exact_match over seeds")["model.position=alibi"][4] == (
      "identical in every seed")


@pytest.mark.parametrize("k,n", [(3, 3), (2, 3), (0, 3), (7, 10), (0, 1)])
def test_success_rates_carry_the_clopper_pearson_interval(k, n):
  threshold = stats.parse_threshold("valid/exact_match>=0.5")
  rate = stats.success_rate([1.0] * k + [0.0] * (n - k), threshold)
  expected = scipy_stats.binomtest(k, n).proportion_ci(0.95, method="exact")
  assert (rate.k, rate.n) == (k, n)
  np.testing.assert_allclose(rate.ci, (expected.low, expected.high), rtol=1e-9, atol=1e-12)
  if (k, n) == (3, 3):  # all three seeds succeed: the rate may still be as low as 0.29
    assert rate.ci[0] == pytest.approx(0.2924018) and rate.ci[1] == 1.0
  failing = stats.success_rate([1.0] * k, threshold, failed=n - k)  # failed runs meet none
  assert (failing.k, failing.n, failing.ci) == (k, n, rate.ci)


def test_intervals_of_a_bounded_metric_stay_in_its_range(tmp_path):
  values = [0.99, 1.0, 0.97]  # a mean near 1: the t interval reaches past it
  lo, hi = scipy_stats.t.interval(0.95, 2, loc=np.mean(values), scale=scipy_stats.sem(values))
  assert hi > 1
  s = stats.summary(values, METRICS["accuracy"])
  assert s.clipped and s.ci == (pytest.approx(lo), 1.0)
  assert stats.summary(values).ci == (pytest.approx(lo), pytest.approx(hi))  # no range declared
  loss = stats.summary([0.01, 0.02, 0.4], METRICS["loss"])  # loss ≥ 0
  assert loss.clipped and loss.ci[0] == 0.0
  d = [1.0, 1.0, 0.1]  # a difference of fractions stays inside [−1, 1]
  d_lo, d_hi = scipy_stats.t.interval(0.95, 2, loc=np.mean(d), scale=scipy_stats.sem(d))
  pair = stats.paired({0: 0.0, 1: 0.0, 2: 0.1}, {0: 1.0, 1: 1.0, 2: 0.2},
                      METRICS["exact_match"])
  assert d_hi > 1 and pair.clipped and pair.ci == (pytest.approx(d_lo), 1.0)
  md = compare.compare([fake_run(tmp_path / f"r-{seed}", v, seed)
                        for seed, v in enumerate(values)])
  assert _rows(md, "")["all runs"][3] == f"{np.mean(values):.4f} [{lo:.4f}, 1.0000]‡"
  assert "clipped to it and marked ‡" in md


def _parts(metric, digest="test set", **columns):
  """bootstrap.Parts of `metric` from per-example columns, as a final evaluation records
  them."""
  return bootstrap.parts({PER_EXAMPLE: {"digest": digest, **{
      k: np.asarray(v).tolist() for k, v in columns.items()}}}, metric)


def test_the_bootstrap_over_examples_has_the_plug_in_variance():
  """One seed: the bootstrap distribution of a mean of n paired differences d has the
  plug-in variance σ̂²/n exactly (σ̂ with n in its denominator), and for n this large its
  percentile interval is the normal one."""
  rng = np.random.default_rng(1)
  n, metric = 400, METRICS["exact_match"]
  a = rng.random(n) < 0.6
  b = np.where(rng.random(n) < 0.8, a, ~a) | (rng.random(n) < 0.1)
  base, variant = {0: _parts(metric, exact=a.astype(int))}, {0: _parts(metric, exact=b.astype(int))}
  d = b.astype(float) - a
  sd = d.std() / np.sqrt(n)
  draws = bootstrap.replicates(base, variant, metric, resamples=4000)
  assert draws.mean() == pytest.approx(d.mean(), abs=0.1 * sd)
  assert draws.std() == pytest.approx(sd, rel=0.05)
  test = bootstrap.paired_bootstrap(base, variant, metric, resamples=4000)
  normal = scipy_stats.norm.interval(0.95, d.mean(), sd)
  np.testing.assert_allclose(test.ci, normal, atol=0.1 * (normal[1] - normal[0]) / 2)
  assert test.mean == pytest.approx(d.mean()) and test.examples == (n, n) and test.shared


@pytest.mark.parametrize("shared", [True, False])
def test_the_bootstrap_of_seeds_whose_examples_agree_is_the_bootstrap_over_seeds(shared):
  """Every example of a seed scores alike: drawing examples changes nothing, and the
  bootstrap is the one over seeds, whose distribution is known exactly: the mean of k
  draws with replacement from the k differences, each of the k^k draws equally likely."""
  metric = METRICS["accuracy"]
  digest = lambda s: "test set" if shared else f"seed {s}"  # noqa: E731
  base = {s: _parts(metric, digest(s), correct=[5] * 50, tokens=[10] * 50) for s in range(3)}
  variant = {s: _parts(metric, digest(s), correct=[c] * 50, tokens=[10] * 50)
             for s, c in enumerate((6, 7, 9))}
  d = np.array([0.1, 0.2, 0.4])
  exact: dict[float, float] = {}
  for draw in itertools.product(range(3), repeat=3):
    value = round(float(d[list(draw)].mean()), 9)
    exact[value] = exact.get(value, 0) + 1 / 27
  draws = np.round(bootstrap.replicates(base, variant, metric, resamples=5000), 9)
  assert set(draws) <= set(exact)
  for value, p in exact.items():
    assert np.mean(draws == value) == pytest.approx(p, abs=4 * np.sqrt(p * (1 - p) / 5000))
  assert draws.var() == pytest.approx(d.var() / 3, rel=0.1)
  test = bootstrap.paired_bootstrap(base, variant, metric)
  assert test.shared == shared and test.mean == pytest.approx(d.mean())


def test_a_mean_over_lengths_is_resampled_within_each_length():
  """mean_accuracy (the algorithmic tasks': accuracy pooled per input length, averaged over
  the lengths) keeps each length's rows when resampled: with rows alike within each
  length every resample gives the same value, which a draw across lengths would not."""
  metric = METRICS["mean_accuracy"]
  length = np.array([3, 5, 3, 3, 5, 3, 5, 3, 5, 3])
  scored = np.where(length == 3, 4, 5)
  base = {0: _parts(metric, length=length, hits=np.where(length == 3, 2, 5), scored=scored)}
  variant = {0: _parts(metric, length=length, hits=np.where(length == 3, 3, 5), scored=scored)}
  assert base[0].value(metric)[0] == pytest.approx((2 / 4 + 5 / 5) / 2)
  test = bootstrap.paired_bootstrap(base, variant, metric)
  assert test.ci is None and test.mean == pytest.approx(0.125)  # 0.875 − 0.75, every time
  pooled = dataclasses.replace(metric, stratum=None)
  across = bootstrap.replicates({0: _parts(pooled, length=length, hits=np.where(
                                    length == 3, 2, 5), scored=scored)},
                                {0: _parts(pooled, length=length, hits=np.where(
                                    length == 3, 3, 5), scored=scored)}, pooled)
  assert across.std() > 0.01


def test_the_bootstrap_pairs_only_the_same_examples():
  metric = METRICS["exact_match"]
  one = _parts(metric, exact=[1, 0, 1])
  assert bootstrap.check({0: one}, {1: one}) == "no shared seed"
  assert bootstrap.check({0: one}, {0: None}) == "no per-example results"
  assert bootstrap.check({0: one}, {0: _parts(metric, "another", exact=[1, 1, 1])}) == (
      "not the same test examples")
  assert bootstrap.check({0: one, 1: one}, {0: one, 1: one}) is None
  assert bootstrap.parts({"exact_match": 0.5}, metric) is None  # recorded without them
  assert bootstrap.parts({PER_EXAMPLE: {"digest": "x", "exact": [1]}}, METRICS["bleu"]) is None


def test_the_report_shows_the_bootstrap_over_seeds_and_examples(tmp_path):
  """Runs whose final evaluations recorded per-example results of one test set: the paired
  table's bootstrap interval is bootstrap.paired_bootstrap's of the same parts."""
  rng = np.random.default_rng(0)
  outcomes = {(p, seed): (rng.random(64) < (0.5 if p == "sinusoidal" else 0.7)).astype(int)
              for p in ("sinusoidal", "rotary") for seed in range(3)}
  paths = [fake_run(tmp_path / f"{p}-{seed}", float(x.mean()), seed,
                    examples={"digest": "shared", "exact": x.tolist()}, **{"model.position": p})
           for (p, seed), x in outcomes.items()]
  out = tmp_path / "out"
  md = compare.compare(paths, str(out))
  parts = {p: {seed: _parts(METRICS["exact_match"], "shared", exact=outcomes[p, seed])
               for seed in range(3)} for p in ("sinusoidal", "rotary")}
  expected = bootstrap.paired_bootstrap(parts["sinusoidal"], parts["rotary"],
                                        METRICS["exact_match"])
  row = _rows(md, "## Paired differences against model.position=sinusoidal "
                  "(valid/exact_match)")["model.position=rotary"]
  assert row[4:] == [f"[{expected.ci[0]:.4f}, {expected.ci[1]:.4f}]",
                     "*" if expected.excludes_zero else "", "64, the same in every seed"]
  assert "paired bootstrap over seeds and examples together (1000 resamples" in md
  with open(out / "report.csv") as f:
    csv_row = {r["variant"]: r for r in csv.DictReader(f)}["model.position=rotary"]
  np.testing.assert_allclose([float(csv_row[f"valid/exact_match diff bootstrap ci_{end}"])
                              for end in ("low", "high")], expected.ci)


def test_one_seed_per_variant_says_so_where_the_differences_are(tmp_path):
  """One shared seed: no t interval, and the paired table says why in its row, not only in
  the header; a bootstrap over the examples that excludes 0 is starred as these two runs'
  difference, not the variants'."""
  outcomes = {"sinusoidal": [0] * 48 + [1] * 16, "rotary": [1] * 48 + [0] * 16}
  paths = [fake_run(tmp_path / p, float(np.mean(x)), 0,
                    examples={"digest": "shared", "exact": x}, **{"model.position": p})
           for p, x in outcomes.items()]
  md = compare.compare(paths)
  row = _rows(md, "## Paired differences against model.position=sinusoidal "
                  "(valid/exact_match)")["model.position=rotary"]
  assert row[:4] == ["1", "+0.5000", "none: one seed cannot show a difference between "
                     "variants", ""]
  assert row[4].startswith("[") and row[5] == "* (of these two runs only)"


def test_failed_runs_are_failed_in_every_table(tmp_path):
  """A diverged run (its failure recorded, or finished with a metric that is not finite)
  is a failed run in the main table, the grid, the spread and success rates, the paired
  differences and the list of runs, and enters no mean."""
  exact = {("rotary", "post"): [0.5, 0.6, 0.7], ("rotary", "pre"): [0.8, 0.9, None],
           ("alibi", "post"): [None, None, math.nan], ("alibi", "pre"): [0.4, 0.5, 0.45]}
  paths = []
  for (p, n), values in exact.items():
    for seed, value in enumerate(values):
      path = fake_run(tmp_path / f"{p}-{n}-{seed}", 0.0 if value is None else value, seed,
                      final=value is not None, **{"model.position": p, "model.norm": n})
      if value is None:
        record_failure(path, RuntimeError("training diverged at step 3: the loss is not finite"))
      paths.append(path)
  md = compare.compare(paths, baseline="model.norm=post",
                       thresholds=[stats.parse_threshold("valid/exact_match>=0.6")])
  assert "(8 finished, 4 failed)" in md
  table = _rows(md, "")
  assert table["model.position=alibi,model.norm=post"][:4] == ["0", "3", "0", "failed"]
  assert table["model.position=rotary,model.norm=pre"][:3] == ["2", "1", "0"]
  grid = _rows(md, "## valid/exact_match by model.position: mean [95% CI]")
  assert grid["alibi"][0] == "failed" and grid["rotary"][1].endswith(" (1 failed)")
  spread = _rows(md, "## valid/exact_match over seeds")
  assert spread["model.position=alibi,model.norm=post"] == [
      "0", "3", "failed", "", "", "", "", "0/3 [0.00, 0.71]", ""]
  assert spread["model.position=rotary,model.norm=pre"][:3] == ["2", "1", "0.8500"]
  assert spread["model.position=rotary,model.norm=pre"][7] == "2/3 [0.09, 0.99]"
  paired = _rows(md, "## Paired differences against the same variant with model.norm=post "
                     "(valid/exact_match)")
  assert paired["model.position=alibi,model.norm=pre"][:2] == ["0", "baseline failed"]
  assert paired["model.position=rotary,model.norm=pre"][:2] == ["2", "+0.3000"]
  without = _rows(md, "## Runs without results")
  assert without[str(tmp_path / "alibi-post-2")] == [
      "failed: diverged, its final evaluation is not finite (valid/loss = nan)"]
  assert without[str(tmp_path / "alibi-post-0")][0].startswith("failed: training diverged")
  assert _rows(md, "## Runs")[str(tmp_path / "alibi-post-2")][-1] == "failed"
  with pytest.raises(ConfigError, match="has no results: .*; compare finished"):
    compare.compare(paths + [fake_run(tmp_path / "unfinished", 0.5, 5, final=False)])


def test_a_grid_only_when_the_runs_form_one(tmp_path):
  cells = [("rotary", "post"), ("rotary", "pre"), ("alibi", "post")]  # alibi × pre missing
  paths = [fake_run(tmp_path / f"{p}-{n}-{seed}", 0.5 + seed / 10, seed,
                    **{"model.position": p, "model.norm": n}) for p, n in cells
           for seed in range(2)]
  md = compare.compare(paths)
  assert "- variants differ in: model.position, model.norm" in md
  assert "## valid/exact_match by" not in md
  assert compare.compare(paths + [fake_run(tmp_path / "alibi-pre", 0.5, 0, **{
      "model.position": "alibi", "model.norm": "pre"})]).count(
          "## valid/exact_match by model.position") == 1


def test_no_plot_of_one_point(tmp_path):
  """A language model evaluated at one length has no perplexity-by-length curve, and an
  earlier report's perplexity.png goes; a run evaluated at one input length has no
  extrapolation curve."""
  workdir = fake_run(tmp_path / "run", 0.5)
  (tmp_path / "perplexity.png").write_bytes(b"an earlier report's")
  record = {"eval_length": 64.0, "perplexity": 9.0, "loss_by_position": {"0": 3.0, "32": 2.0}}
  written = report_plots.plot(str(tmp_path), {"lm": [workdir]}, {"lm": [{"len64": record}]},
                              None, 64)
  assert written == ["curves.png", "position_loss.png"]
  assert not (tmp_path / "perplexity.png").exists()
  one_length = {"valid": {"exact_match_by_length": {"3": 0.5}}}
  assert report_plots.plot(str(tmp_path), {"a": [workdir]}, {"a": [one_length]}, None,
                           5) == ["curves.png"]
  assert not (tmp_path / "position_loss.png").exists()


def test_per_example_sums_add_up_to_the_evaluations():
  """row_metrics' rows sum to token_metrics; a scored split's rows from its outputs
  (argmax and −log p per position: no pass of their own) are row_metrics' where no two
  logits tie."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 6, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, size=(4, 6)))
  weights = jnp.asarray(rng.random((4, 6)) < 0.7)
  rows = {k: np.asarray(v) for k, v in metrics_lib.row_metrics(logits, targets, weights).items()}
  sums = metrics_lib.token_metrics(logits, targets, weights)
  for key in ("nll", "correct", "tokens"):
    np.testing.assert_allclose(rows[key].sum(), float(sums[key]), rtol=1e-6)
  outputs = {"predictions": np.asarray(jnp.argmax(logits, -1)),
             "nll": np.asarray(metrics_lib.token_nll(logits, targets))}
  scored = scored_row_sums(outputs, {"targets": np.asarray(targets),
                                     "targets_segmentation": np.asarray(weights, np.int32)})
  for key in ("nll", "correct", "tokens"):
    np.testing.assert_allclose(scored[key], rows[key], rtol=1e-5)


@pytest.mark.parametrize("cast,arch", [("decoder", "decoder"), ("slots", "encoder")])
def test_per_example_results_give_an_evaluations_metrics_again(cast, arch):
  """A final evaluation's per-example results reproduce its metrics, each way a split is
  evaluated: answers generated after their prompts (decoder) and one pass (slots), the
  algorithmic tasks' mean accuracy by length too (a decoded split's: test_sweep.py; every
  source's: test_sources.py)."""
  cfg = parse(chomsky_tiny_config(cast=cast, arch=arch, max_len=3, test_max_len=5))
  exp = experiment.build(cfg)
  results, _ = Evaluator(exp).evaluate(exp.init()["params"], exp.source.eval_splits(),
                                       per_example=True)
  declared, checked = METRICS, set()
  for record in results.values():
    for key, value in record.items():
      if isinstance(value, float) and declared[key].parts:
        parts = bootstrap.parts(record, declared[key])
        assert parts.value(declared[key])[0] == pytest.approx(value, rel=1e-5), key
        checked.add(key)
  assert checked == {"loss", "accuracy", "mean_accuracy"} | (
      {"exact_match"} if cast == "decoder" else set())


def test_finished_runs_without_the_main_metric_are_not_measured_not_failed(tmp_path):
  """Runs that finished but evaluated other splits (a fine-tune at another length) have no
  value of the main metric: 'not measured' in the spread table, never 'failed'."""
  paths = [fake_run(tmp_path / f"rotary-{seed}", 0.5 + seed / 10, seed,
                    **{"model.position": "rotary"}) for seed in range(2)]
  for seed in range(2):
    path = fake_run(tmp_path / f"alibi-{seed}", 0.6, seed, **{"model.position": "alibi"})
    records = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    for record in records:
      if record["split"] == "valid":
        del record["exact_match"], record["exact_match_by_length"]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    paths.append(path)
  md = compare.compare(paths)
  assert "(4 finished)" in md
  spread = _rows(md, "## valid/exact_match over seeds")
  assert spread["model.position=alibi"][:3] == ["0", "0", "not measured"]
  assert spread["model.position=rotary"][:3] == ["2", "0", "0.5500"]
