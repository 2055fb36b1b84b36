"""Hugging Face datasets (`pip install -e '.[hf]'`): translation pairs (data.source "hf") and
language-modelling documents (data.source "lm" with data.corpus "hf").

Where the rows are, in either source's config.data:
  hub     data.hf_path a dataset's name on the hub (e.g. "wmt/wmt14"), or a local directory
          laid out like one; data.hf_name its config ("" its default), data.hf_revision a
          branch, tag or commit ("" the default branch); the splits data.train_split,
          valid_split (and, translation, test_split: "" none).
  files   data.hf_path one of datasets' builders of local files (LOCAL_BUILDERS: parquet,
          json (JSON Lines too), arrow, csv) and data.train_files, valid_files (and,
          translation, test_files: optional), a glob under data.dir each, one split each.
A column is named by its path: "de", or "translation.de" inside a nested column (the hub's
WMT datasets keep each pair as translation: {de: ..., en: ...}). data.hf_streaming reads the
rows as they arrive (datasets' IterableDataset) instead of preparing the whole dataset in
datasets' cache (data.hf_cache_dir; "": $HF_DATASETS_CACHE) first.

Translation pairs then go the text and tfds sources' way (translation.TranslationSource):
a tokenizer trained on a sample of the training pairs, the training pairs encoded once into
the array_record cache (encoded.py), whose key holds the dataset's identity (identity: the
path, config, revision, split and columns, and the local files' paths, sizes and mtimes or a
hub dataset's hash, its commit), and packed batches of each process's part of it. As with
those sources, every process streams the training rows while the cache is built, each
encoding its own chunks (encoded.build), and only process 0 trains the tokenizer. Without
streaming, every process loads the dataset as datasets does (prepared once per cache
directory, under datasets' file lock; a shared data.hf_cache_dir prepares it once): that is
datasets' own cache, never the workdir, which the source leaves unwritten until prepare().
"""

import dataclasses
import logging
import pathlib
from collections.abc import Iterator

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.fields import check, execution
from transformer.data import SourceArgs, encoded
from transformer.data.base import Example
from transformer.data.translation import TranslationData, TranslationSource

LOCAL_BUILDERS = ("arrow", "csv", "json", "parquet")
LOCAL_SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # files: split names
_BATCH = 1024  # rows read at a time

log = logging.getLogger("transformer")


def _datasets(what: str):
  """The datasets module, quiet (no progress bars: a failing run prints one error line); a
  ConfigError naming the extra without it."""
  try:
    import datasets  # noqa: PLC0415 - optional: pip install -e '.[hf]'
  except ImportError:
    raise ConfigError(f"{what} needs the Hugging Face datasets library: "
                      "pip install -e '.[hf]'") from None
  datasets.disable_progress_bars()
  datasets.logging.set_verbosity_error()
  return datasets


def check_fields(data, splits: tuple[str, ...]) -> None:
  """The checks of a config.data's hf_* fields that need no data (its __post_init__):
  hf_path names a hub dataset without files, a LOCAL_BUILDERS entry with them."""
  check(bool(data.hf_path), "hf_path", data.hf_path, "a hub dataset's name or one of "
        f"{', '.join(LOCAL_BUILDERS)} (local files)")
  if is_local(data):
    check(data.hf_path in LOCAL_BUILDERS, "hf_path", data.hf_path,
          f"one of {', '.join(LOCAL_BUILDERS)} (a builder of local files) when "
          "data.train_files is given")
    for split in splits[:2]:
      check(bool(getattr(data, f"{split}_files")), f"{split}_files", "",
            f"a glob under data.dir when data.hf_path={data.hf_path!r}")
  else:
    check(data.hf_path not in LOCAL_BUILDERS, "hf_path", data.hf_path,
          "a hub dataset without data.train_files (a builder of local files reads those)")


def is_local(data) -> bool:
  return bool(data.train_files or data.hf_path in LOCAL_BUILDERS)


