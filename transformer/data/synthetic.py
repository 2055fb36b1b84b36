"""Synthetic seq2seq tasks generated deterministically from a seed: the offline default.

Each example is a random string over `num_symbols` symbols; the target is a function of
it (reverse, copy, sort). Example i of a split is drawn from numpy's generator seeded with
(seed, split, i), so the data is a pure function of its index: a grain MapDataset with random
access, identical across runs, processes and resumptions.

Held-out strings are a fixed 1/`heldout_modulus` slice of string space (by CRC32); training
never sees them and evaluation splits contain only them, so held-out accuracy measures
generalisation, not memorisation.
"""

import dataclasses
import zlib
from collections.abc import Callable

import grain
import jax
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_1, Range, check, check_ranges
from transformer.core.metrics import exact_match_by_length
from transformer.core.registry import lookup
from transformer.core.vocab import EOS_ID, NUM_RESERVED, RESERVED_PIECES
from transformer.data import SourceArgs, Targets
from transformer.data.base import DataSource, Example, Split, SplitResult
from transformer.data.pipeline import READ_OPTIONS, generated_batches, pad_batch

TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "reverse": lambda s: s[::-1],
    "copy": lambda s: s,
    "sort": np.sort,
}

_TRAIN_STREAM = 0  # split ids that seed the generators; evaluation splits use 1, 2, ...
_MAX_DRAWS = 1000  # a string space with no string of the wanted kind is an error, not a hang


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """config.task of data.source "synthetic"."""

  name: str  # a key of TRANSFORMS
  num_symbols: int = 16
  min_len: int = 1
  max_len: int = 16
  heldout_modulus: int = 10  # 1/heldout_modulus of string space is held out for evaluation
  longer_max_len: int = 24  # the `longer` split: lengths max_len+1 .. this (none if ≤ max_len)

  def __post_init__(self):
    lookup(TRANSFORMS, self.name, "task")
    check_ranges(self, num_symbols=AT_LEAST_1, min_len=AT_LEAST_1, heldout_modulus=Range(2))
    check(self.max_len >= self.min_len, "max_len", self.max_len, f"≥ min_len ({self.min_len})")

  @property
  def vocab_size(self) -> int:
    return self.num_symbols + NUM_RESERVED

  def is_heldout(self, symbols: np.ndarray) -> bool:
    return zlib.crc32(symbols.astype(np.int32).tobytes()) % self.heldout_modulus == 0

  def example(self, seed: int, split: int, index: int, min_len: int, max_len: int,
              heldout: bool) -> tuple[np.ndarray, np.ndarray]:
    """Source and target token ids (each ending in EOS) of one example."""
    rng = np.random.default_rng([seed, split, index])
    for _ in range(_MAX_DRAWS):
      length = rng.integers(min_len, max_len + 1)
      symbols = rng.integers(NUM_RESERVED, self.vocab_size, size=length, dtype=np.int32)
      if self.is_heldout(symbols) == heldout:
        break
    else:
      raise ConfigError(
          f"task: no {'held-out' if heldout else 'training'} string of lengths {min_len}.."
          f"{max_len} over {self.num_symbols} symbols found in {_MAX_DRAWS} draws; allow more "
          f"strings (task.num_symbols, task.max_len) or change task.heldout_modulus")
    target = TRANSFORMS[self.name](symbols)
    eos = np.array([EOS_ID], np.int32)
    return np.concatenate([symbols, eos]), np.concatenate([target, eos])


def train_dataset(task: SyntheticTask, seed: int, batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> grain.MapDataset:
  """Endless training batches; `dataset[step]` is this process's rows of the global batch
  of that step (batch_size rows in all, split evenly between the processes)."""
  return generated_batches(
      batch_size, lambda i: task.example(seed, _TRAIN_STREAM, i, task.min_len, task.max_len,
                                         heldout=False),
      lambda pairs: pad_batch(pairs, task.max_len + 1), process_index, process_count)


def eval_splits(task: SyntheticTask, seed: int, num_examples: int
                ) -> dict[str, dict[str, np.ndarray]]:
  """Held-out splits as whole padded batches.

  `valid`: training lengths. `longer`: lengths max_len+1 .. longer_max_len, longer than any
  training example (length extrapolation).
  """
  ranges = {"valid": (task.min_len, task.max_len),
            "longer": (task.max_len + 1, task.longer_max_len)}
  splits = {}
  for split_id, (name, (lo, hi)) in enumerate(ranges.items(), start=1):
    if hi < lo:
      continue
    pairs = [task.example(seed, split_id, i, lo, hi, heldout=True) for i in range(num_examples)]
    splits[name] = pad_batch(pairs, hi + 1)
  return splits


class SyntheticSource(DataSource):
  """data.source "synthetic": config.task's transform of random strings, from the seed."""

  Task = SyntheticTask
  targets = Targets.SEQUENCE

  def __init__(self, data, task: SyntheticTask, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          "≥ 1 for a synthetic task")
    eval_splits(task, args.seed, 1)  # a string space without such strings
    train_dataset(task, args.seed, 1)[0]  # fails here

  @classmethod
  def output_sizes(cls, data, task: SyntheticTask) -> tuple[int, int]:
    return task.vocab_size, 0

  @classmethod
  def train_length(cls, data, task: SyntheticTask) -> int:
    return task.max_len  # symbols, as exact_match_by_length counts them

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="reverse", num_symbols=6, min_len=1, max_len=5, longer_max_len=7)
    return Example({"data": {"source": "synthetic"}, "task": task}, "3 1 4")

  def max_lengths(self) -> dict[str, int]:
    lengths = {"task.max_len": self.task.max_len + 1}  # EOS included
    if self.task.longer_max_len > self.task.max_len:
      lengths["task.longer_max_len"] = self.task.longer_max_len + 1
    return lengths

  def train_batches(self) -> grain.IterDataset:
    dataset = train_dataset(self.task, self.args.seed, self.args.batch_size,
                            jax.process_index(), jax.process_count())
    return dataset.to_iter_dataset(READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """`valid` and `longer`, num_examples each (0: config.eval.num_examples)."""
    splits = eval_splits(self.task, self.args.seed, num_examples or self.args.eval_examples)
    return {name: Split(arrays) for name, arrays in splits.items()}

  def decode_length(self, split: Split) -> int:
    return split.arrays["targets"].shape[1]  # exact match needs the full target and its EOS

  def split_results(self, name, split, outputs) -> SplitResult:
    """Exact match per input length (length extrapolation curves)."""
    lengths = (split.arrays["inputs"] != 0).sum(1) - 1  # symbols, EOS excluded
    return SplitResult({"exact_match_by_length": exact_match_by_length(
        outputs["predictions"], split.arrays["targets"], lengths)})

  def encode(self, text: str) -> np.ndarray:
    """Space-separated symbols 0..num_symbols-1 (e.g. "3 1 4") -> token ids ending in EOS."""
    words, n = text.split(), self.task.num_symbols
    if not words or any(not (w.isdigit() and int(w) < n) for w in words):
      raise ConfigError(f"synthetic input {text!r}: give space-separated symbols in "
                        f"0..{n - 1}, e.g. \"3 1 4\"")
    return np.asarray([int(w) + NUM_RESERVED for w in words] + [EOS_ID], np.int32)

  def pieces(self, ids) -> list[str]:
    """A label per token id: its symbol, or <s>, </s>, <pad>."""
    return [RESERVED_PIECES.get(i, str(i - NUM_RESERVED)) for i in np.asarray(ids).tolist()]
