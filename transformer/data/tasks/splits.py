"""Splits rules (problem.SplitsRule): how a generated task's instances are drawn into splits. Each
source of generated tasks draws by one rule; its fields join the problem's in config.task.

  LengthSplits    the papers' length generalisation (Delétang et al. 2023, Ruoss et al.
                  2023): train on lengths min_len..max_len, test on max_len+1..test_max_len;
                  held-out splits spread their rows evenly over their lengths; nothing else
                  is held out (data.source "algorithmic").
  HeldOutSplits   a fixed 1/heldout_modulus slice of input space (by a hash of the input) is
                  held out: training never sees it, evaluation draws only from it, lengths
                  drawn at random (data.source "labelled").
  HeldOutLonger   HeldOutSplits and a `longer` split of lengths max_len+1..longer_max_len
                  (data.source "synthetic").

Instance i of a split is drawn from numpy's generator seeded with (seed, stream of the split,
i), so it is a pure function of them.
"""

import dataclasses

import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_1, Range, check, check_ranges
from transformer.core.registry import one_of
from transformer.data.tasks.problem import Instance, SplitsRule

MAX_DRAWS = 10_000  # a split with no input of its kind is an error, not a hang


def _check_lengths(rule) -> None:
  check_ranges(rule, min_len=AT_LEAST_1)
  check(rule.max_len >= rule.min_len, "max_len", rule.max_len, f"≥ min_len ({rule.min_len})")


TRAIN_LENGTHS = ("per_row", "per_batch")  # LengthSplits.train_lengths


@dataclasses.dataclass(frozen=True)
class LengthSplits(SplitsRule):
  """The papers' protocol (module docstring). Training rows draw their length uniformly from
  min_len..max_len, from a generator of their own: one per row (`train_lengths` per_row), or
  one per batch, shared by its rows (per_batch: the papers' curriculum, a length per
  training step); `valid` spreads its rows over the training lengths, `test` over
  max_len+1..test_max_len."""

  min_len: int = 1
  max_len: int = 40
  test_max_len: int = 100
  train_lengths: str = "per_row"  # one of TRAIN_LENGTHS

  split_fields = {"valid": "max_len", "test": "test_max_len"}

  @classmethod
  def draws(cls, problem) -> bool:
    return problem.sized

  def __post_init__(self):
    super().__post_init__()
    _check_lengths(self)
    check(self.test_max_len >= self.max_len, "test_max_len", self.test_max_len,
          f"≥ max_len ({self.max_len}); equal: no test split")
    check(self.train_lengths in TRAIN_LENGTHS, "train_lengths", self.train_lengths,
          one_of(TRAIN_LENGTHS))

  def splits(self) -> dict[str, range]:
    train = range(self.min_len, self.max_len + 1)
    test = range(self.max_len + 1, self.test_max_len + 1)
    return {"train": train, "valid": train, **({"test": test} if len(test) else {})}

  @property
  def train_length(self) -> int:
    return self.max_len

  def eval_rows(self, split: str, num_examples: int) -> int:
    return max(num_examples, len(self.splits()[split]))  # at least one row per length

  def example(self, seed: int, split: str, index: int) -> Instance:
    lengths, stream = self.splits()[split], self.stream(split)
    if stream == 0:
      n = int(np.random.default_rng([seed, 0, index, 1]).integers(lengths.start, lengths.stop))
    else:
      n = lengths[index % len(lengths)]
    return self._at(seed, stream, index, n)

  def train_example(self, seed: int, index: int, batch_size: int) -> Instance:
    if self.train_lengths == "per_row":
      return self.example(seed, "train", index)
    lengths, batch = self.splits()["train"], index // batch_size
    n = int(np.random.default_rng([seed, 0, batch, 2]).integers(lengths.start, lengths.stop))
    return self._at(seed, 0, index, n)

  def _at(self, seed: int, stream: int, index: int, n: int) -> Instance:
    inputs, outputs = self.sample(np.random.default_rng([seed, stream, index]), n)
    return Instance(inputs, outputs, n)


@dataclasses.dataclass(frozen=True)
class HeldOutSplits(SplitsRule):
  """A held-out slice of input space (module docstring): `valid` draws held-out inputs of
  the training lengths. An instance draws (length, input) again until it falls on its
  split's side of the slice."""

  min_len: int = 1
  max_len: int = 16
  heldout_modulus: int = 10  # 1/heldout_modulus of input space is held out for evaluation

  split_fields = {"valid": "max_len"}

  def __post_init__(self):
    super().__post_init__()
    _check_lengths(self)
    check_ranges(self, heldout_modulus=Range(2))

  def splits(self) -> dict[str, range]:
    train = range(self.min_len, self.max_len + 1)
    return {"train": train, "valid": train}

  def holds_out(self) -> bool:
    return True

  def is_heldout(self, inputs: np.ndarray) -> bool:
    return self.heldout_hash(inputs) % self.heldout_modulus == 0

  def example(self, seed: int, split: str, index: int) -> Instance:
    lengths, stream = self.splits()[split], self.stream(split)
    rng, heldout = np.random.default_rng([seed, stream, index]), stream > 0
    for _ in range(MAX_DRAWS):
      drawn = self.draw(rng, lengths)
      if drawn is not None and self.is_heldout(drawn.inputs) == heldout:
        return drawn
    raise ConfigError(
        f"task: no {'held-out' if heldout else 'training'} input of {self.name} of lengths "
        f"{lengths.start}..{lengths.stop - 1} found in {MAX_DRAWS} draws; allow more inputs "
        f"(a larger alphabet, longer lengths) or change task.heldout_modulus")


@dataclasses.dataclass(frozen=True)
class HeldOutLonger(HeldOutSplits):
  """HeldOutSplits and `longer`: held-out inputs of lengths max_len+1..longer_max_len,
  longer than any training input (length extrapolation; none if longer_max_len ≤ max_len)."""

  longer_max_len: int = 24

  split_fields = {"valid": "max_len", "longer": "longer_max_len"}

  def splits(self) -> dict[str, range]:
    longer = range(self.max_len + 1, self.longer_max_len + 1)
    return {**super().splits(), **({"longer": longer} if len(longer) else {})}

  @property
  def train_length(self) -> int:
    return self.max_len
