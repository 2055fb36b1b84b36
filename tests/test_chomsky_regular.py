"""The regular tasks of Delétang et al. 2023 (data/tasks/chomsky/regular.py): the papers' and
DeepMind's examples through a direct computation of each answer, and every sampled example
(lengths 1, 2, 3, … 100) checked against that computation; modular_arithmetic's inputs as
DeepMind's code draws them (an even length n: an expression of n − 1 symbols) and, for runs
saved before, as this code drew them (n − 1 symbols and a blank), both valued by a
re-implementation of DeepMind's evaluator; samples are a pure function of the generator's
seed; bad fields are refused by name. numpy only: fast."""

import numpy as np
import pytest

from transformer.core.errors import ConfigError
from transformer.data.tasks.chomsky import PROBLEMS, regular

# ----------------------------------------------------------------- reference answers


def even_pairs(s):
  """1 if the 01 and 10 pairs are odd in number, counted one by one."""
  unequal = sum(1 for a, b in zip(s, s[1:]) if a != b)
  return [unequal % 2]


def parity_check(s):
  return [list(s).count(1) % 2]


def cycle_navigation(s, cycle_length=5):
  """Walks the cycle one move at a time: symbol 0 back, 1 stay, 2 forward."""
  position = 0
  for symbol in s:
    position = {0: position - 1, 1: position, 2: position + 1}[symbol]
    position = (position + cycle_length) % cycle_length
  return [position]


def modular_arithmetic(s, modulus=5):
  """Python's own evaluation of the expression written out (the trailing blank dropped)."""
  text = "".join(str(x) if x < modulus else "+-*_"[x - modulus] for x in s).rstrip("_")
  return [eval(text) % modulus]


def deepmind_modular_value(s, modulus=5):
  """The value as DeepMind's _evaluate_expression computes it (tasks/regular/
  modular_arithmetic.py), step by step: a blank at an operator's place is +, at a number's 0;
  each − becomes + and negates the number after it; the numbers joined by × are multiplied
  (a + starts a new term); the terms are summed, modulo `modulus`."""
  plus, minus, blank = modulus + regular.PLUS, modulus + regular.MINUS, modulus + regular.BLANK
  s = [(plus if i % 2 else 0) if x == blank else x for i, x in enumerate(s)]
  signed = list(s)
  for i in range(1, len(s) - 1, 2):
    if s[i] == minus:
      signed[i], signed[i + 1] = plus, -s[i + 1]
  terms = [signed[0]]
  for op, number in zip(signed[1::2], signed[2::2]):
    if op == plus:
      terms.append(number)
    else:  # times
      terms[-1] *= number
  return [sum(terms) % modulus]


def deepmind_modular_input_length(n):
  """DeepMind's sample_batch: `if length % 2 != 1: length -= 1`."""
  return n if n % 2 == 1 else n - 1


REFERENCES = {"even_pairs": even_pairs, "parity_check": parity_check,
              "cycle_navigation": cycle_navigation, "modular_arithmetic": modular_arithmetic}


def digits(text):
  return [int(c) for c in text]


def moves(text):
  """"1 -1 0" (DeepMind's actions) → symbols (action + 1)."""
  return [int(m) + 1 for m in text.split()]


def expression(text, modulus=5):
  return [int(c) if c.isdigit() else modulus + "+-*_".index(c) for c in text.split()]


# ------------------------------------------------------------------------- tests


def test_registry():
  assert {name: PROBLEMS[name] for name in REFERENCES} == regular.PROBLEMS
  for name, cls in regular.PROBLEMS.items():
    assert cls().name == name


@pytest.mark.parametrize("reference, symbols, answer", [
    # DeepMind's docstrings
    (even_pairs, digits("001110"), 0),  # one 10 and one 01
    (even_pairs, digits("0101001"), 1),  # two 10 and three 01
    (even_pairs, digits("1"), 0),
    (even_pairs, digits("10"), 1),
    (parity_check, digits("1010100"), 1),
    (parity_check, digits("01111"), 0),
    (cycle_navigation, moves("1 -1 0 -1 -1"), 3),  # −2
    (cycle_navigation, moves("1 1 1 -1"), 2),
    (cycle_navigation, moves("-1"), 4),
    (modular_arithmetic, expression("1 + 2 * 3"), 2),
    (modular_arithmetic, expression("1 - 1 - 1"), 4),
    (modular_arithmetic, expression("0 * 1 + 4 * 3 - 2"), 0),
    (modular_arithmetic, expression("3 - 2 * 4 _"), 0),  # an even length's blank
    (modular_arithmetic, expression("4"), 4),
])
def test_examples(reference, symbols, answer):
  assert reference(symbols) == [answer]
  if reference is modular_arithmetic:  # the task's own evaluator too
    assert regular.evaluate(np.array(symbols), 5) == answer


