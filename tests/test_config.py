"""One config schema: the dataclasses hold every field's default (run/config.schema); each
config file is the schema of its data source plus deltas, so it has every field (each one
overridable on the command line), and builds and parses with every argument it declares."""

import dataclasses
import glob
import importlib.util
import inspect
import os

import pytest
from flax import nnx

from transformer.core import fields
from transformer.core.errors import ConfigError
from transformer.data.tasks import algorithmic
from transformer.data.base import SourceSection
from transformer.data.sources import SOURCES
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.run import config as config_lib
from transformer.run import config_help
from transformer.study import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                      if not p.endswith("__init__.py"))


def _module(name: str):
  spec = importlib.util.spec_from_file_location(f"configs.{name[:-3]}",
                                                os.path.join(ROOT, "configs", name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _calls():
  """(file, argument) for every config file and each argument it declares (ARGS; None:
  get_config() takes none)."""
  for name in CONFIG_FILES:
    yield from ((name, arg) for arg in getattr(_module(name), "ARGS", [None]))


def _call(module, function: str, arg):
  return getattr(module, function)(*([] if arg is None else [arg]))


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_a_config_file_that_takes_an_argument_declares_them(name):
  """ARGS lists them, the default among them (the tests build each)."""
  module = _module(name)
  parameters = list(inspect.signature(module.get_config).parameters.values())
  assert bool(parameters) == hasattr(module, "ARGS"), f"{name}: get_config's arguments: ARGS"
  assert not parameters or parameters[0].default in module.ARGS


@pytest.mark.parametrize("name,arg", list(_calls()))
def test_every_config_file_builds_with_every_field_of_the_schema(name, arg):
  """It parses (text sources' corpora need not exist: no source is made), its model builds,
  its ConfigDict has exactly the fields of its source's schema (so every field of the typed
  config is there to override), and each value its sweep gives a field parses (in the
  first run that has it: a run per value, not the whole product)."""
  module = _module(name)
  config = _call(module, "get_config", arg)
  cfg = config_lib.parse(config)
  model = nnx.eval_shape(lambda: make_model(cfg.model, rngs=nnx.Rngs(0)))
  assert model.cfg == cfg.model and cfg.model.vocab_size > 0
  given = fields.flat(config.to_dict())
  assert set(given) == set(fields.flat(config_lib.schema(cfg.data.source).to_dict()))
  assert set(fields.flat(config_lib.to_dict(cfg))) <= set(given)
  if hasattr(module, "get_sweep"):
    seen = set()
    for overrides in _call(module, "get_sweep", arg):
      if not set(map(repr, overrides.items())) <= seen:
        seen |= set(map(repr, overrides.items()))
        config_lib.parse(sweep.with_overrides(config, overrides))


def _with_unset_given(source: str, directory: str):
  """(config, the unset fields given {section: {field: value}}) for schema(source): once per
  task of a task section chosen by name, else with the values of the source's example."""
  entry = SOURCES[source]
  if isinstance(entry.Task, fields.Chosen):
    for name in entry.Task.registry:
      config = config_lib.schema(source)
      config.task.name = name
      yield config, {"task": {"name": name}}
    return
  config, given = config_lib.schema(source), {}
  for path, value in fields.flat(config.to_dict()).items():
    if value is None:
      section, field = path.split(".")
      value = entry.example(directory).sections[section][field]
      config[section][field] = given.setdefault(section, {})[field] = value
  yield config, given


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_schema_holds_the_dataclasses_defaults(source, tmp_path):
  """Every section of schema(source) has exactly its dataclass's fields and parses to its
  defaults; a task section chosen by name holds every task's fields, unset, and parses to
  the chosen task's defaults."""
  entry = SOURCES[source]
  for config, given in _with_unset_given(source, str(tmp_path)):
    cfg = config_lib.parse(config)
    assert cfg.data == entry.Data(source=source)
    vocab_size, num_classes = entry.output_sizes(cfg.data, cfg.task)
    assert cfg.model == ModelConfig(vocab_size=vocab_size, num_classes=num_classes)
    assert (cfg.seed, cfg.train, cfg.eval, cfg.mesh) == (
        0, config_lib.TrainConfig(), config_lib.EvalConfig(), config_lib.MeshConfig())
    sections, typed = config.to_dict(), config_lib.to_dict(cfg)
    for name in ("data", "model", "train", "eval", "mesh"):
      assert fields.flat(sections[name]).keys() == fields.flat(typed[name]).keys(), name
    if entry.Task is None:
      assert "task" not in sections and cfg.task is None
    elif isinstance(entry.Task, fields.Chosen):
      assert cfg.task == entry.Task.registry[cfg.task.name]()
      every = {f.name for task in entry.Task.registry.values() for f in dataclasses.fields(task)}
      assert set(sections["task"]) == every
    else:
      assert cfg.task == entry.Task(**given["task"])
      assert set(sections["task"]) == set(typed["task"])


def test_a_field_added_to_a_dataclass_is_in_every_config(monkeypatch):
  """A new field of a source's Data and of a task chosen by name reaches every config file
  of that source, with its default, and can be overridden, with no config file touched."""
  wider_data = dataclasses.make_dataclass(
      "WiderData", [("new_knob", int, dataclasses.field(default=7))], bases=(SourceSection,),
      frozen=True)
  monkeypatch.setattr(SOURCES["synthetic"], "Data", wider_data)
  wider_task = dataclasses.make_dataclass(
      "WiderReverse", [("other_knob", float, dataclasses.field(default=0.5))],
      bases=(algorithmic.AlgorithmicSource.Task.registry["reverse_string"],), frozen=True)
  monkeypatch.setitem(algorithmic.AlgorithmicSource.Task.registry, "reverse_string", wider_task)
  for name, path, value in (("default.py", "data.new_knob", 7),
                            ("positions.py", "data.new_knob", 7),
                            ("chomsky.py", "task.other_knob", 0.5)):
    config = _module(name).get_config()
    assert fields.flat(config_lib.to_dict(config_lib.parse(config)))[path] == value
    section, field = path.split(".")
    config[section][field] = 2 * value
    assert getattr(getattr(config_lib.parse(config), section), field) == 2 * value
    assert path in {f.path for f in config_help.describe(config)}


def test_a_sweep_over_a_chosen_task_keeps_each_task_s_own_defaults():
  """configs/chomsky.py sets only the lengths every task has: bucket_sort keeps its 5
  symbols (reverse_string: 2); a field the chosen task lacks is refused, naming it."""
  base = _module("chomsky.py").get_config("cpu")
  tasks = {name: config_lib.parse(sweep.with_overrides(base, {"task.name": name})).task
           for name in ("reverse_string", "bucket_sort")}
  assert tasks["reverse_string"].num_symbols == 2 and tasks["bucket_sort"].num_symbols == 5
  assert tasks["bucket_sort"].test_max_len == 100
  with pytest.raises(ConfigError, match=r"unknown field\(s\) modulus in config.task"):
    config_lib.parse(sweep.with_overrides(base, {"task.modulus": 7}))


def test_a_field_without_a_default_must_be_given():
  config = config_lib.schema("synthetic")
  with pytest.raises(ConfigError, match=r"^unknown task None; choose one of: .*reverse_string"):
    config_lib.parse(config)


def test_entries_of_a_chosen_section_must_agree_on_a_field_s_type():
  one = dataclasses.make_dataclass("One", [("name", str, dataclasses.field(default="one")),
                                           ("size", int, dataclasses.field(default=1))])
  two = dataclasses.make_dataclass("Two", [("name", str, dataclasses.field(default="two")),
                                           ("size", float, dataclasses.field(default=1.0))])
  with pytest.raises(TypeError, match="declare the field size as <class 'int'> and as "
                                      "<class 'float'>"):
    fields.Chosen({"one": one, "two": two}, "name", "test entry").schema()


def test_with_source_switches_the_data_and_task_sections():
  config = config_lib.with_source(config_lib.schema("synthetic"), "lm")
  assert "task" not in config and config.data.to_dict() == config_lib.schema("lm").data.to_dict()
  config = config_lib.with_source(config, "algorithmic")
  assert set(config.task) >= {"name", "num_symbols", "modulus"}
