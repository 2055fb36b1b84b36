"""Held-out evaluation: teacher-forced loss and token accuracy, greedy exact match."""

import json
import os

import jax
import numpy as np
from flax import nnx

from transformer import checkpoint, experiment, sharding, workdir as workdir_lib
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




def restore_and_evaluate(workdir: str, step: int | None = None,
                         output: str | None = None) -> tuple[int, dict, str]:
  """Restores the run in `workdir` (latest checkpoint by default), evaluates every held-out
  split and writes the metrics as JSON. Returns (step, metrics, output path)."""
  config = workdir_lib.load_config(workdir)
  task = experiment.make_task(config)
  graphdef, init = experiment.make_init(config, task.vocab_size, experiment.make_optimizer(config))
  abstract = jax.eval_shape(init)
  replicated = jax.tree.map(lambda _: sharding.replicated(sharding.make_mesh()), abstract)
  step, state = checkpoint.restore(checkpoint.manager(workdir, read_only=True), abstract,
                                   replicated, step)
  results = Evaluator(graphdef, config.eval.batch_size).evaluate(
      state["params"], experiment.eval_data(config, task))
  output = output or os.path.join(workdir, f"eval_step_{step}.json")
  with open(output, "w") as f:
    json.dump({"step": step, "workdir": os.path.abspath(workdir), "splits": results}, f, indent=2)
  return step, results, output


def format_table(results: dict[str, dict[str, float]]) -> str:
  rows = [f"{'split':<10}{'examples':>10}{'loss':>10}{'accuracy':>10}{'exact':>10}"]
  for name, m in results.items():
    rows.append(f"{name:<10}{m['examples']:>10d}{m['loss']:>10.4f}{m['accuracy']:>10.4f}"
                f"{m['exact_match']:>10.4f}")
  return "\n".join(rows)
