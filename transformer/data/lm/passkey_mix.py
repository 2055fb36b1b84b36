"""Passkey rows in a language model's training batches (data.passkey.train_fraction > 0), so
that a small model learns the retrieval format at the training length L and the evaluation
at L, 2L, ... asks whether retrieval survives at lengths never trained.

Rows: training row i (the LM source's row i: batch s holds rows s·B ... s·B + B − 1) is a
passkey row when the first uniform draw of the generator (run seed, STREAM, i) is below the
fraction; its key and the place of the information line are that generator's next draws.
A row is a pure function of (seed, i): batch s is the same whether or not earlier batches
were made, so a resumed run trains on what an uninterrupted one would; a row that is not a
passkey row is the window it is without the mix (lm.py draws windows from (seed, 0, i)).
A passkey row is passkey.prompt's row at L: exactly L + 1 tokens, inputs and targets
shifted by one as lm.window_batch's windows.

Keys: uniform over the training half of 1..50000 (passkey.training_keys); a run with a mix
is evaluated on keys of the other half (passkey.draw_keys(held_out=True)). No evaluation
row is ever trained on: its key is never a training key, at any depth and length, whatever
data.passkey.seed, .examples and .depths an evaluation sets. The halves are pseudorandom,
so held-out keys have the training keys' digits and tokens: retrieving one is copying it,
not recalling a key seen in training.

Depth: the number of filler tokens before the information line is uniform over 0..F (F
the row's filler), every place the evaluation's depths can put it at L.

Loss: the whole row, as language-model text, like every other training row. The mix then
changes what the corpus holds (a fraction f of the rows and of the scored tokens), not the
objective, and the key's repetition a few tokens after it ("Remember it. KEY") is a
short-range copy on the way to the long-range one. Scoring the answer alone gives these
rows ~1/16 of a window's weight in the loss (a key of 3-5 pieces in 64 tokens). On
configs/lm_context.py (rotary, one seed, f = 0.25) the whole row retrieved 26% of the
held-out keys at L (token accuracy 0.70; perplexity at L 49.9), the answer alone 16% (0.63;
49.5); a tiny model on a toy corpus went the other way at 400 steps: one seed each, so
weak evidence either way, and the whole row is the plainer choice. The first key is
unpredictable (its loss is the digits' entropy) and the filler is memorized quickly;
neither is asked for at evaluation.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from transformer.core.errors import ConfigError
from transformer.data.lm import passkey

STREAM = 1  # the generator (seed, STREAM, i) of training row i's passkey draws


@dataclasses.dataclass(frozen=True)
class Row:
  """A passkey row of a training batch: training key `key` (an index into Mix.keys) with
  `before` filler tokens before its information line."""

  key: int
  before: int


class Mix:
  """The passkey rows of a run's training batches (module docstring)."""

  def __init__(self, fraction: float, seed: int, length: int,
               encode: Callable[[str], list[int]]):
    """fraction: data.passkey.train_fraction (> 0); seed: the run's; length: L; encode: the
    run's tokenizer (text -> ids). A ConfigError if a training key's row exceeds L."""
    self.fraction, self.seed, self.length = fraction, seed, length
    self.phrases = passkey.Phrases.encode(encode, length)
    every = np.arange(passkey.KEYS[0], passkey.KEYS[1] + 1)
    self.keys = every[passkey.training_keys(every)]  # [~25000] the training keys
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
    filler = passkey.filler_length(self.phrases, self.tokens[key], self.length)
    return Row(key, int(rng.integers(filler + 1)))

  def batch(self, rows: list, windows: Callable[[list[int]], dict]) -> dict:
    """The batch of `rows` (per row a window start, or a Row): windows(starts) makes the
    windows (lm.window_batch's arrays [n, L]), then each Row's prompt replaces its row."""
    out = windows([0 if isinstance(r, Row) else r for r in rows])
    for n, row in enumerate(rows):
      if isinstance(row, Row):
        key = self.tokens[row.key]
        filler = passkey.filler_length(self.phrases, key, self.length)
        tokens, _ = passkey.prompt_at(self.phrases, key, filler, row.before)
        out["inputs"][n], out["targets"][n] = tokens[:-1], tokens[1:]
        out["inputs_positions"][n] = out["targets_positions"][n] = np.arange(self.length)
        out["inputs_segmentation"][n] = out["targets_segmentation"][n] = 1
    return out

