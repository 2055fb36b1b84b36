"""A run's state from its files (transformer/run/state.py) and the metrics records it reads
(run/workdir.py): an evaluation counts only when recorded whole, records of steps to be
trained again go, and every state a report can show, each from the files that make it.
No training: the files are written as training writes them."""

import json
import os
import pathlib
import shutil

import pytest

from transformer.run import checkpoint, state
from transformer.run import workdir as workdir_lib

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "workdirs_043b6c9"


def _train(*steps):
  return [{"step": s, "split": "train", "loss": 1.0 / s} for s in steps]


def _evaluation(step, splits=("valid", "longer")):
  return workdir_lib.evaluation_records(step, {s: {"loss": step / 100, "examples": 8}
                                               for s in splits})


def _write(workdir, records, tail=""):
  """metrics.jsonl holding `records`, then `tail` (e.g. a line cut short)."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, workdir_lib.METRICS_FILE), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def _cut(records):
  """The records, the last one cut mid-line, as a process killed in their write leaves them."""
  whole = "".join(json.dumps(r) + "\n" for r in records)
  return whole[:len(whole) - len(json.dumps(records[-1])) // 2 - 1]


def test_an_evaluation_counts_only_when_recorded_whole():
  records = _train(10) + _evaluation(10)
  assert workdir_lib.evaluation(records, 10) == ({r["split"]: r for r in records[1:]}, [])
  assert records[1][workdir_lib.SPLITS] == ["valid", "longer"]
  assert workdir_lib.evaluation(records[:2], 10) == (None, ["longer"])  # longer was cut
  assert workdir_lib.evaluation(records, 20) == (None, [])  # none at that step
  # records written before SPLITS existed name no splits: any one of them counts, as it did
  legacy = [{k: v for k, v in r.items() if k != workdir_lib.SPLITS} for r in records]
  assert workdir_lib.evaluation(legacy[:2], 10) == ({"valid": legacy[1]}, [])


def test_truncation_keeps_the_whole_records_up_to_a_step(tmp_path):
  run = str(tmp_path)
  records = _train(10) + _evaluation(10) + _train(20) + _evaluation(20)
  _write(run, records[:-1], tail=_cut(records[-1:]))  # the final evaluation cut short
  assert workdir_lib.read_metrics(run) == records[:-1]  # the cut line is skipped
  assert workdir_lib.whole(workdir_lib.read_metrics(run)) == records[:4]
  workdir_lib.truncate_metrics(run, 20)  # resumed at 20: its evaluation is done again
  assert workdir_lib.read_metrics(run) == records[:4]
  workdir_lib.append_metrics(run, *_evaluation(20))
  assert workdir_lib.read_metrics(run) == records  # each record once, none merged
  workdir_lib.truncate_metrics(run, 10)
  assert workdir_lib.read_metrics(run) == records[:3]
  workdir_lib.truncate_metrics(run, 0)  # begun again from scratch: nothing trained is kept
  assert workdir_lib.read_metrics(run) == []


@pytest.mark.parametrize("case, files, expected", [
    ("finished", dict(records=_train(10, 20) + _evaluation(20), steps=[10, 20]),
     ("finished", "")),
    ("checkpoints deleted", dict(records=_train(10, 20) + _evaluation(20), steps=[]),
     ("finished", "")),
    ("final evaluation cut", dict(records=_train(10, 20) + _evaluation(20)[:1], steps=[20],
                                  tail=_cut(_evaluation(20)[1:])),
     ("unfinished", "its final evaluation (step 20) was cut short (longer not recorded): "
                    "training it again evaluates it again")),
    ("trained, not evaluated", dict(records=_train(10, 20), steps=[10, 20]),
     ("unfinished", "trained to step 20, its final evaluation not recorded: training it "
                    "again evaluates it")),
    ("stopped", dict(records=_train(10), steps=[10]),
     ("unfinished", "checkpoint at step 10 of 20: training, or stopped (resumable)")),
    ("killed before its first checkpoint", dict(records=_train(10), steps=[]),
     ("unfinished", "its metrics.jsonl has no final evaluation (step 20)")),
    ("not started", dict(records=[], steps=[]), ("unfinished", "not trained yet")),
    ("failed", dict(records=_train(10), steps=[10], failure="training diverged at step 12"),
     ("failed", "failed: training diverged at step 12")),
    ("trained past num_steps", dict(records=_train(10, 20) + _evaluation(20) + _train(30),
                                    steps=[20, 30]),
     ("unfinished", "trained to step 30, past train.num_steps=20: it has no final evaluation "
                    "at step 20")),
])
def test_run_state_of_each_case(tmp_path, monkeypatch, case, files, expected):
  run = str(tmp_path / "run")
  _write(run, files["records"], files.get("tail", ""))
  monkeypatch.setattr(checkpoint, "steps", lambda workdir: files["steps"])
  if "failure" in files:
    state.record_failure(run, RuntimeError(files["failure"]))
  got = state.run_state(run, 20)
  assert (got.state, got.note) == expected
  assert got.finished == (expected[0] == "finished") and got.num_steps == 20
  if got.finished:  # its results: the final evaluation's records, never an earlier one's
    assert got.final == {r["split"]: r for r in files["records"] if r["step"] == 20
                         and r["split"] != "train"}
  else:
    assert got.final is None
  state.clear_failure(run)
  assert state.read_failure(run) is None


def test_a_run_written_before_evaluations_named_their_splits_is_finished(tmp_path):
  run = tmp_path / "encoder_decoder"
  shutil.copytree(FIXTURES / "encoder_decoder", run)
  got = state.run_state(str(run))  # at its saved config's train.num_steps
  assert got.finished and got.num_steps == 10 and set(got.final) == {"valid", "longer"}
