"""The interface every data source meets. A source is registered in sources.SOURCES under its
`data.source` name; tests/test_sources.py runs one conformance suite over every registered
source (each gives a tiny instance of itself: DataSource.example), so a new source is
tested the moment it is registered.

A source declares its config sections (Data: config.data; Task: config.task, or None) as
frozen dataclasses, parsed once by transformer/run/config.py, and what its batches ask a model
to predict (targets), which the model family must learn (families.ModelFamily.learns). It
gives training batches (a checkpointable grain IterDataset of the batch layout in
data/__init__.py), held-out Splits, and the metrics of a model's outputs on them.
"""

import abc
import dataclasses
from typing import Any, ClassVar, NamedTuple

import grain
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import Chosen
from transformer.data import SourceArgs, Targets


@dataclasses.dataclass(frozen=True)
class SourceSection:
  """config.data of a source whose settings are its task section: the source's name only."""

  source: str


@dataclasses.dataclass(frozen=True)
class Split:
  """A held-out split: padded arrays in the batch layout, the raw target texts where the
  data has them (BLEU and chrF score detokenized predictions against them), and the length
  each row was drawn at where the data is generated (its by-length metrics' key)."""

  arrays: dict[str, np.ndarray]
  references: list[str] | None = None
  lengths: np.ndarray | None = None  # [rows]

  def __len__(self) -> int:
    return len(self.arrays["inputs"])


class SplitResult(NamedTuple):
  """A source's metrics of a model's outputs on a split, the predictions as text lines
  when it has text (eval.py writes them beside the metrics), and the per-example parts of
  its metrics (core/metrics.py Metric.parts: {part: one value per row}, recorded with a
  run's final evaluation for paired tests over examples)."""

  metrics: dict[str, Any]
  hypotheses: list[str] | None = None
  examples: dict[str, np.ndarray] | None = None


class Grid(NamedTuple):
  """A split metric that is a table {row: {column: value}} (e.g. passkey retrieval by
  evaluation length × depth of the key), which a source declares (DataSource.grids):
  reports tabulate it and draw it as a heatmap, one row per split that has it."""

  title: str  # what the values are, e.g. "passkey retrieval (exact match)"
  rows: str  # what the rows are, e.g. "evaluation length (tokens)"
  columns: str  # what the columns are, e.g. "depth of the key"
  low: float = 0.0  # the values' range (the heatmap's colour scale)
  high: float = 1.0


class Example(NamedTuple):
  """A tiny instance of a source (DataSource.example): config sections that replace the
  base config's `data` and `task` and update its `model` (e.g. the family it needs), and an
  input the source can encode."""

  sections: dict[str, dict[str, Any]]
  sentence: str


class DataSource(abc.ABC):
  """A data source; see the module docstring. Subclasses set `targets` (a Targets) by the
  end of __init__, which checks the config further and writes nothing."""

  Data: ClassVar[type] = SourceSection  # config.data's dataclass
  Task: ClassVar[type | Chosen | None] = None  # config.task's dataclass, or None: no task
  # The split metrics (by key) that are tables {row: {column: value}}: see Grid.
  grids: ClassVar[dict[str, Grid]] = {}
  targets: Targets

  def __init__(self, data, task, args: SourceArgs):
    self.data, self.task, self.args = data, task, args

  # ------------------------------------------------------------------ declarations

  @property
  def unpacked_batches(self) -> bool:
    """Whether this source's training batches are declared unpacked: one sequence per row
    from slot 0, padded at the right (pipeline.unpacked), and so carry no `*_segmentation`
    or `*_positions`. Declared from the config alone, never read from the arrays. The
    omission is how the declaration reaches the model: jit traces a batch's keys, so the
    model needs no argument for it, and a batch with the keys (a held-out split, an old
    run's) is read exactly as before. tests/test_sources.py checks each declaration against
    the keys the source leaves out. Held-out splits keep their keys (metrics read
    targets_segmentation). Default False: packed rows, or targets scored in part."""
    return False

  @classmethod
  @abc.abstractmethod
  def output_sizes(cls, data, task) -> tuple[int, int]:
    """(vocabulary size, number of classes: 0 unless the targets are labels) of the config."""

  @classmethod
  def train_length(cls, data, task) -> int | None:
    """The longest training length, in the units of the by-length metrics (reports mark
    it on their extrapolation plots); None: no such metrics."""
    del data, task
    return None

  @classmethod
  def saved(cls, raw: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (nested dicts, today's layout) as it meant when saved: a field
    the source gained since, that changed what it computes, gets the value that keeps the
    old meaning (e.g. a problem's migration.changed fields). Unchanged by default."""
    return raw

  @classmethod
  @abc.abstractmethod
  def example(cls, directory: str) -> Example:
    """A tiny instance (Example), reading only files it writes under `directory`."""

  def alternatives(self, learns: frozenset[Targets]) -> str | None:
    """What this config could set instead so that a family that learns `learns` fits it
    (e.g. "data.cast slots or label"), for the error that refuses the family; None: nothing."""
    del learns
    return None

  # ------------------------------------------------------------------ data

  @abc.abstractmethod
  def max_lengths(self) -> dict[str, int]:
    """The longest sequences (tokens) the config implies, by the config field implying them:
    the model's positional encoding must cover each."""

  def load(self, has_checkpoints: bool = False) -> None:
    """Reads and checks the data and loads (or builds in memory) what eval_splits and
    encode need, e.g. a tokenizer; writes nothing, so that a bad corpus fails before a run
    writes anything. `has_checkpoints`: the workdir holds a run trained with what was kept
    there (its tokenizer stays). Nothing to load by default."""
    del has_checkpoints

  def prepare(self) -> None:
    """load(), then builds what training needs (writes a tokenizer load() trained, an
    encoded corpus) before batches are read; may write into the workdir, under its lock.
    Nothing to build by default."""
    self.load()

  @abc.abstractmethod
  def train_batches(self) -> grain.IterDataset:
    """Endless training batches of this process's rows, checkpointable (grain)."""

  @abc.abstractmethod
  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """The held-out splits, num_examples rows each (0: config.eval.num_examples)."""

  def file_split(self, source_path: str, reference_path: str) -> dict[str, Split]:
    """A split of any source/reference file pair (eval.py --source_file/--reference_file)."""
    del source_path, reference_path
    raise ConfigError("evaluating a source/reference file pair needs a text data source; "
                      f"this run's is {self.data.source!r}")

  def decode_length(self, split: Split) -> int:
    """Tokens to decode per row of `split` (targets Targets.SEQUENCE)."""
    raise NotImplementedError(f"data.source {self.data.source!r} is not decoded")

  def split_results(self, name: str, split: Split, outputs: dict[str, np.ndarray]
                    ) -> SplitResult:
    """The source's own metrics of a model's outputs on a split: outputs["predictions"]
    [n, length] (decoded tokens, or each position's most likely output) and, for scored
    splits, outputs["nll"] [n, t] (−log p of each target), each declared in
    core/metrics.py's METRICS (or, a grid, in `grids`). None besides the loss and accuracy
    every split has, by default."""
    del name, split, outputs
    return SplitResult({})

  # ------------------------------------------------------------------ text

  @abc.abstractmethod
  def encode(self, text: str) -> np.ndarray:
    """An input written as text (eval.py --sentence) as token ids; ConfigError if invalid."""

  @abc.abstractmethod
  def pieces(self, ids) -> list[str]:
    """A label per token id (pictures' axes)."""

  def detokenize(self, ids) -> str:
    """Token ids as text (generated continuations); the pieces, space-separated, by default."""
    return " ".join(self.pieces(ids))
