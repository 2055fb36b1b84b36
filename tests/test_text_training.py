"""Training and evaluating on parallel text files: tokenizer in the workdir, BLEU, errors."""

import os

import numpy as np
import pytest

from configs import multi30k
from transformer.config import parse
from transformer.errors import ConfigError
from tests.conftest import restore_and_evaluate
from transformer.training import train_and_evaluate
from transformer.workdir import METRICS_FILE

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


def _config(tmp_path):
  tmp_path.mkdir(exist_ok=True)
  for split, n, seed in (("train", 300, 0), ("valid", 20, 1), ("test", 20, 2)):
    en, de = _corpus(n, seed)
    for lang, lines in (("en", en), ("de", de)):
      (tmp_path / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
  config = multi30k.get_config()
  config.data.update(dir=str(tmp_path), train_source="train.en", train_target="train.de",
                     valid_source="valid.en", valid_target="valid.de", test_source="test.en",
                     test_target="test.de", vocab_size=32, max_len=16)
  config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
                      num_decoder_layers=1, dropout=0.0)
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
  with pytest.raises(ConfigError, match=r"config.data.valid_target: corpus file not found: .*nope.de"):
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