LENGTHS = (1, 2, 3, 4, 5, 6, 7, 10, 41, 100)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_samples_match_reference(name):
  task, reference = PROBLEMS[name](), REFERENCES[name]
  for length in LENGTHS:
    for seed in range(40):
      symbols, answer = task.sample(np.random.default_rng([seed, length]), length)
      assert symbols.dtype == answer.dtype == np.int32
      assert symbols.shape == (task.input_length(length),)
      assert answer.shape == (task.output_length(length),)
      assert 0 <= symbols.min() and symbols.max() < task.input_size
      assert 0 <= answer.min() and answer.max() < task.output_size
      assert answer.tolist() == reference(symbols.tolist()), (length, symbols)
      assert task.accuracy_mask(answer).all()
      assert len(task.pieces()) == task.input_size


@pytest.mark.parametrize("even_lengths", ["shorter", "blank"])
def test_modular_arithmetic_format(even_lengths):
  """Numbers at even positions, operators at odd ones, valued as DeepMind's evaluator does.
  As DeepMind's code draws it (shorter, the default): an expression of odd length, n − 1
  symbols for an even n, no blank. As runs saved before the fix drew it (blank): n − 1
  symbols and the blank; the value is the same expression's."""
  task = regular.ModularArithmetic(even_lengths=even_lengths)
  blank = task.modulus + regular.BLANK
  for length in LENGTHS:
    for seed in range(20):
      s, answer = task.sample(np.random.default_rng([seed, length]), length)
      body = s[:deepmind_modular_input_length(length)]
      if even_lengths == "shorter":
        assert len(s) == deepmind_modular_input_length(length) and blank not in s
      else:
        assert len(s) == length and (s[-1] == blank) == (length % 2 == 0)
      assert (body[0::2] < task.modulus).all()
      assert ((body[1::2] >= task.modulus) & (body[1::2] < blank)).all()
      assert answer.tolist() == deepmind_modular_value(s.tolist()) == modular_arithmetic(s)
  assert task.pieces() == ("0", "1", "2", "3", "4", "+", "-", "*", "_")  # DeepMind's alphabet
  assert deepmind_modular_value(expression("3 - 2 * 4 _")) == [0]
  assert deepmind_modular_value(expression("4 * 4 - 3 * 2 * 4 + 1")) == [(16 - 24 + 1) % 5]


def test_other_fields():
  task = regular.CycleNavigation(cycle_length=7)
  task3 = regular.ModularArithmetic(modulus=3)
  assert (task.output_size, task3.input_size, task3.output_size) == (7, 7, 3)
  for seed in range(30):
    s, answer = task.sample(np.random.default_rng(seed), 20)
    assert answer.tolist() == cycle_navigation(s.tolist(), 7)
    s, answer = task3.sample(np.random.default_rng(seed), 21)
    assert answer.tolist() == modular_arithmetic(s.tolist(), 3)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_pure_function_of_seed(name):
  task = PROBLEMS[name]()
  for length in (1, 2, 17, 100):
    a = task.sample(np.random.default_rng([3, length]), length)
    b = task.sample(np.random.default_rng([3, length]), length)
    c = task.sample(np.random.default_rng([4, length]), length)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    if length > 2:
      assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("name, length", [
    ("even_pairs", 2), ("even_pairs", 40), ("parity_check", 1), ("parity_check", 40),
    ("cycle_navigation", 40), ("modular_arithmetic", 3), ("modular_arithmetic", 40)])
def test_every_class_occurs(name, length):
  """Uniform inputs give every class, each far from rare (loose: ≥ 1/3 of its share)."""
  task = PROBLEMS[name]()
  answers = [int(task.sample(np.random.default_rng([seed, length]), length)[1][0])
             for seed in range(300)]
  counts = np.bincount(answers, minlength=task.output_size)
  assert counts.min() >= 300 / task.output_size / 3, counts


@pytest.mark.parametrize("cls, field, value", [
    (regular.ModularArithmetic, "modulus", 1), (regular.ModularArithmetic, "modulus", 0),
    (regular.CycleNavigation, "cycle_length", 1)])
def test_bad_field(cls, field, value):
  with pytest.raises(ConfigError, match=f"{field}={value}"):
    cls(**{field: value})
  with pytest.raises(ConfigError, match="unknown task.even_lengths 'odd'; choose one of: "
                     "blank, shorter"):
    regular.ModularArithmetic(even_lengths="odd")
