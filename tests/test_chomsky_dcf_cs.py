"""Five tasks of Delétang et al. 2023 (stack_manipulation, modular_arithmetic_brackets,
solve_equation, binary_multiplication, compute_sqrt) checked against direct computations of
their answers written here: a simulated stack, Python's eval of the expression mod the
modulus, int(bits, 2) products, math.isqrt; on DeepMind's docstring examples, then on
random examples of the shortest and long lengths. And odds_first as DeepMind's code computes
it (0-based odd indices first), its docstring's order kept for runs saved before. numpy
only."""

import math
import random

import numpy as np
import pytest

from transformer.core.errors import ConfigError
from transformer.data.tasks.chomsky import PROBLEMS
from transformer.data.tasks.chomsky.base import uniform_int
from transformer.data.tasks.chomsky.context_free import (ModularArithmeticBrackets, SolveEquation,
                                                   StackManipulation, bracket_expression)
from transformer.data.tasks.chomsky.context_sensitive import BinaryMultiplication, ComputeSqrt, OddsFirst

NAMES = ("stack_manipulation", "modular_arithmetic_brackets", "solve_equation",
         "binary_multiplication", "compute_sqrt")
LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 21, 40, 60, 77, 100)
SEEDS = range(12)


# ------------------------------------------------------------------ direct answers

def stack_answer(symbols, n):
  """The stack prefix (0s and 1s) run through the actions (POP, PUSH0, PUSH1 = 2, 3, 4)
  as a string; the answer top to bottom, the termination 2 and zeros to n+1 symbols."""
  symbols = [int(s) for s in symbols]
  size = next((i for i, s in enumerate(symbols) if s >= 2), n)
  assert size >= 1 and all(s in (0, 1) for s in symbols[:size])
  assert all(s in (2, 3, 4) for s in symbols[size:])
  stack = "".join(map(str, symbols[:size]))
  for action in symbols[size:]:
    stack = stack[:-1] if action == 2 else stack + str(action - 3)
  answer = [int(c) for c in reversed(stack)] + [2]
  return answer + [0] * (n + 1 - len(answer))


def expression_text(symbols, modulus, operators):
  """The expression's characters: digits, then `operators` (e.g. "+-*()x=") from modulus."""
  return "".join(str(s) if s < modulus else operators[s - modulus] for s in symbols)


def brackets_answer(symbols, modulus=5, mult=True):
  text = expression_text(symbols, modulus, "+-*()x")
  assert "x" not in text and (mult or "*" not in text)
  return [eval(text) % modulus]


def solve_answer(symbols, modulus=5):
  """The x in 0..modulus−1 that makes the left side equal the right; the only one."""
  n = len(symbols)
  if n < 3:
    assert list(symbols) == [0] * n
    return [0]
  text = expression_text(symbols, modulus, "+-()x=")
  left, right = text.split("=")
  assert left.count("x") == 1 and "*" not in left and len(right) == 1 and right.isdigit()
  solutions = [x for x in range(modulus)
               if eval(left.replace("x", str(x))) % modulus == int(right)]
  assert len(solutions) == 1, text
  return solutions


def multiplication_answer(symbols):
  """Little-endian a*b → a·b little-endian, the termination 2, zeros to n symbols; n ≤ 2:
  one number below 2^n − 1 answered by n−1 zeros and the termination (DeepMind's)."""
  symbols, n = [int(s) for s in symbols], len(symbols)
  if n <= 2:
    assert 2 not in symbols and int("".join(map(str, symbols[::-1])), 2) < 2 ** n - 1
    return [0] * (n - 1) + [2]
  assert symbols.count(2) == 1
  at = symbols.index(2)
  a, b = (int("".join(map(str, bits[::-1])), 2) for bits in (symbols[:at], symbols[at + 1:]))
  assert at >= 1 and at <= n - 2 and a >= 1 and b >= 1
  answer = [int(c) for c in reversed(bin(a * b)[2:])] + [2]
  return answer + [0] * (n - len(answer))


def sqrt_answer(symbols):
  n = len(symbols)
  value = int("".join(map(str, symbols)), 2)
  assert value >= 1
  return [int(c) for c in bin(math.isqrt(value))[2:].zfill(math.ceil(n / 2))]


ANSWERS = {"stack_manipulation": lambda s: stack_answer(s, len(s)),
           "modular_arithmetic_brackets": brackets_answer, "solve_equation": solve_answer,
           "binary_multiplication": multiplication_answer, "compute_sqrt": sqrt_answer}


# ------------------------------------------------------------------ DeepMind's examples

def test_stack_examples():
  push0, push1, pop = 3, 4, 2
  # 0 1 1 0 PUSH 1 POP POP -> 1 1 0 2 0 0 0 0
  assert stack_answer([0, 1, 1, 0, push1, pop, pop], 7) == [1, 1, 0, 2, 0, 0, 0, 0]
  # 1 1 0 POP POP POP -> the empty stack (DeepMind's docstring pads to 8, n+1 is 7)
  assert stack_answer([1, 1, 0, pop, pop, pop], 6) == [2, 0, 0, 0, 0, 0, 0]
  # POP of the empty stack does nothing; pushes then come out first
  assert stack_answer([1, pop, pop, push0, push1], 5) == [1, 0, 2, 0, 0, 0]
  assert stack_answer([1], 1) == [1, 2]


