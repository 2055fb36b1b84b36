"""Workdirs written by an earlier version of the code (tests/fixtures/workdirs_043b6c9: each
family, randomized positions, Multi30k) restore and evaluate to exactly the metrics that
version's eval.py wrote: a refactor, a new field or a changed default may not change what a
finished run means."""

import json
import pathlib
import shutil

import pytest

from tests.conftest import restore_and_evaluate

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "workdirs_043b6c9"
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def _numbers(splits: dict) -> dict:
  """Each split's metrics without the paths of files written beside them."""
  return {split: {k: v for k, v in metrics.items() if k not in ("predictions", "references")}
          for split, metrics in splits.items()}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_old_workdir_evaluates_to_its_metrics(name, tmp_path, monkeypatch):
  if name == "multi30k" and not MULTI30K.is_dir():
    pytest.skip(f"Multi30k not found at {MULTI30K}")
  workdir = tmp_path / name
  shutil.copytree(FIXTURES / name, workdir)
  monkeypatch.chdir(ROOT)  # config.json's data.dir is relative to the repository's root
  expected = json.loads((workdir / "expected_eval.json").read_text())
  step, splits, _ = restore_and_evaluate(str(workdir), output=str(tmp_path / "eval.json"))
  assert step == expected["step"]
  # as the JSON file holds them (by-length keys are strings there)
  assert _numbers(json.loads(json.dumps(splits))) == _numbers(expected["splits"])
