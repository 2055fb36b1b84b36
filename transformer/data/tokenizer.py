"""SentencePiece subword vocabularies with the project's reserved ids (PAD 0, BOS 1, EOS 2),
kept as a model file, local or a URL.

A tokenizer a run trains into its workdir (TOKENIZER_FILE) has a record beside it
(RECORD_FILE): what it was trained from (the corpus' identity, vocab_size, tokenizer_type)
and the model's hash. A later run in that workdir compares the record with its own data:
  * no checkpoint in the workdir (a first run failed or was stopped before its first save;
    its config may have changed since): a tokenizer trained on other data is trained anew,
    with a log line saying what changed;
  * checkpoints: the tokenizer is part of what the parameters mean and is kept; a mismatch
    there is a warning, not a refusal: the corpus' identity includes where its files are and
    their mtimes, which legitimately change when a run is resumed on another machine or a
    copied corpus (data.dir is an execution field), and no config change could make such a
    run resumable again;
  * no record (a workdir written without one): the tokenizer is used unchecked.
A tokenizer the user gives (data.tokenizer) is used as it is, never retrained.

Training happens in memory (load_or_train) and the file is written later (save), once the
run holds its workdir's lock: reading the whole corpus for the tokenizer's sample is what
checks it, so a bad corpus fails before anything is written.
"""

import dataclasses
import hashlib
import io
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError
from transformer.core.vocab import BOS_ID, EOS_ID, PAD_ID

MODEL_TYPES = ("unigram", "bpe", "char", "word")
TOKENIZER_FILE = "spm.model"  # the name of a tokenizer a run trains into its workdir
RECORD_FILE = "spm.json"  # beside it: what it was trained from (Recipe.record)
UNK_ID = 3

log = logging.getLogger("transformer")


class Tokenizer:
  """Text <-> int32 ids; every encoded sequence ends in EOS."""

  def __init__(self, model_path: str, proto: bytes | None = None):
    """The model at `model_path`, or the serialized model `proto` that will be kept there."""
    if proto is None:
      if not epath.Path(model_path).is_file():
        raise ConfigError(f"sentencepiece model not found: {model_path}")
      proto = epath.Path(model_path).read_bytes()
    self.path, self.proto = model_path, proto
    self.sp = _spm().SentencePieceProcessor(model_proto=proto)
    self.unsaved: tuple[Recipe, str | None] | None = None  # trained here, not yet written:
    # what it was trained from, and the sha256 of the file it replaces (None: no file)
    if (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD_ID, BOS_ID, EOS_ID):
      raise ConfigError(f"{model_path} must use pad/bos/eos ids {PAD_ID}/{BOS_ID}/{EOS_ID}, has "
                        f"{self.sp.pad_id()}/{self.sp.bos_id()}/{self.sp.eos_id()}")

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.sp.encode(text) + [EOS_ID], np.int32)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """The ids of each text, without EOS, encoded in C++ threads (one per CPU)."""
    return self.sp.encode(texts, num_threads=os.cpu_count() or 1)

  def decode(self, ids) -> str:
    """Decodes up to the first EOS, skipping padding and BOS."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        out.append(i)
    return self.sp.decode(out)



def _spm():
  """sentencepiece, imported by the runs that tokenize text (not in every run's start-up)."""
  import sentencepiece  # noqa: PLC0415
  return sentencepiece

def sample(items: Iterable[str], size: int, seed: int = 0) -> list[str]:
  """A uniform random sample of at most `size` of the streamed `items` (a reservoir,
  seeded; memory for `size` items): all of them, in order, when there are no more."""
  rng, stream = np.random.default_rng(seed), iter(items)
  kept = list(itertools.islice(stream, size))
  seen = len(kept)
  while chunk := list(itertools.islice(stream, 1 << 16)):
    # item t (0-based) replaces slot j ~ U[0, t] when j < size (Vitter's algorithm R)
    slots = (rng.random(len(chunk)) * np.arange(seen + 1, seen + len(chunk) + 1)).astype(np.int64)
    for i in np.flatnonzero(slots < size).tolist():
      kept[slots[i]] = chunk[i]
    seen += len(chunk)
  return kept


def train_model(sentences: Iterable[str], vocab_size: int, model_type: str = "unigram",
                max_sentences: int = 1_000_000, seed: int = 0) -> bytes:
  """A joint vocabulary trained on a seeded sample of at most `max_sentences` of the
  non-empty `sentences`, serialized; nothing is written. The sentences are streamed whole
  (the sample draws from all of them), so a corpus error anywhere in them fails here."""
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"unknown tokenizer type {model_type!r}; choose one of: "
                      f"{', '.join(sorted(MODEL_TYPES))}")
  kept = sample((s for s in sentences if s.strip()), max_sentences, seed)
  model = io.BytesIO()
  try:
    _spm().SentencePieceTrainer.train(
        sentence_iterator=iter(kept), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, input_sentence_size=max_sentences,
        shuffle_input_sentence=True, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        unk_id=UNK_ID, minloglevel=2)
  except RuntimeError as e:  # e.g. a vocab_size larger than the corpus supports
    raise ConfigError(f"sentencepiece training failed: {' '.join(str(e).split())}") from None
  return model.getvalue()


