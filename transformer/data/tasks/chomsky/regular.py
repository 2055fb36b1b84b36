"""The regular tasks of Delétang et al. 2023 (their Table 1, "R")."""

import dataclasses

import numpy as np

from transformer.core.fields import Range, check_ranges
from transformer.core.migration import changed
from transformer.core.registry import lookup
from transformer.data.tasks.chomsky.base import ModularProblem, strings
from transformer.data.tasks.problem import Problem


@dataclasses.dataclass(frozen=True)
class EvenPairs(Problem):
  """A binary string → 1 if it has an odd number of unequal neighbours (01 and 10 pairs),
  else 0; i.e. whether its first and last symbols differ (length 1: always 0)."""

  name: str = "even_pairs"

  input_size = 2
  output_size = 2

  def sample(self, rng, n):
    s = strings(rng, n, 2)
    return s, np.array([s[0] != s[-1]], np.int32)


@dataclasses.dataclass(frozen=True)
class ParityCheck(Problem):
  """A binary string → its number of 1s modulo 2."""

  name: str = "parity_check"

  input_size = 2
  output_size = 2

  def sample(self, rng, n):
    s = strings(rng, n, 2)
    return s, np.array([s.sum() % 2], np.int32)


@dataclasses.dataclass(frozen=True)
class CycleNavigation(Problem):
  """Moves on a cycle of cycle_length positions, symbol s moving by s − 1 (0: one step
  back, 1: stay, 2: one step forward) → the final position, starting at 0."""

  name: str = "cycle_navigation"
  cycle_length: int = 5
  input_pieces = ("-1", "0", "+1")

  input_size = 3

  def __post_init__(self):
    super().__post_init__()
    check_ranges(self, cycle_length=Range(2))

  @property
  def output_size(self) -> int:
    return self.cycle_length

  def sample(self, rng, n):
    s = strings(rng, n, 3)
    return s, np.array([(s - 1).sum() % self.cycle_length], np.int32)


PLUS, MINUS, TIMES, BLANK = range(4)  # the operators' symbols minus the modulus (DeepMind's)


def evaluate(expression, modulus: int) -> int:
  """The value modulo `modulus` of numbers 0..modulus−1 alternating with operators
  modulus + PLUS/MINUS/TIMES, multiplications first; a trailing BLANK is ignored."""
  total, sign, product = 0, 1, int(expression[0])
  for op, number in zip(expression[1::2], expression[2::2]):
    op, number = int(op) - modulus, int(number)
    if op == TIMES:
      product = product * number % modulus
    else:
      total += sign * product
      sign, product = (1 if op == PLUS else -1), number
  return (total + sign * product) % modulus


EVEN_LENGTHS = {  # task.even_lengths of modular_arithmetic: an input of even length n is
    "shorter": "an expression of n − 1 symbols, as DeepMind's code draws it",
    "blank": "an expression of n − 1 symbols and the blank `_`",
}


@dataclasses.dataclass(frozen=True)
class ModularArithmetic(ModularProblem):
  """An expression of numbers 0..modulus−1 (symbols 0..modulus−1) alternating with
  operators + − × (modulus, modulus+1, modulus+2), all uniform → its value modulo modulus,
  multiplications first. Expressions have odd lengths: DeepMind's code draws one of n − 1
  symbols for an even length n (its sample_batch subtracts one), the default here
  ("shorter"); its alphabet has the blank `_` (modulus+3) besides, never drawn. Runs saved
  before `even_lengths` existed ended an even length's expression in the blank ("blank"),
  which their evaluator reads as +, leaving the value unchanged."""

  name: str = "modular_arithmetic"
  even_lengths: str = changed("shorter", old="blank")
  OPERATORS = ("+", "-", "*", "_")  # PLUS, MINUS, TIMES, BLANK

  def __post_init__(self):
    super().__post_init__()
    lookup(EVEN_LENGTHS, self.even_lengths, "task.even_lengths")

  def input_length(self, n: int) -> int:
    return n - 1 if n % 2 == 0 and self.even_lengths == "shorter" else n

  def sample(self, rng, n):
    terms = (n - 1) // 2  # operators; the expression has 2 * terms + 1 symbols
    expression = np.full(self.input_length(n), self.modulus + BLANK, np.int32)
    expression[0:2 * terms + 1:2] = strings(rng, terms + 1, self.modulus)
    expression[1:2 * terms:2] = self.modulus + strings(rng, terms, 3)  # + − ×
    return expression, np.array([evaluate(expression, self.modulus)], np.int32)


PROBLEMS = {"even_pairs": EvenPairs, "modular_arithmetic": ModularArithmetic,
            "parity_check": ParityCheck, "cycle_navigation": CycleNavigation}
