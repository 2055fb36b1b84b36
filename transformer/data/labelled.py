"""Synthetic tasks for the encoder-only family, generated from a seed: ListOps (a label per
sequence) and duplicate detection (a label per token), and their data source.

As in synthetic.py, example i of a split is drawn from numpy's generator seeded with
(seed, split, i), so the data is a pure function of its index, and held-out sequences are a
fixed 1/`heldout_modulus` slice of sequence space (by CRC32) that training never sees.

Batches carry the model's inputs as usual and the labels as `targets` with weights
`targets_segmentation`: for a per-sequence label, the class sits at each sequence's first
token (a CLS token, BOS_ID) and only that token is weighted; for per-token labels every
real token is.
"""

import dataclasses
import zlib

import grain
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_1, Chosen, Range, check, check_ranges
from transformer.core.metrics import macro_f1
from transformer.core.vocab import BOS_ID, NUM_RESERVED, RESERVED_PIECES
from transformer.data import SourceArgs, Targets, pipeline
from transformer.data.base import DataSource, Example, Split, SplitResult

_TRAIN_STREAM = 0  # evaluation splits use 1, 2, ...
_MAX_DRAWS = 10_000  # a task with no sequence of the wanted kind is an error, not a hang

# ListOps (Nangia & Bowman 2018, as generated for the Long Range Arena, Tay et al. 2021).
OPERATORS = {
    "[MAX": max,
    "[MIN": min,
    "[MED": lambda xs: int(np.median(xs)),
    "[SM": lambda xs: sum(xs) % 10,
}
LISTOPS_PIECES = [str(d) for d in range(10)] + list(OPERATORS) + ["]"]
_PIECE_ID = {piece: NUM_RESERVED + i for i, piece in enumerate(LISTOPS_PIECES)}


@dataclasses.dataclass(frozen=True)
class ListOps:
  """Nested MAX/MIN/MED/SM (sum mod 10) over digits; the label is the value (10 classes).
  Trees as LRA's generator draws them: below max_depth a node is an operator with
  probability `branch_prob` (else a digit), with 2..max_args arguments; the root is always
  an operator. Sequences of min_len..max_len tokens (CLS included) are kept."""

  name: str = "listops"
  min_len: int = 10
  max_len: int = 64
  max_depth: int = 4
  max_args: int = 5
  branch_prob: float = 0.25
  heldout_modulus: int = 10

  pooled = True
  num_classes = 10

  def __post_init__(self):
    check_ranges(self, min_len=Range(4), max_depth=Range(2), max_args=Range(2),
                 branch_prob=Range(0, 1, lo_open=True), heldout_modulus=Range(2))
    check(self.max_len >= self.min_len, "max_len", self.max_len, f"≥ min_len ({self.min_len})")

  @property
  def vocab_size(self) -> int:
    return NUM_RESERVED + len(LISTOPS_PIECES)

  def _tree(self, rng, depth: int) -> tuple[list[str], int]:
    """(pieces, value) of a subtree at `depth` (the root is at 1)."""
    if depth > 1 and (depth >= self.max_depth or rng.random() >= self.branch_prob):
      digit = int(rng.integers(10))
      return [str(digit)], digit
    op = LISTOPS_PIECES[10 + int(rng.integers(len(OPERATORS)))]
    pieces, values = [op], []
    for _ in range(int(rng.integers(2, self.max_args + 1))):
      sub, value = self._tree(rng, depth + 1)
      pieces += sub
      values.append(value)
      if len(pieces) > self.max_len:  # too long already: stop early, it is rejected
        break
    return pieces + ["]"], OPERATORS[op](values)

  def draw(self, rng) -> tuple[np.ndarray, np.ndarray] | None:
    """(tokens, labels) of one random sequence, or None if its length is out of range."""
    pieces, value = self._tree(rng, 1)
    if not self.min_len <= len(pieces) + 1 <= self.max_len:
      return None
    tokens = np.array([BOS_ID] + [_PIECE_ID[p] for p in pieces], np.int32)
    labels = np.zeros_like(tokens)
    labels[0] = value
    return tokens, labels

  def weights(self, tokens: np.ndarray) -> np.ndarray:
    return (np.arange(len(tokens)) == 0).astype(np.int32)  # the label sits at the CLS token

  def pieces(self, ids) -> list[str]:
    names = {i: p for p, i in _PIECE_ID.items()} | {BOS_ID: "<cls>"}
    return [names.get(i, RESERVED_PIECES.get(i, "?")) for i in np.asarray(ids).tolist()]

  def encode(self, sentence: str) -> np.ndarray:
    """The tokens (CLS first) of a ListOps expression written as space-separated pieces; a
    ConfigError unless it is one well-formed expression (listops_value)."""
    words = sentence.split()
    bad = [w for w in words if w not in _PIECE_ID]
    if not words or bad:
      raise ConfigError(f"ListOps input {sentence!r}: give space-separated pieces of "
                        f"{' '.join(LISTOPS_PIECES)}, e.g. {_LISTOPS_EXAMPLE}")
    try:
      listops_value(words)
    except ValueError as e:
      raise ConfigError(f"ListOps input {sentence!r} is not an expression: {e}; e.g. "
                        f"{_LISTOPS_EXAMPLE}") from None
    return np.array([BOS_ID] + [_PIECE_ID[w] for w in words], np.int32)


