"""Where files live. Every file the project reads or writes (configs, metrics, tokenizers,
corpora, predictions, reports, plots, locks) goes through etils.epath, the path library
orbax uses for the checkpoints, so a workdir, a sweep directory or a corpus may be a local
path or a URL (`gs://bucket/dir`; other schemes as epath supports them).

Local files keep POSIX guarantees: a write goes to a temporary file renamed into place (no
reader sees half of it), appends append. An object store has neither rename nor append,
but replaces a whole object at once: a write is one upload, an append rewrites the object.
"""

import os

from etils import epath


def is_local(path) -> bool:
  return "://" not in str(path)


def absolute(path: str) -> str:
  """An absolute local path; a URL unchanged."""
  return os.path.abspath(path) if is_local(path) else str(path)


def join(path, *names: str) -> str:
  return str(epath.Path(path).joinpath(*names))


def write(path, data: str | bytes) -> None:
  """Writes `data` to `path` as a whole: through a renamed temporary file locally, as one
  object upload to a bucket."""
  target = epath.Path(path)
  binary = isinstance(data, bytes)
  if not is_local(path):
    target.write_bytes(data) if binary else target.write_text(data, encoding="utf-8")
    return
  temporary = epath.Path(f"{path}.tmp")
  temporary.write_bytes(data) if binary else temporary.write_text(data, encoding="utf-8")
  os.replace(temporary, target)


def append(path, text: str) -> None:
  """Appends `text` to the file at `path` (creating it)."""
  target = epath.Path(path)
  if is_local(path):
    with open(target, "a", encoding="utf-8") as f:
      f.write(text)
  else:
    write(path, (target.read_text(encoding="utf-8") if target.exists() else "") + text)


def read_text(path) -> str:
  return epath.Path(path).read_text(encoding="utf-8")


def writable_directory(path) -> str | None:
  """None if files can be created under the directory `path` (or the directories that would
  be made for it), else why not. Checked locally; a URL's permissions are known only when
  writing."""
  if not is_local(path):
    return None
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{existing} is a file, not a directory"
  if not os.access(existing, os.W_OK | os.X_OK):
    return f"{existing} is not writable"
  return None
