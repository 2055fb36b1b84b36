"""data.source "hf": translation pairs of a Hugging Face dataset (`pip install -e '.[hf]'`),
from the hub or from local files (where the rows are, and how they are read:
hf_datasets.py). A language model on a Hugging Face dataset is data.source "lm" with
data.corpus "hf".

The pairs then go the text and tfds sources' way (base.TranslationSource): a
tokenizer trained on a sample of the training pairs, the training pairs encoded once into
the array_record cache (data/encoded_corpus.py), whose key holds the dataset's identity
(hf_datasets.identity), and packed batches of each process's part of it. As with those
sources, every process streams the training rows while the cache is built, each encoding
its own chunks (encoded_corpus.build), and only process 0 trains the tokenizer. Without
streaming, every process loads the dataset as datasets does (prepared once per cache
directory, under datasets' file lock; a shared data.hf_cache_dir prepares it once): that is
datasets' own cache, never the workdir, which the source leaves unwritten until prepare().
"""

import dataclasses
import pathlib
from collections.abc import Iterator

from transformer.core.errors import ConfigError
from transformer.core.fields import check, execution
from transformer.data import SourceArgs, hf_datasets
from transformer.data.base import Example
from transformer.data.translation.base import TranslationData, TranslationSource


@dataclasses.dataclass(frozen=True)
class HfData(TranslationData):
  """config.data of data.source "hf": a Hugging Face dataset's source and target columns
  (module docstring). A language model on one: data.source=lm with data.corpus=hf."""

  hf_path: str = "wmt/wmt14"  # a hub dataset, or a builder of local files (hf_datasets)
  hf_name: str = "de-en"  # hub: the dataset's config; "": its default
  hf_revision: str = ""  # hub: a branch, tag or commit; "": the default branch
  hf_streaming: bool = execution(False)  # read rows as they arrive; False: prepare it first
  hf_cache_dir: str = execution("")  # datasets' cache; "": $HF_DATASETS_CACHE
  dir: str = execution("")  # files: the directory of the globs
  train_files: str = ""  # files: a glob per split; the test split is optional ("")
  valid_files: str = ""
  test_files: str = ""
  train_split: str = "train"  # hub: the dataset's splits; the test split is optional ("")
  valid_split: str = "validation"
  test_split: str = "test"
  source_column: str = "translation.en"  # a column path (module docstring)
  target_column: str = "translation.de"

  unknown_hint = ("a language model on a Hugging Face dataset is data.source=lm with "
                  "data.corpus=hf (its column: data.text_key)")

  def __post_init__(self):
    super().__post_init__()
    hf_datasets.check_fields(self, ("train", "valid", "test"))
    for field in ("source_column", "target_column"):
      check(bool(getattr(self, field)), field, "", "a column of the dataset")


class HfSource(TranslationSource):
  """data.source "hf": translation pairs of a Hugging Face dataset (HfData)."""

  Data = HfData
  WHAT = "data.source 'hf'"

  def __init__(self, data: HfData, task, args: SourceArgs):
    super().__init__(data, task, args)
    self.datasets = {}
    for split in ("train", "valid"):  # fails early, before anything is written
      self._dataset(split)
    # what was loaded, taken now: a file changed later is another corpus, read by a new run
    self.identity = [hf_datasets.identity(self.data, "train", self._columns(), self.WHAT)]

  @classmethod
  def example(cls, directory: str) -> Example:
    """Parquet files of English-German pairs in the nested layout of the hub's WMT
    datasets (needs datasets: an ImportError without it)."""
    import datasets  # noqa: F401, PLC0415 - optional: pip install -e '.[hf]'
    import pyarrow as pa  # noqa: PLC0415 - datasets' own dependency
    import pyarrow.parquet as pq  # noqa: PLC0415

    words = ["a", "dog", "cat", "runs", "sleeps", "the", "big", "small"]
    lines = [f"{a} {b} {c}" for a in words[:4] for b in words[4:] for c in words[::3]]
    rows = [{"translation": {"en": s, "de": s.upper()}} for s in lines]
    pq.write_table(pa.Table.from_pylist(rows * 2), pathlib.Path(directory) / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:8]), pathlib.Path(directory) / "valid.parquet")
    data = dict(source="hf", hf_path="parquet", dir=directory, train_files="train.parquet",
                valid_files="valid.parquet", vocab_size=40, max_len=12, decode_offset=3)
    return Example({"data": data}, "the dog runs")

  def _columns(self) -> list[str]:
    return [self.data.source_column, self.data.target_column]

  def _dataset(self, split: str):
    if split not in self.datasets:
      dataset = hf_datasets.load(self.data, split, self.WHAT)
      for field in ("source_column", "target_column"):
        hf_datasets.check_column(dataset, getattr(self.data, field), field,
                                 hf_datasets.describe(self.data, split))
      self.datasets[split] = dataset
    return self.datasets[split]

  def held_out(self) -> list[str]:
    test = self.data.test_files if hf_datasets.is_local(self.data) else self.data.test_split
    return ["valid", "test"] if test else ["valid"]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    pairs = list(self._stream(split))
    if not any(s.strip() and t.strip() for s, t in pairs):
      raise ConfigError(f"empty split: no non-empty sentence pair in "
                        f"{hf_datasets.describe(self.data, split)}")
    return pairs

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return self._stream("train")

  def _stream(self, split: str) -> Iterator[tuple[str, str]]:
    return hf_datasets.texts(self._dataset(split), self._columns(),
                             hf_datasets.describe(self.data, split))

  def corpus_identity(self) -> list[dict]:
    return self.identity
