"""Losses and metrics over non-padding target tokens. Each returns sums, so that batches,
devices and logging intervals combine by adding before a final division."""

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float = 0.0) -> jax.Array:
  """Summed cross-entropy of logits [b, t, V] against targets [b, t] under weights [b, t].

  With label smoothing ε the target distribution is (1 − ε)·onehot + ε/V.
  """
  labels = optax.smooth_labels(jax.nn.one_hot(targets, logits.shape[-1]), label_smoothing)
  return jnp.sum(optax.softmax_cross_entropy(logits, labels) * weights)


def token_metrics(logits, targets, weights, label_smoothing=0.0) -> dict[str, jax.Array]:
  """Sums: `loss` (smoothed CE), `nll` (plain CE), `correct` and `tokens`."""
  nll = cross_entropy(logits, targets, weights)
  loss = nll if label_smoothing == 0.0 else cross_entropy(logits, targets, weights, label_smoothing)
  correct = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
  return {"loss": loss, "nll": nll, "correct": correct, "tokens": jnp.sum(weights)}
