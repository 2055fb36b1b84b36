"""data.source "synthetic": the offline quick start. A task of data/tasks/registry.py
(reverse_string, copy, bucket_sort, or any other drawn at a given length) over held-out
strings (data/tasks/splits.py HeldOutLonger: training never sees 1/heldout_modulus of input
space; `valid` and `longer` hold only it), cast seq2seq: an encoder-decoder reads the input
and decodes the answer. Besides loss, accuracy and exact match, each split reports exact
match by input length.

The names `reverse` and `sort` are read as reverse_string and bucket_sort, the same
problems, in a run's saved config, so a saved run restores unchanged; a config given today
is refused them (problem.TaskChoice).
"""

import numpy as np

from transformer.core.metrics import exact_match_by_length
from transformer.data.base import Example, SplitResult
from transformer.data.tasks.casts import CASTS
from transformer.data.tasks.generated import GeneratedSource
from transformer.data.tasks.problem import TaskChoice, drawn_by
from transformer.data.tasks.registry import TASKS
from transformer.data.tasks.splits import HeldOutLonger

RENAMED = {"reverse": "reverse_string", "sort": "bucket_sort"}


class SyntheticSource(GeneratedSource):
  """data.source "synthetic" (module docstring)."""

  rule = HeldOutLonger
  Task = TaskChoice(drawn_by(rule, TASKS), "name", "task", RENAMED)
  what = "a synthetic task"

  @classmethod
  def cast_of(cls, data, task):
    return cls.fitting(CASTS["seq2seq"], "seq2seq", task)

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="reverse_string", num_symbols=6, min_len=1, max_len=5, longer_max_len=7)
    return Example({"data": {"source": "synthetic"}, "task": task}, "3 1 4")

  def split_results(self, name, split, outputs) -> SplitResult:
    """Exact match per input length (length extrapolation curves)."""
    return SplitResult({"exact_match_by_length": exact_match_by_length(
        outputs["predictions"], split.arrays["targets"], np.asarray(split.lengths))})
