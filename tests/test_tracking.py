"""Weights & Biases tracking (transformer/run/tracking.py): real offline runs read back from
wandb's own run files (the scalars are metrics.jsonl's, the config is config.json's, a
resumed run continues the same W&B run and sends no step twice, a sweep's runs share a
group), and with a stand-in wandb module: process 0 only, a run begun part-way gets the
history so far, a missing wandb is one error before anything is written, a failed login is
a RunError that leaves no run id behind."""

import glob
import json
import os
import struct
import sys
import types

import jax
import numpy as np
import pytest

from tests.support import fake_bucket
from transformer.core.errors import ConfigError, RunError
from transformer.run import checkpoint, summaries, tracking
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import read_metrics
from transformer.study import sweep

SWEEP_CONFIG = """
from tests.support import make_tiny_config
from transformer.api import axis

def get_config():
  return make_tiny_config(**{"train.num_steps": 2, "train.log_every": 1,
                             "train.checkpoint_every": 2, "eval.num_examples": 8})

def get_sweep():
  return axis("seed", [0, 1])
"""


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """wandb in offline mode: no network, no login, its own files under tmp_path."""
  pytest.importorskip("wandb")
  for name, value in (("MODE", "offline"), ("SILENT", "true"), ("CONSOLE", "off"),
                      ("DISABLE_GIT", "true"), ("DISABLE_CODE", "true")):
    monkeypatch.setenv(f"WANDB_{name}", value)
  for name in ("DIR", "CONFIG_DIR", "CACHE_DIR", "DATA_DIR"):
    monkeypatch.setenv(f"WANDB_{name}", str(tmp_path / f"wandb_{name.lower()}"))
  monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _records(path):
  """The protobuf records of a .wandb file: wandb's header, then LevelDB's log format
  (32 KiB blocks; each chunk: crc32, length, type (full, first, middle, last))."""
  from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 - wandb is optional

  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  pos, parts = 7, b""
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
    if kind == 0:  # the end of a block: padding
      pos += left
      continue
    parts += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      parts = b""
      yield record


def _offline_runs(workdir):
  """[(run record, [history rows as dicts])] of every invocation's offline run, oldest first."""
  out = []
  for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
    run, rows = None, []
    for record in _records(path):
      kind = record.WhichOneof("record_type")
      if kind == "run":
        run = record.run
      elif kind == "history":
        rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item})
    out.append((run, rows))
  return out


def _by_split_and_step(rows):
  """{(split, step): {metric: value}} of W&B history rows (`split/metric` keys)."""
  out = {}
  for row in rows:
    for key, value in row.items():
      if "/" in key:
        split, metric = key.split("/", 1)
        out.setdefault((split, row["step"]), {})[metric] = value
  return out


def test_offline_run_holds_the_scalars_and_config_and_resume_continues_it(tmp_path, offline,
                                                                         tiny_config):
  config = tiny_config(**{"train.num_steps": 10, "train.log_every": 5, "train.eval_every": 5,
                          "train.checkpoint_every": 5, "eval.num_examples": 16,
                          "train.wandb_project": "ablations-test"})
  workdir = str(tmp_path / "run")
  train_and_evaluate(parse(config), workdir)
  first = read_metrics(workdir)
  # A crash after step 10 was logged but before its checkpoint; the re-run goes on to 15:
  # it trains 6-10 again (metrics.jsonl drops and rewrites them; W&B has them) and 11-15.
  checkpoints = os.path.join(workdir, "checkpoints")
  os.rename(os.path.join(checkpoints, "10"), os.path.join(checkpoints, "10.orbax-checkpoint-tmp-1"))
  config.train.num_steps = 15
  train_and_evaluate(parse(config), workdir)
  records = read_metrics(workdir)

  run_id = open(os.path.join(workdir, tracking.RUN_ID_FILE)).read().strip()
  runs = _offline_runs(workdir)
  assert len(runs) == 2 and {run.run_id for run, _ in runs} == {run_id}  # one W&B run
  for run, _ in runs:
    assert run.project == "ablations-test" and run.display_name == "run"
  logged = {u.key: json.loads(u.value_json) for u in runs[-1][0].config.update}
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert {k: logged[k] for k in saved} == saved  # the latest invocation's config
  assert logged["train"]["num_steps"] == 15

  sent = [_by_split_and_step(rows) for _, rows in runs]
  assert sorted(sent[0]) == sorted((r["split"], r["step"]) for r in first)
  assert not set(sent[0]) & set(sent[1])  # no step sent twice
  assert [step for split, step in sorted(sent[1]) if split == "train"] == [15]
  history = sent[0] | sent[1]
  assert sorted(history) == sorted((r["split"], r["step"]) for r in records)
  for record in records:  # the re-trained steps' values: exact resume
    numbers = summaries.numbers(record)
    values = history[record["split"], record["step"]]
    assert set(values) == set(numbers)
    for name in ("loss", "accuracy", "examples", "exact_match"):
      if name in numbers:
        np.testing.assert_allclose(values[name], numbers[name], rtol=1e-6)


