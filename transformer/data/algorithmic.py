"""data.source "algorithmic": the length-generalisation tasks of Delétang et al. 2023 and
Ruoss et al. 2023 (data/chomsky), cast (data.cast) as the papers cast them for a
Transformer, "slots": an encoder (model.arch=encoder, pooling none) reads the input string
followed by one answer slot per output symbol and predicts every output symbol at its slot
in one pass; or "seq2seq": an encoder-decoder reads the input and decodes the output.

Slots: a row is [input symbols…, SLOT × output_length(n)]: input symbol s is token
NUM_RESERVED + s and SLOT the token after them; `targets` hold the output symbols (classes)
at the slots, which are the only weighted positions (the loss is over every slot, as in
DeepMind's code). Seq2seq: the input and the output as token sequences ending in EOS
(symbol s is token NUM_RESERVED + s on both sides); evaluation decodes greedily.

Training rows draw their length uniformly from task.min_len..task.max_len, one per row (the
papers draw one per batch); example i of a split is a pure function of (seed, split, i),
so batches are resumable and identical on any number of processes. Held-out splits spread
config.eval.num_examples evenly over their lengths: `valid` over the training lengths,
`test` over task.max_len+1..task.test_max_len. Besides loss and accuracy (pooled over every
output token) each split reports the papers' metric: accuracy per input length over the
output symbols the task scores (base.Task.accuracy_mask), `accuracy_by_length`, and its
mean over the split's lengths, `mean_accuracy` (their score on the test lengths).
"""

import dataclasses

import grain
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import Chosen, check
from transformer.core.metrics import Metric
from transformer.core.registry import lookup
from transformer.core.vocab import EOS_ID, NUM_RESERVED, RESERVED_PIECES
from transformer.data import SourceArgs, Targets, pipeline
from transformer.data.base import DataSource, Example, Split, SplitResult
from transformer.data.chomsky import TASKS
from transformer.data.labelled import label_batch

_TRAIN_STREAM = 0  # evaluation splits use 1, 2, ...
CASTS = {"slots": Targets.TOKEN_LABELS, "seq2seq": Targets.SEQUENCE}  # data.cast


@dataclasses.dataclass(frozen=True)
class AlgorithmicData:
  """config.data of data.source "algorithmic": how the task is cast for a model."""

  source: str
  cast: str = "slots"  # slots (an encoder, as the papers) | seq2seq (an encoder-decoder)

  def __post_init__(self):
    lookup(CASTS, self.cast, "data.cast")


def slot_id(task) -> int:
  """The answer slot's token id, after the input symbols'."""
  return NUM_RESERVED + task.input_size


def pair_at(task, seed: int, split: int, index: int, length: int):
  """(input, output) symbols of example `index` of a split, of `length` input symbols."""
  return task.sample(np.random.default_rng([seed, split, index]), length)


def seq2seq_example(symbols, answer):
  """(source, target) token ids, each ending in EOS."""
  eos = np.array([EOS_ID], np.int32)
  return (np.concatenate([symbols + NUM_RESERVED, eos]),
          np.concatenate([answer + NUM_RESERVED, eos]))


def slots_example(task, symbols, answer):
  """(tokens, labels, weights) of one example: the row layout of the module docstring."""
  length, slots = len(symbols), len(answer)
  tokens = np.concatenate([symbols + NUM_RESERVED, np.full(slots, slot_id(task), np.int32)])
  labels = np.concatenate([np.zeros(length, np.int32), answer]).astype(np.int32)
  weights = np.concatenate([np.zeros(length, np.int32), np.ones(slots, np.int32)])
  return tokens, labels, weights


def split_lengths(task) -> dict[str, range]:
  """Input lengths of each held-out split (the test split only past the training ones)."""
  lengths = {"valid": range(task.min_len, task.max_len + 1),
             "test": range(task.max_len + 1, task.test_max_len + 1)}
  return {name: r for name, r in lengths.items() if len(r)}


def row_length(task, lengths, cast: str = "slots") -> int:
  """Tokens of the longest row of any of these input lengths (seq2seq: of either side)."""
  if cast == "seq2seq":
    return max(max(n, task.output_length(n)) + 1 for n in lengths)
  return max(n + task.output_length(n) for n in lengths)


def answers(task, cast: str, split: Split, predictions: np.ndarray):
  """(input length, answer, predicted answer) of each row of a split: at the slots, or the
  first output_length(n) decoded tokens."""
  inputs, targets = split.arrays["inputs"], split.arrays["targets"]
  if cast == "seq2seq":
    lengths = (inputs != 0).sum(1) - 1  # EOS excluded
    for row, n in enumerate(lengths):
      k = task.output_length(int(n))
      yield int(n), targets[row, :k] - NUM_RESERVED, predictions[row, :k] - NUM_RESERVED
    return
  slots = inputs == slot_id(task)
  lengths = ((inputs != 0) & ~slots).sum(1)
  for row, n in enumerate(lengths):
    yield int(n), targets[row, slots[row]], predictions[row, slots[row]]


def row_accuracy(task, split: Split, predictions: np.ndarray, cast: str = "slots"
                 ) -> dict[str, np.ndarray]:
  """Each row's input `length`, the output symbols the task scores (`scored`) and how many
  of them were predicted (`hits`), [rows] each: mean_accuracy's per-example parts."""
  rows = []
  for n, answer, predicted in answers(task, cast, split, predictions):
    scored = task.accuracy_mask(answer)
    rows.append((n, int((scored & (answer == predicted)).sum()), int(scored.sum())))
  return dict(zip(("length", "hits", "scored"), np.array(rows, np.int64).reshape(-1, 3).T))


