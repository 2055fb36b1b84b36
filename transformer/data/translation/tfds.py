"""data.source "tfds": translation pairs of a prepared TFDS translation dataset, read through
tfds.data_source (array_record, no TensorFlow; data/text_files.py's tfds_split says how to
prepare one). What every translation source shares: base.py."""

import dataclasses
import functools
from collections.abc import Iterator

from transformer.core import storage
from transformer.core.fields import execution
from transformer.data import SourceArgs, text_files
from transformer.data.base import Example
from transformer.data.translation.base import TranslationData, TranslationSource


@dataclasses.dataclass(frozen=True)
class TfdsData(TranslationData):
  """config.data of data.source "tfds": a prepared TFDS translation dataset, read through
  tfds.data_source (array_record, no TensorFlow), source_lang → target_lang."""

  tfds_name: str = "wmt14_translate/de-en"
  tfds_dir: str = execution("")  # "": tfds's default, ~/tensorflow_datasets
  source_lang: str = "en"
  target_lang: str = "de"
  train_split: str = "train"
  valid_split: str = "validation"
  test_split: str = "test"  # "": none


class TfdsSource(TranslationSource):
  """data.source "tfds": a prepared TFDS translation dataset (TfdsData), e.g.
  wmt14_translate/de-en. Preparing it once needs TensorFlow for the WMT builders."""

  Data = TfdsData

  def __init__(self, data: TfdsData, task, args: SourceArgs):
    super().__init__(data, task, args)
    for split in ("train", "valid"):  # fails early, before anything is written
      self._data_source(split)

  @classmethod
  def example(cls, directory: str) -> Example:
    """A six-pair dataset prepared as array_record under `directory` (needs
    tensorflow-datasets: an ImportError without it)."""
    _example_builder()(data_dir=directory, file_format="array_record").download_and_prepare()
    data = dict(source="tfds", tfds_name="example_translation", tfds_dir=directory,
                vocab_size=40, max_len=16, decode_offset=5, test_split="")
    return Example({"data": data}, "a dog runs")

  def _data_source(self, split: str):
    return text_files.tfds_split(self.data.tfds_name, getattr(self.data, f"{split}_split"),
                           self.data.tfds_dir)

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if getattr(self.data, f"{split}_split")]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return list(self._stream(split))

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return self._stream("train")

  def _stream(self, split: str, chunk: int = 4096) -> Iterator[tuple[str, str]]:
    """The pairs of a split in record order, read `chunk` records at a time."""
    src, tgt = self.data.source_lang, self.data.target_lang
    where = f"TFDS dataset {self.data.tfds_name!r} split {split!r}"
    for ex in text_files.tfds_records(self._data_source(split), where, chunk):
      yield text_files.as_text(ex[src], where), text_files.as_text(ex[tgt], where)

  def corpus_identity(self) -> list[dict]:
    """The split's name, version and size, and each of its array_record files' size and
    mtime with the records read from it: a re-prepared dataset has new files."""
    source = self._data_source("train")
    files = [text_files.file_identity(f.filename) | {"skip": f.skip, "take": f.take}
             for f in source.dataset_info.splits[source.split].file_instructions]
    return [{"tfds_name": self.data.tfds_name, "split": self.data.train_split,
             "tfds_dir": storage.absolute(self.data.tfds_dir) if self.data.tfds_dir else "",
             "version": str(source.dataset_info.version), "records": len(source),
             "languages": [self.data.source_lang, self.data.target_lang], "files": files}]


@functools.cache
def _example_builder():
  """A TFDS builder of six English-German pairs (train ×10, validation ×1): TfdsSource's
  example. Defined once: tfds registers a builder class by its name."""
  import tensorflow_datasets as tfds  # noqa: PLC0415 - optional: pip install '.[tfds]'

  pairs = [("a dog runs", "ein hund läuft"), ("the cat sleeps", "die katze schläft"),
           ("a big dog", "ein großer hund"), ("the small cat", "die kleine katze"),
           ("here now", "hier jetzt"), ("a cat runs", "eine katze läuft")]

  class ExampleTranslation(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self,
                                   features=tfds.features.Translation(languages=("en", "de")))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(10), "validation": self._generate_examples(1)}

    def _generate_examples(self, repeats):
      for i in range(repeats * len(pairs)):
        yield i, dict(zip(("en", "de"), pairs[i % len(pairs)]))

  return ExampleTranslation