def test_expression_examples():
  plus, minus, times, open_, close = 5, 6, 7, 8, 9
  assert brackets_answer([3]) == [3]
  assert brackets_answer([minus, 3]) == [2]
  assert brackets_answer([open_, 4, close]) == [4]
  assert brackets_answer([open_, minus, 1, close]) == [4]
  # ((1-2)*(-3)) = 3
  assert brackets_answer([open_, open_, 1, minus, 2, close, times, open_, minus, 3, close,
                          close]) == [3]
  # (4--2) = 6 = 1, (2*-3) = -6 = 4
  assert brackets_answer([open_, 4, minus, minus, 2, close]) == [1]
  assert brackets_answer([open_, 2, times, minus, 3, close]) == [4]
  plus, minus, open_, close, x, eq = 5, 6, 7, 8, 9, 10
  assert solve_answer([x, eq, 3]) == [3]
  assert solve_answer([minus, x, eq, 3]) == [2]
  assert solve_answer([open_, x, plus, 2, close, eq, 4]) == [2]
  assert solve_answer([open_, 3, minus, x, close, eq, 4]) == [4]
  assert solve_answer([open_, minus, x, minus, minus, 1, close, eq, 0]) == [1]
  assert solve_answer([0, 0]) == [0]


def test_binary_examples():
  bits = lambda text: [2 if c == "*" else int(c) for c in text]  # noqa: E731
  # 001 * 01101 = 000110120 (4 * 22 = 88), 1001 * 000001 = 00000100120 (9 * 32 = 288)
  assert multiplication_answer(bits("001*01101")) == bits("000110120")
  assert multiplication_answer(bits("1001*000001")) == bits("00000100120")
  assert multiplication_answer(bits("1*1")) == bits("120")
  assert multiplication_answer(bits("0")) == [2]
  assert multiplication_answer(bits("10")) == [0, 2]
  # 100101 = 37 -> 6 = 110; 111 = 7 -> 2 = 10; leading zeros are kept
  assert sqrt_answer(bits("100101")) == bits("110")
  assert sqrt_answer(bits("111")) == bits("10")
  assert sqrt_answer(bits("0001")) == bits("01")
  assert sqrt_answer(bits("1")) == bits("1")


# ------------------------------------------------------------------ the tasks

@pytest.mark.parametrize("name", NAMES)
def test_random_examples_match_the_direct_answer(name):
  task = PROBLEMS[name]()
  assert task.name == name
  assert len(task.pieces()) == task.input_size == len(set(task.pieces()))
  for n in LENGTHS:
    for seed in SEEDS:
      symbols, answer = task.sample(np.random.default_rng([seed, n]), n)
      assert symbols.dtype == np.int32 and answer.dtype == np.int32
      assert symbols.shape == (n,) and answer.shape == (task.output_length(n),)
      assert symbols.min() >= 0 and symbols.max() < task.input_size
      assert answer.min() >= 0 and answer.max() < task.output_size
      assert answer.tolist() == ANSWERS[name](symbols), (name, seed, n, symbols)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_example_and_no_global_randomness(name):
  task = PROBLEMS[name]()
  np.random.seed(1)
  random.seed(1)
  global_state, python_state = np.random.get_state()[1].copy(), random.getstate()
  for n in (1, 3, 5, 40):
    first = task.sample(np.random.default_rng([7, n]), n)
    second = task.sample(np.random.default_rng([7, n]), n)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
  draws = {tuple(task.sample(np.random.default_rng([seed, 40]), 40)[0]) for seed in range(10)}
  assert len(draws) > 1
  assert np.array_equal(np.random.get_state()[1], global_state)
  assert random.getstate() == python_state


def test_output_lengths():
  assert [StackManipulation().output_length(n) for n in (1, 7)] == [2, 8]
  assert [BinaryMultiplication().output_length(n) for n in (1, 9)] == [1, 9]
  assert [ComputeSqrt().output_length(n) for n in (1, 2, 3, 6, 7)] == [1, 1, 2, 3, 4]
  assert [ModularArithmeticBrackets().output_length(n) for n in (1, 50)] == [1, 1]


@pytest.mark.parametrize("name", NAMES)
def test_accuracy_mask(name):
  task = PROBLEMS[name]()
  terminated = name in ("stack_manipulation", "binary_multiplication")
  for n in (1, 2, 3, 8, 30):
    for seed in range(5):
      answer = task.sample(np.random.default_rng([seed, n]), n)[1]
      mask = task.accuracy_mask(answer)
      assert mask.dtype == bool and mask.shape == answer.shape
      if terminated:
        end = answer.tolist().index(2)
        assert mask.tolist() == [i <= end for i in range(len(answer))]
        assert not answer[end + 1:].any()
      else:
        assert mask.all()
  if terminated:  # a batch of rows
    rows = np.stack([task.sample(np.random.default_rng([s, 9]), 9)[1] for s in range(4)])
    ends = (rows == 2).argmax(1)
    assert np.array_equal(task.accuracy_mask(rows), np.arange(rows.shape[1]) <= ends[:, None])