def test_a_sweeps_runs_share_a_group(tmp_path, offline):
  config_path, sweep_dir = tmp_path / "tiny_sweep.py", tmp_path / "positions_sweep"
  config_path.write_text(SWEEP_CONFIG)
  trained, failed = sweep.run(str(config_path), str(sweep_dir),
                              overrides={"train.wandb_project": "ablations-test"})
  assert len(trained) == 2 and not failed
  runs = [run for name in trained for run, _ in _offline_runs(str(sweep_dir / name))]
  assert [run.run_group for run in runs] == ["positions_sweep"] * 2
  assert [run.display_name for run in runs] == trained
  assert len({run.run_id for run in runs}) == 2


def test_sweep_group_defaults_to_the_sweep_directory(tmp_path):
  config_path = tmp_path / "tiny_sweep.py"
  config_path.write_text(SWEEP_CONFIG)
  groups = lambda overrides: {run.config.train.wandb_group  # noqa: E731
                              for run in sweep.runs(str(config_path), str(tmp_path / "s"),
                                                    overrides)}
  assert groups({"train.wandb_project": "p"}) == {"s"}
  assert groups({"train.wandb_project": "p", "train.wandb_group": "mine"}) == {"mine"}
  assert groups({}) == {""}  # no W&B: nothing set


class FakeRun:
  def __init__(self, **kwargs):
    self.init, self.logged, self.metrics, self.exit_code = kwargs, [], [], None

  def define_metric(self, name, **kwargs):
    self.metrics.append((name, kwargs))

  def log(self, row):
    self.logged.append(row)

  def finish(self, exit_code=0):
    self.exit_code = exit_code


@pytest.fixture
def fake_wandb(monkeypatch):
  """A stand-in wandb module; its `runs` are the FakeRuns wandb.init made."""
  module = types.ModuleType("wandb")
  module.runs, module.fail = [], None
  module.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))

  def init(**kwargs):
    if module.fail:
      raise module.errors.Error(module.fail)
    module.runs.append(FakeRun(**kwargs))
    return module.runs[-1]

  module.init = init
  monkeypatch.setitem(sys.modules, "wandb", module)
  return module


def _records_at(*steps):
  return [r for step in steps for r in ({"step": step, "split": "train", "loss": 1.0 / step},
                                        {"step": step, "split": "valid", "bleu": 2.0 * step,
                                         "examples": 8, "decoded": True})]


def test_processes_past_0_send_nothing(tmp_path, fake_wandb, monkeypatch, tiny_config):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  cfg = parse(tiny_config(**{"train.wandb_project": "p"}))
  writer = tracking.WandB(cfg, str(tmp_path), resumed_at=10, logged=_records_at(5, 10))
  writer.scalars("train", 15, {"loss": 0.5})
  writer.close()
  assert fake_wandb.runs == [] and os.listdir(tmp_path) == []


