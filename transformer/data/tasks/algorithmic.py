"""data.source "algorithmic": the length-generalisation protocol of Delétang et al. 2023 and
Ruoss et al. 2023 over a task of data/tasks/registry.py drawn at a given length (their 15, and
reverse/copy/sort's problems): lengths as data/tasks/splits.py LengthSplits draws them (train
min_len..max_len, `valid` the same lengths, `test` max_len+1..test_max_len, each held-out
split spread evenly over its lengths), presented as data.cast says (data/tasks/casts.py): "slots",
an encoder reading the input and one answer slot per answer symbol, as the papers cast it
(model.arch=encoder, pooling none); "seq2seq", an encoder-decoder; "label", an encoder
reading a CLS token (tasks answered by one label; pooling cls or mean); "token_labels", an
encoder labelling each input symbol (answers as long as the input); "decoder", a
decoder-only model continuing the input and a separator with the answer (model.arch=decoder;
the answer generated greedily at evaluation).

Besides loss and accuracy (pooled over every answer token) each split reports the papers'
metric: accuracy per length (the length an instance was drawn at) over the answer symbols
the task scores (Problem.accuracy_mask), `accuracy_by_length`, and its mean over the split's
lengths, `mean_accuracy` (their score on the test lengths); of the answers as predicted in
one pass (slots, label, token_labels), or decoded (seq2seq) or generated (decoder) without
teacher forcing, which then also report `exact_match` (every answer symbol right).
"""

import dataclasses

import numpy as np

from transformer.core.registry import lookup
from transformer.data.base import Example, Split, SplitResult
from transformer.data.tasks.casts import CASTS, Cast
from transformer.data.tasks.generated import GeneratedSource
from transformer.data.tasks.problem import TaskChoice, drawn_by
from transformer.data.tasks.registry import TASKS
from transformer.data.tasks.splits import LengthSplits


@dataclasses.dataclass(frozen=True)
class AlgorithmicData:
  """config.data of data.source "algorithmic": how the task is cast for a model."""

  source: str
  cast: str = "slots"  # a key of casts.CASTS: slots (an encoder, as the papers) | seq2seq | ...

  def __post_init__(self):
    lookup(CASTS, self.cast, "data.cast")


def row_accuracy(task, cast: Cast, split: Split, predictions: np.ndarray
                 ) -> dict[str, np.ndarray]:
  """Each row's `length` (the length it was drawn at), the answer symbols the task scores
  (`scored`) and how many of them were predicted (`hits`), [rows] each: mean_accuracy's
  per-example parts."""
  rows = []
  for n, (answer, predicted) in zip(split.lengths, cast.answers(split.arrays, predictions)):
    scored = task.accuracy_mask(answer)
    rows.append((int(n), int((scored & (answer == predicted)).sum()), int(scored.sum())))
  return dict(zip(("length", "hits", "scored"), np.array(rows, np.int64).reshape(-1, 3).T))


def pooled_accuracy(rows: dict[str, np.ndarray]) -> dict[int, float]:
  """{length: Σ hits / Σ scored over the rows of that length} of row_accuracy's rows."""
  lengths = rows["length"]
  return {int(n): int(rows["hits"][lengths == n].sum()) / int(rows["scored"][lengths == n].sum())
          for n in np.unique(lengths)}


def length_accuracy(task, cast: Cast, split: Split, predictions: np.ndarray) -> dict[int, float]:
  """{length: accuracy over the answer symbols the task scores}, pooled over the split's
  rows of that length (DeepMind's per-length accuracy)."""
  return pooled_accuracy(row_accuracy(task, cast, split, predictions))


class AlgorithmicSource(GeneratedSource):
  """data.source "algorithmic" (module docstring)."""

  Data = AlgorithmicData
  rule = LengthSplits
  Task = TaskChoice(drawn_by(rule, TASKS), "name", "algorithmic task")
  what = "a generated task"

  @classmethod
  def cast_of(cls, data, task):
    return cls.fitting(CASTS[data.cast], data.cast, task)

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="reverse_string", min_len=1, max_len=4, test_max_len=6)
    return Example({"data": {"source": "algorithmic"}, "task": task,
                    "model": {"arch": "encoder", "pooling": "none"}}, "0 1 1")

  def alternatives(self, learns):
    fitting = [name for name, cast in CASTS.items()
               if cast.targets in learns and cast.unfit(self.task) is None]
    return f"data.cast {' or '.join(fitting)} (not {self.data.cast!r})" if fitting else None

  def split_results(self, name, split, outputs) -> SplitResult:
    rows = row_accuracy(self.task, self.cast, split, outputs["predictions"])
    by_length = pooled_accuracy(rows)
    return SplitResult({"mean_accuracy": float(np.mean(list(by_length.values()))),
                        "accuracy_by_length": by_length}, examples=rows)
