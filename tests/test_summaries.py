"""TensorBoard event files, read back with TensorBoard's own reader: they hold the scalars
metrics.jsonl holds, step for step, and a resumed run's re-trained steps appear once."""

import os

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from transformer.run.config import parse
from transformer.run.summaries import SUMMARY_DIR
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import read_metrics


def _scalars(workdir, split):
  events = EventAccumulator(os.path.join(workdir, SUMMARY_DIR, split))
  events.Reload()
  return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
          for tag in events.Tags()["scalars"]}


def test_event_files_hold_the_logged_scalars_and_resume_replaces_retrained_steps(tmp_path,
                                                                                tiny_config):
  config = tiny_config(**{"train.num_steps": 30, "train.eval_every": 20,
                          "train.profile_steps": 2})
  workdir = str(tmp_path / "run")
  train_and_evaluate(parse(config), workdir)
  records = read_metrics(workdir)
  train = _scalars(workdir, "train")
  assert {"loss", "accuracy", "learning_rate", "grad_norm", "tokens_per_sec"} <= set(train)
  expected = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
  assert [step for step, _ in train["loss"]] == list(expected) == [10, 20, 30]
  np.testing.assert_allclose([v for _, v in train["loss"]], list(expected.values()), rtol=1e-6)
  for split in ("valid", "longer"):
    assert [step for step, _ in _scalars(workdir, split)["exact_match"]] == [20, 30]
  profiles = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
  assert any(f.endswith(".xplane.pb") for f in profiles), profiles

  # A crash after step 30 was logged but before its checkpoint: the re-run trains 21-30 again.
  checkpoints = os.path.join(workdir, "checkpoints")
  os.rename(os.path.join(checkpoints, "30"), os.path.join(checkpoints, "30.orbax-checkpoint-tmp-1"))
  train_and_evaluate(parse(config), workdir)
  again = _scalars(workdir, "train")["loss"]
  assert [step for step, _ in again] == [10, 20, 30]  # step 30 once: the first run's is purged
  rerun = {r["step"]: r["loss"] for r in read_metrics(workdir) if r["split"] == "train"}
  np.testing.assert_allclose(again[-1][1], rerun[30], rtol=1e-6)
  assert [step for step, _ in _scalars(workdir, "valid")["loss"]] == [20, 30]
