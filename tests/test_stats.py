"""Statistics over seeds (transformer/study/stats.py) against direct computation; the report's
tables of them over run directories written as training writes them (compare.py, no
training); paired bootstrap resampling of translation hypotheses (sacreBLEU)."""

import csv
import io
import json
import math
import os

import numpy as np
import pytest
import sacrebleu
from scipy import stats as scipy_stats

from tests.conftest import make_tiny_config
from transformer.core.errors import ConfigError
from transformer.run import config as config_lib
from transformer.run import workdir as workdir_lib
from transformer.run.evaluation import text_paths
from transformer.study import compare, stats


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


def fake_run(path, exact: float, seed: int = 0, steps: int = 40, final: bool = True,
             **overrides) -> str:
  """A run's workdir as training leaves it, without training: config.json and
  metrics.jsonl (training losses; the final evaluation unless not `final`) of the tiny
  config with `overrides`, its valid exact match `exact`."""
  cfg = config_lib.parse(make_tiny_config(**{"seed": seed, "train.num_steps": steps,
                                             **overrides}))
  path = str(path)
  os.makedirs(path, exist_ok=True)
  workdir_lib.write_config(cfg, path)
  workdir_lib.append_metrics(path, *({"step": s, "split": "train", "loss": 2.0 - exact * s / steps}
                                     for s in range(10, steps + 1, 10)))
  if final:
    workdir_lib.append_metrics(
        path, {"step": steps, "split": "valid", "loss": 1.0 - exact, "accuracy": 0.5 + exact / 2,
               "exact_match": exact, "exact_match_by_length": {"3": exact}, "examples": 64},
        {"step": steps, "split": "longer", "loss": 2.0 - exact, "accuracy": exact / 2,
         "exact_match": exact / 4, "exact_match_by_length": {"6": exact / 4}, "examples": 64})
  return path


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
      "3", f"{np.mean(rotary):.4f}", f"{np.std(rotary, ddof=1):.4f}", f"[{lo:.4f}, {hi:.4f}]",
      "0.7000", "0.8000", "3/3", "0: 0.7000, 1: 0.7500, 2: 0.8000"]
  assert spread["model.position=sinusoidal"][6] == "1/3"  # 0.5, 0.6, 0.55 against >= 0.6
  assert spread["model.position=alibi"][1:7] == ["0.9000", "", "", "0.9000", "0.9000", "1/1"]

  paired = _rows(md, "## Paired differences against model.position=sinusoidal "
                     "(valid/exact_match)")
  differences = np.subtract(rotary, sinusoidal)
  d_lo, d_hi = scipy_stats.t.interval(0.95, 2, loc=differences.mean(),
                                      scale=scipy_stats.sem(differences))
  assert paired["model.position=rotary"] == [
      "3", f"{differences.mean():+.4f}", f"[{d_lo:.4f}, {d_hi:.4f}]", "*"]
  assert paired["model.position=alibi"] == ["1", "+0.4000", "", ""]  # seed 0 only: no interval
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
    if d.std() > 0:
      lo, hi = scipy_stats.t.interval(0.95, 2, loc=d.mean(), scale=scipy_stats.sem(d))
      assert row[2] == f"[{lo:.4f}, {hi:.4f}]"
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
      assert cell == f"{np.mean(values):.4f} [{lo:.4f}, {hi:.4f}]"
  with pytest.raises(ConfigError, match="--baseline model.norm=mid: no such variant"):
    compare.compare(paths, baseline="model.norm=mid")


def test_runs_that_cannot_be_compared_are_refused(runs, tmp_path):
  unfinished = fake_run(tmp_path / "unfinished", 0.5, 5, final=False)
  with pytest.raises(ConfigError, match="unfinished has no results: its metrics.jsonl has no "
                                        r"final evaluation \(step 40\)"):
    compare.compare(runs + [unfinished])
  with pytest.raises(ConfigError, match="sinusoidal-0 and .*copy-0 are the same run"):
    compare.compare([runs[0], fake_run(tmp_path / "copy-0", 0.5, 0)])
  reverse = fake_run(tmp_path / "reverse", 0.5, 0, **{"task.name": "reverse"})
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


def write_evaluation(path, hypotheses: list[str], references: list[str]) -> str:
  """eval.py's output for a text split `valid`: the metrics JSON and the files beside it."""
  hyp_path, ref_path = text_paths(str(path), "valid")
  for file, lines in ((hyp_path, hypotheses), (ref_path, references)):
    with open(file, "w", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in lines))
  path.write_text(json.dumps({"step": 10, "splits": {"valid": {"bleu": 0.0,
                                                               "predictions": hyp_path}}}))
  return str(path)


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
