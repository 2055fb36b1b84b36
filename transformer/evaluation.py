"""Held-out evaluation: teacher-forced loss and token accuracy, greedy exact match."""


import jax
import numpy as np
from flax import nnx

from transformer.decoding import greedy_decode
from transformer.metrics import exact_matches, token_metrics


class Evaluator:
  """Jitted evaluation of a model given as (graphdef, params) over padded batches."""

  def __init__(self, graphdef: nnx.GraphDef, batch_size: int):
    self.batch_size = batch_size

    @jax.jit
    def eval_step(params, batch):
      model = nnx.merge(graphdef, params)
      logits = model(batch)
      weights = batch["targets_segmentation"] > 0
      sums = token_metrics(logits, batch["targets"], weights)
      predictions = greedy_decode(model, batch, batch["targets"].shape[1])
      sums["exact"] = exact_matches(predictions, batch["targets"], batch["row_mask"])
      return sums

    self._eval_step = eval_step

  def evaluate_split(self, params, split: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean NLL per target token, token accuracy and exact-match rate over a split."""
    n = len(split["inputs"])
    totals: dict[str, float] = {}
    for start in range(0, n, self.batch_size):
      batch = _pad_rows({k: v[start:start + self.batch_size] for k, v in split.items()},
                        self.batch_size)
      for k, v in jax.device_get(self._eval_step(params, batch)).items():
        totals[k] = totals.get(k, 0.0) + float(v)
    return {"loss": totals["nll"] / totals["tokens"],
            "accuracy": totals["correct"] / totals["tokens"],
            "exact_match": totals["exact"] / n,
            "examples": n}

  def evaluate(self, params, splits) -> dict[str, dict[str, float]]:
    return {name: self.evaluate_split(params, split) for name, split in splits.items()}


def _pad_rows(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
  """Pads a final short batch with all-padding rows (weight 0) to keep one compiled shape."""
  n = len(batch["inputs"])
  padded = {k: np.pad(v, [(0, size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}
  padded["row_mask"] = (np.arange(size) < n).astype(np.int32)
  return padded


