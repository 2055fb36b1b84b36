"""Data sources, chosen by `config.data.source`: what the trainer and evaluator read.

A source gives the vocabulary size, an endless stream of training batches (a checkpointable
grain IterDataset), held-out splits as padded batches (text ones with their raw
`references`), and, for text, a tokenizer that turns predictions back into sentences. No
results of earlier calls are kept; the metrics live in transformer/metrics.py.
"""

import types
from collections.abc import Iterator

import grain
import jax
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer import storage
from transformer.data import SourceArgs, encoded, labelled, lm, pipeline, synthetic, text
from transformer.data.tokenizer import MODEL_TYPES, TOKENIZER_FILE, Tokenizer, load_or_train
from transformer.errors import ConfigError
from transformer.fields import AT_LEAST_0, Range, check, check_ranges, dataclass_from
from transformer.registry import lookup
from transformer.vocab import EOS_ID, NUM_RESERVED, RESERVED_PIECES

ENCODED_DIR = "encoded_train"  # the encoded training corpus, under data.cache_dir
WINDOW = 8192  # training examples packed at a time (data.window)


class SyntheticSource:
  """config.task: reverse/copy/sort of random strings, generated from the seed."""

  section = "task"  # the config section the source reads
  tokenizer = None
  archs = ("encoder_decoder",)  # the model families (model.ARCHS) that learn this data
  num_classes, pooled = 0, False  # an encoder's outputs; a label per sequence

  def __init__(self, section: ml_collections.ConfigDict, args: SourceArgs):
    task = section.to_dict()
    self.longer_max_len = task.pop("longer_max_len")
    self.task = dataclass_from(synthetic.SyntheticTask, task, "task")
    check(isinstance(self.longer_max_len, int) and not isinstance(self.longer_max_len, bool),
          "config.task.longer_max_len", self.longer_max_len, "an integer")
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          "≥ 1 for a synthetic task")
    self.args = args
    self.vocab_size = self.task.vocab_size
    synthetic.eval_splits(self.task, args.seed, 1, self.longer_max_len)  # a string space
    synthetic.train_dataset(self.task, args.seed, 1)[0]  # without such strings fails here

  def max_lengths(self) -> dict[str, int]:
    """The longest sequences (tokens, EOS included) the config implies, by the field."""
    lengths = {"task.max_len": self.task.max_len + 1}
    if self.longer_max_len > self.task.max_len:
      lengths["task.longer_max_len"] = self.longer_max_len + 1
    return lengths

  def prepare(self) -> None:
    """Nothing to build: the data is a function of the seed."""

  def train_batches(self) -> grain.IterDataset:
    dataset = synthetic.train_dataset(self.task, self.args.seed, self.args.batch_size,
                                      jax.process_index(), jax.process_count())
    return dataset.to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """`valid` and `longer`, num_examples each (0: config.eval.num_examples)."""
    return synthetic.eval_splits(self.task, self.args.seed,
                                 num_examples or self.args.eval_examples,
                                 self.longer_max_len)

  def file_split(self, source_path: str, reference_path: str):
    raise ConfigError("evaluating a source/reference file pair needs a text data source; "
                      "this run's is 'synthetic'")

  def decode_len(self, split: dict[str, np.ndarray]) -> int:
    return split["targets"].shape[1]  # exact match needs the full target and its EOS

  def encode(self, sentence: str) -> np.ndarray:
    """Space-separated symbols 0..num_symbols-1 (e.g. "3 1 4") -> token ids ending in EOS."""
    words, n = sentence.split(), self.task.num_symbols
    if not words or any(not (w.isdigit() and int(w) < n) for w in words):
      raise ConfigError(f"synthetic input {sentence!r}: give space-separated symbols in "
                        f"0..{n - 1}, e.g. \"3 1 4\"")
    return np.asarray([int(w) + NUM_RESERVED for w in words] + [EOS_ID], np.int32)

  def pieces(self, ids) -> list[str]:
    """A label per token id: its symbol, or <s>, </s>, <pad>."""
    return [RESERVED_PIECES.get(i, str(i - NUM_RESERVED)) for i in np.asarray(ids).tolist()]


