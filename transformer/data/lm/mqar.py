"""data.source "mqar": multi-query associative recall (Arora et al. 2024, "Zoology"), a
synthetic language-modelling task for the decoder-only family: trained on sequences of
data.max_len = L tokens, evaluated by sequence length × number of key-value pairs.

A sequence of length W with N pairs, as Zoology's generator writes it
(HazyResearch/zoology, zoology/data/multiquery_ar.py, random_non_queries=True, one pass):
  * the pairs k1 v1 ... kN vN: N distinct keys from the first half of the data.vocab_size
    symbols, N distinct values from the second half;
  * then the query region: key k_i asked once, at offset 2·g_i from the region's start,
    the gaps g_i drawn without replacement from 0..space−1 (space = (W − 2N)/2) with
    probability ∝ (g + 1)^(power_a − 1): with power_a = 0.01 close to 1/(g + 1), so most
    queries come soon after the pairs, as repeated bigrams do in text;
  * every other position a symbol drawn uniformly from all of them.
The loss is on the answers only: at a query's position the target is the key's value (the
input after it is noise, so the model has to recall it). Symbols are token ids from
NUM_RESERVED up; their pieces are k0, k1, ... for keys and v0, v1, ... for values.

Held-out splits, drawn from one fixed stream whatever config.seed (every run is tested on
the same sequences, so runs pair by sequence): `valid`, the training distribution (W = L,
N = data.num_kv_pairs); and `lenW` for W = L, 2L, ..., data.max_factor·L, with
eval.num_examples rows for each N = num_kv_pairs·2^j that fits (4N ≤ W, as Zoology asserts,
and N ≤ vocab_size/2). Each reports loss and accuracy over its answers (Zoology's metric;
`valid/accuracy` is a report's main metric), and a `lenW` split `accuracy_by_length` {W:
accuracy at the training N} (the reports' extrapolation plot) and the grid GRID {W: {N:
accuracy}}.
"""

import dataclasses
import math

import grain
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_1, Range, check, check_ranges
from transformer.core.vocab import NUM_RESERVED, RESERVED_PIECES
from transformer.data import SourceArgs, Targets, pipeline
from transformer.data.base import DataSource, Example, Grid, Split, SplitResult

GRID = "accuracy_by_length_pairs"
_TRAIN, _HELDOUT = 0, 1  # the random streams of training and held-out rows
_KEYS = ("inputs", "targets", "inputs_positions", "inputs_segmentation", "targets_positions",
         "targets_segmentation")


@dataclasses.dataclass(frozen=True)
class MQARData:
  """config.data for data.source "mqar"."""

  source: str = "mqar"
  vocab_size: int = 256  # symbols: keys the first half, values the second (Zoology: 8192)
  max_len: int = 64  # L: the training sequence length (Zoology's input_seq_len)
  num_kv_pairs: int = 4  # N: key-value pairs per training sequence
  power_a: float = 0.01  # the query gaps' power law (1: uniform)
  max_factor: int = 8  # evaluation at L, 2L, 4L, ... up to max_factor·L

  def __post_init__(self):
    check_ranges(self, vocab_size=Range(2), max_len=Range(4), num_kv_pairs=AT_LEAST_1,
                 power_a=Range(0, 1, lo_open=True), max_factor=AT_LEAST_1)
    check(self.vocab_size % 2 == 0, "vocab_size", self.vocab_size, "even (keys and values "
          "take half each)")
    check(self.max_len % 2 == 0, "max_len", self.max_len, "even (Zoology's query region "
          "holds a query every other position)")
    check(self.max_factor & (self.max_factor - 1) == 0, "max_factor", self.max_factor,
          "a power of 2")
    check(4 * self.num_kv_pairs <= self.max_len, "num_kv_pairs", self.num_kv_pairs,
          f"at most max_len/4 = {self.max_len // 4} (the pairs, and a query region with room "
          "for each key)")
    check(self.num_kv_pairs <= self.vocab_size // 2, "num_kv_pairs", self.num_kv_pairs,
          f"at most vocab_size/2 = {self.vocab_size // 2} (distinct keys)")

  @property
  def eval_lengths(self) -> list[int]:
    return [self.max_len * 2**i for i in range(int(math.log2(self.max_factor)) + 1)]

  def eval_pairs(self, length: int) -> list[int]:
    """The numbers of pairs evaluated at `length`: num_kv_pairs·2^j while they fit."""
    out, n = [], self.num_kv_pairs
    while 4 * n <= length and n <= self.vocab_size // 2:
      out.append(n)
      n *= 2
    return out


