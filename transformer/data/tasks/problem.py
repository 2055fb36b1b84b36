"""The seam every generated task meets (reverse, copy, sort, the 15 tasks of Delétang et al.,
ListOps, duplicates): a task is a *problem* — what is asked, its alphabets and answers —
drawn into splits by a *splits rule* — the lengths of each split, whether a slice of inputs is
held out, how example i of a split is drawn. Composed (drawn_by), the two are the task a
config.task section parses to: `example(seed, split, index)` is a pure function of its
arguments, so batches are resumable and identical on any number of processes.

  Problem      what is asked (this module): `sample(rng, n)` draws an input of length n and
               its answer, or `draw(rng, lengths)` one of a length in `lengths`; every task's
               problem, by the task's name: TASKS, data/tasks/registry.py.
  SplitsRule   how instances are drawn into splits (data/tasks/splits.py): the papers'
               length splits, or held-out slices of input space.
  Cast         how an instance becomes a row a model family reads (data/tasks/casts.py): answer
               slots, seq2seq, a label per sequence, a label per token.

A problem's symbols are 0-based ints (inputs 0..input_size-1, answers 0..output_size-1); a
cast maps them to token ids. An answer is a string of output_length(n) symbols: one for a
classification (a label), n aligned with the input for a labelling.

A field that changes what a task computes is declared with `changed(new, old=...)`
(core/migration.py): a saved run whose config lacks the field reads `old`
(GeneratedSource.saved); every config file and override gets `new`.
"""

import abc
import dataclasses
import enum
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import Chosen
from transformer.core.vocab import NUM_RESERVED


class Answer(enum.Enum):
  """What a problem's answers are (Problem.answer): which casts can present them."""

  LABEL = "one label: output_length(n) = 1"
  PER_SYMBOL = "one symbol per input symbol: output_length(n) = input_length(n)"
  STRING = "a string of output_length(n) symbols"


class Instance(NamedTuple):
  """One instance of a problem: input symbols [input_length(length)], answer symbols
  [output_length(length)] (int32) and the length it was drawn at (the by-length metrics'
  key)."""

  inputs: np.ndarray
  outputs: np.ndarray
  length: int


@dataclasses.dataclass(frozen=True)
class TaskPart:
  """The root of Problem and SplitsRule, the two parts of a config.task section: its `name`
  (the task's key in TASKS) comes first; each __post_init__ checks its fields and calls its
  parent's, so a task composed of both checks both."""

  name: str

  def __post_init__(self):
    pass