_LISTOPS_EXAMPLE = '"[MAX 2 9 [MIN 4 7 ] 0 ]"'


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


@dataclasses.dataclass(frozen=True)
class Duplicates:
  """Random strings over num_symbols symbols; each token's label is how many other tokens
  of the string equal it, capped at num_labels − 1 (with 2 labels: "does it occur
  elsewhere?"). The occurrences may lie on either side, so a token's label needs context
  from both: a causal model cannot know it."""

  name: str = "duplicates"
  num_symbols: int = 16
  min_len: int = 4
  max_len: int = 16
  num_labels: int = 2
  heldout_modulus: int = 10

  pooled = False

  def __post_init__(self):
    check_ranges(self, num_symbols=Range(2), min_len=AT_LEAST_1, num_labels=Range(2),
                 heldout_modulus=Range(2))
    check(self.max_len >= self.min_len, "max_len", self.max_len, f"≥ min_len ({self.min_len})")

  @property
  def vocab_size(self) -> int:
    return NUM_RESERVED + self.num_symbols

  @property
  def num_classes(self) -> int:
    return self.num_labels

  def draw(self, rng) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(NUM_RESERVED, self.vocab_size, int(rng.integers(
        self.min_len, self.max_len + 1)), dtype=np.int32)
    others = (tokens[:, None] == tokens[None, :]).sum(1) - 1
    return tokens, np.minimum(others, self.num_labels - 1).astype(np.int32)

  def weights(self, tokens: np.ndarray) -> np.ndarray:
    return np.ones(len(tokens), np.int32)

  def pieces(self, ids) -> list[str]:
    return [RESERVED_PIECES.get(i, str(i - NUM_RESERVED)) for i in np.asarray(ids).tolist()]

  def encode(self, sentence: str) -> np.ndarray:
    words, n = sentence.split(), self.num_symbols
    if not words or any(not (w.isdigit() and int(w) < n) for w in words):
      raise ConfigError(f"duplicates input {sentence!r}: give space-separated symbols in "
                        f"0..{n - 1}, e.g. \"3 1 4 1\"")
    return np.array([int(w) + NUM_RESERVED for w in words], np.int32)


TASKS = {"listops": ListOps, "duplicates": Duplicates}


def is_heldout(tokens: np.ndarray, modulus: int) -> bool:
  return zlib.crc32(tokens.astype(np.int32).tobytes()) % modulus == 0