def data_files(data, split: str) -> list[str]:
  """The local files of a split (`split`: train | valid | test), sorted; a ConfigError if
  its glob matches none."""
  pattern = getattr(data, f"{split}_files")
  paths = sorted(epath.Path(data.dir).glob(pattern)) if pattern else []
  if not paths:
    raise ConfigError(f"config.data.{split}_files={pattern!r}: no file matches under "
                      f"{data.dir or '.'!r}")
  return [storage.absolute(str(p)) for p in paths]


def describe(data, split: str) -> str:
  if is_local(data):
    return f"the {data.hf_path} files data.{split}_files={getattr(data, f'{split}_files')!r}"
  name = f" ({data.hf_name})" if data.hf_name else ""
  return (f"Hugging Face dataset {data.hf_path!r}{name} split "
          f"{getattr(data, f'{split}_split')!r}")


def load(data, split: str, what: str):
  """A split (`split`: train | valid | test) as a datasets Dataset, or an IterableDataset when
  data.hf_streaming; a ConfigError naming the field to fix if it cannot be loaded."""
  datasets = _datasets(what)
  if is_local(data):
    name = LOCAL_SPLITS[split]
    kwargs = dict(path=data.hf_path, data_files={name: data_files(data, split)}, split=name)
  else:
    kwargs = dict(path=data.hf_path, name=data.hf_name or None, split=getattr(
        data, f"{split}_split"), revision=data.hf_revision or None)
  log.info("reading %s%s", describe(data, split), " (streaming)" if data.hf_streaming else "")
  try:
    return datasets.load_dataset(**kwargs, streaming=data.hf_streaming,
                                 cache_dir=data.hf_cache_dir or None)
  except Exception as e:  # noqa: BLE001 - datasets raises assorted errors for a bad dataset
    reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    field = (f"{split}_files" if is_local(data) else
             f"{split}_split" if "split" in reason.lower() else
             "hf_name" if "builderconfig" in reason.lower() else "hf_path")
    raise ConfigError(f"config.data.{field}={getattr(data, field)!r}: cannot read "
                      f"{describe(data, split)} ({reason})") from None


def _leaves(features, prefix: str = "") -> dict[str, object]:
  """{column path: feature} of a dataset's features, nested columns' leaves as `a.b`."""
  out = {}
  for key, feature in features.items():
    path = f"{prefix}{key}"
    if isinstance(feature, dict):
      out.update(_leaves(feature, f"{path}."))
    elif hasattr(feature, "languages") and hasattr(feature, "flatten"):  # datasets.Translation
      out.update(_leaves(feature.flatten(), f"{path}."))
    else:
      out[path] = feature
  return out


