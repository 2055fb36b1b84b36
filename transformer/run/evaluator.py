"""The Evaluator: a trained state's held-out metrics, split by split, in compiled batches —
teacher-forced loss and accuracy, then decoding (greedy, sampled or beam search) for a family
that decodes, or each answer generated after its prompt where the targets are prompted
answers — used by the training loop and by eval.py (run/evaluation.py)."""

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer.core.errors import Interrupted
from transformer.core.metrics import exact_matches, row_metrics, token_metrics, token_nll
from transformer.data import Targets
from transformer.data.base import Split
from transformer.model.decoding import beam_search, generate, greedy_decode
from transformer.model.positions import batch_key
from transformer.model.sampling import GREEDY, Sampling
from transformer.run import experiment, logs

# In a split's record of a run's final evaluation: its results example by example
# (per_example_record)
PER_EXAMPLE = "per_example"


class Evaluator:
  """Jitted evaluation of an experiment's model, given its params, over padded batches:
  teacher-forced loss and accuracy, then decoding (greedy or as `sampling` says, or beam
  search when beam_size > 1) if the family decodes, or the answers generated after their
  prompts (greedy or as `sampling` says) if the targets are prompted answers, and the
  source's metrics (source.split_results). Sampling draws each batch with the key of `seed`
  folded with the batch's number; random positions drawn per batch
  (model.random_positions_draw=per_batch) with batch_key(the batch's number), so each batch
  of a split gets a fresh draw, the same in every evaluation (as Ruoss et al.'s, whose
  evaluation draws per batch from a fixed seed)."""

  def __init__(self, exp: experiment.Experiment, beam_size: int = 1, alpha: float = 0.6,
               sampling: Sampling = GREEDY, seed: int = 0):
    self.exp, self.batch_size, graphdef = exp, exp.eval.batch_size, exp.graphdef
    random_positions = exp.model.random_positions

    def model_for(params, number):  # at the random positions of batch `number`, if any
      model = nnx.merge(graphdef, params)
      if random_positions:
        model.draw_positions_from(batch_key(number))
      return model

    @jax.jit
    def score(params, batch, number):
      logits = model_for(params, number)(batch)
      return token_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)

    @functools.partial(jax.jit, static_argnums=2)
    def predict(params, batch, max_len, number):
      model = model_for(params, number)
      if beam_size == 1:
        key = jax.random.fold_in(jax.random.key(seed), number)
        return greedy_decode(model, batch, max_len, sampling, key)
      return beam_search(model, batch, max_len, beam_size, alpha)[0]

    @jax.jit
    def answer(params, batch, number):  # Targets.PROMPTED_ANSWERS: each row's answer generated
      model = model_for(params, number)
      key = jax.random.fold_in(jax.random.key(seed), number)
      tokens, _ = generate(model, batch["inputs"], prompt_lengths(batch),
                           batch["inputs"].shape[1], sampling, key)
      return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # at t, the token after t: as targets

    @jax.jit
    def tokenwise(params, batch, number):  # score's sums, and per position the argmax and −log p
      logits = model_for(params, number)(batch)
      sums = token_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)
      return sums, jax.numpy.argmax(logits, axis=-1), token_nll(logits, batch["targets"])

    # Each row's sums of token_metrics, for the per-example results of a decoded split: a
    # pass of its own (fused into score, its sums would round differently than they did).
    @jax.jit
    def rows(params, batch, number):
      logits = model_for(params, number)(batch)
      return row_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)

    self._score, self._predict, self._tokenwise = score, predict, tokenwise
    self._answer, self._rows = answer, rows

  def num_batches(self, arrays: dict[str, np.ndarray]) -> int:
    return -(-len(arrays["inputs"]) // self.batch_size)

  def _batches(self, arrays: dict[str, np.ndarray], progress: "logs.Progress | None" = None):
    """The arrays in padded batches of batch_size rows; each batch, once its consumer asks
    for the next, counts as done in `progress`."""
    for start in range(0, len(arrays["inputs"]), self.batch_size):
      yield _pad_rows({k: v[start:start + self.batch_size] for k, v in arrays.items()},
                      self.batch_size)
      if progress is not None:
        progress.advance()

  def predict(self, params, arrays: dict[str, np.ndarray], decode_len: int,
              should_stop=lambda: False, progress: "logs.Progress | None" = None) -> np.ndarray:
    """Decoded tokens [n, decode_len] of every row."""
    return self._each_batch(lambda batch, number: self._predict(params, batch, decode_len, number),
                            arrays, should_stop, progress)

  def _each_batch(self, fn, arrays, should_stop, progress) -> np.ndarray:
    """fn(batch, its number) [batch_size, ...] of every batch, as rows [n, ...]."""
    out = []
    for number, batch in enumerate(self._batches(arrays, progress)):
      _check_stop(should_stop)
      out.append(np.asarray(fn(batch, number)))
    return np.concatenate(out)[:len(arrays["inputs"])]

  def evaluate_split(self, params, arrays: dict[str, np.ndarray], decode_len: int,
                     should_stop=lambda: False, progress: "logs.Progress | None" = None):
    """Returns (metrics, predictions [n, decode_len]) of a split that is decoded; raises
    Interrupted between batches once should_stop() is true."""
    totals = self._totals(params, arrays, should_stop, progress)
    predictions = self.predict(params, arrays, decode_len, should_stop, progress)
    exact = exact_matches(predictions, arrays["targets"])
    return {**_scored(totals, exact), "examples": len(exact)}, predictions

  def answer_split(self, params, arrays: dict[str, np.ndarray], should_stop=lambda: False,
                   progress: "logs.Progress | None" = None):
    """Returns (metrics, outputs) of a split of prompted answers: the teacher-forced loss and
    accuracy over the answers, then each answer generated after its prompt (KV-cached):
    outputs {"predictions"} [n, t], the prompt's tokens forced and the answer's generated,
    aligned with the targets; exact_match: every answer token generated right."""
    totals = self._totals(params, arrays, should_stop, progress)
    predictions = self._each_batch(lambda batch, number: self._answer(params, batch, number),
                                   arrays, should_stop, progress)
    exact = answered_exactly(predictions, arrays)
    return {**_scored(totals, exact), "examples": len(exact)}, {"predictions": predictions}

  def _totals(self, params, arrays, should_stop, progress=None) -> dict[str, float]:
    totals: dict[str, float] = {}
    for number, batch in enumerate(self._batches(arrays, progress)):
      _check_stop(should_stop)
      _add(totals, jax.device_get(self._score(params, batch, number)))
    return totals

  def row_sums(self, params, arrays: dict[str, np.ndarray], should_stop=lambda: False,
               progress: "logs.Progress | None" = None) -> dict[str, np.ndarray]:
    """Each row's sums of token_metrics (core/metrics.py row_metrics: nll, correct, tokens;
    [n] each), from a forward pass per batch."""
    rows: dict[str, list] = {}
    for number, batch in enumerate(self._batches(arrays, progress)):
      _check_stop(should_stop)
      for key, value in jax.device_get(self._rows(params, batch, number)).items():
        rows.setdefault(key, []).append(np.asarray(value))
    return {key: np.concatenate(v)[:len(arrays["inputs"])] for key, v in rows.items()}

  def score_split(self, params, arrays: dict[str, np.ndarray], should_stop=lambda: False,
                  progress: "logs.Progress | None" = None):
    """Returns (metrics, outputs) of a split that is scored, not decoded: loss and
    accuracy over the weighted targets, and outputs {"predictions", "nll"} [n, t] (the
    argmax and −log p(target) at every position), from one forward pass per batch."""
    totals: dict[str, float] = {}
    outputs = {"predictions": [], "nll": []}
    for number, batch in enumerate(self._batches(arrays, progress)):
      _check_stop(should_stop)
      sums, *values = jax.device_get(self._tokenwise(params, batch, number))
      _add(totals, sums)
      for key, value in zip(outputs, values):
        outputs[key].append(np.asarray(value))
    n = len(arrays["inputs"])
    outputs = {k: np.concatenate(v)[:n] for k, v in outputs.items()}
    metrics = {"loss": totals["nll"] / max(totals["tokens"], 1.0),
               "accuracy": totals["correct"] / max(totals["tokens"], 1.0), "examples": n}
    return metrics, outputs

  def evaluate(self, params, splits: dict[str, Split], should_stop=lambda: False,
               per_example: bool = False):
    """(metrics, hypotheses) by split: loss and accuracy, exact match of the decoded
    predictions for a family that decodes, and the source's metrics of the outputs (with
    `per_example`, also its results example by example under PER_EXAMPLE:
    per_example_record); the hypotheses are the source's text predictions (None without
    text). Raises Interrupted once should_stop() is true."""
    results, hypotheses = {}, {}
    decodes, answers = self.exp.family.decodes, generates_answers(self.exp)
    for name, split in splits.items():
      # decoded (or answered) splits take two passes: scoring, then decoding (with
      # per_example, a third: each row's scores)
      passes = (2 + per_example) if decodes or answers else 1
      progress = logs.Progress(f"eval {name}", passes * self.num_batches(split.arrays))
      if decodes:
        metrics, predictions = self.evaluate_split(
            params, split.arrays, self.exp.source.decode_length(split), should_stop, progress)
        outputs = {"predictions": predictions}
      elif answers:
        metrics, outputs = self.answer_split(params, split.arrays, should_stop, progress)
      else:
        metrics, outputs = self.score_split(params, split.arrays, should_stop, progress)
      extra = self.exp.source.split_results(name, split, outputs)
      results[name], hypotheses[name] = {**metrics, **extra.metrics}, extra.hypotheses
      if per_example:
        if decodes or answers:
          parts = {**self.row_sums(params, split.arrays, should_stop, progress),
                   "exact": exact_matches(predictions, split.arrays["targets"]) if decodes
                   else answered_exactly(outputs["predictions"], split.arrays)}
        else:
          parts = scored_row_sums(outputs, split.arrays)
        results[name][PER_EXAMPLE] = per_example_record(split, {**parts,
                                                                **(extra.examples or {})})
    return results, hypotheses

def per_example_record(split: Split, parts: dict[str, np.ndarray]) -> dict:
  """A split's results example by example, for paired tests over examples
  (study/bootstrap.py): the digest of its arrays (evaluations whose digests agree scored
  the same examples) and each part (Metric.parts: token_metrics' sums, exact match where
  decoded, the source's own) in row order."""
  return {"digest": digest(split.arrays), **{k: _compact(v) for k, v in parts.items()}}

def scored_row_sums(outputs: dict[str, np.ndarray], arrays: dict[str, np.ndarray]
                    ) -> dict[str, np.ndarray]:
  """row_metrics' sums of a scored split from its outputs (score_split's: no pass of its
  own): each row's nll and tokens, and as `correct` the positions whose argmax is the
  target (token_metrics also counts a tie for the largest logit: they differ on exact
  ties only)."""
  weights = arrays["targets_segmentation"] > 0
  return {"nll": np.sum(outputs["nll"] * weights, axis=1, dtype=np.float64),
          "correct": np.sum((outputs["predictions"] == arrays["targets"]) & weights, axis=1),
          "tokens": np.sum(weights, axis=1)}

def digest(arrays: dict[str, np.ndarray]) -> str:
  """A fingerprint of a split's arrays: two evaluations with the same one scored the same
  examples in the same order (a paired test over examples needs that)."""
  h = hashlib.sha256()
  for key in sorted(arrays):
    array = np.ascontiguousarray(arrays[key])
    h.update(f"{key} {array.dtype} {array.shape}".encode())
    h.update(array.tobytes())
  return h.hexdigest()[:16]

def _compact(values: np.ndarray) -> list:
  """Per-example values as a JSON list: whole numbers as ints, others to 7 significant
  digits (float32's precision, in fewer characters)."""
  values = np.asarray(values)
  if values.dtype == bool or np.all(values == np.rint(values)):
    return [int(v) for v in values]
  return [float(f"{v:.7g}") for v in values]

def generates_answers(exp: experiment.Experiment) -> bool:
  """Whether evaluation generates each row's answer after its prompt: the source's targets
  are prompted answers (which only a family that generates learns)."""
  return exp.source.targets is Targets.PROMPTED_ANSWERS


def prompt_lengths(batch) -> jax.Array:
  """[b] tokens of each row's prompt: up to and including its first scored position
  (Targets.PROMPTED_ANSWERS); 1 for a row of padding."""
  return jnp.argmax(batch["targets_segmentation"] > 0, axis=1) + 1


def answered_exactly(predictions: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
  """[n] (bool): every answer token of the row generated right (Targets.PROMPTED_ANSWERS)."""
  wrong = (predictions != arrays["targets"]) & (arrays["targets_segmentation"] > 0)
  return ~wrong.any(axis=1)


def _scored(totals: dict[str, float], exact: np.ndarray) -> dict[str, float]:
  """Teacher-forced loss and accuracy of a split's totals, and the rate of rows `exact`
  [n] (bool) predicted exactly."""
  return {"loss": totals["nll"] / totals["tokens"],
          "accuracy": totals["correct"] / totals["tokens"], "exact_match": float(np.mean(exact))}


def _add(totals: dict[str, float], sums: dict) -> None:
  """Adds a batch's metric sums into totals."""
  for k, v in sums.items():
    totals[k] = totals.get(k, 0.0) + float(v)

def _check_stop(should_stop) -> None:
  if should_stop():
    raise Interrupted("evaluation stopped by a signal")

def _pad_rows(batch: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
  """Pads a final short batch with all-padding rows (weight 0) to keep one compiled shape."""
  n = len(batch["inputs"])
  padded = {k: np.pad(v, [(0, size - n)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}
  padded["row_mask"] = (np.arange(size) < n).astype(np.int32)
  return padded

def check_split_lengths(exp: experiment.Experiment, splits: dict[str, Split]) -> None:
  """A ConfigError if a held-out split has sequences the positional encoding cannot encode."""
  for name, split in splits.items():
    length = split.arrays["inputs"].shape[1]
    if exp.family.decodes:
      length = max(length, exp.source.decode_length(split))
    experiment.check_length(exp.abstract_model, length, f"the {name} split")
