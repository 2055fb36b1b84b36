"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): a key hidden at a chosen
depth in filler text, asked for at the end. A language model retrieves it when greedy
decoding after the question gives the key's tokens. This module makes the evaluation's rows
and scores them, and puts passkey rows into the training batches (Mix).

The text is the paper's generator's (epfml/landmark-attention, llama/run_test.py): the
filler sentences repeated, the information line and the final question, with one change
and one line fewer:

  <filler prefix>
  The pass key is 12345
  Remember it. 12345 is the pass key.
  <filler suffix>
  What is the pass key? The pass key is 12345

- The key ends a line where the paper writes "12345. Remember it.": it then ends at a word
  boundary at all three places, so it has the same tokens in each (glued to the period, a
  subword vocabulary may cut it otherwise there than in the answer).
- The paper's task description (an instruction to an instruction-tuned model) is left
  out: it takes 49 tokens of the stdlib BPE vocabulary, most of L = 64.

Tokens: the prompt goes through the run's own tokenizer in segments that meet at word
boundaries (the filler, each fixed phrase, the key as a decimal number, each line ending in
EOS as the documents' lines do, after BOS): for a sentencepiece model that splits on
whitespace (every one this project trains), exactly the encoding of the whole text; for any
other, the key still has one tokenization.

Lengths: a row is exactly length + 1 tokens (inputs, and targets shifted by one, as
source.window_batch's): the filler takes what the fixed parts leave, the first round(depth·F)
of its F tokens before the information line and the first F − round(depth·F) after it (both
cut from the start of the repeated filler, as the paper's). Keys are the paper's, uniform
in 1..50000; key i of every (length, depth) cell is drawn from (seed, i), so the cells
differ only in where the key is and how much filler surrounds it.

The metric: greedy retrieval, exact. A row is retrieved when the argmax at every answer
position, the earlier answer tokens given, is the key's token: exactly when greedy decoding
after the question reproduces the key's tokens, so one teacher-forced pass scores it
(tests/test_retrieval.py checks it against KV-cached decoding). The paper reads the first
integer of 10 sampled tokens; a key's tokens followed by more digits count here and not there.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_0, FRACTION, Range, check_ranges, identity_field
from transformer.core.vocab import BOS_ID, EOS_ID

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again.")
HEAD, REMEMBER, TAIL = "The pass key is", "Remember it.", "is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEYS = (1, 50_000)  # the paper's random.randint(1, 50000): both ends included
SUFFIX = "_passkey"  # a passkey split is named lenW_passkey (W: its evaluation length)
GRID = "passkey_by_length_depth"  # its metric {length: {depth: rate}} (DataSource.grids)


@dataclasses.dataclass(frozen=True)
class Passkey:
  """config.data.passkey of data.source "lm": passkey retrieval at each evaluation length."""

  examples: int = 0  # keys per (length, depth) cell; 0: no passkey evaluation
  depths: int = 5  # the key's depths: 0, 1/(depths − 1), ..., 1 of the filler before it
  seed: int = 0  # the keys' draws (the same keys at every length and depth)
  # the share of training rows that are passkey rows at L (Mix); it changes the training
  # data, so it is the run's identity; 0 (a saved run without the field too): none
  train_fraction: float = identity_field(0.0)

  def __post_init__(self):
    check_ranges(self, examples=AT_LEAST_0, depths=Range(2), seed=AT_LEAST_0,
                 train_fraction=FRACTION)

  @property
  def depth_values(self) -> list[float]:
    return [i / (self.depths - 1) for i in range(self.depths)]


def depth_name(depth: float) -> str:
  """A depth as a metric's key: 0, 0.25, 0.5, 0.75, 1."""
  return f"{depth:g}"


@dataclasses.dataclass(frozen=True)
class Phrases:
  """The prompt's fixed parts as token ids (lists of int): see the module docstring."""

  filler: list[int]  # the filler sentences repeated, at least as long as any filler needed
  head: list[int]
  remember: list[int]
  tail: list[int]
  question: list[int]

  @classmethod
  def encode(cls, encode: Callable[[str], list[int]], max_filler: int) -> "Phrases":
    """The phrases through `encode` (text -> ids, no BOS/EOS: the run's tokenizer), the
    filler repeated until it has at least max_filler tokens."""
    once = max(1, len(encode(FILLER)))
    filler = encode(" ".join([FILLER] * (max_filler // once + 2)))
    return cls(filler, encode(HEAD), encode(REMEMBER), encode(TAIL), encode(QUESTION))

  def fixed(self, key: list[int]) -> int:
    """Tokens of a row besides the filler: BOS, the lines' EOS (4), the phrases, the key 3×."""
    return 1 + 4 + len(self.head) + len(self.remember) + len(self.tail) + len(
        self.question) + 3 * len(key)


def training_keys(keys) -> np.ndarray:
  """Per key (bool): whether it is a training key, one a run with data.passkey.train_fraction
  > 0 trains on (Mix); its evaluation keys are the others. The halves are split
  by the lowest bit of a 64-bit mix of the key (splitmix64's finalizer), so each spreads
  evenly over the digits: the held-out keys ask for copying, not for unseen digits."""
  x = np.array(keys, np.uint64, ndmin=1) + np.uint64(0x9E3779B97F4A7C15)
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return ((x ^ (x >> np.uint64(31))) & np.uint64(1)) == 0


def draw_keys(seed: int, count: int, held_out: bool = False) -> list[int]:
  """Keys 0..count-1 of `seed`, each uniform in KEYS (a pure function of (seed, i)); with
  held_out, uniform among the keys that are not training_keys (the first of (seed, i)'s
  draws that is not: the same key where the first draw is one)."""
  keys = []
  for i in range(count):
    rng = np.random.default_rng([seed, i])
    key = int(rng.integers(KEYS[0], KEYS[1] + 1))
    while held_out and training_keys([key])[0]:
      key = int(rng.integers(KEYS[0], KEYS[1] + 1))
    keys.append(key)
  return keys


def filler_length(phrases: Phrases, key: list[int], length: int) -> int:
  """The filler tokens of a row of `length` (+1) hiding the key's tokens `key`; a
  ConfigError if the fixed parts leave no room."""
  filler = length + 1 - phrases.fixed(key)
  if filler < 0:
    raise ConfigError(
        f"the passkey prompt takes {phrases.fixed(key)} tokens of this run's tokenizer, more "
        f"than a window of {length} (+1) holds: raise data.max_len, or set "
        "data.passkey.examples=0")
  return filler


def prompt(phrases: Phrases, key: list[int], length: int, depth: float
           ) -> tuple[np.ndarray, int]:
  """(tokens [length + 1], where the information line starts) of a row hiding the key's
  tokens `key` at `depth` of the filler; a ConfigError if the fixed parts leave no room."""
  filler = filler_length(phrases, key, length)
  return prompt_at(phrases, key, filler, int(np.floor(depth * filler + 0.5)))


def prompt_at(phrases: Phrases, key: list[int], filler: int, before: int
              ) -> tuple[np.ndarray, int]:
  """prompt's row with `filler` tokens of filler, `before` of them before the information
  line."""
  if len(phrases.filler) < max(before, filler - before):
    raise ValueError(f"{len(phrases.filler)} filler tokens for {filler}")
  parts = [[BOS_ID], phrases.filler[:before], [EOS_ID]]
  start = sum(map(len, parts))
  parts += [phrases.head, key, [EOS_ID], phrases.remember, key, phrases.tail, [EOS_ID],
            phrases.filler[:filler - before], [EOS_ID], phrases.question, key]
  return np.concatenate([np.asarray(p, np.int32) for p in parts]), start


def rows(phrases: Phrases, keys: list[list[int]], length: int, depths: list[float]) -> dict:
  """Arrays [len(depths) · len(keys), length] in the batch layout: row d·len(keys) + i hides
  key i at depths[d]; only the answer (the key's tokens after the question) is scored."""
  n = len(depths) * len(keys)
  out = {k: np.zeros((n, length), np.int32) for k in (
      "inputs", "targets", "inputs_positions", "inputs_segmentation", "targets_positions",
      "targets_segmentation")}
  for d, depth in enumerate(depths):
    for i, key in enumerate(keys):
      row = d * len(keys) + i
      tokens, _ = prompt(phrases, key, length, depth)
      out["inputs"][row], out["targets"][row] = tokens[:-1], tokens[1:]
      out["inputs_positions"][row] = out["targets_positions"][row] = np.arange(length)
      out["inputs_segmentation"][row] = 1
      out["targets_segmentation"][row, length - len(key):] = 1
  return out


def retrieved(predictions: np.ndarray, targets: np.ndarray, scored: np.ndarray) -> np.ndarray:
  """Per row [n] (bool): the prediction is the target at every scored position."""
  return np.all((predictions == targets) | ~scored, axis=1)


def results(length: int, depths: list[float], arrays: dict, predictions: np.ndarray) -> dict:
  """The metrics of a passkey split (rows as `rows` lays them out) from each position's
  most likely token: `exact_match`, the fraction of keys retrieved, and GRID {length:
  {depth: that fraction at the depth}}."""
  hit = retrieved(predictions, arrays["targets"], arrays["targets_segmentation"] > 0)
  by_depth = hit.reshape(len(depths), -1).mean(axis=1)
  return {"exact_match": float(hit.mean()),
          GRID: {length: {depth_name(d): float(r) for d, r in zip(depths, by_depth)}}}


STREAM = 1  # the generator (seed, STREAM, i) of training row i's passkey draws


@dataclasses.dataclass(frozen=True)
class Row:
  """A passkey row of a training batch: training key `key` (an index into Mix.keys) with
  `before` filler tokens before its information line."""

  key: int
  before: int


class Mix:
  """The passkey rows of a run's training batches (data.passkey.train_fraction = f > 0), so
  that a small model learns the format at the training length L. Training row i (batch s
  holds rows s·B ... s·B + B − 1) is a passkey row at L when the first draw of the generator
  (run seed, STREAM, i) is below f; its key and the number of filler tokens before the
  information line (uniform over 0..F) are its next draws; any other row is the window it is
  without the mix. A row is a pure function of (seed, i): a resumed run trains on what an
  uninterrupted one would. Keys are drawn from the training half of KEYS (training_keys); a
  run with a mix is evaluated on the other half (draw_keys(held_out=True)), so no evaluation
  row is ever trained on. The loss is the whole row, as language-model text (docs/results.md
  compares it with scoring the answer alone)."""

  def __init__(self, fraction: float, seed: int, length: int,
               encode: Callable[[str], list[int]]):
    """fraction: data.passkey.train_fraction (> 0); seed: the run's; length: L; encode: the
    run's tokenizer (text -> ids). A ConfigError if a training key's row exceeds L."""
    self.fraction, self.seed, self.length = fraction, seed, length
    self.phrases = Phrases.encode(encode, length)
    every = np.arange(KEYS[0], KEYS[1] + 1)
    self.keys = every[training_keys(every)]  # [~25000] the training keys
    self.tokens = [encode(str(k)) for k in self.keys]
    longest = max(self.tokens, key=len)
    if self.phrases.fixed(longest) > length + 1:
      raise ConfigError(
          f"a passkey training row takes at least {self.phrases.fixed(longest)} tokens of "
          f"this run's tokenizer (with the key {self.keys[self.tokens.index(longest)]}), more "
          f"than a window of {length} (+1) holds: raise data.max_len, or set "
          "data.passkey.train_fraction=0")

  def draw(self, i: int) -> Row | None:
    """Training row i's passkey row, or None where row i is a window of text."""
    rng = np.random.default_rng([self.seed, STREAM, i])
    if rng.random() >= self.fraction:
      return None
    key = int(rng.integers(len(self.keys)))
    filler = filler_length(self.phrases, self.tokens[key], self.length)
    return Row(key, int(rng.integers(filler + 1)))

  def batch(self, rows: list, windows: Callable[[list[int]], dict]) -> dict:
    """The batch of `rows` (per row a window start, or a Row): windows(starts) makes the
    windows (source.window_batch's arrays [n, L]), then each Row's prompt replaces its row."""
    out = windows([0 if isinstance(r, Row) else r for r in rows])
    for n, row in enumerate(rows):
      if isinstance(row, Row):
        key = self.tokens[row.key]
        filler = filler_length(self.phrases, key, self.length)
        tokens, _ = prompt_at(self.phrases, key, filler, row.before)
        out["inputs"][n], out["targets"][n] = tokens[:-1], tokens[1:]
        out["inputs_positions"][n] = out["targets_positions"][n] = np.arange(self.length)
        out["inputs_segmentation"][n] = out["targets_segmentation"][n] = 1
    return out

