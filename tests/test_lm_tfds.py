"""data.source=lm on a TFDS text dataset (a tiny builder, array_record, no TensorFlow)."""

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from tests.support import make_tiny_config  # noqa: E402
from transformer.run import experiment  # noqa: E402
from transformer.run.config import parse

LINES = ["def add(a, b):", "    return a + b", "", "class Point:", "    x = 0"]


class TinyText(tfds.core.GeneratorBasedBuilder):
  """Documents of a few lines of code: 40 for training, 8 for validation."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(40), "validation": self._generate_examples(8)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {"text": "\n".join(LINES[:1 + i % 5] + [f"# document {i}"] * 20)}


def test_lm_reads_tfds_documents_as_one_stream(tmp_path):
  data_dir = str(tmp_path / "tfds")
  TinyText(data_dir=data_dir, file_format="array_record").download_and_prepare()
  config = make_tiny_config()
  config.data = dict(source="lm", corpus="tfds", tfds_name="tiny_text", tfds_dir=data_dir,
                     vocab_size=48, max_len=8, max_factor=2)
  config.model.update(arch="decoder", max_len=16)
  config.eval.num_examples = 4
  source = experiment.build(parse(config), str(tmp_path)).source
  source.prepare()
  assert source.streams["train"][0] == 1  # BOS opens a document
  assert (source.streams["valid"] == 1).sum() == 8  # one BOS per validation document
  splits = source.eval_splits()
  assert sorted(splits) == ["len16", "len16_sliding", "len8"]
  batch = next(iter(source.train_batches()))
  assert batch["inputs"].shape == (32, 8)
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
