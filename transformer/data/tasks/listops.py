"""ListOps (Nangia & Bowman 2018, as generated for the Long Range Arena, Tay et al. 2021):
nested MAX/MIN/MED/SM (sum mod 10) over digits, labelled with the value; a problem of
data/tasks/problem.py, drawn by tree, not at a given length."""

import dataclasses
import zlib

import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import Range, check_ranges
from transformer.core.vocab import BOS_ID, NUM_RESERVED
from transformer.data.tasks.problem import Instance, Problem

OPERATORS = {
    "[MAX": max,
    "[MIN": min,
    "[MED": lambda xs: int(np.median(xs)),
    "[SM": lambda xs: sum(xs) % 10,
}
PIECES = (*(str(d) for d in range(10)), *OPERATORS, "]")  # the input symbols, in order
_EXAMPLE = '"[MAX 2 9 [MIN 4 7 ] 0 ]"'


@dataclasses.dataclass(frozen=True)
class ListOps(Problem):
  """Nested MAX/MIN/MED/SM over digits; the answer is the value (10 classes). Trees as
  LRA's generator draws them: below max_depth a node is an operator with probability
  `branch_prob` (else a digit), with 2..max_args arguments; the root is always an operator.
  A length counts the expression's pieces and one CLS token, as LRA's lengths do: an
  instance of length n has n − 1 input symbols."""

  name: str = "listops"
  min_len: int = 10  # the lengths of its splits rule, by default
  max_len: int = 64
  max_depth: int = 4
  max_args: int = 5
  branch_prob: float = 0.25

  sized = False
  input_pieces = PIECES
  input_size = len(PIECES)
  output_size = 10

  def __post_init__(self):
    check_ranges(self, min_len=Range(4), max_depth=Range(2), max_args=Range(2),
                 branch_prob=Range(0, 1, lo_open=True))
    super().__post_init__()  # after: its min_len's range says more than the splits rule's

  def input_length(self, n: int) -> int:
    return n - 1

  def _tree(self, rng, depth: int, max_pieces: int) -> tuple[list[int], int]:
    """(symbols, value) of a subtree at `depth` (the root is at 1)."""
    if depth > 1 and (depth >= self.max_depth or rng.random() >= self.branch_prob):
      digit = int(rng.integers(10))
      return [digit], digit
    op = 10 + int(rng.integers(len(OPERATORS)))
    symbols, values = [op], []
    for _ in range(int(rng.integers(2, self.max_args + 1))):
      sub, value = self._tree(rng, depth + 1, max_pieces)
      symbols += sub
      values.append(value)
      if len(symbols) > max_pieces:  # too long already: stop early, it is rejected
        break
    return symbols + [len(PIECES) - 1], OPERATORS[PIECES[op]](values)

  def draw(self, rng, lengths: range) -> Instance | None:
    """A random tree; None if its length (pieces and CLS) is not in `lengths`."""
    symbols, value = self._tree(rng, 1, lengths.stop - 1)
    if len(symbols) + 1 not in lengths:
      return None
    return Instance(np.array(symbols, np.int32), np.array([value], np.int32), len(symbols) + 1)

  def from_text(self, text: str) -> np.ndarray:
    """The symbols of an expression written as space-separated pieces; a ConfigError unless
    it is one well-formed expression (listops_value)."""
    words = text.split()
    bad = [w for w in words if w not in PIECES]
    if not words or bad:
      raise ConfigError(f"ListOps input {text!r}: give space-separated pieces of "
                        f"{' '.join(PIECES)}, e.g. {_EXAMPLE}")
    try:
      listops_value(words)
    except ValueError as e:
      raise ConfigError(f"ListOps input {text!r} is not an expression: {e}; e.g. "
                        f"{_EXAMPLE}") from None
    return np.array([PIECES.index(w) for w in words], np.int32)

  def heldout_hash(self, inputs: np.ndarray) -> int:
    """CRC32 of the tokens with the CLS token first (BOS_ID, then symbol + NUM_RESERVED,
    int32). Saved runs' held-out slices are this hash's: it stays."""
    tokens = np.concatenate([[BOS_ID], np.asarray(inputs) + NUM_RESERVED]).astype(np.int32)
    return zlib.crc32(tokens.tobytes())


def listops_value(pieces: list[str]) -> int:
  """The value of a ListOps expression given as its pieces: a digit, or an operator, its
  arguments (expressions, at least one) and `]`. A ValueError says what is malformed (an
  operator left open or without arguments, a `]` closing nothing, pieces after the end)."""
  open_ops: list[tuple[str, int, list[int]]] = []  # (operator, piece number, argument values)
  value = None
  for number, piece in enumerate(pieces, start=1):
    if value is not None:
      raise ValueError(f"piece {number} ({piece!r}) follows the end of the expression")
    if piece in OPERATORS:
      open_ops.append((piece, number, []))
      continue
    if piece == "]":
      if not open_ops:
        raise ValueError(f"piece {number} (']') closes no operator")
      op, at, args = open_ops.pop()
      if not args:
        raise ValueError(f"{op} (piece {at}) has no arguments")
      result = OPERATORS[op](args)
    else:
      result = int(piece)
    if open_ops:
      open_ops[-1][2].append(result)
    else:
      value = result
  if open_ops:
    op, at, _ = open_ops[-1]
    raise ValueError(f"{op} (piece {at}) is not closed by a ']'")
  return value
