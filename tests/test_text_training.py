"""Training and evaluating on parallel text files: tokenizer in the workdir (and its record
of what it was trained from), BLEU, errors."""

import json
import logging
import os
import shutil

import numpy as np
import pytest

from configs import multi30k
from tests.support import TINY_CONFIG_MODEL, make_tiny_config, restore_and_evaluate
from transformer.core.errors import ConfigError
from transformer.data.tokenizer import RECORD_FILE, TOKENIZER_FILE, UNK_ID
from transformer.run import checkpoint, experiment
from transformer.run.config import parse
from transformer.run.eval_files import text_paths
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import METRICS_FILE

WORDS = {"the": "der", "dog": "hund", "cat": "katze", "runs": "läuft", "sleeps": "schläft",
         "big": "große", "small": "kleine", "here": "hier", "now": "jetzt"}


def _corpus(n, seed):
  rng = np.random.default_rng(seed)
  en, de = [], []
  for _ in range(n):
    words = list(rng.choice(list(WORDS), size=rng.integers(2, 6)))
    en.append(" ".join(words))
    de.append(" ".join(WORDS[w] for w in words))
  return en, de


def _other_corpus(n, seed):
  """Sentences of words over letters that _corpus never uses: a tokenizer trained on
  _corpus encodes them as unknown pieces."""
  rng = np.random.default_rng(seed)
  words = ["".join(rng.choice(list("qvxy"), size=rng.integers(2, 5))) for _ in range(30)]
  lines = [" ".join(rng.choice(words, size=rng.integers(2, 6))) for _ in range(n)]
  return lines, [line.upper() for line in lines]


