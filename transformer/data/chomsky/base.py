"""The interface of the algorithmic tasks of Delétang et al. 2023 ("Neural Networks and the
Chomsky Hierarchy") and Ruoss et al. 2023 ("Randomized Positional Encodings Boost Length
Generalization of Transformers").

A task maps an input string of length n over `input_size` symbols to an output string of
`output_length(n)` symbols over `output_size` symbols. `sample(rng, n)` draws one example
from a numpy Generator, so a dataset built on it is a pure function of the generator's seed
(data/algorithmic.py seeds it with (seed, split, index)). Symbols are 0-based ints; the data
source maps them to token ids and casts the task for a model (an encoder reading the input
followed by answer slots, as the papers do).

The formats follow DeepMind's code (google-deepmind/neural_networks_chomsky_hierarchy and
randomized_positional_encodings), read to match them; the tests check every task against a
direct computation of its answer.

Each task is a frozen dataclass (its config.task section): the fields every task has
(lengths) and its own (an alphabet size, a modulus), with the papers' values as defaults.
"""

import dataclasses
from typing import ClassVar

import numpy as np

from transformer.core.fields import AT_LEAST_1, Range, check, check_ranges


@dataclasses.dataclass(frozen=True)
class Task:
  """config.task of data.source "algorithmic": the task's name, the training lengths
  min_len..max_len (the papers: 1..40, uniformly) and the test lengths
  max_len+1..test_max_len (the papers: 41..500)."""

  name: str
  min_len: int = 1
  max_len: int = 40
  test_max_len: int = 100

  # What a task declares (class attributes or properties).
  input_pieces: ClassVar[tuple[str, ...] | None] = None  # names of the input symbols

  def __post_init__(self):
    check_ranges(self, min_len=AT_LEAST_1)
    check(self.max_len >= self.min_len, "max_len", self.max_len, f"≥ min_len ({self.min_len})")
    check(self.test_max_len >= self.max_len, "test_max_len", self.test_max_len,
          f"≥ max_len ({self.max_len}); equal: no test split")

  @property
  def input_size(self) -> int:
    """Input symbols 0..input_size-1."""
    raise NotImplementedError

  @property
  def output_size(self) -> int:
    """Output symbols (classes) 0..output_size-1."""
    raise NotImplementedError

  def output_length(self, n: int) -> int:
    """Output symbols for an input of length n; one (a classification) by default."""
    del n
    return 1

  def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(input [n], output [output_length(n)]) int32 symbols of one random example."""
    raise NotImplementedError

  def accuracy_mask(self, output: np.ndarray) -> np.ndarray:
    """Which output symbols count in the accuracy (bool, like `output`): all by default;
    tasks whose answer ends in a termination symbol and padding count up to it."""
    return np.ones(output.shape, bool)

  def pieces(self) -> tuple[str, ...]:
    """A name per input symbol (pictures, eval.py --sentence); the digits by default."""
    return self.input_pieces or tuple(str(i) for i in range(self.input_size))


@dataclasses.dataclass(frozen=True)
class StringTask(Task):
  """A task over strings of num_symbols symbols whose output has those symbols too."""

  num_symbols: int = 2

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, num_symbols=Range(2))

  @property
  def input_size(self) -> int:
    return self.num_symbols

  @property
  def output_size(self) -> int:
    return self.num_symbols

  def output_length(self, n: int) -> int:
    return n


@dataclasses.dataclass(frozen=True)
class ModularTask(Task):
  """A task over digits 0..modulus−1 followed by the symbols OPERATORS names, whose answer
  is a value modulo `modulus` (the papers: 5)."""

  modulus: int = 5
  OPERATORS: ClassVar[tuple[str, ...]] = ()  # the input symbols after the digits

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, modulus=Range(2))

  @property
  def input_size(self) -> int:
    return self.modulus + len(self.OPERATORS)

  @property
  def output_size(self) -> int:
    return self.modulus

  @property
  def input_pieces(self) -> tuple[str, ...]:
    return (*map(str, range(self.modulus)), *self.OPERATORS)

  def symbol(self, piece: str) -> int:
    """The input symbol of an operator piece."""
    return self.modulus + self.OPERATORS.index(piece)


def up_to_termination(output: np.ndarray, terminator: int) -> np.ndarray:
  """True up to and including the first `terminator` of each row (all if none): the
  papers' accuracy mask for answers that end in a termination symbol and zero padding."""
  output = np.asarray(output)
  hits = output == terminator
  first = np.where(hits.any(-1), hits.argmax(-1), output.shape[-1] - 1)
  return np.arange(output.shape[-1]) <= first[..., None]


def strings(rng: np.random.Generator, n: int, num_symbols: int) -> np.ndarray:
  """n uniform symbols 0..num_symbols-1."""
  return rng.integers(0, num_symbols, size=n, dtype=np.int32)


def uniform_int(rng: np.random.Generator, low: int, high: int) -> int:
  """A uniform Python int in [low, high), of any size (rng.integers stops at 2**63): random
  bits of the span's width, redrawn while past the span (less than half the time)."""
  span = high - low
  if span < 1:
    raise ValueError(f"empty range [{low}, {high})")
  bits = (span - 1).bit_length()
  while True:
    drawn = int.from_bytes(rng.bytes((bits + 7) // 8), "little") >> (-bits % 8)
    if drawn < span:
      return low + drawn