def _row_leaves(row: dict, prefix: str = "") -> dict[str, object]:
  """_leaves of a row (its values' type names), for a streamed dataset whose features are
  not known."""
  out = {}
  for key, value in row.items():
    if isinstance(value, dict):
      out.update(_row_leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = type(value).__name__
  return out


def check_column(dataset, column: str, field: str, where: str) -> None:
  """A ConfigError unless `column` is a text column of `dataset` (the error lists them)."""
  if dataset.features is not None:
    leaves = _leaves(dataset.features)
  else:
    leaves = _row_leaves(next(iter(dataset), {}))
  if column not in leaves:
    raise ConfigError(f"config.data.{field}={column!r}: no such column in {where}; its "
                      f"columns: {', '.join(leaves) or 'none'}")
  feature = leaves[column]
  if feature != "str" and getattr(feature, "dtype", None) not in ("string", "large_string"):
    raise ConfigError(f"config.data.{field}={column!r} is not a text column of {where} "
                      f"({feature})")


def _path(column: str, top: list[str]) -> list[str]:
  """A column's keys: the longest dotted prefix naming a top-level column, then the rest."""
  parts = column.split(".")
  for i in range(len(parts), 0, -1):
    if ".".join(parts[:i]) in top:
      return [".".join(parts[:i]), *parts[i:]]
  return parts


def texts(dataset, columns: list[str], where: str) -> Iterator[tuple[str, ...]]:
  """The rows' values of `columns` (checked by check_column), streamed a batch at a time; a
  ConfigError for a value that is not text (a null)."""
  paths = [_path(c, list(dataset.column_names or [])) for c in columns]
  top = sorted({p[0] for p in paths})
  row = 0
  for batch in dataset.select_columns(top).iter(batch_size=_BATCH):
    values = []
    for path in paths:
      column = batch[path[0]]
      for key in path[1:]:
        column = [None if v is None else v.get(key) for v in column]
      values.append(column)
    for i, items in enumerate(zip(*values)):
      for column, value in zip(columns, items):
        if not isinstance(value, str):
          raise ConfigError(f"{where}, row {row + i}: column {column!r} holds {value!r}, "
                            "not text")
      yield items
    row += len(values[0])


def identity(data, split: str, columns: list[str], what: str) -> dict:
  """What a split's rows are, cheaply: the local files' paths, sizes and mtimes, or a hub
  dataset's name, config, revision and hash (datasets' builder hash: the dataset's commit,
  or for a local dataset directory a hash of its files' paths and mtimes)."""
  out = {"hf_path": data.hf_path, "columns": list(columns)}
  if is_local(data):
    return out | {"split": split, "files": [encoded.file_identity(f)
                                            for f in data_files(data, split)]}
  try:
    builder = _datasets(what).load_dataset_builder(
        data.hf_path, data.hf_name or None, revision=data.hf_revision or None,
        cache_dir=data.hf_cache_dir or None)
    digest = builder.hash
  except Exception as e:  # noqa: BLE001 - as in load()
    raise ConfigError(f"config.data.hf_path={data.hf_path!r}: cannot read "
                      f"{describe(data, split)} ({type(e).__name__}: {e})") from None
  return out | {"hf_name": data.hf_name, "revision": data.hf_revision,
                "split": getattr(data, f"{split}_split"), "hash": digest}


# --------------------------------------------------------------------------- translation


@dataclasses.dataclass(frozen=True)
class HfData(TranslationData):
  """config.data of data.source "hf": a Hugging Face dataset's source and target columns
  (module docstring). A language model on one: data.source=lm with data.corpus=hf."""

  hf_path: str = "wmt/wmt14"  # a hub dataset, or a builder of local files (LOCAL_BUILDERS)
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
    check_fields(self, ("train", "valid", "test"))
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
    self.identity = [identity(self.data, "train", self._columns(), self.WHAT)]

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
      dataset = load(self.data, split, self.WHAT)
      for field in ("source_column", "target_column"):
        check_column(dataset, getattr(self.data, field), field, describe(self.data, split))
      self.datasets[split] = dataset
    return self.datasets[split]

  def held_out(self) -> list[str]:
    test = self.data.test_files if is_local(self.data) else self.data.test_split
    return ["valid", "test"] if test else ["valid"]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    pairs = list(self._stream(split))
    if not any(s.strip() and t.strip() for s, t in pairs):
      raise ConfigError(f"empty split: no non-empty sentence pair in "
                        f"{describe(self.data, split)}")
    return pairs

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return self._stream("train")

  def _stream(self, split: str) -> Iterator[tuple[str, str]]:
    return texts(self._dataset(split), self._columns(), describe(self.data, split))

  def corpus_identity(self) -> list[dict]:
    return self.identity


# --------------------------------------------------------------------------- language model


def documents(data, split: str) -> list[str]:
  """The `data.text_key` column of a split (train | valid) of data.corpus "hf", one document
  per row (lm.LMData)."""
  dataset = load(data, split, "data.corpus 'hf'")
  where = describe(data, split)
  check_column(dataset, data.text_key, "text_key", where)
  return [text for (text,) in texts(dataset, [data.text_key], where)]


def check_split(data, split: str) -> None:
  """A ConfigError if a split of data.corpus "hf" cannot be read or lacks its column."""
  dataset = load(data, split, "data.corpus 'hf'")
  check_column(dataset, data.text_key, "text_key", describe(data, split))