def pooled_accuracy(rows: dict[str, np.ndarray]) -> dict[int, float]:
  """{input length: Σ hits / Σ scored over the rows of that length} of row_accuracy's rows."""
  lengths = rows["length"]
  return {int(n): int(rows["hits"][lengths == n].sum()) / int(rows["scored"][lengths == n].sum())
          for n in np.unique(lengths)}


def length_accuracy(task, split: Split, predictions: np.ndarray, cast: str = "slots"
                    ) -> dict[int, float]:
  """{input length: accuracy over the output symbols the task scores}, pooled over the
  split's rows of that length (DeepMind's per-length accuracy)."""
  return pooled_accuracy(row_accuracy(task, split, predictions, cast))


class AlgorithmicSource(DataSource):
  """data.source "algorithmic": config.task names a task of data/chomsky (its fields: that
  task's dataclass), cast (data.cast) for an encoder with a label per token or for an
  encoder-decoder."""

  Data = AlgorithmicData
  Task = Chosen(TASKS, "name", "algorithmic task")
  own_metrics = {"mean_accuracy": Metric(0.0, 1.0, parts=("hits", "scored"), stratum="length"),
                 "accuracy_by_length": Metric(0.0, 1.0)}  # {length: accuracy}

  def __init__(self, data, task, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          "≥ 1 for a generated task")
    self.targets = CASTS[data.cast]

  def _example(self, split: int, index: int, length: int):
    symbols, answer = pair_at(self.task, self.args.seed, split, index, length)
    if self.data.cast == "seq2seq":
      return seq2seq_example(symbols, answer)
    return slots_example(self.task, symbols, answer)

  def _batch(self, examples, width: int):
    if self.data.cast == "seq2seq":
      return pipeline.pad_batch(examples, width)
    return label_batch(examples, width)

  @classmethod
  def output_sizes(cls, data, task) -> tuple[int, int]:
    if data.cast == "seq2seq":  # one vocabulary: symbols of either side
      return NUM_RESERVED + max(task.input_size, task.output_size), 0
    return slot_id(task) + 1, task.output_size

  @classmethod
  def train_length(cls, data, task) -> int:
    return task.max_len

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="reverse_string", min_len=1, max_len=4, test_max_len=6)
    return Example({"data": {"source": "algorithmic"}, "task": task,
                    "model": {"arch": "encoder", "pooling": "none"}}, "0 1 1")

  def max_lengths(self) -> dict[str, int]:
    lengths = split_lengths(self.task)
    fields = {"valid": "task.max_len", "test": "task.test_max_len"}
    return {fields[name]: row_length(self.task, r, self.data.cast)
            for name, r in lengths.items()}

  def train_batches(self) -> grain.IterDataset:
    """Endless batches; batch `step` is a pure function of (seed, step), this process's rows."""
    task, seed = self.task, self.args.seed
    width = row_length(task, range(task.min_len, task.max_len + 1), self.data.cast)

    def row(i):
      length = np.random.default_rng([seed, _TRAIN_STREAM, i, 1]).integers(
          task.min_len, task.max_len + 1)
      return self._example(_TRAIN_STREAM, i, int(length))

    return pipeline.generated_batches(
        self.args.batch_size, row, lambda exs: self._batch(exs, width)
    ).to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """`valid` and `test`: num_examples rows each (0: config.eval.num_examples), spread
    evenly over the split's input lengths (at least one of each)."""
    n = num_examples or self.args.eval_examples
    splits = {}
    for split_id, (name, lengths) in enumerate(split_lengths(self.task).items(), start=1):
      rows = max(n, len(lengths))
      examples = [self._example(split_id, i, lengths[i % len(lengths)]) for i in range(rows)]
      splits[name] = Split(self._batch(examples, row_length(self.task, lengths, self.data.cast)))
    return splits

  def decode_length(self, split: Split) -> int:
    return split.arrays["targets"].shape[1]  # the whole answer and its EOS

  def split_results(self, name, split, outputs) -> SplitResult:
    rows = row_accuracy(self.task, split, outputs["predictions"], self.data.cast)
    by_length = pooled_accuracy(rows)
    return SplitResult({"mean_accuracy": float(np.mean(list(by_length.values()))),
                        "accuracy_by_length": by_length}, examples=rows)

  def encode(self, text: str) -> np.ndarray:
    """Space-separated input pieces (e.g. "0 1 1") -> the input's tokens and answer slots
    (seq2seq: and EOS)."""
    pieces = self.task.pieces()
    words = text.split()
    if not words or any(w not in pieces for w in words):
      raise ConfigError(f"{self.task.name} input {text!r}: give space-separated symbols of "
                        f"{' '.join(pieces)}, e.g. {' '.join(pieces[:2])!r}")
    symbols = np.array([pieces.index(w) for w in words], np.int32)
    if self.data.cast == "seq2seq":
      return np.concatenate([symbols + NUM_RESERVED, [EOS_ID]]).astype(np.int32)
    slots = np.full(self.task.output_length(len(words)), slot_id(self.task), np.int32)
    return np.concatenate([symbols + NUM_RESERVED, slots])

  def pieces(self, ids) -> list[str]:
    """A label per token id: its input symbol (others: their number), `?` for an answer
    slot, or <pad>, </s>."""
    names = dict(enumerate(self.task.pieces(), start=NUM_RESERVED))
    if self.data.cast == "slots":
      names[slot_id(self.task)] = "?"
    return [names.get(i, RESERVED_PIECES.get(i, str(i - NUM_RESERVED)))
            for i in np.asarray(ids).tolist()]
