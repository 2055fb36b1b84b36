"""Losses and metrics: over non-padding target tokens (each returns sums, so that batches,
devices and logging intervals combine by adding before a final division), and of decoded
predictions (exact match, BLEU, chrF); and what each recorded metric is (METRICS: its range,
its direction, where the reports show it, its per-example parts), each declared once, here."""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float = 0.0) -> jax.Array:
  """Summed cross-entropy of logits [b, t, V] against targets [b, t] under weights [b, t].

  With label smoothing ε the target distribution is q = (1 − ε)·onehot + ε/V, and
  −Σ q log softmax(z) = logsumexp(z) − (1 − ε)·z_target − ε·mean(z): no one-hot [b, t, V]
  is materialised.
  """
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  loss = lse - (1.0 - label_smoothing) * target_logit
  if label_smoothing:
    loss = loss - label_smoothing * jnp.mean(logits, axis=-1)
  return jnp.sum(loss * weights)


def token_metrics(logits, targets, weights, label_smoothing=0.0) -> dict[str, jax.Array]:
  """Sums: `loss` (smoothed CE), `nll` (plain CE), `correct` and `tokens`."""
  nll = cross_entropy(logits, targets, weights)
  loss = nll if label_smoothing == 0.0 else cross_entropy(logits, targets, weights, label_smoothing)
  # The target's logit is a largest one (a tie counts as correct): no argmax pass.
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = jnp.sum((target_logit >= jnp.max(logits, axis=-1)) * weights)
  return {"loss": loss, "nll": nll, "correct": correct, "tokens": jnp.sum(weights)}


def row_metrics(logits: jax.Array, targets: jax.Array, weights: jax.Array
                ) -> dict[str, jax.Array]:
  """token_metrics' plain sums row by row, each [b]: `nll`, `correct` (a tie counts) and
  `tokens` of logits [b, t, V] against targets [b, t] under weights [b, t]; an evaluation's
  per-example results (Metric.parts), whose sums over the rows are token_metrics'."""
  logits = logits.astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
  correct = target_logit >= jnp.max(logits, axis=-1)
  return {"nll": jnp.sum(nll * weights, axis=1), "correct": jnp.sum(correct * weights, axis=1),
          "tokens": jnp.sum(weights, axis=1)}