def example_at(task, seed: int, split: int, index: int, heldout: bool):
  """(tokens, labels, weights) of example `index` of a split: a pure function of them."""
  rng = np.random.default_rng([seed, split, index])
  for _ in range(_MAX_DRAWS):
    drawn = task.draw(rng)
    if drawn is not None and is_heldout(drawn[0], task.heldout_modulus) == heldout:
      return drawn[0], drawn[1], task.weights(drawn[0])
  raise ConfigError(f"task {task.name}: no {'held-out' if heldout else 'training'} sequence "
                    f"of lengths {task.min_len}..{task.max_len} found in {_MAX_DRAWS} draws; "
                    f"widen the length range or change the tree shape")


def label_batch(examples, length: int, pack: bool = False) -> dict[str, np.ndarray]:
  """Rows of `length` tokens from (tokens, labels, weights) examples: one per row, padded,
  or with `pack` several per row in order (a new row when the next one does not fit), each
  with its own segment id and positions from 0. targets_segmentation is the segment id
  where a label is scored, 0 elsewhere."""
  rows: list[list] = []
  for ex in examples:
    if not rows or not pack or sum(len(e[0]) for e in rows[-1]) + len(ex[0]) > length:
      rows.append([])
    rows[-1].append(ex)
  out = {k: np.zeros((len(rows), length), np.int32) for k in (
      "inputs", "inputs_positions", "inputs_segmentation", "targets", "targets_segmentation")}
  for r, row in enumerate(rows):
    start = 0
    for segment, (tokens, labels, weights) in enumerate(row, start=1):
      span = slice(start, start + len(tokens))
      out["inputs"][r, span], out["targets"][r, span] = tokens, labels
      out["inputs_positions"][r, span] = np.arange(len(tokens))
      out["inputs_segmentation"][r, span] = segment
      out["targets_segmentation"][r, span] = segment * weights
      start += len(tokens)
  return out


class LabelledSource(DataSource):
  """data.source "labelled": config.task names a task of TASKS (its fields: that task's
  dataclass) for an encoder (model.arch=encoder) with the pooling the task needs."""

  Task = Chosen(TASKS, "name", "labelled task")

  def __init__(self, data, task, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          "≥ 1 for a synthetic task")
    self.targets = Targets.SEQUENCE_LABELS if task.pooled else Targets.TOKEN_LABELS
    example_at(task, args.seed, _TRAIN_STREAM, 0, heldout=False)  # fails early if none

  @classmethod
  def output_sizes(cls, data, task) -> tuple[int, int]:
    return task.vocab_size, task.num_classes

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="listops", min_len=5, max_len=16, max_depth=3, max_args=3)
    return Example({"data": {"source": "labelled"}, "task": task,
                    "model": {"arch": "encoder", "pooling": "cls"}}, "[MAX 2 9 [MIN 4 7 ] 0 ]")

  def max_lengths(self) -> dict[str, int]:
    return {"task.max_len": self.task.max_len}

  def train_batches(self) -> grain.IterDataset:
    """Endless batches; batch `step` is a pure function of (seed, step), this process's rows."""
    task, seed = self.task, self.args.seed
    return pipeline.generated_batches(
        self.args.batch_size, lambda i: example_at(task, seed, _TRAIN_STREAM, i, heldout=False),
        lambda exs: label_batch(exs, task.max_len)).to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """`valid`: num_examples held-out sequences (0: config.eval.num_examples)."""
    n = num_examples or self.args.eval_examples
    examples = [example_at(self.task, self.args.seed, 1, i, heldout=True) for i in range(n)]
    return {"valid": Split(label_batch(examples, self.task.max_len))}

  def encode(self, text: str) -> np.ndarray:
    return self.task.encode(text)

  def pieces(self, ids) -> list[str]:
    return self.task.pieces(ids)

  def split_results(self, name, split, outputs) -> SplitResult:
    """Macro-F1 over the scored labels (per token, or per sequence)."""
    weights = split.arrays["targets_segmentation"] > 0
    return SplitResult({"macro_f1": macro_f1(outputs["predictions"], split.arrays["targets"],
                                             weights, self.task.num_classes)})