def sequence(rng: np.random.Generator, length: int, num_pairs: int, vocab_size: int,
             power_a: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """One MQAR sequence (module docstring) in symbols 0..vocab_size−1: (inputs [length],
  targets [length], scored [length] bool): targets hold each query's value at its key's
  position, 0 elsewhere."""
  half = vocab_size // 2
  keys = rng.choice(half, num_pairs, replace=False)
  values = half + rng.choice(vocab_size - half, num_pairs, replace=False)
  space = (length - 2 * num_pairs) // 2
  p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
  gaps = rng.choice(space, num_pairs, replace=False, p=p / p.sum())
  inputs = rng.integers(vocab_size, size=length)
  inputs[0:2 * num_pairs:2], inputs[1:2 * num_pairs:2] = keys, values
  queries = 2 * num_pairs + 2 * gaps
  inputs[queries] = keys
  targets, scored = np.zeros(length, np.int64), np.zeros(length, bool)
  targets[queries], scored[queries] = values, True
  return inputs, targets, scored


def batch(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
  """Sequences of one length in the batch layout (symbols as token ids)."""
  inputs, targets, scored = (np.stack(x) for x in zip(*rows))
  n, length = inputs.shape
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length))
  return dict(zip(_KEYS, (
      (inputs + NUM_RESERVED).astype(np.int32),
      np.where(scored, targets + NUM_RESERVED, 0).astype(np.int32), positions.copy(),
      np.ones((n, length), np.int32), positions.copy(), scored.astype(np.int32))))


def accuracy(predictions: np.ndarray, arrays: dict, rows: np.ndarray) -> float:
  """Of the selected rows (a mask [n]), the fraction of all their queries whose predicted
  token [n, length] is the value (pooled over queries, as Zoology's accuracy)."""
  scored = arrays["targets_segmentation"][rows] > 0
  return float(((predictions[rows] == arrays["targets"][rows]) & scored).sum() / scored.sum())


class MQARSource(DataSource):
  """data.source "mqar" (module docstring)."""

  Data = MQARData
  targets = Targets.NEXT_TOKENS  # a causal model's prediction at each position, scored at queries
  grids = {GRID: Grid("MQAR accuracy", "sequence length (tokens)", "key-value pairs")}

  def __init__(self, data: MQARData, task, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          "≥ 1 (sequences per length and number of pairs)")

  @classmethod
  def output_sizes(cls, data: MQARData, task) -> tuple[int, int]:
    return NUM_RESERVED + data.vocab_size, 0

  @classmethod
  def train_length(cls, data: MQARData, task) -> int:
    return data.max_len

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    data = dict(source="mqar", vocab_size=16, max_len=16, num_kv_pairs=2, max_factor=2)
    return Example({"data": data, "model": {"arch": "decoder"}}, "k1 v3 k0 v5 k1")

  def max_lengths(self) -> dict[str, int]:
    return {"data.max_len": self.data.max_len,
            "data.max_factor × data.max_len": self.data.eval_lengths[-1]}

  def _sequence(self, stream: int, length: int, pairs: int, i: int, seed: int = 0):
    rng = np.random.default_rng([seed, stream, length, pairs, i])
    return sequence(rng, length, pairs, self.data.vocab_size, self.data.power_a)

  def train_batches(self) -> grain.IterDataset:
    """Endless batches at L with num_kv_pairs pairs; row i a pure function of (seed, i)."""
    d, seed = self.data, self.args.seed
    return pipeline.generated_batches(
        self.args.batch_size,
        lambda i: self._sequence(_TRAIN, d.max_len, d.num_kv_pairs, i, seed), batch
    ).to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """`valid` and `lenW` (module docstring), num_examples rows per number of pairs (0:
    eval.num_examples); a `lenW` split's rows grouped by their number of pairs."""
    n, d = num_examples or self.args.eval_examples, self.data
    cells = {"valid": (d.max_len, [d.num_kv_pairs])}
    cells.update({f"len{w}": (w, d.eval_pairs(w)) for w in d.eval_lengths})
    return {name: Split(batch([self._sequence(_HELDOUT, w, pairs, i)
                               for pairs in all_pairs for i in range(n)]))
            for name, (w, all_pairs) in cells.items()}

  def split_results(self, name, split, outputs) -> SplitResult:
    """Of a lenW split, accuracy_by_length and GRID (module docstring)."""
    if not name.startswith("len"):
      return SplitResult({})
    length = split.arrays["inputs"].shape[1]
    all_pairs = self.data.eval_pairs(length)  # eval_splits' rows: grouped by their pairs
    pairs = np.repeat(all_pairs, len(split) // len(all_pairs))
    by_pairs = {p: accuracy(outputs["predictions"], split.arrays, pairs == p)
                for p in all_pairs}
    return SplitResult({"accuracy_by_length": {length: by_pairs[self.data.num_kv_pairs]},
                        GRID: {length: {str(p): a for p, a in by_pairs.items()}}})

  def encode(self, text: str) -> np.ndarray:
    """Space-separated pieces (k0 ... for keys, v0 ... for values) as token ids."""
    ids = {piece: i for i, piece in enumerate(self._pieces())}
    bad = [p for p in text.split() if p not in ids]
    if bad or not text.split():
      half = self.data.vocab_size // 2
      raise ConfigError(f"{' '.join(bad) or repr(text)}: an MQAR input is space-separated "
                        f"keys k0..k{half - 1} and values v0..v{half - 1}")
    return np.asarray([ids[p] for p in text.split()], np.int32)

  def _pieces(self) -> list[str]:
    half = self.data.vocab_size // 2
    return ([RESERVED_PIECES.get(i, f"<{i}>") for i in range(NUM_RESERVED)]
            + [f"k{i}" for i in range(half)] + [f"v{i}" for i in range(half)])

  def pieces(self, ids) -> list[str]:
    table = self._pieces()
    return [table[i] for i in np.asarray(ids).tolist()]
