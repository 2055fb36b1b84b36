"""data.source "labelled": a task of data/tasks/registry.py for an encoder
(model.arch=encoder), over held-out inputs (data/tasks/splits.py HeldOutSplits: training
never sees 1/heldout_modulus of input space; `valid` holds only it), cast as the task's
answers say: one label per input at a CLS token (cast `label`, e.g. ListOps; model.pooling
cls or mean), else one per input symbol (cast `token_labels`, e.g. duplicates; pooling none).
Besides loss and accuracy, each split reports the macro-F1 of the scored labels."""

from transformer.core.errors import ConfigError
from transformer.core.metrics import macro_f1
from transformer.data.base import Example, SplitResult
from transformer.data.tasks.casts import CASTS
from transformer.data.tasks.generated import GeneratedSource
from transformer.data.tasks.problem import TaskChoice, drawn_by
from transformer.data.tasks.registry import TASKS
from transformer.data.tasks.splits import HeldOutSplits

CAST_NAMES = ("label", "token_labels")  # the first that presents the task


def _labels(task) -> bool:
  return any(CASTS[name].unfit(task) is None for name in CAST_NAMES)


class LabelledSource(GeneratedSource):
  """data.source "labelled" (module docstring)."""

  rule = HeldOutSplits
  # the tasks whose answers are labels (with their defaults)
  Task = TaskChoice({name: task for name, task in drawn_by(rule, TASKS).items()
                     if _labels(task())}, "name", "labelled task")
  what = "a labelled task"

  @classmethod
  def cast_of(cls, data, task):
    for name in CAST_NAMES:
      if CASTS[name].unfit(task) is None:
        return CASTS[name]
    raise ConfigError(f"task {task.name!r} has answers that are neither one label nor one "
                      f"label per input symbol: data.source 'labelled' cannot present it")

  @classmethod
  def example(cls, directory: str) -> Example:
    del directory
    task = dict(name="listops", min_len=5, max_len=16, max_depth=3, max_args=3)
    return Example({"data": {"source": "labelled"}, "task": task,
                    "model": {"arch": "encoder", "pooling": "cls"}}, "[MAX 2 9 [MIN 4 7 ] 0 ]")

  def split_results(self, name, split, outputs) -> SplitResult:
    """Macro-F1 over the scored labels (per token, or per sequence)."""
    weights = split.arrays["targets_segmentation"] > 0
    return SplitResult({"macro_f1": macro_f1(outputs["predictions"], split.arrays["targets"],
                                             weights, self.cast.num_classes(self.task))})
