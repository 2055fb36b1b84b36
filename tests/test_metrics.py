"""The fused, chunked loss head against the formula on materialised logits; every metric a
data source records declared once (core/metrics.py METRICS), and read from there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from tests.support import source_config
from transformer.core.metrics import (BY_LENGTH, BY_POSITION, METRICS, TABLE,
                                      exact_match_by_length, loss_head_metrics, shown,
                                      text_scores, token_metrics)
from transformer.data.sources import SOURCES
from transformer.run import experiment
from transformer.run.config import parse
from transformer.run.restored_run import format_table
from transformer.study import results


def _problem(n=24, d=8, vocab=11, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  y = jax.random.normal(keys[0], (n, d))
  w_out = jax.random.normal(keys[1], (vocab, d))
  bias = jax.random.normal(keys[2], (vocab,))
  targets = jax.random.randint(keys[3], (n,), 0, vocab)
  weights = (jax.random.uniform(keys[4], (n,)) > 0.25).astype(jnp.float32)  # some padding
  return y, w_out, bias, targets, weights


def _reference(y, w_out, bias, targets, weights, smoothing):
  logits = y @ w_out.T + (0.0 if bias is None else bias)
  return token_metrics(logits[None], targets[None], weights[None], smoothing)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunks", [1, 4, 5])  # 5 does not divide 24: 4 chunks are used
@pytest.mark.parametrize("with_bias", [True, False])
def test_loss_head_equals_token_metrics_and_their_gradients(smoothing, chunks, with_bias):
  y, w_out, bias, targets, weights = _problem()
  bias = bias if with_bias else None
  fused = loss_head_metrics(y, w_out, bias, targets, weights, smoothing, chunks)
  expected = _reference(y, w_out, bias, targets, weights, smoothing)
  assert set(fused) == set(expected)
  for key in expected:
    np.testing.assert_allclose(fused[key], expected[key], rtol=1e-5, err_msg=key)

  argnums = (0, 1, 2) if with_bias else (0, 1)
  loss = lambda f: lambda *a: f(*a, targets, weights, smoothing)["loss"]  # noqa: E731
  got = jax.grad(loss(lambda *a: loss_head_metrics(*a, chunks)), argnums)(y, w_out, bias)
  want = jax.grad(loss(_reference), argnums)(y, w_out, bias)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # under jit and grad together, as in the train step, with a scaled cotangent
  scaled = jax.jit(jax.grad(lambda y: 3.0 * loss_head_metrics(
      y, w_out, bias, targets, weights, smoothing, chunks)["loss"]))(y)
  np.testing.assert_allclose(scaled, 3.0 * want[0], rtol=1e-4, atol=1e-5)


def test_accuracy_counts_a_target_tied_for_the_largest_logit():
  logits = jnp.array([[[2.0, 2.0, 1.0], [0.0, 3.0, 1.0], [1.0, 1.0, 1.0]]])
  targets = jnp.array([[1, 2, 0]])
  metrics = token_metrics(logits, targets, jnp.ones((1, 3)))
  assert float(metrics["correct"]) == 2.0  # a tie at the top counts; a smaller logit does not
  fused = loss_head_metrics(jnp.eye(3), logits[0].T, None, targets[0], jnp.ones(3))
  assert float(fused["correct"]) == 2.0


def test_exact_match_by_length_groups_rows_by_input_length():
  targets = np.array([[4, 2, 0], [5, 6, 2], [7, 8, 2], [9, 2, 0]])
  predictions = targets.copy()
  predictions[2, 1] = 3  # wrong at one token: row 2 (length 2) misses
  by_length = exact_match_by_length(predictions, targets, np.array([1, 2, 2, 1]))
  assert by_length == {"1": 1.0, "2": 0.5}


def test_text_scores_are_sacrebleus_corpus_scores():
  references = ["a man rides a horse on the beach", "two dogs play in the snow"]
  perfect = text_scores(references, references)
  assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
  hypotheses = ["a man rides a horse", "two cats play in the snow"]
  scores = text_scores(hypotheses, references)
  assert scores["bleu"] == pytest.approx(
      sacrebleu.corpus_bleu(hypotheses, [references]).score)
  assert 0 < scores["bleu"] < 100 and "nrefs:1" in scores["bleu_signature"]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_metric_a_source_records_is_declared(name, tmp_path):
  """Each metric a registered source computes (split_results of a perfect model's outputs on
  its example's held-out splits) is declared in METRICS, as what it is: a number within its
  range shown in the tables, or a {length or position: value} curve; a table {row: {column:
  value}} is one of the source's grids. Ints and strings are facts of the evaluation (its
  window length, BLEU's signature), not metrics."""
  (tmp_path / "data").mkdir()
  try:
    example = SOURCES[name].example(str(tmp_path / "data"))
  except ImportError as e:  # an optional dependency (tfds) that this install lacks
    pytest.skip(f"data.source {name!r} needs a package not installed here: {e}")
  source = experiment.build(parse(source_config(example.sections)), str(tmp_path / "run")).source
  source.load()
  for split_name, split in source.eval_splits().items():
    targets = split.arrays["targets"]
    outputs = {"predictions": targets, "nll": np.zeros(targets.shape, np.float32)}
    for key, value in source.split_results(split_name, split, outputs).metrics.items():
      if isinstance(value, float):
        assert key in METRICS and METRICS[key].shown == TABLE, f"{name}: {split_name}/{key}"
        assert METRICS[key].low <= value <= METRICS[key].high, (name, split_name, key, value)
      elif isinstance(value, dict) and key not in source.grids:
        assert key in METRICS and METRICS[key].shown in (BY_LENGTH, BY_POSITION), \
            f"{name}: {split_name}/{key} is a curve that METRICS does not declare as one"


def test_the_table_and_the_reports_read_the_declarations():
  """eval.py's table has a column for every metric declared shown in a table that a split
  has (mean_accuracy too), in METRICS' order; the reports order a split's metrics the same
  way and take the main metric from the declarations (Metric.main)."""
  record = {key: 0.5 for key in shown(TABLE)} | {"examples": 4}
  header = format_table({"test": record}).splitlines()[0].split()
  assert header == ["split", "examples", *shown(TABLE)] and "mean_accuracy" in header
  names = {f"{split}/{key}" for split in ("valid", "test") for key in shown(TABLE)}
  ordered, main = results.order_metrics(names, None)
  assert main == "valid/bleu" and ordered[0] == main
  assert [n.split("/")[1] for n in ordered if n.startswith("test/")] == shown(TABLE)
  algorithmic = {"valid/exact_match", "test/exact_match", "test/mean_accuracy", "test/loss"}
  assert results.order_metrics(algorithmic, None)[1] == "test/mean_accuracy"
  lm = {"len32/perplexity", "len64/perplexity", "len64/loss"}
  assert results.order_metrics(lm, 64)[1] == "len64/perplexity"
  assert results.order_metrics(lm, 16)[1] == "len32/perplexity"  # no split at 16: the shortest
  for key, metric in METRICS.items():
    assert metric.words and (metric.shown == TABLE or metric.main is None), key
