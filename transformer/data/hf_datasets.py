"""Reading Hugging Face datasets (`pip install -e '.[hf]'`), for the translation source
(data.source "hf": hf.py) and the language-model corpus (data.source "lm" with data.corpus
"hf": corpora.py). The functions take either source's config.data.

Where the rows are:
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
datasets' cache (data.hf_cache_dir; "": $HF_DATASETS_CACHE) first. A split's identity
(identity: the path, config, revision, split and columns, and the local files' paths, sizes
and mtimes or a hub dataset's hash, its commit) keys what a run builds from it.
"""

import logging
from collections.abc import Iterator

from transformer.core.errors import ConfigError
from transformer.core.fields import check
from transformer.data import text_files

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
  # its own error lines too ("Failed to load JSON from file ..."): the ConfigError says it
  datasets.logging.set_verbosity(datasets.logging.CRITICAL)
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


def describe(data, split: str) -> str:
  if is_local(data):
    files = text_files.split_files(data, split)
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return (f"the {data.hf_path} files data.{split}_files={getattr(data, f'{split}_files')!r}"
            f" ({named})")
  name = f" ({data.hf_name})" if data.hf_name else ""
  return (f"Hugging Face dataset {data.hf_path!r}{name} split "
          f"{getattr(data, f'{split}_split')!r}")


def load(data, split: str, what: str):
  """A split (`split`: train | valid | test) as a datasets Dataset, or an IterableDataset when
  data.hf_streaming; a ConfigError naming the field to fix if it cannot be loaded."""
  datasets = _datasets(what)
  if is_local(data):
    name = LOCAL_SPLITS[split]
    kwargs = dict(path=data.hf_path, data_files={name: text_files.split_files(data, split)}, split=name)
  else:
    kwargs = dict(path=data.hf_path, name=data.hf_name or None, split=getattr(
        data, f"{split}_split"), revision=data.hf_revision or None)
  log.info("reading %s%s", describe(data, split), " (streaming)" if data.hf_streaming else "")
  try:
    return datasets.load_dataset(**kwargs, streaming=data.hf_streaming,
                                 cache_dir=data.hf_cache_dir or None)
  except Exception as e:  # noqa: BLE001 - datasets raises assorted errors for a bad dataset
    reason = _reason(e)
    field = (f"{split}_files" if is_local(data) else
             f"{split}_split" if "split" in reason.lower() else
             "hf_name" if "builderconfig" in reason.lower() else "hf_path")
    raise ConfigError(f"config.data.{field}={getattr(data, field)!r}: cannot read "
                      f"{describe(data, split)} ({reason})") from None


def _reason(e: BaseException) -> str:
  """What went wrong, in one line: the cause at the root of `e` (datasets raises a file's own
  error, e.g. pyarrow's JSON parse error or a UnicodeDecodeError, as the cause of a
  DatasetGenerationError that says only that generating failed)."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
  return f"not UTF-8 text ({text})" if isinstance(e, UnicodeDecodeError) else text


def _read(rows, where: str) -> Iterator:
  """The items of `rows` (a dataset's batches or rows, read as they are asked for: a streamed
  dataset reads its files here), an error of the reading as one ConfigError naming `where`."""
  iterator = iter(rows)
  while True:
    try:
      item = next(iterator)
    except StopIteration:
      return
    except Exception as e:  # noqa: BLE001 - datasets, pyarrow and pandas raise anything
      raise ConfigError(f"cannot read {where}: {_reason(e)}") from None
    yield item


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
    leaves = _row_leaves(next(_read(dataset, where), {}))
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
  for batch in _read(dataset.select_columns(top).iter(batch_size=_BATCH), where):
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
    return out | {"split": split, "files": [text_files.file_identity(f)
                                            for f in text_files.split_files(data, split)]}
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


def documents(data, split: str) -> list[str]:
  """The `data.text_key` column of a split (train | valid) of data.corpus "hf", one document
  per row (lm/source.py LMData)."""
  dataset = load(data, split, "data.corpus 'hf'")
  where = describe(data, split)
  check_column(dataset, data.text_key, "text_key", where)
  return [value for (value,) in texts(dataset, [data.text_key], where)]


def check_split(data, split: str) -> None:
  """A ConfigError if a split of data.corpus "hf" cannot be read or lacks its column."""
  dataset = load(data, split, "data.corpus 'hf'")
  check_column(dataset, data.text_key, "text_key", describe(data, split))