def test_other_moduli_and_no_multiplication():
  for task in (ModularArithmeticBrackets(modulus=7, mult=False),
               ModularArithmeticBrackets(modulus=2), ModularArithmeticBrackets(modulus=13)):
    assert task.input_size == task.modulus + 6 and task.output_size == task.modulus
    for n in (1, 4, 5, 30, 61):
      for seed in range(10):
        symbols, answer = task.sample(np.random.default_rng([seed, n]), n)
        assert answer.tolist() == brackets_answer(symbols, task.modulus, task.mult)
        assert task.modulus + 2 not in symbols or task.mult  # no * without mult
  task = SolveEquation(modulus=7)
  for n in (3, 4, 9, 50):
    for seed in range(10):
      symbols, answer = task.sample(np.random.default_rng([seed, n]), n)
      assert answer.tolist() == solve_answer(symbols, 7)


def test_length_500():
  """One example of each at length 500; the recursive expression generator is at most
  n/4 + 1 calls deep, also when every left part is a single digit (its deepest)."""
  for name in NAMES:
    task = PROBLEMS[name]()
    symbols, answer = task.sample(np.random.default_rng([3, 500]), 500)
    assert symbols.shape == (500,) and answer.shape == (task.output_length(500),)
    assert answer.tolist() == ANSWERS[name](symbols)

  class Lowest:
    """A generator drawing the lowest value of every range: left parts of one symbol."""

    def integers(self, low, high=None):
      return 0 if high is None else low

  symbol = {"+": 5, "-": 6, "*": 7, "(": 8, ")": 9}
  symbols, value = bracket_expression(Lowest(), 500, 5, "+-*", symbol)
  assert len(symbols) == 500 and symbols[:3] == [8, 0, 5]
  assert [value] == brackets_answer(symbols)


def test_bad_configs():
  for cls in (ModularArithmeticBrackets, SolveEquation):
    with pytest.raises(ConfigError, match="modulus"):
      cls(modulus=1)
  with pytest.raises(ConfigError, match="mult"):
    ModularArithmeticBrackets(mult=2)
  with pytest.raises(ConfigError, match="unknown task.indexing '2-based'; choose one of: "
                     "0-based, 1-based"):
    OddsFirst(indexing="2-based")


# ------------------------------------------------------------------ odds_first

def deepmind_odds_first(s):
  """DeepMind's OddsFirst.sample_batch (tasks/cs/odds_first.py) on one string: the output is
  jnp.concatenate([one_hot_strings[:, 1::2], one_hot_strings[:, ::2]], axis=1), i.e. the
  symbols at 0-based indices 1, 3, 5, … then 0, 2, 4, …"""
  return [s[i] for i in range(len(s)) if i % 2 == 1] + [s[i] for i in range(len(s)) if i % 2 == 0]


def docstring_odds_first(s):
  """DeepMind's OddsFirst docstring: s_1 s_3 s_5 … s_2 s_4 s_6 … (1-based positions)."""
  positions = range(1, len(s) + 1)
  return ([s[p - 1] for p in positions if p % 2 == 1]
          + [s[p - 1] for p in positions if p % 2 == 0])


def test_odds_first_is_deepminds_code_and_saved_runs_keep_the_docstring():
  bits = lambda text: [int(c) for c in text]  # noqa: E731
  # the docstring's examples hold for the docstring's order, not for the code's
  assert docstring_odds_first(bits("00110101")) == bits("01000111")
  assert docstring_odds_first(bits("110")) == bits("101")
  assert deepmind_odds_first(bits("00110101")) == bits("01110100")
  assert deepmind_odds_first(bits("110")) == bits("110")
  code, saved = OddsFirst(), OddsFirst(indexing="1-based")
  assert code.indexing == "0-based"
  differ = 0
  for n in LENGTHS:
    for seed in SEEDS:
      for task, reference in ((code, deepmind_odds_first), (saved, docstring_odds_first)):
        symbols, answer = task.sample(np.random.default_rng([seed, n]), n)
        assert answer.tolist() == reference(symbols.tolist()), (task, symbols)
      differ += deepmind_odds_first(symbols.tolist()) != docstring_odds_first(symbols.tolist())
  assert differ > len(LENGTHS) * len(SEEDS) / 2  # the two orders differ on most strings


def test_uniform_int():
  rng = np.random.default_rng(0)
  counts = np.bincount([uniform_int(rng, 3, 8) for _ in range(5000)], minlength=8)
  assert not counts[:3].any() and all(850 < c < 1150 for c in counts[3:])
  big = [uniform_int(rng, 2 ** 70, 2 ** 90 + 1) for _ in range(200)]
  assert all(2 ** 70 <= v <= 2 ** 90 for v in big) and max(big).bit_length() == 90
  assert uniform_int(rng, 4, 5) == 4
