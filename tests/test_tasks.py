"""Conformance of every generated task (data/tasks/registry.py TASKS) under every source that draws it
(each source's splits rule: its task.name registry) and every cast that presents it: instances
a pure function of (seed, split, index); symbols, lengths and tokens within what the task and
the cast declare; held-out inputs never in training where the rule holds some out; rows that
give back their answers; an input that encodes as its row reads it. A new task, splits rule or
cast is tested here the moment it is registered. numpy only: fast."""

import numpy as np
import pytest

from transformer.core.errors import ConfigError
from transformer.data import Targets
from transformer.data.tasks.casts import CASTS
from transformer.data.tasks.generated import GeneratedSource
from transformer.data.sources import SOURCES
from transformer.data.tasks.problem import Answer
from transformer.data.tasks.registry import TASKS
from transformer.model.families import ARCHS

GENERATED = {name: source for name, source in SOURCES.items()
             if issubclass(source, GeneratedSource)}
ENTRIES = [(source, task) for source in sorted(GENERATED)
           for task in sorted(GENERATED[source].Task.registry)]
ROWS = 12  # instances of each split checked
TOKENS = (Targets.SEQUENCE, Targets.PROMPTED_ANSWERS)  # targets that are tokens, not classes


class _Data:
  """config.data of a source, casting as `cast`."""

  def __init__(self, source: str, cast: str):
    self.source, self.cast = source, cast


def _casts(source_name: str, task) -> dict[str, object]:
  """The casts the source offers this task: data.cast's choices if it reads one, else its
  own choice."""
  source = GENERATED[source_name]
  if "cast" in getattr(source.Data, "__dataclass_fields__", {}):
    return {name: cast for name, cast in CASTS.items() if cast.unfit(task) is None}
  cast = source.cast_of(_Data(source_name, ""), task)
  return {next(n for n, c in CASTS.items() if c is cast): cast}


def _instances(task, seed=0):
  return {split: [task.example(seed, split, i) for i in range(ROWS)] for split in task.splits()}


def test_one_registry_one_name_per_task():
  """Every source's choices are problems of TASKS under their registry name."""
  for source in GENERATED.values():
    for name, entry in source.Task.registry.items():
      assert issubclass(entry, TASKS[name]) and entry().name == name


@pytest.mark.parametrize("source_name,name", ENTRIES)
def test_instances_are_pure_and_in_range(source_name, name):
  task = GENERATED[source_name].Task.registry[name]()
  first, again, other = _instances(task), _instances(task), _instances(task, seed=1)
  splits = task.splits()
  assert list(splits)[0] == "train" and len(splits) >= 2
  assert [task.stream(s) for s in splits] == list(range(len(splits)))
  differs = False
  for split, lengths in splits.items():
    for x, y, z in zip(first[split], again[split], other[split]):
      assert all(np.array_equal(a, b) for a, b in zip(x, y)) and x.length == y.length
      differs |= not np.array_equal(x.inputs, z.inputs)
      assert x.length in lengths
      assert x.inputs.dtype == np.int32 and x.outputs.dtype == np.int32
      assert x.inputs.shape == (task.input_length(x.length),)
      assert x.outputs.shape == (task.output_length(x.length),)
      assert task.answer is Answer.STRING or len(x.outputs) == (
          1 if task.answer is Answer.LABEL else len(x.inputs)), "answers as declared"
      assert x.inputs.min(initial=0) >= 0 and x.inputs.max(initial=0) < task.input_size
      assert x.outputs.min() >= 0 and x.outputs.max() < task.output_size
      mask = task.accuracy_mask(x.outputs)
      assert mask.dtype == bool and mask.shape == x.outputs.shape and mask.any()
  assert differs, "another seed draws other instances"
  assert len(task.pieces()) == task.input_size == len(set(task.pieces()))


@pytest.mark.parametrize("source_name,name", ENTRIES)
def test_heldout_inputs_never_train(source_name, name):
  task = GENERATED[source_name].Task.registry[name]()
  if not task.holds_out():
    assert not any(task.is_heldout(x.inputs) for x in _instances(task)["train"])
    return
  train = [task.example(0, "train", i) for i in range(300)]
  heldout = [x for split, xs in _instances(task).items() if split != "train" for x in xs]
  assert not any(task.is_heldout(x.inputs) for x in train)
  assert heldout and all(task.is_heldout(x.inputs) for x in heldout)
  assert not {x.inputs.tobytes() for x in train} & {x.inputs.tobytes() for x in heldout}


@pytest.mark.parametrize("source_name,name", ENTRIES)
def test_every_cast_presents_the_instances(source_name, name):
  """Rows within the cast's vocabulary and classes and its width; the answers they give
  back are the instances'; an input encodes as its row reads it; a cast that does not fit is
  refused by name."""
  source = GENERATED[source_name]
  task = source.Task.registry[name]()
  casts = _casts(source_name, task)
  assert casts, f"no cast of data.source {source_name!r} presents {name}"
  for cast_name, cast in casts.items():
    assert any(cast.targets in family.learns for family in ARCHS.values())
    vocab, classes = cast.vocab_size(task), cast.num_classes(task)
    assert (classes == 0) == (cast.targets in TOKENS), "tokens are decoded, labels classified"
    for split, xs in _instances(task).items():
      rows = [cast.row(task, x) for x in xs]
      width = cast.width(task, task.splits()[split])
      arrays = cast.batch(rows, width)
      assert all(a.shape == (ROWS, width) and a.dtype == np.int32 for a in arrays.values())
      assert arrays["inputs"].max() < vocab and arrays["inputs"].min() >= 0
      scored = arrays["targets_segmentation"] > 0
      assert scored.any(1).all()
      assert arrays["targets"][scored].max() < (classes or vocab)
      got = list(cast.answers(arrays, arrays["targets"]))
      for x, (answer, predicted) in zip(xs, got):
        np.testing.assert_array_equal(answer, x.outputs)
        np.testing.assert_array_equal(predicted, x.outputs)
      for x, row in zip(xs, rows):
        np.testing.assert_array_equal(cast.encode(task, x.inputs), row[0])
        assert len(cast.pieces(task, row[0])) == len(row[0])
        text = " ".join(task.pieces()[s] for s in x.inputs)
        if len(x.inputs):
          np.testing.assert_array_equal(task.from_text(text), x.inputs)
  data_fields = getattr(source.Data, "__dataclass_fields__", {})
  for cast_name in set(CASTS) - set(casts) if "cast" in data_fields else ():
    with pytest.raises(ConfigError, match=f"data.cast {cast_name!r} cannot present"):
      source.output_sizes(_Data(source_name, cast_name), task)


def test_a_bad_input_text_names_the_pieces():
  task = GENERATED["algorithmic"].Task.registry["binary_addition"]()
  with pytest.raises(ConfigError, match=r"binary_addition input '0 7': give space-separated "
                     r"symbols of 0 1 \+"):
    task.from_text("0 7")
