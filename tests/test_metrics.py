"""The fused, chunked loss head against the formula on materialised logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from transformer.core.metrics import (exact_match_by_length, loss_head_metrics, text_scores,
                                      token_metrics)


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
