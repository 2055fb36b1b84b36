"""Text corpora: parallel files with one sentence per line, a source and a target file per
split, plain or gzip, local or a URL; the files of a split named by a glob; and prepared
TFDS datasets; what identifies a corpus file (file_identity). Bad input fails with a
ConfigError naming the file (and line) or saying how to prepare the dataset."""

import contextlib
import gzip
import itertools
from collections.abc import Iterator

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError


def file_identity(path: str) -> dict:
  """What identifies a corpus file's contents cheaply: its path, size and mtime."""
  stat = epath.Path(path).stat()
  return {"path": storage.absolute(path), "size": stat.length, "mtime": int(stat.mtime)}


def split_files(data, split: str) -> list[str]:
  """The files of a split (`split`: train | valid | test) that the glob of a config.data's
  `{split}_files` matches under its `dir`, sorted, as absolute paths; a ConfigError if it
  matches none."""
  pattern = getattr(data, f"{split}_files")
  paths = sorted(epath.Path(data.dir).glob(pattern)) if pattern else []
  if not paths:
    raise ConfigError(f"config.data.{split}_files={pattern!r}: no file matches under "
                      f"{data.dir or '.'!r}")
  return [storage.absolute(str(p)) for p in paths]


def read_lines(path: str) -> list[str]:
  """The lines of a UTF-8 text file (.gz is decompressed), without line endings."""
  return list(iter_lines(path))


def iter_lines(path: str) -> Iterator[str]:
  """The lines of a UTF-8 text file (.gz is decompressed), without line endings, streamed."""
  if not epath.Path(path).is_file():
    raise ConfigError(f"corpus file not found: {path}")
  try:
    with _open(path) as f:
      for number, raw in enumerate(f, start=1):
        try:
          yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
          raise ConfigError(f"{path}:{number}: not valid UTF-8 ({e.reason} at byte {e.start})"
                            ) from None
  except (OSError, EOFError) as e:  # e.g. a truncated or non-gzip .gz
    raise ConfigError(f"cannot read {path}: {e}") from None


@contextlib.contextmanager
def _open(path: str):
  """The file's bytes, local or a URL; .gz decompressed."""
  with epath.Path(path).open("rb") as raw:
    if path.endswith(".gz"):
      with gzip.open(raw, "rb") as f:
        yield f
    else:
      yield raw


def read_parallel(source_path: str, target_path: str) -> list[tuple[str, str]]:
  """Aligned (source, target) sentence pairs of two files with one sentence per line."""
  sources, targets = read_lines(source_path), read_lines(target_path)
  if len(sources) != len(targets):
    raise ConfigError(f"{source_path} has {len(sources)} lines but {target_path} has "
                      f"{len(targets)}; parallel files must align line by line")
  if not any(s.strip() and t.strip() for s, t in zip(sources, targets)):
    raise ConfigError(f"empty corpus: no non-empty sentence pair in {source_path} and "
                      f"{target_path}")
  return list(zip(sources, targets))


def iter_parallel(source_path: str, target_path: str) -> Iterator[tuple[str, str]]:
  """read_parallel's pairs streamed, in constant memory; the same errors, raised when met."""
  sources, targets = iter_lines(source_path), iter_lines(target_path)
  count, nonempty = 0, False
  for source, target in itertools.zip_longest(sources, targets):
    if source is None or target is None:
      longer, shorter = (source_path, target_path) if target is None else (target_path,
                                                                           source_path)
      raise ConfigError(f"{longer} has more lines than {shorter} ({count}); parallel files "
                        f"must align line by line")
    count += 1
    nonempty = nonempty or bool(source.strip() and target.strip())
    yield source, target
  if not nonempty:
    raise ConfigError(f"empty corpus: no non-empty sentence pair in {source_path} and "
                      f"{target_path}")


def tfds_split(name: str, split: str, data_dir: str = "", what: str = "data.source 'tfds'"):
  """The random-access tfds.data_source of a prepared dataset's split (array_record, no
  TensorFlow); a ConfigError that says how to prepare it if it cannot be read. `what` names
  the config choice that needs tensorflow-datasets."""
  try:
    import tensorflow_datasets as tfds  # noqa: PLC0415 - optional: pip install '.[tfds]'
  except ImportError:
    raise ConfigError(f"{what} needs tensorflow-datasets: pip install -e '.[tfds]'") from None
  data_dir = data_dir or None
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # noqa: BLE001 - tfds raises assorted errors for an unprepared set
    raise ConfigError(
        f"TFDS dataset {name!r} (split {split!r}) is not readable under "
        f"{data_dir or '~/tensorflow_datasets'} ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:200]}). Prepare it once in array_record format: pip install "
        f"tensorflow tensorflow-datasets && python -c \"import tensorflow_datasets as tfds; "
        f"tfds.builder('{name}', data_dir={data_dir!r}, file_format='array_record')"
        f".download_and_prepare()\"") from None


def as_text(value, where: str = "a TFDS record") -> str:
  """A TFDS text feature (bytes or str) as str; a ConfigError naming `where` if its bytes
  are not UTF-8."""
  try:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
  except UnicodeDecodeError as e:
    raise ConfigError(f"{where}: a text feature is not valid UTF-8 ({e.reason} at byte "
                      f"{e.start}); prepare the dataset again") from None


def tfds_records(source, where: str, chunk: int = 4096) -> Iterator:
  """The records of a tfds.data_source in order, `chunk` at a time; a damaged file of it is
  one ConfigError naming `where` (array_record raises assorted errors)."""
  for start in range(0, len(source), chunk):
    try:
      records = source.__getitems__(range(start, min(start + chunk, len(source))))
    except Exception as e:  # noqa: BLE001
      raise ConfigError(f"cannot read {where}, records {start}.. ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); prepare the dataset again"
                        ) from None
    yield from records
