"""Conformance of every registered data source (sources.SOURCES) to data.base.DataSource, on
the tiny instance each source gives of itself (DataSource.example): declarations, batches in
the batch layout, determinism, checkpointable iteration, held-out splits (from load(), which
writes nothing), text in and out, and a run that trains, restores and evaluates. A new
source is tested here the moment it is registered; a new generated task, in
tests/test_tasks.py."""

import dataclasses
import math

import grain
import numpy as np
import pytest

from tests.support import implied_structure, restore_and_evaluate, source_config
from transformer.core.fields import Chosen
from transformer.core.metrics import METRICS
from transformer.data import Targets, pipeline
from transformer.data.base import DataSource, Split
from transformer.data.sources import SOURCES
from transformer.model.families import ARCHS
from transformer.run import config as config_lib
from transformer.run import experiment
from transformer.run.config import parse
from transformer.run.state import run_state
from transformer.run.training import train_and_evaluate
from transformer.study import bootstrap

BATCH_KEYS = ("inputs", "targets", "inputs_positions", "inputs_segmentation",
              "targets_segmentation")


@pytest.fixture(params=sorted(SOURCES))
def example(request, tmp_path):
  """(name, Example, typed config) of a registered source."""
  directory = tmp_path / "data"
  directory.mkdir()
  try:
    example = SOURCES[request.param].example(str(directory))
  except ImportError as e:  # an optional dependency (tfds) that this install lacks
    pytest.skip(f"data.source {request.param!r} needs a package not installed here: {e}")
  return request.param, example, parse(source_config(example.sections))


def test_the_declarations(example):
  name, _, cfg = example
  source = SOURCES[name]
  assert issubclass(source, DataSource)
  assert dataclasses.is_dataclass(source.Data) and "source" in {
      f.name for f in dataclasses.fields(source.Data)}
  assert source.Task is None or dataclasses.is_dataclass(source.Task) or isinstance(
      source.Task, Chosen)
  assert cfg.data.source == name and (cfg.task is None) == (source.Task is None)
  assert parse(config_lib.to_dict(cfg)) == cfg  # a run's config.json reads back the same
  vocab_size, num_classes = source.output_sizes(cfg.data, cfg.task)
  assert (cfg.model.vocab_size, cfg.model.num_classes) == (vocab_size, num_classes)


def test_a_source_declaring_unpacked_rows_leaves_out_what_they_imply(example, tmp_path,
                                                                    monkeypatch):
  """An unpacked source's training batch is its rows without the segment ids and positions,
  which are those the declaration implies (its scored targets: those not PAD_ID); any other
  source's batch carries its segment ids."""
  name, _, cfg = example
  source = experiment.build(cfg, str(tmp_path / "run")).source
  source.prepare()
  batch = next(iter(source.train_batches()))
  if not source.unpacked_batches:
    assert {"inputs_segmentation", "targets_segmentation"} <= set(batch)
    return
  monkeypatch.setattr(pipeline, "unpacked", lambda arrays: arrays)  # the rows as built
  whole = next(iter(source.train_batches()))
  assert set(batch) == set(whole) - set(pipeline.STRUCTURE_KEYS)
  implied = implied_structure(batch)
  assert implied.keys() == whole.keys()
  for key in whole:
    np.testing.assert_array_equal(implied[key], whole[key], err_msg=f"{name}: {key}")
  real = batch["inputs"] != 0
  assert (real[:, :-1] >= real[:, 1:]).all() and real[:, 0].all()  # from slot 0, padded right


def test_batches_splits_and_text(example, tmp_path):
  name, ex, cfg = example
  exp = experiment.build(cfg, str(tmp_path / "run"))
  source = exp.source
  assert isinstance(source.targets, Targets) and source.targets in exp.family.learns
  assert any(source.targets in family.learns for family in ARCHS.values())
  assert source.max_lengths() and all(n >= 1 for n in source.max_lengths().values())
  data_files = sorted((tmp_path / "data").rglob("*"))
  source.load()  # reads and checks the data: a run calls it before it writes anything
  assert not (tmp_path / "run").exists() and sorted((tmp_path / "data").rglob("*")) == data_files
  assert source.eval_splits(), "load() gives what the held-out splits need"
  source.prepare()
  n_out = cfg.model.num_classes or cfg.model.vocab_size

  def check(arrays, rows=None):
    assert set(BATCH_KEYS) <= set(arrays), sorted(arrays)
    shapes = {arrays[k].shape for k in BATCH_KEYS if not k.startswith("targets")}
    assert len(shapes) == 1 and all(arrays[k].dtype == np.int32 for k in BATCH_KEYS)
    assert rows is None or arrays["inputs"].shape[0] == rows
    assert (arrays["targets_segmentation"] > 0).any()
    assert 0 <= arrays["inputs"].min() and arrays["inputs"].max() < cfg.model.vocab_size
    scored = arrays["targets"][arrays["targets_segmentation"] > 0]
    assert 0 <= scored.min() and scored.max() < n_out
    real = arrays["inputs_segmentation"] > 0
    assert (arrays["inputs"][real] != 0).all() and (arrays["inputs"][~real] == 0).all()

  batches = source.train_batches()
  assert isinstance(batches, grain.IterDataset)
  first, again = iter(batches), iter(source.train_batches())
  a = next(first)
  check(implied_structure(a) if source.unpacked_batches else a, cfg.train.batch_size)
  np.testing.assert_equal(next(again), a)  # a pure function of the seed
  state = first.get_state()
  b = next(first)
  resumed = iter(source.train_batches())
  resumed.set_state(state)
  np.testing.assert_equal(next(resumed), b)  # checkpointable

  splits = source.eval_splits()
  assert splits and all(isinstance(s, Split) for s in splits.values())
  for split in splits.values():
    check(split.arrays)
    assert len(split) >= 1
    assert split.references is None or len(split.references) == len(split)
    if exp.family.decodes:
      assert source.decode_length(split) >= 1

  ids = source.encode(ex.sentence)
  assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) >= 1
  assert ids.min() >= 0 and ids.max() < cfg.model.vocab_size
  assert len(source.pieces(ids)) == len(ids) and isinstance(source.detokenize(ids), str)


def test_a_run_trains_restores_and_evaluates(example, tmp_path):
  _, _, cfg = example
  workdir = str(tmp_path / "run")
  assert train_and_evaluate(cfg, workdir) == cfg.train.num_steps
  step, results, _ = restore_and_evaluate(workdir)
  assert step == cfg.train.num_steps and results
  for metrics in results.values():
    assert math.isfinite(metrics["loss"]) and metrics["examples"] >= 1
  # Every metric the final evaluation records is declared (its range holds it), and one
  # declared a function of per-example results is that function of the ones recorded.
  declared = METRICS
  for split, record in run_state(workdir).final.items():
    for key, value in record.items():
      if isinstance(value, float):
        metric = declared.get(key)
        assert metric is not None, f"{split}/{key}: no declaration in core/metrics.py METRICS"
        assert metric.low <= value <= metric.high, (split, key, value)
        if metric.parts:
          parts = bootstrap.parts(record, metric)
          assert parts is not None, f"{split}/{key}: its per-example parts are not recorded"
          assert parts.value(metric)[0] == pytest.approx(value, rel=1e-5), (split, key)
