"""The encoded-corpus cache: a translation training corpus encoded once into token ids,
kept as sharded array_record files under data.cache_dir (build), checked against its manifest
(check) and read back by random access (EncodedCorpus).

Records: [source length, source ids..., EOS, target ids..., EOS], one per pair, as uint16 (a
vocabulary of at most 65536 pieces) or int32; CHUNK pairs per shard.

Building: the pairs are encoded in chunks (sentencepiece encodes each chunk's list in C++
threads); with P processes, process i encodes chunks i, i+P, ..., all wait at one barrier for
the shards, then process 0 writes the manifest last and all wait for it. The manifest holds
the key the shards were built for (the tokenizer's bytes, the corpus's identity), the
records' dtype, each shard's record count and byte size, their total, and a checksum of all
that. An error in the corpus while encoding removes the shards written so far.

Checking: a run reads the shards only when the manifest agrees with itself (its checksum),
with the run (its key and dtype) and with the shards (each one's size and record count, their
total); otherwise it says why in a log line and rebuilds the cache, or, where the cache's
directory is not writable (a shared read-only cache), is refused in one line saying how to
fix it.

Reading: a corrupted byte inside a shard (same size and record count, which check cannot
see) fails its read during training, riegeli checking each chunk's hash: refused in one line,
never trained on silently.
"""

import contextlib
import hashlib
import itertools
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.vocab import EOS_ID

FORMAT = 2  # 2: the manifest has a checksum
MANIFEST = "manifest.json"
CHUNK = 1 << 17  # pairs per encoding chunk and per shard file
WRITER_OPTIONS = "group_size:1,uncompressed"  # group size 1: each record read on its own

log = logging.getLogger("transformer")


def make_key(tokenizer_bytes: bytes, corpus: list[dict]) -> dict:
  """The cache key: the tokenizer model's hash and the corpus' identity."""
  return {"format": FORMAT, "tokenizer_sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
          "corpus": corpus}


def shard_name(index: int) -> str:
  return f"shard-{index:05d}.array_record"


