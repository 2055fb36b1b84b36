"""Held-out evaluation: teacher-forced loss and token accuracy, decoding metrics."""

import functools
import json
import os

import jax
import numpy as np
from flax import nnx

from transformer import checkpoint, experiment, sharding, workdir as workdir_lib
from transformer.data import sources
from transformer.decoding import beam_search, greedy_decode
from transformer.metrics import exact_matches, token_metrics


class Evaluator:
  """Jitted evaluation of a model given as (graphdef, params) over padded batches:
  teacher-forced loss and accuracy, then decoding (greedy, or beam search when
  beam_size > 1) for exact match and, on text sources, BLEU and chrF."""

  def __init__(self, graphdef: nnx.GraphDef, batch_size: int, beam_size: int = 1,
               alpha: float = 0.6):
    self.batch_size = batch_size

    @jax.jit
    def score(params, batch):
      logits = nnx.merge(graphdef, params)(batch)
      return token_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)

    @functools.partial(jax.jit, static_argnums=2)
    def predict(params, batch, max_len):
      model = nnx.merge(graphdef, params)
      if beam_size == 1:
        return greedy_decode(model, batch, max_len)
      return beam_search(model, batch, max_len, beam_size, alpha)[0]

    self._score, self._predict = score, predict

  def _batches(self, split: dict[str, np.ndarray]):
    for start in range(0, len(split["inputs"]), self.batch_size):
      yield _pad_rows({k: v[start:start + self.batch_size] for k, v in split.items()},
                      self.batch_size)

  def predict(self, params, split: dict[str, np.ndarray], decode_len: int) -> np.ndarray:
    """Decoded tokens [n, decode_len] of every row of the split."""
    predictions = [np.asarray(self._predict(params, batch, decode_len))
                   for batch in self._batches(split)]
    return np.concatenate(predictions)[:len(split["inputs"])]

  def evaluate_split(self, params, split: dict[str, np.ndarray], decode_len: int):
    """Returns (metrics, predictions [n, decode_len]) for one split."""
    totals: dict[str, float] = {}
    for batch in self._batches(split):
      for k, v in jax.device_get(self._score(params, batch)).items():
        totals[k] = totals.get(k, 0.0) + float(v)
    predictions = self.predict(params, split, decode_len)
    metrics = {"loss": totals["nll"] / totals["tokens"],
               "accuracy": totals["correct"] / totals["tokens"],
               "exact_match": float(np.mean(exact_matches(predictions, split["targets"]))),
               "examples": len(split["inputs"])}
    return metrics, predictions

  def evaluate(self, params, splits, source):
    """Metrics of every split, with the source's text metrics; and the hypotheses (text
    sources) or None per split."""
    results, hypotheses = {}, {}
    for name, split in splits.items():
      metrics, predictions = self.evaluate_split(params, split, source.decode_len(split))
      text_metrics, hypotheses[name] = source.text_metrics(name, predictions)
      results[name] = {**metrics, **text_metrics}
    return results, hypotheses


def _pad_rows(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
  """Pads a final short batch with all-padding rows (weight 0) to keep one compiled shape."""
  n = len(batch["inputs"])
  padded = {k: np.pad(v, [(0, size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}
  padded["row_mask"] = (np.arange(size) < n).astype(np.int32)
  return padded


def restore_run(workdir: str, step: int | None = None, average: int = 1):
  """The run in `workdir` ready to evaluate: (config, its prepared data source, graphdef,
  checkpoint steps averaged, train state of the last of them), the state laid out on this
  process's devices. average > 1: the mean parameters of the last `average` checkpoints
  up to `step` (default: the latest)."""
  config = workdir_lib.load_config(workdir)
  source = sources.make_source(config, workdir)
  graphdef, init = experiment.make_init(config, source.vocab_size,
                                        experiment.make_optimizer(config))
  abstract = jax.eval_shape(init)
  shardings = sharding.state_shardings(abstract, sharding.make_mesh())
  mngr = checkpoint.manager(workdir, read_only=True)
  steps, state = checkpoint.restore_average(mngr, abstract, shardings, step, average)
  source.prepare()
  return config, source, graphdef, steps, state


def restore_and_evaluate(workdir: str, step: int | None = None, output: str | None = None,
                         beam_size: int = 1, alpha: float = 0.6, average: int = 1,
                         files: tuple[str, str] | None = None) -> tuple[int, dict, str]:
  """Restores the run in `workdir` (latest checkpoint by default; with `average` > 1 the
  mean parameters of the last `average` checkpoints up to it), evaluates every held-out
  split, or the (source, reference) text `files` instead, and writes the metrics as JSON
  (and, for text, the detokenized predictions beside it, one file per split). Returns
  (step, metrics, metrics path)."""
  return evaluate_run(workdir, restore_run(workdir, step, average), output, beam_size, alpha,
                      files)


def evaluate_run(workdir: str, run: tuple, output: str | None = None, beam_size: int = 1,
                 alpha: float = 0.6, files: tuple[str, str] | None = None
                 ) -> tuple[int, dict, str]:
  """restore_and_evaluate for a run already restored by restore_run(workdir, ...)."""
  config, source, graphdef, steps, state = run
  step = steps[-1]
  splits = source.eval_splits() if files is None else source.file_split(*files)
  evaluator = Evaluator(graphdef, config.eval.batch_size, beam_size, alpha)
  results, hypotheses = evaluator.evaluate(state["params"], splits, source)
  output = output or os.path.join(workdir, f"eval_step_{step}.json")
  for split, lines in hypotheses.items():
    if lines is not None:
      path = f"{os.path.splitext(output)[0]}.{split}.txt"
      with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
      results[split]["predictions"] = path
  with open(output, "w") as f:
    json.dump({"step": step, "averaged_steps": steps, "workdir": os.path.abspath(workdir),
               "beam_size": beam_size, "alpha": alpha, "splits": results}, f, indent=2)
  return step, results, output


def format_table(results: dict[str, dict]) -> str:
  columns = [c for c in ("loss", "accuracy", "exact_match", "bleu", "chrf")
             if any(c in m for m in results.values())]
  rows = [f"{'split':<10}{'examples':>10}" + "".join(f"{c:>13}" for c in columns)]
  for name, m in results.items():
    rows.append(f"{name:<10}{m['examples']:>10d}" + "".join(f"{m[c]:>13.4f}" for c in columns))
  signatures = {m["bleu_signature"] for m in results.values() if "bleu_signature" in m}
  return "\n".join(rows + [f"sacreBLEU signature: {s}" for s in signatures])
