"""The regular tasks of Delétang et al. 2023 (data/chomsky/regular.py): the papers' and
DeepMind's examples through a direct computation of each answer, and every sampled example
(lengths 1, 2, 3, … 100) checked against that computation; samples are a pure function of
the generator's seed; bad fields are refused by name. numpy only: fast."""

import numpy as np
import pytest

from transformer.core.errors import ConfigError
from transformer.data.chomsky import TASKS, regular

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
  assert {name: TASKS[name] for name in REFERENCES} == regular.TASKS
  for name, cls in regular.TASKS.items():
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
  task, reference = TASKS[name](), REFERENCES[name]
  for length in LENGTHS:
    for seed in range(40):
      symbols, answer = task.sample(np.random.default_rng([seed, length]), length)
      assert symbols.dtype == answer.dtype == np.int32
      assert symbols.shape == (length,) and answer.shape == (task.output_length(length),)
      assert 0 <= symbols.min() and symbols.max() < task.input_size
      assert 0 <= answer.min() and answer.max() < task.output_size
      assert answer.tolist() == reference(symbols.tolist()), (length, symbols)
      assert task.accuracy_mask(answer).all()
      assert len(task.pieces()) == task.input_size


def test_modular_arithmetic_format():
  """Numbers at even positions, operators at odd ones; an even length ends in the blank,
  which appears nowhere else."""
  task = regular.ModularArithmetic()
  blank = task.modulus + regular.BLANK
  for length in LENGTHS:
    for seed in range(20):
      s, _ = task.sample(np.random.default_rng([seed, length]), length)
      body = s[:-1] if length % 2 == 0 else s
      assert (s[-1] == blank) == (length % 2 == 0)
      assert (body[0::2] < task.modulus).all()
      assert ((body[1::2] >= task.modulus) & (body[1::2] < blank)).all()
  assert task.pieces() == ("0", "1", "2", "3", "4", "+", "-", "*", "_")


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
  task = TASKS[name]()
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
  task = TASKS[name]()
  answers = [int(task.sample(np.random.default_rng([seed, length]), length)[1][0])
             for seed in range(300)]
  counts = np.bincount(answers, minlength=task.output_size)
  assert counts.min() >= 300 / task.output_size / 3, counts


@pytest.mark.parametrize("cls, field, value", [
    (regular.ModularArithmetic, "modulus", 1), (regular.ModularArithmetic, "modulus", 0),
    (regular.CycleNavigation, "cycle_length", 1), (regular.ParityCheck, "min_len", 0)])
def test_bad_field(cls, field, value):
  with pytest.raises(ConfigError, match=f"{field}={value}"):
    cls(**{field: value})