def exact_matches(predictions: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Per row: equal to the target everywhere, padding included, so a match needs every token
  and the EOS in place and nothing after it."""
  width = max(predictions.shape[1], targets.shape[1])
  pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])))  # noqa: E731
  return np.all(pad(predictions) == pad(targets), axis=1)


def exact_match_by_length(predictions: np.ndarray, targets: np.ndarray,
                          lengths: np.ndarray) -> dict[str, float]:
  """Exact-match rate per input length (lengths [n]), for length-extrapolation curves."""
  exact = exact_matches(predictions, targets)
  return {str(n): float(exact[lengths == n].mean()) for n in np.unique(lengths)}


def text_scores(hypotheses: list[str], references: list[str]) -> dict:
  """Corpus sacreBLEU and chrF of detokenized hypotheses against one reference each, and
  the BLEU signature (tokenizer, smoothing, version) that makes the score comparable."""
  import sacrebleu  # noqa: PLC0415 - text runs only: not in every run's start-up
  bleu = sacrebleu.metrics.BLEU()
  return {"bleu": bleu.corpus_score(hypotheses, [references]).score,
          "chrf": sacrebleu.metrics.CHRF().corpus_score(hypotheses, [references]).score,
          "bleu_signature": str(bleu.get_signature())}


def language_model_metrics(nll: np.ndarray, weights: np.ndarray, bins: int = 32) -> dict:
  """Of per-token losses nll [n, t] (−log p of each target) under weights [n, t]:
  perplexity, bits per token, the window length t, and the mean loss by position within
  the window (in up to `bins` bins, keyed by the bin's first position)."""
  loss = float(np.sum(nll * weights) / max(np.sum(weights), 1))
  length = nll.shape[1]
  bin_size = max(1, length // bins)
  by_position = {}
  for start in range(0, length, bin_size):
    w = weights[:, start:start + bin_size]
    if w.any():
      by_position[str(start)] = float(np.sum(nll[:, start:start + bin_size] * w) / np.sum(w))
  return {"perplexity": math.exp(min(loss, 50.0)), "bits_per_token": loss / math.log(2),
          "eval_length": length, "loss_by_position": by_position}


def _row_losses(logits, targets, label_smoothing, mean_logit):
  """Per row of logits [n, V] (float32) with their means over the vocabulary mean_logit [n]:
  smoothed loss, plain CE, correct, log Z = logsumexp, and (softmax, target one-hot) for
  the gradient."""
  top = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - top)
  total = jnp.sum(exp, axis=-1, keepdims=True)
  lse = (top + jnp.log(total))[:, 0]
  onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == targets[:, None]
  target_logit = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
  nll = lse - target_logit
  loss = nll - label_smoothing * (mean_logit - target_logit)
  correct = target_logit >= top[:, 0]  # as in token_metrics
  return loss, nll, correct, lse, (exp / total, onehot)


def _num_chunks(rows: int, chunks: int) -> int:
  """The largest divisor of `rows` that is at most `chunks`."""
  return max(c for c in range(1, max(1, min(chunks, rows)) + 1) if rows % c == 0)


def _loss_head(y, w_out, bias, targets, weights, label_smoothing, chunks, with_grads,
               z_loss=0.0):
  """Sums of the metrics of logits = y @ w_outᵀ + bias, over `chunks` groups of rows
  (rows i, i + chunks, ... form one group, so a batch sharded by rows stays sharded); with
  the gradients of the summed loss with respect to y, w_out and bias when with_grads.
  z_loss > 0 adds z_loss·log²Z per row to the loss (and its sum as `z_loss`); 0 leaves
  every op as it was."""
  n, v = y.shape[0], w_out.shape[0]
  k = _num_chunks(n, chunks)
  split = lambda x: x.reshape(n // k, k, *x.shape[1:]).swapaxes(0, 1)  # noqa: E731

  mean_w = jnp.mean(w_out, axis=0, dtype=jnp.float32).astype(w_out.dtype)
  mean_b = 0.0 if bias is None else jnp.mean(bias, dtype=jnp.float32)

  def chunk(grads, xs):
    y_c, t_c, w_c = xs
    logits = jnp.dot(y_c, w_out.T, preferred_element_type=jnp.float32)
    if bias is not None:
      logits = logits + bias.astype(jnp.float32)
    # mean over the vocabulary of y·w_v + b_v = y·mean(w) + mean(b): no pass over logits
    mean_logit = jnp.dot(y_c, mean_w, preferred_element_type=jnp.float32) + mean_b
    loss, nll, correct, lse, (probs, onehot) = _row_losses(logits, t_c, label_smoothing,
                                                           mean_logit)
    sums = [loss, nll, correct]
    if z_loss:
      z_term = z_loss * lse * lse
      sums = [loss + z_term, nll, correct, z_term]
      # d z_loss·log²Z / d logits = 2·z_loss·log Z·softmax
      probs = probs * (1.0 + 2.0 * z_loss * lse)[:, None]
    sums = jnp.stack([jnp.sum(x * w_c) for x in sums])
    if not with_grads:
      return grads, (sums, None)
    # d loss / d logits = w · (softmax − (1 − ε)·onehot − ε/V) (+ the z-loss term's)
    d_logits = w_c[:, None] * (probs - jnp.where(onehot, 1.0 - label_smoothing, 0.0)
                               - label_smoothing / v)
    d_logits = d_logits.astype(y.dtype)
    d_w, d_bias = grads
    d_w = d_w + jnp.dot(d_logits.T, y_c, preferred_element_type=jnp.float32)
    d_bias = None if bias is None else d_bias + jnp.sum(d_logits, axis=0, dtype=jnp.float32)
    return (d_w, d_bias), (sums, jnp.dot(d_logits, w_out))

  zeros = (jnp.zeros(w_out.shape, jnp.float32),
           None if bias is None else jnp.zeros(bias.shape, jnp.float32))
  grads, (sums, d_y) = jax.lax.scan(chunk, zeros, (split(y), split(targets), split(weights)))
  sums = jnp.sum(sums, axis=0)
  metrics = {"loss": sums[0], "nll": sums[1], "correct": sums[2], "tokens": jnp.sum(weights)}
  if z_loss:
    metrics["z_loss"] = sums[3]
  if not with_grads:
    return metrics, None
  d_y = d_y.swapaxes(0, 1).reshape(y.shape)
  return metrics, (d_y, grads[0].astype(w_out.dtype),
                   None if bias is None else grads[1].astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def loss_head_metrics(y, w_out, bias, targets, weights, label_smoothing=0.0, chunks=1,
                      z_loss=0.0):
  """token_metrics(y @ w_outᵀ + bias, targets, weights, label_smoothing) for decoder
  outputs y [n, d], output weights w_out [V, d] (the shared embedding), bias [V] or None,
  targets and weights [n], without the logits [n, V] ever existing whole: they are made
  for `chunks` groups of rows at a time (a divisor of n, the largest at most `chunks`),
  and under jax.grad the gradient of the summed `loss` is computed in the same pass, while
  each group's logits are in cache, and only scaled in the backward pass. Differentiable
  in `loss` only: the other sums are metrics, whose cotangents are ignored.

  z_loss > 0 (t5x, PaLM): `loss` also sums z_loss·log²Z per target token under the same
  weights, Z = Σ_v exp(logit_v) the softmax's normaliser, pulling log Z towards 0; the
  sum of that term alone is returned as `z_loss` (absent when z_loss is 0)."""
  return _loss_head(y, w_out, bias, targets, weights, label_smoothing, chunks, False,
                    z_loss)[0]


def _loss_head_fwd(y, w_out, bias, targets, weights, label_smoothing, chunks, z_loss):
  return _loss_head(y, w_out, bias, targets, weights, label_smoothing, chunks, True, z_loss)


def _loss_head_bwd(label_smoothing, chunks, z_loss, grads, cotangent):
  del label_smoothing, chunks, z_loss
  g = cotangent["loss"]
  d_y, d_w, d_bias = jax.tree.map(lambda x: (g * x).astype(x.dtype), grads)
  return d_y, d_w, d_bias, None, None


loss_head_metrics.defvjp(_loss_head_fwd, _loss_head_bwd)


def macro_f1(predictions: np.ndarray, labels: np.ndarray, weights: np.ndarray,
             num_classes: int) -> float:
  """The mean over classes of F1 = 2·TP / (2·TP + FP + FN), counting the positions where
  weights > 0; a class that neither occurs nor is predicted is left out of the mean."""
  p, t = predictions[weights > 0], labels[weights > 0]
  scores = []
  for c in range(num_classes):
    tp, fp = np.sum((p == c) & (t == c)), np.sum((p == c) & (t != c))
    fn = np.sum((p != c) & (t == c))
    if tp + fp + fn:
      scores.append(2 * tp / (2 * tp + fp + fn))
  return float(np.mean(scores)) if scores else 0.0


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """−log p(target) per position: logits [b, t, V], targets [b, t] -> [b, t] (float32)."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


# Where the reports show a metric (Metric.shown).
TABLE = "table"  # a number per split: a column of eval.py's table and of the reports' tables
BY_LENGTH = "by_length"  # {input length: value}: a curve of the reports' extrapolation.png
BY_POSITION = "by_position"  # {first position of a bin: value}: position_loss.png
# Metric.main of a metric that is main at the training length: the split len{train_length}
AT_TRAINING_LENGTH = "len{train_length}"


@dataclasses.dataclass(frozen=True)
class Metric:
  """What a recorded metric is, declared once, in METRICS, so that every reader (eval.py's
  table, the reports, their statistics) follows the declaration instead of a list of names:
  `words` (a plot's axis), its range [low, high] (intervals of it stay inside), whether
  lower is better, where the reports show it (`shown`: TABLE, BY_LENGTH or BY_POSITION), and
  `main`: the split on which it is a report's main metric (the column after the run counts,
  the bar chart), the first of METRICS' order that the runs have; AT_TRAINING_LENGTH: the
  split at the training length, else the shortest. When it is computed from per-example
  results (an evaluation's per-example record): of_mean(Σ numerator / Σ denominator) over
  the examples (`parts`; a denominator of None: 1 per example); with a `stratum`, that ratio
  within each stratum (e.g. input length), averaged over the strata. None of `parts`: not a
  function of per-example results (BLEU, chrF and macro F1 are corpus-level)."""

  words: str = ""
  low: float = -math.inf
  high: float = math.inf
  lower_is_better: bool = False
  shown: str = TABLE
  main: str | None = None
  parts: tuple[str, str | None] | None = None
  stratum: str | None = None
  of_mean: Callable[[np.ndarray], np.ndarray] | None = None  # of the ratio; None: itself

  def __post_init__(self):
    if not self.low < self.high:
      raise ValueError(f"a metric's range needs low < high, got [{self.low}, {self.high}]")
    if self.shown not in (TABLE, BY_LENGTH, BY_POSITION):
      raise ValueError(f"a metric is shown as {TABLE!r}, {BY_LENGTH!r} or {BY_POSITION!r}, "
                       f"not {self.shown!r}")


def _perplexity(loss):
  return np.exp(np.minimum(loss, 50.0))  # as language_model_metrics caps it


def _bits(loss):
  return loss / math.log(2)


# Every metric an evaluation records, by the key a split's record holds it under (computed
# here, by the Evaluator, or by a data source's split_results), in the tables' order; a
# source's grids ({row: {column: value}}) are declared by the source (DataSource.grids).
METRICS = {
    "bleu": Metric("BLEU", 0.0, 100.0, main="valid"),
    "chrf": Metric("chrF", 0.0, 100.0),
    # the algorithmic tasks' score: accuracy within each test length, averaged over them
    "mean_accuracy": Metric("mean accuracy over the lengths", 0.0, 1.0, main="test",
                            parts=("hits", "scored"), stratum="length"),
    "exact_match": Metric("exact match", 0.0, 1.0, main="valid", parts=("exact", None)),
    "accuracy": Metric("accuracy", 0.0, 1.0, main="valid", parts=("correct", "tokens")),
    "macro_f1": Metric("macro F1", 0.0, 1.0),
    "perplexity": Metric("perplexity", 1.0, math.inf, lower_is_better=True,
                         main=AT_TRAINING_LENGTH, parts=("nll", "tokens"), of_mean=_perplexity),
    "bits_per_token": Metric("bits per token", 0.0, math.inf, lower_is_better=True,
                             parts=("nll", "tokens"), of_mean=_bits),
    "loss": Metric("loss", 0.0, math.inf, lower_is_better=True, parts=("nll", "tokens")),
    "exact_match_by_length": Metric("exact match", 0.0, 1.0, shown=BY_LENGTH),
    "accuracy_by_length": Metric("accuracy", 0.0, 1.0, shown=BY_LENGTH),
    "loss_by_position": Metric("loss", 0.0, math.inf, lower_is_better=True, shown=BY_POSITION),
}


def shown(where: str) -> list[str]:
  """The keys of the metrics shown `where` (TABLE, BY_LENGTH, BY_POSITION), in METRICS'
  order."""
  return [key for key, metric in METRICS.items() if metric.shown == where]