# Ranges of the text sources' numeric settings.
_TEXT_RANGES = {"vocab_size": Range(NUM_RESERVED + 2), "max_len": Range(2),
                "decode_offset": AT_LEAST_0}


class ParallelTextSource:
  """config.data: source/target files per split under `dir`, a sentencepiece vocabulary
  trained on a sample of the training pairs into the workdir (or `tokenizer`, an existing
  model). The training pairs are encoded once into data.cache_dir (default: the tokenizer's
  directory; encoded.py) and streamed from there, each process reading its own part."""

  section = "data"
  archs = ("encoder_decoder",)
  num_classes, pooled = 0, False

  def __init__(self, section: ml_collections.ConfigDict, args: SourceArgs):
    self.args, self.data = args, section
    self.vocab_size = self.data.vocab_size
    self.tokenizer_path = self.data.tokenizer or storage.join(args.workdir or ".",
                                                             TOKENIZER_FILE)
    self.cache_dir = storage.join(self.data.get("cache_dir") or
                                  str(epath.Path(self.tokenizer_path).parent), ENCODED_DIR)
    self.corpus: encoded.EncodedCorpus | None = None
    self.tokenizer: Tokenizer | None = None
    try:
      check_ranges(types.SimpleNamespace(**{k: self.data[k] for k in _TEXT_RANGES}),
                   **_TEXT_RANGES)
    except ConfigError as e:
      raise ConfigError(f"config.data.{e}") from None
    lookup({t: t for t in MODEL_TYPES}, self.data.tokenizer_type, "data.tokenizer_type")
    self.check()

  def check(self) -> None:
    """Fails early, before anything is written, if the corpus is not there."""
    for split in ("train", "valid"):
      for side in ("source", "target"):
        path = self.path(split, side)
        if not epath.Path(path).is_file():
          raise ConfigError(f"config.data.{split}_{side}: corpus file not found: {path}")

  def max_lengths(self) -> dict[str, int]:
    """The longest training sequences (held-out ones are checked once encoded)."""
    return {"data.max_len": self.data.max_len}

  def path(self, split: str, side: str) -> str:
    return storage.join(self.data.dir, self.data[f"{split}_{side}"])

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return text.read_parallel(self.path(split, "source"), self.path(split, "target"))

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    """The training pairs, streamed."""
    return text.iter_parallel(self.path("train", "source"), self.path("train", "target"))

  def corpus_identity(self) -> list[dict]:
    """What the encoded training corpus depends on, besides the tokenizer."""
    return [encoded.file_identity(self.path("train", side)) for side in ("source", "target")]

  def prepare(self) -> None:
    """Loads the tokenizer, training it on a sample of the training pairs first if it does
    not exist."""
    self.tokenizer = load_or_train(
        self.tokenizer_path, lambda: (s for pair in self.train_pairs() for s in pair),
        self.vocab_size, self.data.tokenizer_type)

  def _encode(self, pairs):
    return [(self.tokenizer.encode(s), self.tokenizer.encode(t)) for s, t in pairs]

  def encode(self, sentence: str) -> np.ndarray:
    return self.tokenizer.encode(sentence)

  def pieces(self, ids) -> list[str]:
    """A label per token id: its sentencepiece piece."""
    return [self.tokenizer.sp.id_to_piece(i) for i in np.asarray(ids).tolist()]

  def encoded_corpus(self) -> encoded.EncodedCorpus:
    """The encoded training corpus, encoded first (by all processes) if the cache is
    missing, stale or damaged."""
    if self.corpus is None:
      key = encoded.make_key(epath.Path(self.tokenizer_path).read_bytes(),
                             self.corpus_identity())
      manifest = encoded.check(self.cache_dir, key)
      if jax.process_count() > 1:  # no process rebuilds while another still checks
        multihost_utils.sync_global_devices("encoded_check")
      if manifest is None:
        manifest = encoded.build(
            self.cache_dir, key, self.train_pairs(), self.tokenizer.encode_batch,
            self.vocab_size, jax.process_index(), jax.process_count(),
            barrier=multihost_utils.sync_global_devices if jax.process_count() > 1
            else lambda name: None)
      self.corpus = encoded.EncodedCorpus(self.cache_dir, manifest)
    return self.corpus

  def train_batches(self, process_index: int | None = None,
                    process_count: int | None = None) -> grain.IterDataset:
    """Endless packed batches of this process's part of the training pairs (another
    process's with explicit process_index/process_count)."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    return pipeline.PackedStream(
        self.encoded_corpus(), seed=self.args.seed,
        batch_size=self.args.batch_size // process_count, max_len=self.data.max_len,
        pack=self.data.pack, window=self.data.get("window", WINDOW),
        process_index=process_index, process_count=process_count)

  def eval_splits(self, num_examples: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The first num_examples pairs (0: config.eval.num_examples; 0 there: all) of the
    `valid` and, if configured, `test` splits, none dropped."""
    limit = num_examples or self.args.eval_examples or None
    return {split: self._split(self.pairs(split)[:limit]) for split in self.held_out()}

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if self.data.get(f"{split}_source")]

  def file_split(self, source_path: str, reference_path: str):
    """({name: split}) for any source/reference file pair, named after the source file."""
    name = epath.Path(source_path).name.removesuffix(".gz")
    return {name: self._split(text.read_parallel(source_path, reference_path))}

  def _split(self, pairs: list[tuple[str, str]]) -> dict:
    """Padded arrays of the pairs, with the raw target sentences as `references` (for
    BLEU and chrF)."""
    encoded = self._encode(pairs)
    return {**pipeline.pad_batch(encoded, max(max(len(s), len(t)) for s, t in encoded)),
            "references": [t for _, t in pairs]}

  def decode_len(self, split: dict[str, np.ndarray]) -> int:
    return split["inputs"].shape[1] + self.data.decode_offset