def train_tokenizer(sentences: Iterable[str], model_path: str, vocab_size: int,
                    model_type: str = "unigram", max_sentences: int = 1_000_000,
                    seed: int = 0) -> Tokenizer:
  """train_model's vocabulary, written atomically to `model_path` (without a record)."""
  proto = train_model(sentences, vocab_size, model_type, max_sentences, seed)
  _write(model_path, proto)
  return Tokenizer(model_path)


def _write(path: str, data: bytes | str) -> None:
  epath.Path(storage.absolute(path)).parent.mkdir(parents=True, exist_ok=True)
  storage.write(path, data)


def _sha256(data: bytes | None) -> str | None:
  return None if data is None else hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What a run's tokenizer is trained from: its record (RECORD_FILE) keeps this."""

  corpus: Any  # JSON: the training corpus' identity (files' paths, sizes, mtimes; a version)
  vocab_size: int
  tokenizer_type: str
  max_sentences: int = 1_000_000

  def record(self, proto: bytes) -> dict:
    return {"model_sha256": _sha256(proto), **json.loads(json.dumps(
        dataclasses.asdict(self)))}


def record_path(model_path: str) -> str:
  return storage.join(str(epath.Path(model_path).parent), RECORD_FILE)


def _changes(old, new, where: str = "") -> list[str]:
  """The leaves that differ between two JSON values, as `where: old → new`."""
  if isinstance(old, dict) and isinstance(new, dict):
    return [c for k in [*new, *(k for k in old if k not in new)]
            for c in _changes(old.get(k), new.get(k), f"{where}.{k}" if where else str(k))]
  if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
    return [c for i, (a, b) in enumerate(zip(old, new)) for c in _changes(a, b, f"{where}[{i}]")]
  return [] if old == new else [f"{where}: {old!r} → {new!r}"]


def _stale(model_path: str, proto: bytes, recipe: Recipe) -> str | None:
  """Why the tokenizer `proto` at model_path is not recipe's: None if its record matches
  or if it has none (a workdir written without one: used unchecked, with a log line)."""
  path = epath.Path(record_path(model_path))
  if not path.exists():
    log.info("%s has no record of what it was trained on (an older version wrote it): "
             "using it unchecked", model_path)
    return None
  try:
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
      raise ValueError("not a JSON object")
  except ValueError as e:
    return f"its record {path} is unreadable ({e})"
  if record.get("model_sha256") != _sha256(proto):
    return f"its record {path} describes another model (a write was interrupted)"
  changes = _changes(*({k: v for k, v in r.items() if k != "model_sha256"}
                       for r in (record, recipe.record(proto))))
  if not changes:
    return None
  more = f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
  return f"it was trained on other data ({'; '.join(changes[:3])}{more})"


