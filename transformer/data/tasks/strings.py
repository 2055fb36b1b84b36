"""String problems beyond the papers' 15: copy (the quick start's seq2seq task) and
duplicates (a label per token that needs context from both sides). Interface:
data/tasks/problem.py; PROBLEMS: both, by task name (data/tasks/registry.py registers them)."""

import dataclasses

import numpy as np

from transformer.core.fields import Range, check_ranges
from transformer.data.tasks.chomsky import StringProblem, strings


@dataclasses.dataclass(frozen=True)
class Copy(StringProblem):
  """s → s."""

  name: str = "copy"

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    return s, s.copy()


@dataclasses.dataclass(frozen=True)
class Duplicates(StringProblem):
  """Strings over num_symbols symbols; each symbol's label is how many other symbols of the
  string equal it, capped at num_labels − 1 (with 2 labels: "does it occur elsewhere?").
  The occurrences may lie on either side, so a label needs context from both: a causal
  model cannot know it."""

  name: str = "duplicates"
  num_symbols: int = 16
  min_len: int = 4  # the lengths of its splits rule, by default
  max_len: int = 16
  num_labels: int = 2

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, num_symbols=Range(2), num_labels=Range(2))

  @property
  def output_size(self) -> int:
    return self.num_labels

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    others = (s[:, None] == s[None, :]).sum(1) - 1
    return s, np.minimum(others, self.num_labels - 1).astype(np.int32)


PROBLEMS = {"copy": Copy, "duplicates": Duplicates}
