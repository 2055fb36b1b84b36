"""The context-sensitive tasks of Delétang et al. 2023 (their Table 1, "CS")."""

import dataclasses
import math

import numpy as np

from transformer.core.migration import changed
from transformer.core.registry import lookup
from transformer.data.tasks.chomsky.base import (StringProblem, strings, uniform_int,
                                                 up_to_termination)
from transformer.data.tasks.problem import Answer, Problem


@dataclasses.dataclass(frozen=True)
class DuplicateString(StringProblem):
  """s → s s (the papers: binary strings)."""

  name: str = "duplicate_string"
  answer = Answer.STRING

  def output_length(self, n: int) -> int:
    return 2 * n

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    return s, np.concatenate([s, s])


INDEXINGS = {  # task.indexing of odds_first: which positions count as odd
    "0-based": "s[1::2] then s[0::2], as DeepMind's code computes it",
    "1-based": "s[0::2] then s[1::2] (s_1 s_3 … s_2 s_4 …), as DeepMind's docstring says",
}


@dataclasses.dataclass(frozen=True)
class OddsFirst(StringProblem):
  """s → its symbols at odd positions, then those at even ones (the papers: binary).
  `indexing` says which are odd. DeepMind's docstring (s_1 s_3 s_5 … s_2 s_4 …, and its
  examples 00110101 → 0100 0111) counts from 1; its code (tasks/cs/odds_first.py:
  one_hot_strings[:, 1::2] then [:, ::2]), which produced the papers' numbers, counts from 0,
  and is the default. Runs saved before this field existed used 1-based."""

  name: str = "odds_first"
  indexing: str = changed("0-based", old="1-based")

  def __post_init__(self):
    super().__post_init__()
    lookup(INDEXINGS, self.indexing, "task.indexing")

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    odd, even = (s[1::2], s[0::2]) if self.indexing == "0-based" else (s[0::2], s[1::2])
    return s, np.concatenate([odd, even])


@dataclasses.dataclass(frozen=True)
class BucketSort(StringProblem):
  """s → its symbols in increasing order (the papers: 5 symbols)."""

  name: str = "bucket_sort"
  num_symbols: int = 5

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    return s, np.sort(s)


@dataclasses.dataclass(frozen=True)
class MissingDuplicate(Problem):
  """A binary string w of length n//2 written twice, w w, with one symbol replaced by the
  placeholder 2 (and, for odd n, the padding symbol 3 at the end); the answer is the
  replaced symbol. Length 1 (no w) is the input "1" with answer 1, as in DeepMind's code."""

  name: str = "missing_duplicate_string"
  input_pieces = ("0", "1", "_", "#")  # _: the missing symbol, #: padding of odd lengths

  input_size = 4
  output_size = 2

  def sample(self, rng, n):
    if n == 1:
      return np.ones(1, np.int32), np.ones(1, np.int32)
    w = strings(rng, n // 2, 2)
    doubled = np.concatenate([w, w])
    at = int(rng.integers(len(doubled)))
    answer = doubled[at]
    doubled[at] = 2
    return np.concatenate([doubled, np.full(n % 2, 3, np.int32)]), np.array([answer], np.int32)


def little_endian(value: int, width: int = 0) -> list[int]:
  """The binary digits of value, least significant first, at least `width` of them (0 is
  one digit)."""
  return [int(b) for b in reversed(f"{value:b}".zfill(width))]


def big_endian(value: int, width: int = 0) -> list[int]:
  """The binary digits of value, most significant first, at least `width` of them."""
  return [int(b) for b in f"{value:b}".zfill(width)]


@dataclasses.dataclass(frozen=True)
class BinaryAddition(Problem):
  """"a+b" in little-endian binary (n symbols in all, "+" is 2; a and b have 1..n−2 and
  n−1−len(a) digits, no zero value) → a+b in little-endian binary without leading zeros, the
  termination symbol 2, and zeros to n+1 symbols; the accuracy counts up to the
  termination. Inputs of length ≤ 2 are one number below 2^n − 1 in n digits, answered by
  itself, as in DeepMind's code."""

  name: str = "binary_addition"
  answer = Answer.STRING
  input_pieces = ("0", "1", "+")

  input_size = 3
  output_size = 3

  def output_length(self, n: int) -> int:
    return n + 1

  def sample(self, rng, n):
    if n <= 2:
      value = int(rng.integers(0, 2 ** n - 1))
      expression, total = little_endian(value, n), value
    else:
      len_a = int(rng.integers(1, n - 1))
      len_b = n - 1 - len_a
      a, b = (uniform_int(rng, 1, 2 ** k) for k in (len_a, len_b))
      expression, total = little_endian(a, len_a) + [2] + little_endian(b, len_b), a + b
    answer = little_endian(total) + [2]
    answer += [0] * (n + 1 - len(answer))
    return np.array(expression, np.int32), np.array(answer, np.int32)

  def accuracy_mask(self, output):
    return up_to_termination(output, 2)


@dataclasses.dataclass(frozen=True)
class BinaryMultiplication(Problem):
  """"a*b" in little-endian binary (n symbols in all, "*" is 2; a and b have 1..n−2 and
  n−1−len(a) digits, no zero value) → a·b in little-endian binary without leading zeros, the
  termination symbol 2, and zeros to n symbols; the accuracy counts up to the termination.
  Inputs of length ≤ 2 are one number below 2^n − 1 in n digits, answered by n−1 zeros and
  the termination (not their value), as in DeepMind's code."""

  name: str = "binary_multiplication"
  answer = Answer.PER_SYMBOL  # n symbols, as many as the input's
  input_pieces = ("0", "1", "*")

  input_size = 3
  output_size = 3

  def output_length(self, n: int) -> int:
    return n

  def sample(self, rng, n):
    if n <= 2:
      expression = little_endian(int(rng.integers(0, 2 ** n - 1)), n)
      digits = [0] * (n - 1)
    else:
      len_a = int(rng.integers(1, n - 1))
      len_b = n - 1 - len_a
      a, b = (uniform_int(rng, 1, 2 ** k) for k in (len_a, len_b))
      expression = little_endian(a, len_a) + [2] + little_endian(b, len_b)
      digits = little_endian(a * b)
    answer = digits + [2] + [0] * (n - 1 - len(digits))
    return np.array(expression, np.int32), np.array(answer, np.int32)

  def accuracy_mask(self, output):
    return up_to_termination(output, 2)


@dataclasses.dataclass(frozen=True)
class ComputeSqrt(Problem):
  """A number in 1..2^n − 1 in big-endian binary of n digits (leading zeros kept) → the floor
  of its square root in big-endian binary of ⌈n/2⌉ digits."""

  name: str = "compute_sqrt"
  answer = Answer.STRING

  input_size = 2
  output_size = 2

  def output_length(self, n: int) -> int:
    return -(-n // 2)

  def sample(self, rng, n):
    value = uniform_int(rng, 1, 2 ** n)
    return (np.array(big_endian(value, n), np.int32),
            np.array(big_endian(math.isqrt(value), self.output_length(n)), np.int32))


PROBLEMS = {"duplicate_string": DuplicateString, "odds_first": OddsFirst,
            "bucket_sort": BucketSort, "missing_duplicate_string": MissingDuplicate,
            "binary_addition": BinaryAddition, "binary_multiplication": BinaryMultiplication,
            "compute_sqrt": ComputeSqrt}
