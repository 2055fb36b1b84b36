"""The data source of every generated task: a problem of data/tasks/registry.py
(config.task.name) drawn by the source's splits rule (data/tasks/splits.py) and presented by
a cast (data/tasks/casts.py). The registered sources ("synthetic", "labelled",
"algorithmic") are this class with their own rule, their way of choosing the cast, and their
metrics."""

import abc
from typing import Any, ClassVar

import grain
import numpy as np

from transformer.core.errors import ConfigError
from transformer.core.fields import check
from transformer.core.migration import as_saved
from transformer.data import SourceArgs, pipeline
from transformer.data.base import DataSource, Split
from transformer.data.tasks.casts import Cast
from transformer.data.tasks.problem import SplitsRule, TaskChoice


class GeneratedSource(DataSource):
  """A generated task presented by a cast (module docstring). Subclasses set `rule`, Task
  (a TaskChoice over drawn_by(rule, TASKS), or the part of it they take), `what` (how an
  error names the task), and cast_of."""

  rule: ClassVar[type[SplitsRule]]  # the splits rule the source's tasks are drawn by
  Task: ClassVar[TaskChoice]
  what: ClassVar[str]  # e.g. "a synthetic task"

  def __init__(self, data, task, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          f"≥ 1 for {self.what}")
    self.cast = self.cast_of(data, task)
    self.targets = self.cast.targets
    for split in task.splits():  # a split that has no instance fails here, not in training
      task.example(args.seed, split, 0)

  @classmethod
  @abc.abstractmethod
  def cast_of(cls, data, task) -> Cast:
    """The cast of this config; a ConfigError if it cannot present the task."""

  @staticmethod
  def fitting(cast: Cast, name: str, task) -> Cast:
    """`cast` (called `name`), or a ConfigError saying why it cannot present `task`."""
    problem = cast.unfit(task)
    if problem:
      raise ConfigError(f"data.cast {name!r} cannot present task {task.name!r}: {problem}")
    return cast

  # ------------------------------------------------------------------ declarations

  @classmethod
  def output_sizes(cls, data, task) -> tuple[int, int]:
    cast = cls.cast_of(data, task)
    return cast.vocab_size(task), cast.num_classes(task)

  @classmethod
  def train_length(cls, data, task) -> int | None:
    return task.train_length

  @classmethod
  def saved(cls, raw: dict[str, Any]) -> dict[str, Any]:
    """The task section with each `changed` field (core/migration.py) it lacks set to its
    old value."""
    section = cls.Task.rename(raw.get("task", {}))
    entry = cls.Task.registry.get(section.get(cls.Task.key))
    return raw if entry is None else {**raw, "task": as_saved(entry, section)}

  # ------------------------------------------------------------------ data

  def max_lengths(self) -> dict[str, int]:
    splits = self.task.splits()
    return {f"task.{field}": self.cast.width(self.task, splits[split])
            for split, field in self.task.split_fields.items() if split in splits}

  @property
  def unpacked_batches(self) -> bool:
    """The cast's declaration (Cast.unpacked)."""
    return self.cast.unpacked

  def train_batches(self) -> grain.IterDataset:
    """Endless batches; batch `step` is a pure function of (seed, step), this process's rows;
    without segment ids and positions where the cast declares its rows unpacked."""
    task, cast, seed, rows = self.task, self.cast, self.args.seed, self.args.batch_size
    width = cast.width(task, task.splits()["train"])
    layout = pipeline.unpacked if self.unpacked_batches else dict
    return pipeline.generated_batches(
        rows, lambda i: cast.row(task, task.train_example(seed, i, rows)),
        lambda rows: layout(cast.batch(rows, width))).to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """The task's held-out splits (task.splits()), num_examples rows each (0:
    config.eval.num_examples; the splits rule may ask for more)."""
    n = num_examples or self.args.eval_examples
    out = {}
    for name, lengths in list(self.task.splits().items())[1:]:
      drawn = [self.task.example(self.args.seed, name, i)
               for i in range(self.task.eval_rows(name, n))]
      arrays = self.cast.batch([self.cast.row(self.task, x) for x in drawn],
                               self.cast.width(self.task, lengths))
      out[name] = Split(arrays, lengths=np.array([x.length for x in drawn]))
    return out

  def decode_length(self, split: Split) -> int:
    return self.cast.decode_length(split.arrays)

  # ------------------------------------------------------------------ text

  def encode(self, text: str) -> np.ndarray:
    """An input written as space-separated pieces (e.g. "0 1 1") as the tokens the cast
    makes of it (answer slots, EOS or a CLS token included)."""
    return self.cast.encode(self.task, self.task.from_text(text))

  def pieces(self, ids) -> list[str]:
    return self.cast.pieces(self.task, ids)
