"""The deterministic context-free tasks of Delétang et al. 2023 (their Table 1, "DCF")."""

import dataclasses

import numpy as np

from transformer.core.fields import check
from transformer.data.tasks.chomsky.base import (ModularProblem, StringProblem, strings,
                                                 up_to_termination)
from transformer.data.tasks.problem import Answer, Problem


@dataclasses.dataclass(frozen=True)
class ReverseString(StringProblem):
  """s_1 … s_n → s_n … s_1 (the papers: binary strings)."""

  name: str = "reverse_string"

  def sample(self, rng, n):
    s = strings(rng, n, self.num_symbols)
    return s, s[::-1].copy()


@dataclasses.dataclass(frozen=True)
class StackManipulation(Problem):
  """A binary stack bottom to top (1..n−1 symbols 0, 1) and the actions POP (2), PUSH0 (3),
  PUSH1 (4) filling the n symbols → the final stack top to bottom (a POP of the empty stack
  does nothing), the termination symbol 2 and zeros to n+1 symbols; the accuracy counts up to
  the termination. Length 1 is a one-symbol stack and no action, as in DeepMind's code."""

  name: str = "stack_manipulation"
  answer = Answer.STRING
  input_pieces = ("0", "1", "POP", "PUSH0", "PUSH1")

  input_size = 5
  output_size = 3

  def output_length(self, n: int) -> int:
    return n + 1

  def sample(self, rng, n):
    stack = strings(rng, 1 if n == 1 else int(rng.integers(1, n)), 2)
    actions = rng.integers(2, 5, size=n - len(stack), dtype=np.int32)
    final = list(stack)
    for action in actions:
      if action >= 3:
        final.append(action - 3)
      elif final:
        final.pop()
    answer = final[::-1] + [2] + [0] * (n - len(final))
    return np.concatenate([stack, actions]), np.array(answer, np.int32)

  def accuracy_mask(self, output):
    return up_to_termination(output, 2)


def bracket_expression(rng: np.random.Generator, n: int, modulus: int, operators: str,
                       symbol: dict[str, int]) -> tuple[list[int], int]:
  """A random expression of exactly n symbols and its value mod `modulus`, drawn as DeepMind's
  generate_one_expression_and_result draws it: a uniform digit d as d, −d, (d), (−d) for
  n = 1, 2, 3, 4; longer ones (L op R) with L of 1..n−4 symbols (uniform), R of the rest and
  op uniform among `operators` ("+-" or "+-*"). Digits are the symbols 0..modulus−1, and
  `symbol` gives those of "+", "-", "*", "(", ")". Each call is on at least 4 fewer
  symbols, so the recursion is at most n/4 + 1 deep."""
  if n <= 4:
    digit = int(rng.integers(modulus))
    negated = n % 2 == 0
    symbols = [symbol["-"], digit] if negated else [digit]
    if n >= 3:
      symbols = [symbol["("], *symbols, symbol[")"]]
    return symbols, (-digit if negated else digit) % modulus
  left_n = int(rng.integers(1, n - 3))
  left, a = bracket_expression(rng, left_n, modulus, operators, symbol)
  right, b = bracket_expression(rng, n - 3 - left_n, modulus, operators, symbol)
  op = operators[int(rng.integers(len(operators)))]
  value = {"+": a + b, "-": a - b, "*": a * b}[op] % modulus
  return [symbol["("], *left, symbol[op], *right, symbol[")"]], value


@dataclasses.dataclass(frozen=True)
class ModularArithmeticBrackets(ModularProblem):
  """An expression of n symbols (bracket_expression: digits 0..modulus−1, then +, −, *, (, ),
  and x, which never occurs, as in DeepMind's alphabet) → its value mod modulus. Lengths 1..4
  are d, −d, (d), (−d), as in DeepMind's code. The papers: modulus 5 with * (their
  constants.py)."""

  name: str = "modular_arithmetic_brackets"
  mult: bool = True
  OPERATORS = ("+", "-", "*", "(", ")", "x")

  def __post_init__(self):
    super().__post_init__()
    check(isinstance(self.mult, bool), "mult", self.mult, "true or false")

  def sample(self, rng, n):
    symbol = {p: self.symbol(p) for p in "+-*()"}
    symbols, value = bracket_expression(rng, n, self.modulus, "+-*" if self.mult else "+-",
                                        symbol)
    return np.array(symbols, np.int32), np.array([value], np.int32)


@dataclasses.dataclass(frozen=True)
class SolveEquation(ModularProblem):
  """An expression of n−2 symbols (bracket_expression with + and − only) with one digit
  replaced by x, then "=" and the expression's value (digits 0..modulus−1, then +, −, (, ),
  x, =, DeepMind's alphabet) → the replaced digit, the one solution (x occurs once, with
  coefficient ±1). The digit replaced is the first at or cyclically after a uniform position,
  and lengths below 3 are n zeros answered by 0, as in DeepMind's code. The papers: modulus
  5; no *, as in DeepMind's SolveEquation (its alphabet has none, and x times 0 would have
  every solution)."""

  name: str = "solve_equation"
  OPERATORS = ("+", "-", "(", ")", "x", "=")

  def sample(self, rng, n):
    if n < 3:
      return np.zeros(n, np.int32), np.zeros(1, np.int32)
    m = self.modulus
    symbols, value = bracket_expression(rng, n - 2, m, "+-", {p: self.symbol(p) for p in "+-()"})
    at = int(rng.integers(n - 2))
    while symbols[at] >= m:  # not a digit
      at = (at + 1) % (n - 2)
    answer = symbols[at]
    symbols[at] = self.symbol("x")
    return np.array(symbols + [self.symbol("="), value], np.int32), np.array([answer], np.int32)


PROBLEMS = {"reverse_string": ReverseString, "stack_manipulation": StackManipulation,
            "modular_arithmetic_brackets": ModularArithmeticBrackets,
            "solve_equation": SolveEquation}