def _config(tmp_path, corpus=None):
  tmp_path.mkdir(exist_ok=True)
  for split, n, seed in (("train", 300, 0), ("valid", 20, 1), ("test", 20, 2)):
    en, de = (corpus or _corpus)(n, seed)
    for lang, lines in (("en", en), ("de", de)):
      (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
  config = multi30k.get_config()
  config.data.update(dir=str(tmp_path), train_source="train.en", train_target="train.de",
                     valid_source="valid.en", valid_target="valid.de", test_source="test.en",
                     test_target="test.de", vocab_size=32, max_len=16)
  config.model.update(**TINY_CONFIG_MODEL, dropout=0.0)
  config.model.attention.dropout = 0.0
  config.train.update(batch_size=16, num_steps=20, warmup_steps=10, log_every=10,
                      eval_every=0, checkpoint_every=10)
  config.eval.update(num_examples=0, batch_size=16)
  return config


def test_text_run_trains_evaluates_and_resumes_with_its_tokenizer(tmp_path):
  config = _config(tmp_path / "data")
  workdir = str(tmp_path / "run")
  assert train_and_evaluate(parse(config), workdir) == 20
  spm_path = os.path.join(workdir, "spm.model")
  trained_at = os.path.getmtime(spm_path)
  with open(os.path.join(workdir, METRICS_FILE)) as f:
    assert '"bleu"' in f.read()

  config.train.num_steps = 30  # resume: the tokenizer is reused, not retrained
  assert train_and_evaluate(parse(config), workdir) == 30
  assert os.path.getmtime(spm_path) == trained_at

  step, results, path = restore_and_evaluate(workdir, beam_size=2)
  assert step == 30 and set(results) == {"valid", "test"}
  for split in ("valid", "test"):
    assert 0.0 <= results[split]["bleu"] <= 100.0 and 0.0 <= results[split]["chrf"] <= 100.0
    assert results[split]["bleu_signature"].startswith("nrefs:1|case:mixed")
    with open(results[split]["predictions"], encoding="utf-8") as f:
      assert len(f.read().splitlines()) == 20
    with open(results[split]["references"], encoding="utf-8") as f:  # the paired bootstrap's
      assert f.read() == (tmp_path / "data" / f"{split}.de").read_text(encoding="utf-8")
    assert results[split]["references"] == text_paths(path, split)[1]

  # Any source/reference file pair, no config edit: the valid files give the valid figures.
  data = config.data
  files = (os.path.join(data.dir, data.valid_source), os.path.join(data.dir, data.valid_target))
  _, by_file, _ = restore_and_evaluate(workdir, beam_size=2, files=files)
  assert set(by_file) == {"valid.en"}
  for key in ("bleu", "chrf", "loss"):
    assert by_file["valid.en"][key] == results["valid"][key]


def test_missing_corpus_file_fails_before_writing(tmp_path):
  config = _config(tmp_path / "data")
  config.data.valid_target = "nope.de"
  with pytest.raises(ConfigError,
                     match=r"config.data.valid_target: corpus file not found: .*nope.de"):
    train_and_evaluate(parse(config), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_given_tokenizer_must_match_vocab_size(tmp_path):
  config = _config(tmp_path / "data")
  workdir = str(tmp_path / "run")
  config.train.num_steps = 2
  train_and_evaluate(parse(config), workdir)
  other = _config(tmp_path / "data")
  other.data.update(tokenizer=os.path.join(workdir, "spm.model"), vocab_size=48)
  with pytest.raises(ConfigError, match="has 32 pieces but config.data.vocab_size is 48"):
    train_and_evaluate(parse(other), str(tmp_path / "run2"))


def _unknowns(workdir, lines):
  """How many pieces of `lines` the workdir's tokenizer does not know."""
  tokenizer = experiment.make_source(parse(_config_of(workdir)), workdir)
  tokenizer.load(has_checkpoints=True)
  return sum(int((tokenizer.tokenizer.encode(line) == UNK_ID).sum()) for line in lines)


def _config_of(workdir):
  from transformer.run.workdir import load_config  # noqa: PLC0415
  return load_config(workdir)


def test_a_stopped_first_runs_tokenizer_is_trained_again_on_another_corpus(tmp_path, caplog):
  """The issue's scenario: a first run on corpus A stops after training its tokenizer and
  before its first checkpoint; the same workdir is then run on corpus B."""
  workdir = str(tmp_path / "run")
  config_a = _config(tmp_path / "a")
  config_a.train.num_steps = 2
  assert train_and_evaluate(parse(config_a), workdir, should_stop=lambda: True) == 0
  assert not checkpoint.has_checkpoints(workdir)
  record = json.loads(open(os.path.join(workdir, RECORD_FILE)).read())
  assert record["corpus"][0]["path"] == str(tmp_path / "a" / "train.en")
  b_lines = _other_corpus(20, 1)[0]
  assert _unknowns(workdir, b_lines) > 0  # A's tokenizer does not know B's letters

  config_b = _config(tmp_path / "b", corpus=_other_corpus)
  config_b.train.num_steps = 2
  with caplog.at_level(logging.INFO):
    assert train_and_evaluate(parse(config_b), workdir) == 2
  assert "it was trained on other data (corpus[0].path:" in caplog.text
  assert "the workdir has no checkpoint: training a new tokenizer" in caplog.text
  assert _unknowns(workdir, b_lines) == 0
  record = json.loads(open(os.path.join(workdir, RECORD_FILE)).read())
  assert record["corpus"][0]["path"] == str(tmp_path / "b" / "train.en")

  # With checkpoints the tokenizer is the run's: a moved corpus (same files elsewhere) keeps
  # it, with a warning naming what differs; the given tokenizer of another run is used as it
  # is; a workdir of an older version (no record) loads as before.
  model = open(os.path.join(workdir, TOKENIZER_FILE), "rb").read()
  shutil.copytree(tmp_path / "b", tmp_path / "moved")
  moved = _config(tmp_path / "moved", corpus=_other_corpus)
  caplog.clear()
  with caplog.at_level(logging.INFO):
    source = experiment.make_source(parse(moved), workdir)
    source.load(has_checkpoints=True)
  assert source.tokenizer.proto == model
  assert "it was trained on other data (corpus[0].path:" in caplog.text
  assert "it is kept, since this workdir's checkpoints were trained with it:" in caplog.text

  given = _config(tmp_path / "a")
  given.data.tokenizer = os.path.join(workdir, TOKENIZER_FILE)
  source = experiment.make_source(parse(given), str(tmp_path / "other"))
  source.prepare()
  assert source.tokenizer.proto == model and not (tmp_path / "other").exists()

  os.remove(os.path.join(workdir, RECORD_FILE))
  caplog.clear()
  with caplog.at_level(logging.INFO):
    source = experiment.make_source(parse(_config(tmp_path / "a")), workdir)
    source.load()
  assert source.tokenizer.proto == model
  assert "has no record of what it was trained on" in caplog.text


def _lm_config(directory, letters):
  rng = np.random.default_rng(0)
  directory.mkdir()
  for split, n in (("train", 300), ("valid", 60)):
    words = ["".join(rng.choice(list(letters), size=3)) for _ in range(20)]
    (directory / f"{split}.txt").write_text("\n".join(
        f"def {rng.choice(words)}(x):\n  return x + {i}" for i in range(n)))
  config = make_tiny_config(**{"train.num_steps": 2, "eval.num_examples": 4})
  config.data = dict(source="lm", corpus="files", dir=str(directory), train_files="train.txt",
                     valid_files="valid.txt", vocab_size=64, max_len=16, max_factor=2)
  config.model.update(arch="decoder", max_len=32)
  return config


def test_a_stopped_first_lm_runs_tokenizer_is_trained_again_on_another_corpus(tmp_path,
                                                                              caplog):
  workdir = str(tmp_path / "run")
  train_and_evaluate(parse(_lm_config(tmp_path / "a", "abcdef")), workdir,
                     should_stop=lambda: True)
  config_b = _lm_config(tmp_path / "b", "qvxyz")
  with caplog.at_level(logging.INFO):
    assert train_and_evaluate(parse(config_b), workdir) == 2
  assert "it was trained on other data (corpus.files[0].path:" in caplog.text
  assert "training a new tokenizer" in caplog.text
  source = experiment.make_source(parse(config_b), workdir)
  source.load(has_checkpoints=True)
  assert not (source.streams["valid"] == UNK_ID).any()