def dtype_for(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def _differences(old: dict, new: dict) -> list[str]:
  return [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def checksum(manifest: dict) -> str:
  """The sha256 of a manifest's content besides its checksum."""
  content = {k: v for k, v in manifest.items() if k != "checksum"}
  return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def check(directory: str, key: dict, dtype: np.dtype) -> dict | None:
  """The manifest of the cache in `directory` if it agrees with itself, with `key` and
  `dtype` and with its shards (module docstring); otherwise None, with a log line saying
  why: the cache is to be built. A ConfigError if it cannot be (the directory is not
  writable)."""
  path = epath.Path(directory) / MANIFEST
  exists = path.exists()
  why = _disagreement(directory, key, np.dtype(dtype)) if exists else "not built yet"
  if why is None:
    return json.loads(path.read_text())
  problem = storage.writable_directory(directory)
  if problem:
    raise ConfigError(f"the encoded corpus at {directory}: {why}, and it cannot be built "
                      f"there ({problem}): set data.cache_dir to a writable directory, or "
                      f"build it where it can be written")
  if exists:
    log.warning("encoded corpus at %s: %s; rebuilding it", directory, why)
  else:
    log.info("no encoded corpus at %s: encoding it", directory)
  return None


def _disagreement(directory: str, key: dict, dtype: np.dtype) -> str | None:
  """Why the cache in `directory`, which has a manifest, cannot be read as it is, or None."""
  path = epath.Path(directory) / MANIFEST
  try:
    manifest = json.loads(path.read_text())
    if manifest.get("key", {}).get("format") != FORMAT:
      return f"built by another version (format {manifest['key'].get('format')}, now {FORMAT})"
    if manifest.get("checksum") != checksum(manifest):
      return f"{path} was edited or damaged (its checksum does not match its content)"
    changed = _differences(manifest["key"], key)
    shards, total, stored = manifest["shards"], manifest["records"], manifest["dtype"]
    counts = [(shard["file"], shard["records"], shard["bytes"]) for shard in shards]
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    return f"unreadable manifest {path} ({type(e).__name__}: {e})"
  if changed:
    return f"built for another {' and '.join(changed)}"
  if stored != dtype.name:
    return f"its manifest says dtype {stored!r}, this vocabulary's records are {dtype.name}"
  if total != sum(records for _, records, _ in counts):
    return (f"its manifest says {total} records, its shards' counts add up to "
            f"{sum(records for _, records, _ in counts)}")
  for name, records, size in counts:
    file = epath.Path(directory) / name
    actual = file.stat().length if file.exists() else None
    if actual != size:
      return f"shard {name} has {actual} bytes, the manifest says {size}"
    try:
      reader = ArrayRecordReader(str(file))
      held = reader.num_records()
      reader.close()
    except RuntimeError as e:  # riegeli: e.g. a damaged footer
      return f"shard {name} is damaged ({' '.join(str(e).split())[:200]})"
    if held != records:
      return f"shard {name} holds {held} records, the manifest says {records}"
  return None


def _records(src_ids: list[list[int]], tgt_ids: list[list[int]], dtype: np.dtype):
  """Serialized records of the encoded pairs (EOS appended here), skipping pairs whose
  length does not fit the dtype. Returns (list of bytes, number skipped)."""
  src_len = np.fromiter(map(len, src_ids), np.int64, len(src_ids)) + 1
  tgt_len = np.fromiter(map(len, tgt_ids), np.int64, len(tgt_ids)) + 1
  keep = src_len <= np.iinfo(dtype).max
  if not keep.all():
    src_ids = list(itertools.compress(src_ids, keep))
    tgt_ids = list(itertools.compress(tgt_ids, keep))
    src_len, tgt_len = src_len[keep], tgt_len[keep]
  sizes = 1 + src_len + tgt_len
  ends = np.cumsum(sizes)
  starts = ends - sizes
  out = np.full(int(ends[-1]) if len(ends) else 0, EOS_ID, dtype)
  out[starts] = src_len
  for ids, lengths, first in ((src_ids, src_len, starts + 1), (tgt_ids, tgt_len,
                                                                starts + 1 + src_len)):
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, int((lengths - 1).sum()))
    within = np.arange(len(flat)) - np.repeat(np.cumsum(lengths - 1) - (lengths - 1), lengths - 1)
    out[np.repeat(first, lengths - 1) + within] = flat
  data, size = out.tobytes(), dtype.itemsize
  bounds = (np.stack([starts, ends], 1) * size).tolist()
  return [data[a:b] for a, b in bounds], int((~keep).sum())


def _write_shard(path: str, records: list[bytes]) -> None:
  """Writes an array_record file whole: a local temporary file renamed (or uploaded). The
  writer creates it, so its permissions are the umask's, as for every other file."""
  local = storage.is_local(path)
  if local:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  else:
    fd, tmp = tempfile.mkstemp(suffix=".array_record.tmp")
    os.close(fd)
  writer = ArrayRecordWriter(tmp, WRITER_OPTIONS)
  for record in records:
    writer.write(record)
  writer.close()
  if local:
    os.replace(tmp, path)
  else:
    epath.Path(tmp).copy(epath.Path(path), overwrite=True)
    os.remove(tmp)


def build(directory: str, key: dict, pairs: Iterable[tuple[str, str]], encode: Callable,
          vocab_size: int, process_index: int = 0, process_count: int = 1,
          barrier: Callable[[str], None] = lambda name: None) -> dict:
  """Encodes `pairs` into shards under `directory` and writes the manifest (process 0).

  Args:
    pairs: the training (source, target) sentences, streamed; every process streams all of
      them and encodes chunks process_index, process_index + process_count, ...
    encode: a list of sentences -> a list of id lists (no EOS), e.g. a batched sentencepiece
      encode.
    barrier: waits for all processes (named), e.g. multihost_utils.sync_global_devices.
  Returns the manifest.
  """
  created = not epath.Path(directory).exists()
  epath.Path(directory).mkdir(parents=True, exist_ok=True)
  if process_index == 0 and (epath.Path(directory) / MANIFEST).exists():
    (epath.Path(directory) / MANIFEST).unlink()  # no reader may trust a half-rebuilt cache
  dtype = dtype_for(vocab_size)
  start, encoded, skipped, num_chunks, written = time.perf_counter(), 0, 0, 0, []
  iterator = iter(pairs)
  try:
    while chunk := list(itertools.islice(iterator, CHUNK)):
      if num_chunks % process_count == process_index:
        sources, targets = zip(*chunk)
        records, dropped = _records(encode(list(sources)), encode(list(targets)), dtype)
        written.append(storage.join(directory, shard_name(num_chunks)))
        _write_shard(written[-1], records)
        encoded, skipped = encoded + len(chunk), skipped + dropped
      num_chunks += 1
    if not num_chunks:
      raise ConfigError("empty training corpus: nothing to encode")
  except ConfigError:  # a corpus error: what was written of this cache is of no use
    for path in written:
      epath.Path(path).unlink(missing_ok=True)
    if created and process_index == 0:
      with contextlib.suppress(OSError):
        epath.Path(directory).rmdir()  # only if empty: the other processes' shards are gone
    raise
  seconds = time.perf_counter() - start
  log.info("encoded %d training pairs (%d chunks of %d) into %s in %.1f s: %.0f "
               "sentences/s", encoded, -(-num_chunks // process_count), CHUNK, directory,
               seconds, 2 * encoded / max(seconds, 1e-9))
  barrier("encoded_shards")
  if process_index == 0:
    shards = []
    for index in range(num_chunks):
      path = storage.join(directory, shard_name(index))
      reader = ArrayRecordReader(path)
      shards.append({"file": shard_name(index), "records": reader.num_records(),
                     "bytes": epath.Path(path).stat().length})
      reader.close()
    for stale in epath.Path(directory).glob("shard-*.array_record"):  # of a larger corpus
      if stale.name not in {s["file"] for s in shards}:
        stale.unlink(missing_ok=True)
    manifest = {"key": key, "dtype": dtype.name, "shards": shards,
                "records": sum(s["records"] for s in shards), "skipped": skipped}
    manifest["checksum"] = checksum(manifest)
    storage.write(storage.join(directory, MANIFEST), json.dumps(manifest, indent=1))
  barrier("encoded_manifest")
  return json.loads((epath.Path(directory) / MANIFEST).read_text())


class EncodedCorpus:
  """Random access to the pairs of an encoded corpus, a window of indices at a time.

  Reads each shard with array_record's own reader, one batched read per shard and window:
  3x faster here than grain's ArrayRecordDataSource, whose per-index Python bookkeeping
  dominated a window's packing."""

  def __init__(self, directory: str, manifest: dict):
    self.directory, self.dtype = directory, np.dtype(manifest["dtype"])
    shards = [s for s in manifest["shards"] if s["records"]]
    counts = np.array([s["records"] for s in shards], np.int64)
    self.ends, self.firsts = np.cumsum(counts), np.cumsum(counts) - counts
    self.num_records = manifest["records"]
    try:
      self.readers = [ArrayRecordReader(storage.join(directory, s["file"]),
                                        "readahead_buffer_size:0", file_reader_buffer_size=32768)
                      for s in shards]
    except RuntimeError as e:  # riegeli: e.g. a damaged block header or footer
      raise self._damaged(e) from None
    for shard, reader in zip(shards, self.readers):
      if reader.num_records() != shard["records"]:
        raise self._damaged(f"{shard['file']} holds {reader.num_records()} records, its "
                            f"manifest says {shard['records']}")

  def __len__(self) -> int:
    return self.num_records

  def _damaged(self, error) -> ConfigError:
    reason = " ".join(str(error).split())[:200]
    return ConfigError(f"encoded corpus at {self.directory} is damaged ({reason}); delete "
                       f"{self.directory} to rebuild it")

  def read(self, indices: np.ndarray):
    """The pairs at `indices` as (tokens [T] int32, starts [n, 2], lengths [n, 2]): pair k's
    source is tokens[starts[k, 0]:][:lengths[k, 0]], its target likewise at column 1."""
    shard = np.searchsorted(self.ends, indices, side="right")
    order = np.argsort(shard, kind="stable")  # grouped by shard; tokens in this order
    shard = shard[order]
    positions = np.asarray(indices)[order] - self.firsts[shard]
    bounds = np.searchsorted(shard, np.arange(len(self.readers) + 1))
    records = []
    try:
      for s in np.flatnonzero(np.diff(bounds)).tolist():
        records += self.readers[s].read(positions[bounds[s]:bounds[s + 1]].tolist())
    except RuntimeError as e:  # riegeli: a chunk's hash does not match its bytes
      raise self._damaged(e) from None
    size = np.fromiter(map(len, records), np.int64, len(records)) // self.dtype.itemsize
    tokens = np.frombuffer(b"".join(records), self.dtype).astype(np.int32)
    first = np.cumsum(size) - size
    src_len = tokens[first].astype(np.int64)
    starts, lengths = np.empty((len(order), 2), np.int64), np.empty((len(order), 2), np.int64)
    starts[order] = np.stack([first + 1, first + 1 + src_len], 1)
    lengths[order] = np.stack([src_len, size - 1 - src_len], 1)
    return tokens, starts, lengths
