"""data.source=tfds: a tiny TFDS translation dataset prepared as array_record, read and trained
on without TensorFlow; a clear error when a dataset is not prepared."""

import glob
import logging
import os
import shutil
import sys
import time

import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from tests.support import TINY_CONFIG_MODEL
from configs import wmt14_base  # noqa: E402
from transformer.core.errors import ConfigError  # noqa: E402
from transformer.run import experiment  # noqa: E402
from transformer.run.config import parse  # noqa: E402
from transformer.run.training import train_and_evaluate  # noqa: E402

EN = ["a dog runs", "the cat sleeps", "a big dog", "the small cat", "here now", "a cat runs"]
DE = ["ein hund läuft", "die katze schläft", "ein großer hund", "die kleine katze", "hier jetzt",
      "eine katze läuft"]


class TinyTranslate(tfds.core.GeneratorBasedBuilder):
  """Six sentence pairs repeated: train 60 pairs, validation and test 6 each."""

  VERSION = tfds.core.Version("1.0.0")
  REVERSED = False  # True: the English sentences in the other order, as if the data changed

  def _info(self):
    return tfds.core.DatasetInfo(builder=self,
                                 features=tfds.features.Translation(languages=("en", "de")))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(10), "validation": self._generate_examples(1),
            "test": self._generate_examples(1)}

  def _generate_examples(self, repeats):
    for i in range(repeats * len(EN)):
      yield i, {"en": (EN[::-1] if self.REVERSED else EN)[i % len(EN)], "de": DE[i % len(DE)]}


def _config(data_dir):
  config = wmt14_base.get_config()
  config.data.update(tfds_name="tiny_translate", tfds_dir=data_dir, vocab_size=40,
                     tokenizer_type="unigram", max_len=16, decode_offset=5)
  config.model.update(**TINY_CONFIG_MODEL, dropout=0.0)
  config.train.update(batch_size=4, num_steps=6, warmup_steps=2, log_every=3, eval_every=0,
                      checkpoint_every=3, eval_examples=0)
  config.eval.update(num_examples=0, batch_size=8)
  return config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  TinyTranslate(data_dir=data_dir, file_format="array_record").download_and_prepare()
  return data_dir


def test_tfds_pairs_are_read_without_tensorflow(prepared):
  source = experiment.make_source(parse(_config(prepared)), None)
  pairs = source.pairs("train")
  assert len(pairs) == 60 and set(pairs) == set(zip(EN, DE))  # tfds stores them shuffled
  assert source.held_out() == ["valid", "test"]
  assert "tensorflow" not in sys.modules


def test_tfds_run_trains_and_evaluates(prepared, tmp_path):
  workdir = str(tmp_path / "run")
  assert train_and_evaluate(parse(_config(prepared)), workdir) == 6
  assert os.path.exists(os.path.join(workdir, "spm.model"))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    text = f.read()
  assert '"split": "test"' in text and '"bleu"' in text


def test_a_prepared_again_dataset_rebuilds_the_encoded_cache(tmp_path, caplog, monkeypatch):
  """Same name, version and record count, other contents: the files tell them apart."""
  data_dir, run = str(tmp_path / "tfds"), str(tmp_path / "run")
  TinyTranslate(data_dir=data_dir, file_format="array_record").download_and_prepare()
  source = experiment.make_source(parse(_config(data_dir)), run)
  source.prepare()
  assert len(source.encoded_corpus()) == 60
  shutil.rmtree(data_dir)
  monkeypatch.setattr(TinyTranslate, "REVERSED", True)
  TinyTranslate(data_dir=data_dir, file_format="array_record").download_and_prepare()
  files = glob.glob(os.path.join(data_dir, "*", "*", "*train.array_record*"))
  assert files
  for name in files:
    os.utime(name, (time.time() + 60,) * 2)  # prepared later, not within the same second
  source = experiment.make_source(parse(_config(data_dir)), run)
  with caplog.at_level(logging.INFO):
    source.prepare()  # no checkpoint: the tokenizer too is trained again, on the new files
    assert len(source.encoded_corpus()) == 60
  assert "built for another corpus; rebuilding it" in caplog.text
  assert "trained on other data (corpus[0].files[0].mtime" in caplog.text
  assert "training a new tokenizer" in caplog.text


def test_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path):
  config = _config(str(tmp_path / "empty"))
  with pytest.raises(ConfigError, match=r"TFDS dataset 'tiny_translate' \(split 'train'\) is not "
                                        r"readable .* file_format='array_record'"):
    train_and_evaluate(parse(config), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