@dataclasses.dataclass(frozen=True)
class Problem(TaskPart, abc.ABC):
  """A problem (config.task, with its splits rule's fields): subclasses set `name`'s default
  to their key in TASKS, their alphabets (input_size, output_size) and answers."""

  answer: ClassVar[Answer] = Answer.LABEL  # consistent with output_length (a test checks)
  sized: ClassVar[bool] = True  # sample(rng, n) draws at any given length n
  input_pieces: ClassVar[tuple[str, ...] | None] = None  # names of the input symbols

  @property
  @abc.abstractmethod
  def input_size(self) -> int:
    """Input symbols 0..input_size-1."""

  @property
  @abc.abstractmethod
  def output_size(self) -> int:
    """Answer symbols (classes) 0..output_size-1."""

  def output_length(self, n: int) -> int:
    """Answer symbols of an instance of length n; one (a label) by default."""
    del n
    return 1

  def input_length(self, n: int) -> int:
    """Input symbols of an instance of length n; n by default."""
    return n

  def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, answer) int32 symbols of a random instance of length n (sized tasks)."""
    raise NotImplementedError(f"task {self.name} is not drawn at a given length")

  def draw(self, rng: np.random.Generator, lengths: range) -> Instance | None:
    """A random instance of a length in `lengths`, or None if the draw missed them (the
    splits rule draws again): a uniform length, then sample()."""
    n = int(rng.integers(lengths.start, lengths.stop))
    inputs, outputs = self.sample(rng, n)
    return Instance(inputs, outputs, n)

  def accuracy_mask(self, outputs: np.ndarray) -> np.ndarray:
    """Which answer symbols count in the per-length accuracy (bool, like `outputs`): all by
    default; answers that end in a termination symbol and padding count up to it."""
    return np.ones(np.shape(outputs), bool)

  def pieces(self) -> tuple[str, ...]:
    """A name per input symbol (pictures, eval.py --sentence); the digits by default."""
    return self.input_pieces or tuple(str(i) for i in range(self.input_size))

  def from_text(self, text: str) -> np.ndarray:
    """An input written as space-separated pieces (eval.py --sentence) as symbols; a
    ConfigError naming what is allowed."""
    pieces, words = self.pieces(), text.split()
    if not words or any(w not in pieces for w in words):
      raise ConfigError(f"{self.name} input {text!r}: give space-separated symbols of "
                        f"{' '.join(pieces)}, e.g. {' '.join(pieces[:2])!r}")
    return np.array([pieces.index(w) for w in words], np.int32)

  def heldout_hash(self, inputs: np.ndarray) -> int:
    """The hash whose residue decides whether an input is held out: CRC32 of its token ids
    (symbol + NUM_RESERVED, int32). Saved runs' held-out slices are this hash's: it stays."""
    return zlib.crc32((np.asarray(inputs) + NUM_RESERVED).astype(np.int32).tobytes())


@dataclasses.dataclass(frozen=True)
class SplitsRule(TaskPart, abc.ABC):
  """A splits rule (data/tasks/splits.py): its fields join the problem's in config.task."""

  split_fields: ClassVar[dict[str, str]]  # held-out split -> config.task field of its longest

  @classmethod
  def draws(cls, problem: type[Problem]) -> bool:
    """Whether this rule can draw `problem`."""
    del problem
    return True

  @abc.abstractmethod
  def splits(self) -> dict[str, range]:
    """The lengths of each split: "train", then the held-out splits (their seed streams are
    1, 2, ... in this order); a held-out split without lengths is left out."""

  @abc.abstractmethod
  def example(self, seed: int, split: str, index: int) -> Instance:
    """Instance `index` of `split`: a pure function of (seed, split, index)."""

  def train_example(self, seed: int, index: int, batch_size: int) -> Instance:
    """Training row `index` of batches of batch_size rows (row i in batch i // batch_size):
    example(seed, "train", index) unless the rule draws something per batch."""
    del batch_size
    return self.example(seed, "train", index)

  def eval_rows(self, split: str, num_examples: int) -> int:
    """Rows of a held-out split asked for num_examples."""
    del split
    return num_examples

  def holds_out(self) -> bool:
    """Whether training never sees the held-out splits' inputs (is_heldout says which)."""
    return False

  def is_heldout(self, inputs: np.ndarray) -> bool:
    del inputs
    return False

  @property
  def train_length(self) -> int | None:
    """The longest training length (reports mark it on by-length plots); None: no such."""
    return None

  def stream(self, split: str) -> int:
    """The seed stream of a split: 0 for training, then 1, 2, ..."""
    return list(self.splits()).index(split)


def drawn_by(rule: type[SplitsRule], problems: Mapping[str, type[Problem]]) -> dict[str, type]:
  """config.task's choices for a source whose splits rule is `rule`: each problem it can
  draw, composed with it into one frozen dataclass with the fields of both (a field both
  declare, e.g. ListOps's lengths, keeps the problem's default) and named for both:
  `LengthSplits[ReverseString]` is ReverseString drawn by LengthSplits. Built once, so a
  parsed config compares equal to itself parsed again.

  Generated, not written out: a task is then one problem class and its registry line, and
  every rule that can draw it offers it (written out, each new problem would need a class per
  rule); tests/test_tasks.py lists every generated class against its two parts.
  """
  out = {}
  for name, problem in problems.items():
    if rule.draws(problem):
      qualname = f"{rule.__name__}[{problem.__name__}]"
      doc = (f"{problem.__qualname__} ({problem.__module__}) drawn by {rule.__qualname__} "
             f"({rule.__module__}).")
      namespace = {"__module__": __name__, "__qualname__": qualname, "__doc__": doc}
      out[name] = dataclasses.dataclass(frozen=True)(type(qualname, (problem, rule), namespace))
  return out


@dataclasses.dataclass(frozen=True)
class TaskChoice(Chosen):
  """config.task of a generated source: `name` picks the task of the registry. A name in
  `renamed` (a task's former name) is refused in a config (parse), and read as its new one
  in a run's saved config (rename, which the source's `saved` applies first): a saved run
  restores unchanged, and a new one is written under the name it will be listed by."""

  renamed: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def parse(self, section: Mapping[str, Any], name: str):
    given = section.get(self.key)
    if isinstance(given, str) and given in self.renamed:
      raise ConfigError(f"config.{name}.{self.key}={given!r} is the former name of "
                        f"{self.renamed[given]!r}: write --config.{name}.{self.key}="
                        f"{self.renamed[given]} (a run saved under the former name restores "
                        "as it is)")
    return super().parse(section, name)

  def rename(self, section: Mapping[str, Any]) -> dict[str, Any]:
    section = dict(section)
    if isinstance(section.get(self.key), str) and section[self.key] in self.renamed:
      section[self.key] = self.renamed[section[self.key]]
    return section
