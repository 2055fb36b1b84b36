"""data.source "algorithmic": the length-generalisation protocol of Delétang et al. 2023 and
Ruoss et al. 2023 over a task of data/tasks.py drawn at a given length (their 15, and
reverse/copy/sort's problems): lengths as data/splits.py LengthSplits draws them (train
min_len..max_len, `valid` the same lengths, `test` max_len+1..test_max_len, each held-out
split spread evenly over its lengths), presented as data.cast says (data/casts.py): "slots",
an encoder reading the input and one answer slot per answer symbol, as the papers cast it
(model.arch=encoder, pooling none); "seq2seq", an encoder-decoder; "label", an encoder
reading a CLS token (tasks answered by one label; pooling cls or mean); "token_labels", an
encoder labelling each input symbol (answers as long as the input).

Besides loss and accuracy (pooled over every answer token) each split reports the papers'
metric: accuracy per length (the length an instance was drawn at) over the answer symbols
the task scores (Task.accuracy_mask), `accuracy_by_length`, and its mean over the split's
lengths, `mean_accuracy` (their score on the test lengths).
"""

import dataclasses

import numpy as np

from transformer.core.registry import lookup
from transformer.data.base import Example, Split, SplitResult
from transformer.data.casts import CASTS, Cast
from transformer.data.generated import GeneratedSource
from transformer.data.splits import LengthSplits
from transformer.data.task import TaskChoice, drawn_by
from transformer.data.tasks import TASKS as ALL_TASKS

TASKS = drawn_by(LengthSplits, ALL_TASKS)  # config.task.name's choices


@dataclasses.dataclass(frozen=True)
class AlgorithmicData:
  """config.data of data.source "algorithmic": how the task is cast for a model."""

  source: str
  cast: str = "slots"  # a key of casts.CASTS: slots (an encoder, as the papers) | seq2seq | ...

  def __post_init__(self):
    lookup(CASTS, self.cast, "data.cast")


def length_accuracy(task, cast: Cast, split: Split, predictions: np.ndarray) -> dict[int, float]:
  """{length: accuracy over the answer symbols the task scores}, pooled over the split's
  rows of that length (DeepMind's per-length accuracy)."""
  correct: dict[int, list[int]] = {}
  for n, (answer, predicted) in zip(split.lengths, cast.answers(split.arrays, predictions)):
    scored = task.accuracy_mask(answer)
    sums = correct.setdefault(int(n), [0, 0])
    sums[0] += int((scored & (answer == predicted)).sum())
    sums[1] += int(scored.sum())
  return {n: hits / total for n, (hits, total) in sorted(correct.items())}


class AlgorithmicSource(GeneratedSource):
  """data.source "algorithmic" (module docstring)."""

  Data = AlgorithmicData
  Task = TaskChoice(TASKS, "name", "algorithmic task")
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

  def split_results(self, name, split, outputs) -> SplitResult:
    by_length = length_accuracy(self.task, self.cast, split, outputs["predictions"])
    return SplitResult({"mean_accuracy": float(np.mean(list(by_length.values()))),
                        "accuracy_by_length": by_length})
