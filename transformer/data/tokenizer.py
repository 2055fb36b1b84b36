"""SentencePiece subword vocabularies with the project's reserved ids (PAD 0, BOS 1, EOS 2),
kept as a model file, local or a URL."""

import itertools
import os
import tempfile
from collections.abc import Callable, Iterable

import jax
import numpy as np
import sentencepiece as spm
from etils import epath
from jax.experimental import multihost_utils

from transformer import storage
from transformer.errors import ConfigError
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

MODEL_TYPES = ("unigram", "bpe", "char", "word")
TOKENIZER_FILE = "spm.model"  # the name of a tokenizer a run trains into its workdir
UNK_ID = 3


class Tokenizer:
  """Text <-> int32 ids; every encoded sequence ends in EOS."""

  def __init__(self, model_path: str):
    if not epath.Path(model_path).is_file():
      raise ConfigError(f"sentencepiece model not found: {model_path}")
    self.path = model_path
    self.sp = spm.SentencePieceProcessor(model_proto=epath.Path(model_path).read_bytes())
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


def train_tokenizer(sentences: Iterable[str], model_path: str, vocab_size: int,
                    model_type: str = "unigram", max_sentences: int = 1_000_000,
                    seed: int = 0) -> Tokenizer:
  """Trains a joint vocabulary on a seeded sample of at most `max_sentences` of the
  non-empty `sentences` (streamed) and writes it atomically to `model_path`."""
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"unknown tokenizer type {model_type!r}; choose one of: "
                      f"{', '.join(sorted(MODEL_TYPES))}")
  with tempfile.TemporaryDirectory() as tmp:
    prefix = os.path.join(tmp, "spm")
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(sample((s for s in sentences if s.strip()), max_sentences,
                                        seed)), model_prefix=prefix,
          vocab_size=vocab_size, model_type=model_type, character_coverage=1.0,
          input_sentence_size=max_sentences, shuffle_input_sentence=True,
          pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID, minloglevel=2)
    except RuntimeError as e:  # e.g. a vocab_size larger than the corpus supports
      raise ConfigError(f"sentencepiece training failed: {' '.join(str(e).split())}") from None
    epath.Path(storage.absolute(model_path)).parent.mkdir(parents=True, exist_ok=True)
    with open(prefix + ".model", "rb") as f:
      storage.write(model_path, f.read())
  return Tokenizer(model_path)


def load_or_train(model_path: str, sentences: Callable[[], Iterable[str]], vocab_size: int,
                  model_type: str, max_sentences: int = 1_000_000) -> Tokenizer:
  """The tokenizer at `model_path`; if it does not exist, process 0 first trains it on
  sentences() (train_tokenizer) while the other processes wait. A ConfigError if it does
  not have vocab_size pieces."""
  if not epath.Path(model_path).exists() and jax.process_index() == 0:
    train_tokenizer(sentences(), model_path, vocab_size, model_type, max_sentences)
  if jax.process_count() > 1:  # the others wait for process 0's tokenizer
    multihost_utils.sync_global_devices("tokenizer")
  tokenizer = Tokenizer(model_path)
  if tokenizer.vocab_size != vocab_size:
    raise ConfigError(f"{model_path} has {tokenizer.vocab_size} pieces but "
                      f"config.data.vocab_size is {vocab_size}")
  return tokenizer
