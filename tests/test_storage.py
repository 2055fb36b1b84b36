"""A workdir (and a corpus) given as a bucket URL: config, metrics, lock, tokenizer,
corpus, predictions and pictures all go through etils.epath. gs:// is mocked here onto a
local folder (etils.epath.testing), which also proves no code path opens a URL with
`open`/`os` (it would find no such file)."""

import gzip
import json
import os

import numpy as np
import pytest
from etils import epath

from tests.support import fake_bucket, make_tiny_config
from transformer.core import storage
from transformer.data import text_files
from transformer.data.tokenizer import Tokenizer, train_tokenizer
from transformer.run import lock
from transformer.run import workdir as workdir_lib
from transformer.run.config import parse
from transformer.study import figures


def test_a_bucket_workdir_round_trips_config_metrics_lock_and_tokenizer(tmp_path):
  run, bucket = "gs://bucket/runs/one", tmp_path / "bucket" / "runs" / "one"
  config = parse(make_tiny_config(seed=3))
  sentences = [f"the {w} sat on the mat number {i}" for i, w in
               enumerate(["cat", "dog", "bird", "fish"] * 25)]
  with fake_bucket(tmp_path):
    assert not storage.is_local(run) and storage.absolute(run) == run
    with lock.WorkdirLock(run):  # no O_EXCL in a bucket: written, then read back
      assert json.loads((bucket / lock.LOCK_FILE).read_text())["pid"] == os.getpid()
      with pytest.raises(lock.Locked):
        lock.WorkdirLock(run).acquire()
      workdir_lib.write_config(config, run)
      assert parse(workdir_lib.load_config(run)) == config
      for step in (10, 20, 30):
        workdir_lib.append_metrics(run, {"step": step, "split": "train", "loss": 1 / step})
      workdir_lib.truncate_metrics(run, 20)
      assert [r["step"] for r in workdir_lib.read_metrics(run)] == [10, 20]
      model = storage.join(run, "spm.model")
      train_tokenizer(sentences, model, vocab_size=32)
      ids = Tokenizer(model).encode("the cat sat")
      assert Tokenizer(model).decode(ids) == "the cat sat"
      storage.write(storage.join(run, "eval.valid.txt"), "hypothesis\n")
      fig, _ = figures.pyplot().subplots()
      figures.save(fig, storage.join(run, "plots", "a.png"))
    assert not (bucket / lock.LOCK_FILE).exists()
    corpus = storage.join("gs://bucket/corpus", "train.en.gz")
    storage.write(corpus, gzip.compress("a b\nc d\n".encode()))
    assert text_files.read_lines(corpus) == ["a b", "c d"]
  # Everything landed in the bucket's folder, nothing in the working directory.
  assert json.loads((bucket / "config.json").read_text())["seed"] == 3
  assert len((bucket / "metrics.jsonl").read_text().splitlines()) == 2
  assert Tokenizer(str(bucket / "spm.model")).vocab_size == 32
  assert (bucket / "plots" / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (bucket / "eval.valid.txt").read_text() == "hypothesis\n"
  assert not epath.Path("gs:").exists() and not os.path.exists("gs:")


def test_local_writes_replace_the_file_whole(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  storage.write(path, "a\n")
  storage.append(path, "b\n")
  storage.write(path + ".bin", np.arange(3, dtype=np.uint8).tobytes())
  assert storage.read_text(path) == "a\nb\n" and not os.path.exists(path + ".tmp")
  assert (tmp_path / "metrics.jsonl.bin").read_bytes() == b"\x00\x01\x02"
  assert storage.writable_directory(str(tmp_path / "new" / "dir")) is None
  assert "is a file" in storage.writable_directory(path)
