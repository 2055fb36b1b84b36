"""Where the language-modelling documents come from: one reader per `data.corpus`, and
what a corpus is (its identity: what a run's tokenizer is trained from).

Corpora (`data.corpus`):
  stdlib  the Python standard library's source, which every Python installation carries:
          the .py files under sysconfig.get_paths()["stdlib"] (no site-packages or test
          directories; `data.stdlib_scope` "top": top-level modules only, "all": packages
          too), sorted by path; `data.python_version` must be the running interpreter's,
          so that a run names the exact files it read.
  files   the files matching `data.train_files` / `data.valid_files` (globs under data.dir),
          one document each.
  tfds    the `data.text_key` feature of `data.tfds_name`'s train_split / valid_split,
          read through tfds.data_source (array_record, no TensorFlow), one document each.
  hf      the `data.text_key` column of a Hugging Face dataset's train_split / valid_split
          (data.hf_path, hf_name, ...) or of local files (data.hf_path a builder such as
          parquet, data.train_files / valid_files): one document per row (hf_datasets.py).
Held-out documents: for stdlib, the files whose CRC32 of the relative path is 0 modulo
`data.heldout_modulus`; otherwise the valid files or split.

Each reader takes the config.data of data.source "lm" (source.LMData, which checks data.corpus
against CORPORA) and a split, train or valid.
"""

import hashlib
import json
import pathlib
import sys
import sysconfig
import zlib

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.data import hf_datasets, text_files

_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_files(data) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """(train, valid) .py files of the running interpreter's standard library (see the module
  docstring); a ConfigError if it is not data.python_version."""
  running = f"{sys.version_info.major}.{sys.version_info.minor}"
  if data.python_version != running:
    raise ConfigError(f"config.data.python_version={data.python_version!r} but this is Python "
                      f"{running}: the stdlib corpus is pinned to one version; set "
                      f"--config.data.python_version={running} (a different corpus)")
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])  # always local
  files = sorted(p for p in root.rglob("*.py")
                 if not set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS
                 and (data.stdlib_scope == "all" or len(p.relative_to(root).parts) == 1))
  held = lambda p: zlib.crc32(str(p.relative_to(root)).encode()) % data.heldout_modulus == 0  # noqa: E731
  return [p for p in files if not held(p)], [p for p in files if held(p)]


def _read(path) -> str:
  """An interpreter's own source file (the stdlib is UTF-8 by PEP 3120; a stray byte is not
  the user's to fix)."""
  return epath.Path(path).read_bytes().decode("utf-8", errors="replace")


def _read_text(path) -> str:
  """A corpus file as UTF-8 text; a ConfigError naming the file and line if it is not."""
  data = epath.Path(path).read_bytes()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b"\n") + 1
    raise ConfigError(f"{path}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})"
                      ) from None


def stdlib_documents(data, split: str) -> list[str]:
  train, valid = stdlib_files(data)
  return [_read(p) for p in (train if split == "train" else valid)]


def file_documents(data, split: str) -> list[str]:
  return [_read_text(p) for p in text_files.split_files(data, split)]


def _tfds_split(data, split: str):
  return text_files.tfds_split(data.tfds_name, data.train_split if split == "train"
                         else data.valid_split, data.tfds_dir, what="data.corpus 'tfds'")


def tfds_documents(data, split: str) -> list[str]:
  where = f"TFDS dataset {data.tfds_name!r} ({split} split)"
  return [text_files.as_text(ex[data.text_key], where)
          for ex in text_files.tfds_records(_tfds_split(data, split), where)]


CORPORA = {"stdlib": stdlib_documents, "files": file_documents, "tfds": tfds_documents,
           "hf": hf_datasets.documents}


def _files_identity(paths) -> dict:
  """The files' paths, sizes and mtimes; of many files (the stdlib's), a digest of them."""
  identities = [text_files.file_identity(str(p)) for p in paths]
  if len(identities) <= 8:
    return {"files": identities}
  return {"files": {"count": len(identities), "first": identities[0]["path"],
                    "sha256": hashlib.sha256(json.dumps(identities).encode()).hexdigest()}}


def corpus_identity(data) -> dict:
  """What the training documents are, cheaply (their files' paths, sizes and mtimes, a
  TFDS split's version and size, a Hugging Face dataset's hf_datasets.identity): what the run's
  tokenizer is trained from."""
  if data.corpus == "stdlib":
    return {"corpus": "stdlib", "python": sys.version.split()[0], "scope": data.stdlib_scope,
            "heldout_modulus": data.heldout_modulus, **_files_identity(stdlib_files(data)[0])}
  if data.corpus == "files":
    return {"corpus": "files", **_files_identity(text_files.split_files(data, "train"))}
  if data.corpus == "hf":
    return {"corpus": "hf", **hf_datasets.identity(data, "train", [data.text_key],
                                                   "data.corpus 'hf'")}
  source = _tfds_split(data, "train")
  return {"corpus": "tfds", "tfds_name": data.tfds_name, "split": data.train_split,
          "tfds_dir": storage.absolute(data.tfds_dir) if data.tfds_dir else "",
          "version": str(source.dataset_info.version), "records": len(source),
          "text_key": data.text_key}