class TfdsSource(ParallelTextSource):
  """config.data.tfds_name (e.g. wmt14_translate/de-en) read through tfds.data_source from
  array_record files under tfds_dir, without TensorFlow; source_lang → target_lang. The
  dataset must have been prepared once (that step needs TensorFlow for the WMT builders)."""

  def check(self) -> None:
    for split in ("train", "valid"):
      self._data_source(split)

  def _data_source(self, split: str):
    return text.tfds_split(self.data.tfds_name, self.data[f"{split}_split"], self.data.tfds_dir)

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if self.data.get(f"{split}_split")]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return list(self._stream(split))

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return self._stream("train")

  def _stream(self, split: str, chunk: int = 4096) -> Iterator[tuple[str, str]]:
    """The pairs of a split in record order, read `chunk` records at a time."""
    src, tgt = self.data.source_lang, self.data.target_lang
    source = self._data_source(split)
    for start in range(0, len(source), chunk):
      for ex in source.__getitems__(range(start, min(start + chunk, len(source)))):
        yield text.as_text(ex[src]), text.as_text(ex[tgt])

  def corpus_identity(self) -> list[dict]:
    """The split's name, version and size, and each of its array_record files' size and
    mtime with the records read from it: a re-prepared dataset has new files."""
    source = self._data_source("train")
    files = [encoded.file_identity(f.filename) | {"skip": f.skip, "take": f.take}
             for f in source.dataset_info.splits[source.split].file_instructions]
    return [{"tfds_name": self.data.tfds_name, "split": self.data.train_split,
             "tfds_dir": storage.absolute(self.data.tfds_dir) if self.data.tfds_dir else "",
             "version": str(source.dataset_info.version), "records": len(source),
             "languages": [self.data.source_lang, self.data.target_lang], "files": files}]


SOURCES = {"synthetic": SyntheticSource, "text": ParallelTextSource, "tfds": TfdsSource,
           "labelled": labelled.LabelledSource, "lm": lm.LanguageModelSource}


def make_source(config: ml_collections.ConfigDict, workdir: str | None = None):
  """The source config.data.source names, given its own section (`section`: task or data)
  and the values every source takes (SourceArgs), not the whole config."""
  source = lookup(SOURCES, config.data.source, "data source")
  return source(config[source.section], SourceArgs(
      seed=config.seed, batch_size=config.train.batch_size,
      eval_examples=config.eval.num_examples, workdir=workdir))
