"""The problems of Delétang et al. 2023 ("Neural Networks and the Chomsky Hierarchy") and
Ruoss et al. 2023 ("Randomized Positional Encodings Boost Length Generalization of
Transformers"), on the interface of data/tasks/problem.py: a problem maps an input string of
length n over `input_size` symbols to an answer of `output_length(n)` symbols over `output_size`
symbols, and `sample(rng, n)` draws one instance from a numpy Generator. The papers' splits
(train on 1..40, test on 41..500) are data/tasks/splits.py's LengthSplits.

The formats follow DeepMind's code (google-deepmind/neural_networks_chomsky_hierarchy and
randomized_positional_encodings), read to match them; where its docstrings say otherwise,
the code is followed (it produced the papers' numbers) and the task's docstring says so.
The tests check every task against a direct computation of its answer.

Each problem is a frozen dataclass (its fields join config.task): its own fields (an alphabet
size, a modulus), with the papers' values as defaults.
"""

import dataclasses
from typing import ClassVar

import numpy as np

from transformer.core.fields import AT_LEAST_1, Range, check_ranges
from transformer.data.tasks.problem import Answer, Problem


@dataclasses.dataclass(frozen=True)
class StringProblem(Problem):
  """A problem over strings of num_symbols symbols whose output has those symbols too, one
  per input symbol unless a subclass says otherwise."""

  num_symbols: int = 2
  answer = Answer.PER_SYMBOL

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, num_symbols=AT_LEAST_1)

  @property
  def input_size(self) -> int:
    return self.num_symbols

  @property
  def output_size(self) -> int:
    return self.num_symbols

  def output_length(self, n: int) -> int:
    return n


@dataclasses.dataclass(frozen=True)
class ModularProblem(Problem):
  """A problem over digits 0..modulus−1 followed by the symbols OPERATORS names, whose answer
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
