"""data.source "text": translation pairs of parallel text files, a source and a target file
per split under data.dir (plain or .gz, one sentence per line, local or a URL;
data/text_files.py reads them). What every translation source shares: base.py."""

import dataclasses
import gzip
import pathlib
from collections.abc import Iterator

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.fields import execution
from transformer.data import SourceArgs, text_files
from transformer.data.base import Example
from transformer.data.translation.base import TranslationData, TranslationSource


@dataclasses.dataclass(frozen=True)
class TextData(TranslationData):
  """config.data of data.source "text": a source and a target file per split under `dir`
  (plain or .gz, one sentence per line); the test split is optional ("")."""

  dir: str = execution("")
  train_source: str = ""
  train_target: str = ""
  valid_source: str = ""
  valid_target: str = ""
  test_source: str = ""
  test_target: str = ""


class ParallelTextSource(TranslationSource):
  """data.source "text": parallel files (TextData)."""

  Data = TextData

  def __init__(self, data: TextData, task, args: SourceArgs):
    super().__init__(data, task, args)
    for split in ("train", "valid"):  # fails early, before anything is written
      for side in ("source", "target"):
        path = self.path(split, side)
        if not epath.Path(path).is_file():
          raise ConfigError(f"config.data.{split}_{side}: corpus file not found: {path}")

  @classmethod
  def example(cls, directory: str) -> Example:
    words = ["a", "dog", "cat", "runs", "sleeps", "the", "big", "small"]
    lines = [f"{a} {b} {c}" for a in words[:4] for b in words[4:] for c in words[::3]]
    for lang, sentences in (("en", lines), ("de", [s.upper() for s in lines])):
      with gzip.open(pathlib.Path(directory) / f"train.{lang}.gz", "wt") as f:
        f.write("\n".join(sentences * 2) + "\n")
      (pathlib.Path(directory) / f"valid.{lang}").write_text("\n".join(sentences[:8]) + "\n")
    data = dict(source="text", dir=directory, train_source="train.en.gz",
                train_target="train.de.gz", valid_source="valid.en", valid_target="valid.de",
                vocab_size=40, max_len=12, decode_offset=3)
    return Example({"data": data}, "the dog runs")

  def path(self, split: str, side: str) -> str:
    return storage.join(self.data.dir, getattr(self.data, f"{split}_{side}"))

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if getattr(self.data, f"{split}_source")]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return text_files.read_parallel(self.path(split, "source"), self.path(split, "target"))

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return text_files.iter_parallel(self.path("train", "source"), self.path("train", "target"))

  def corpus_identity(self) -> list[dict]:
    return [text_files.file_identity(self.path("train", side)) for side in ("source", "target")]
