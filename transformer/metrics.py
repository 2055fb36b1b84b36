"""Losses and metrics over non-padding target tokens. Each returns sums, so that batches,
devices and logging intervals combine by adding before a final division."""

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
  correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
  return {"loss": loss, "nll": nll, "correct": correct, "tokens": jnp.sum(weights)}


def exact_matches(predictions: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Per row: equal to the target everywhere, padding included, so a match needs every token
  and the EOS in place and nothing after it."""
  width = max(predictions.shape[1], targets.shape[1])
  pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])))  # noqa: E731
  return np.all(pad(predictions) == pad(targets), axis=1)