def _load_or_train(model_path: str, sentences: Callable[[], Iterable[str]], recipe: Recipe,
                   given: bool, has_checkpoints: bool) -> Tokenizer:
  """Process 0's part of load_or_train."""
  path = epath.Path(model_path)
  if given:
    return Tokenizer(model_path)
  if not path.exists():
    if has_checkpoints:
      log.warning("%s is missing from a workdir with checkpoints: training it again from the "
                  "corpus (the same corpus and settings give the run's tokenizer)", model_path)
    return _trained(model_path, sentences, recipe, replaces=None)
  proto = path.read_bytes()
  why = _stale(model_path, proto, recipe)
  if why is None:
    tokenizer = Tokenizer(model_path, proto)
    if has_checkpoints or tokenizer.vocab_size == recipe.vocab_size:
      return tokenizer
    why = (f"it has {tokenizer.vocab_size} pieces, config.data.vocab_size is "  # no record
           f"{recipe.vocab_size}")
  if has_checkpoints:
    log.warning("%s: %s; it is kept, since this workdir's checkpoints were trained with it: "
                "fine if the corpus was only moved or copied, otherwise train on the new "
                "corpus in a new --workdir", model_path, why)
    return Tokenizer(model_path, proto)
  log.warning("%s: %s, and the workdir has no checkpoint: training a new tokenizer",
              model_path, why)
  return _trained(model_path, sentences, recipe, replaces=proto)


def _trained(model_path, sentences, recipe: Recipe, replaces: bytes | None) -> Tokenizer:
  proto = train_model(sentences(), recipe.vocab_size, recipe.tokenizer_type,
                      recipe.max_sentences)
  tokenizer = Tokenizer(model_path, proto)
  tokenizer.unsaved = (recipe, _sha256(replaces))
  return tokenizer


def _share(tokenizer: Tokenizer | None, model_path: str) -> Tokenizer:
  """Process 0's tokenizer on every process (its bytes broadcast); every process raises if
  process 0 could not make it (process 0 raises its own error)."""
  proto = b"" if tokenizer is None else tokenizer.proto
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(proto))))
  if not size:
    raise ConfigError(f"process 0 could not load or train the tokenizer {model_path} "
                      "(see its error)")
  data = np.frombuffer(proto, np.uint8) if jax.process_index() == 0 else np.zeros(size, np.uint8)
  shared = multihost_utils.broadcast_one_to_all(data)
  return tokenizer if jax.process_index() == 0 else Tokenizer(model_path, bytes(shared))


def load_or_train(model_path: str, sentences: Callable[[], Iterable[str]], recipe: Recipe,
                  *, given: bool = False, has_checkpoints: bool = False) -> Tokenizer:
  """The tokenizer at `model_path`, or one trained on sentences() in memory when there is
  none or (no checkpoints) its record says it was trained on other data (module docstring);
  save() writes a trained one. `given`: the user's model, used as it is. Process 0 decides
  and trains; the others receive its bytes. A ConfigError if it does not have
  recipe.vocab_size pieces."""
  tokenizer, error = None, None
  if jax.process_index() == 0:
    try:
      tokenizer = _load_or_train(model_path, sentences, recipe, given, has_checkpoints)
    except ConfigError as e:
      error = e
  if jax.process_count() > 1:
    try:
      tokenizer = _share(tokenizer, model_path)
    except ConfigError:
      if error is None:
        raise
  if error is not None:
    raise error
  if tokenizer.vocab_size != recipe.vocab_size:
    raise ConfigError(f"{model_path} has {tokenizer.vocab_size} pieces but "
                      f"config.data.vocab_size is {recipe.vocab_size}")
  return tokenizer


def save(tokenizer: Tokenizer) -> None:
  """Writes a tokenizer load_or_train trained (process 0; nothing for one read from its
  file): its record first, then the model, so that a model is never newer than its record
  (an interrupted write leaves a record of another model, which the next run notices). A
  RunError if the file changed since load_or_train looked (another run in the workdir)."""
  if tokenizer.unsaved is None:
    return
  recipe, replaces = tokenizer.unsaved
  if jax.process_index() == 0:
    path = epath.Path(tokenizer.path)
    now = path.read_bytes() if path.exists() else None
    if _sha256(now) != replaces:
      raise RunError(f"{tokenizer.path} changed while this run read its data (another run in "
                     "this workdir?); re-run the command")
    _write(record_path(tokenizer.path), json.dumps(recipe.record(tokenizer.proto), indent=1))
    _write(tokenizer.path, tokenizer.proto)
  tokenizer.unsaved = None