def test_a_run_begun_part_way_gets_the_history_and_a_continued_one_no_step_twice(
    tmp_path, fake_wandb, tiny_config):
  cfg = parse(tiny_config(**{"train.wandb_project": "p", "train.wandb_entity": "team",
                             "train.wandb_group": "g"}))
  workdir = str(tmp_path / "my_run")
  os.makedirs(workdir)
  writer = tracking.WandB(cfg, workdir, resumed_at=10, logged=_records_at(5, 10, 15))
  run, run_id = fake_wandb.runs[0], tracking.run_id(workdir)
  assert run.init | {"config": None} == dict(
      project="p", entity="team", group="g", name="my_run", id=run_id, resume="allow",
      dir=workdir, config=None)
  assert run.init["config"]["train"]["wandb_project"] == "p"
  assert len(run_id) == 12
  # steps 5 and 10 (up to the checkpoint resumed from), with numbers only
  assert run.logged == [{"step": 5, "train/loss": 0.2}, {"step": 5, "valid/bleu": 10.0,
                                                         "valid/examples": 8},
                        {"step": 10, "train/loss": 0.1}, {"step": 10, "valid/bleu": 20.0,
                                                          "valid/examples": 8}]
  assert ("train/*", {"step_metric": "step"}) in run.metrics
  writer.close(failed=True)
  assert run.exit_code == 1

  again = tracking.WandB(cfg, workdir, resumed_at=10, logged=_records_at(5, 10, 15))
  run = fake_wandb.runs[1]
  assert run.init["id"] == run_id and run.init["resume"] == "allow" and run.logged == []
  for record in _records_at(15, 20):  # 15: re-trained, sent before; 20: new
    again.scalars(record["split"], record["step"], record)
  assert [row["step"] for row in run.logged] == [20, 20]
  again.close()
  assert run.exit_code == 0


def test_a_run_killed_before_its_first_checkpoint_is_recorded_once_by_every_tracker(
    tmp_path, fake_wandb, tiny_config, monkeypatch):
  """Killed before its first checkpoint, a run begins again from scratch and trains the
  logged steps again: metrics.jsonl, TensorBoard and W&B each hold every step once."""
  from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
      EventAccumulator)

  config = tiny_config(**{"train.num_steps": 20, "train.log_every": 5,
                          "train.wandb_project": "p"})
  workdir = str(tmp_path / "run")
  with monkeypatch.context() as patch:
    def killed(*args, **kwargs):
      raise RuntimeError("killed")

    patch.setattr(checkpoint, "save", killed)  # at step 10, after logging steps 5 and 10
    with pytest.raises(RuntimeError, match="killed"):
      train_and_evaluate(parse(config), workdir)
  assert not checkpoint.has_checkpoints(workdir)
  assert [r["step"] for r in read_metrics(workdir)] == [5, 10]
  assert train_and_evaluate(parse(config), workdir) == 20
  records = [(r["split"], r["step"]) for r in read_metrics(workdir)]
  assert records == [("train", s) for s in (5, 10, 15, 20)] + [("valid", 20), ("longer", 20)]
  events = EventAccumulator(os.path.join(workdir, summaries.SUMMARY_DIR, "train"))
  events.Reload()
  assert [e.step for e in events.Scalars("loss")] == [5, 10, 15, 20]
  sent = [(key.split("/")[0], row["step"]) for run in fake_wandb.runs for row in run.logged
          for key in row if key.endswith("/loss")]
  assert sorted(sent) == sorted(records)


def test_a_failed_login_is_a_run_error_and_leaves_no_run_id(tmp_path, fake_wandb, tiny_config):
  fake_wandb.fail = "No API key configured. Use `wandb login` to log in."
  cfg = parse(tiny_config(**{"train.wandb_project": "p"}))
  with pytest.raises(RunError, match="No API key configured.*WANDB_MODE=offline"):
    tracking.WandB(cfg, str(tmp_path))
  assert tracking.run_id(str(tmp_path)) is None


def test_without_wandb_installed_a_run_logging_to_it_is_refused_before_writing(
    tmp_path, monkeypatch, tiny_config):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  tracking.check(parse(tiny_config()).train)  # not asked for: fine
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match=r"train.wandb_project='p' logs to Weights & Biases, but "
                                        r"wandb does not import .*pip install -e '.\[wandb\]'"):
    train_and_evaluate(parse(tiny_config(**{"train.wandb_project": "p"})), str(workdir))
  assert not workdir.exists()


def test_a_bucket_workdir_keeps_its_run_id_in_the_bucket(tmp_path, fake_wandb, tiny_config):
  cfg = parse(tiny_config(**{"train.wandb_project": "p"}))
  with fake_bucket(tmp_path):
    tracking.WandB(cfg, "gs://bucket/runs/one").close()
    tracking.WandB(cfg, "gs://bucket/runs/one").close()
  first, second = fake_wandb.runs
  assert first.init["name"] == "one" and first.init["dir"] is None  # wandb's default dir
  run_id = (tmp_path / "bucket" / "runs" / "one" / tracking.RUN_ID_FILE).read_text().strip()
  assert first.init["id"] == second.init["id"] == run_id
