"""Translation data: parallel text files (data.source "text") or a prepared TFDS translation
dataset (data.source "tfds"), with a sentencepiece vocabulary trained on a sample of the
training pairs into the workdir (or an existing model, data.tokenizer). The training pairs
are encoded once into data.cache_dir (default: the tokenizer's directory; encoded.py) and
streamed from there in packed batches, each process reading its own part.

load() reads what can be wrong before anything is written: the held-out splits, and the
training pairs whole when it trains the tokenizer (in memory: its sample draws from all of
them). prepare() then writes the tokenizer and encodes the training pairs (a second pass,
which a first run needs anyway). A run whose tokenizer exists but whose encoded corpus does
not (a given tokenizer, a deleted cache) reads the training pairs once, while encoding them:
an error there removes the shards written so far.
"""

import dataclasses
import functools
import gzip
import pathlib
from collections.abc import Iterator

import grain
import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_0, Range, check_ranges, execution
from transformer.core.metrics import text_scores
from transformer.core.registry import lookup
from transformer.core.vocab import NUM_RESERVED
from transformer.data import SourceArgs, Targets, encoded, pipeline, text
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.base import DataSource, Example, Split, SplitResult
from transformer.data.tokenizer import MODEL_TYPES, TOKENIZER_FILE, Recipe, Tokenizer

ENCODED_DIR = "encoded_train"  # the encoded training corpus, under data.cache_dir


@dataclasses.dataclass(frozen=True)
class TranslationData:
  """What both translation sources' config.data hold."""

  source: str
  vocab_size: int = 8000  # pieces of the joint sentencepiece vocabulary
  tokenizer_type: str = "unigram"  # a key of tokenizer.MODEL_TYPES
  tokenizer: str = ""  # an existing sentencepiece model; "": train one into the workdir
  max_len: int = 64  # pieces per side: longer training pairs are dropped; packed row width
  pack: bool = True  # several pairs per row
  decode_offset: int = 10  # decode up to the source length + this many pieces
  window: int = 8192  # training pairs shuffled in and packed at a time (memory: one window)
  cache_dir: str = execution("")  # the encoded training corpus; "": next to the tokenizer

  def __post_init__(self):
    check_ranges(self, vocab_size=Range(NUM_RESERVED + 2), max_len=Range(2),
                 decode_offset=AT_LEAST_0, window=Range(1))
    lookup({t: t for t in MODEL_TYPES}, self.tokenizer_type, "data.tokenizer_type")


@dataclasses.dataclass(frozen=True)
class TextData(TranslationData):
  """config.data of data.source "text": a source and a target file per split under `dir`
  (plain or .gz, one sentence per line); the test split is optional ("")."""

  dir: str = execution("")
  train_source: str = ""
  train_target: str = ""
  valid_source: str = ""
  valid_target: str = ""
  test_source: str = ""
  test_target: str = ""


@dataclasses.dataclass(frozen=True)
class TfdsData(TranslationData):
  """config.data of data.source "tfds": a prepared TFDS translation dataset, read through
  tfds.data_source (array_record, no TensorFlow), source_lang → target_lang."""

  tfds_name: str = "wmt14_translate/de-en"
  tfds_dir: str = execution("")  # "": tfds's default, ~/tensorflow_datasets
  source_lang: str = "en"
  target_lang: str = "de"
  train_split: str = "train"
  valid_split: str = "validation"
  test_split: str = "test"  # "": none


class TranslationSource(DataSource):
  """What both translation sources share: the tokenizer, the encoded training corpus, the
  packed batches and the held-out splits with their reference texts. A subclass says where
  the pairs come from (held_out, pairs, train_pairs, corpus_identity)."""

  targets = Targets.SEQUENCE

  def __init__(self, data: TranslationData, task, args: SourceArgs):
    super().__init__(data, task, args)
    self.tokenizer_path = data.tokenizer or storage.join(args.workdir or ".", TOKENIZER_FILE)
    self.cache_dir = storage.join(data.cache_dir or str(epath.Path(self.tokenizer_path).parent),
                                  ENCODED_DIR)
    self.corpus: encoded.EncodedCorpus | None = None
    self.tokenizer: Tokenizer | None = None
    self.held: dict[str, list[tuple[str, str]]] = {}  # the held-out pairs load() read

  @classmethod
  def output_sizes(cls, data: TranslationData, task) -> tuple[int, int]:
    return data.vocab_size, 0

  def held_out(self) -> list[str]:
    """The held-out splits the config names."""
    raise NotImplementedError

  def pairs(self, split: str) -> list[tuple[str, str]]:
    raise NotImplementedError

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    """The training pairs, streamed."""
    raise NotImplementedError

  def corpus_identity(self) -> list[dict]:
    """What the encoded training corpus depends on, besides the tokenizer."""
    raise NotImplementedError

  def max_lengths(self) -> dict[str, int]:
    """The longest training sequences (held-out ones are checked once encoded)."""
    return {"data.max_len": self.data.max_len}

  def load(self, has_checkpoints: bool = False) -> None:
    """Reads the held-out splits and loads the tokenizer, or trains it in memory on a
    sample of the training pairs (tokenizer.load_or_train); writes nothing."""
    if self.tokenizer is not None:
      return
    self.held = {split: self.pairs(split) for split in self.held_out()}
    self.tokenizer = tokenizer_lib.load_or_train(
        self.tokenizer_path, lambda: (s for pair in self.train_pairs() for s in pair),
        Recipe(self.corpus_identity(), self.data.vocab_size, self.data.tokenizer_type),
        given=bool(self.data.tokenizer), has_checkpoints=has_checkpoints)

  def prepare(self) -> None:
    """load(), then writes a tokenizer it trained and builds the encoded training corpus."""
    self.load()
    tokenizer_lib.save(self.tokenizer)
    self.encoded_corpus()

  def encode(self, text: str) -> np.ndarray:
    return self.tokenizer.encode(text)

  def pieces(self, ids) -> list[str]:
    """A label per token id: its sentencepiece piece."""
    return [self.tokenizer.sp.id_to_piece(i) for i in np.asarray(ids).tolist()]

  def detokenize(self, ids) -> str:
    return self.tokenizer.decode(ids)

  def encoded_corpus(self) -> encoded.EncodedCorpus:
    """The encoded training corpus, encoded first (by all processes) if the cache is
    missing, stale or damaged."""
    if self.corpus is None:
      key = encoded.make_key(self.tokenizer.proto, self.corpus_identity())
      dtype = encoded.dtype_for(self.data.vocab_size)
      manifest = encoded.check(self.cache_dir, key, dtype)
      if jax.process_count() > 1:  # no process rebuilds while another still checks
        multihost_utils.sync_global_devices("encoded_check")
      if manifest is None:
        manifest = encoded.build(
            self.cache_dir, key, self.train_pairs(), self.tokenizer.encode_batch,
            self.data.vocab_size, jax.process_index(), jax.process_count(),
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
        pack=self.data.pack, window=self.data.window,
        process_index=process_index, process_count=process_count)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """The first num_examples pairs (0: config.eval.num_examples; 0 there: all) of the
    `valid` and, if configured, `test` splits (as load() read them), none dropped."""
    limit = num_examples or self.args.eval_examples or None
    return {split: self._split(self.held[split][:limit]) for split in self.held_out()}

  def file_split(self, source_path: str, reference_path: str) -> dict[str, Split]:
    """({name: split}) for any source/reference file pair, named after the source file."""
    name = epath.Path(source_path).name.removesuffix(".gz")
    return {name: self._split(text.read_parallel(source_path, reference_path))}

  def _split(self, pairs: list[tuple[str, str]]) -> Split:
    """Padded arrays of the pairs, with the raw target sentences as references."""
    ids = [(self.tokenizer.encode(s), self.tokenizer.encode(t)) for s, t in pairs]
    return Split(pipeline.pad_batch(ids, max(max(len(s), len(t)) for s, t in ids)),
                 references=[t for _, t in pairs])

  def decode_length(self, split: Split) -> int:
    return split.arrays["inputs"].shape[1] + self.data.decode_offset

  def split_results(self, name, split, outputs) -> SplitResult:
    """sacreBLEU and chrF of the detokenized predictions against the references."""
    hypotheses = [self.tokenizer.decode(row) for row in outputs["predictions"]]
    return SplitResult(text_scores(hypotheses, split.references), hypotheses)


class ParallelTextSource(TranslationSource):
  """data.source "text": parallel files (TextData)."""

  Data = TextData

  def __init__(self, data: TextData, task, args: SourceArgs):
    super().__init__(data, task, args)
    for split in ("train", "valid"):  # fails early, before anything is written
      for side in ("source", "target"):
        path = self.path(split, side)
        if not epath.Path(path).is_file():
          raise ConfigError(f"config.data.{split}_{side}: corpus file not found: {path}")

  @classmethod
  def example(cls, directory: str) -> Example:
    words = ["a", "dog", "cat", "runs", "sleeps", "the", "big", "small"]
    lines = [f"{a} {b} {c}" for a in words[:4] for b in words[4:] for c in words[::3]]
    for lang, sentences in (("en", lines), ("de", [s.upper() for s in lines])):
      with gzip.open(pathlib.Path(directory) / f"train.{lang}.gz", "wt") as f:
        f.write("\n".join(sentences * 2) + "\n")
      (pathlib.Path(directory) / f"valid.{lang}").write_text("\n".join(sentences[:8]) + "\n")
    data = dict(source="text", dir=directory, train_source="train.en.gz",
                train_target="train.de.gz", valid_source="valid.en", valid_target="valid.de",
                vocab_size=40, max_len=12, decode_offset=3)
    return Example({"data": data}, "the dog runs")

  def path(self, split: str, side: str) -> str:
    return storage.join(self.data.dir, getattr(self.data, f"{split}_{side}"))

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if getattr(self.data, f"{split}_source")]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    return text.read_parallel(self.path(split, "source"), self.path(split, "target"))

  def train_pairs(self) -> Iterator[tuple[str, str]]:
    return text.iter_parallel(self.path("train", "source"), self.path("train", "target"))

  def corpus_identity(self) -> list[dict]:
    return [encoded.file_identity(self.path("train", side)) for side in ("source", "target")]


class TfdsSource(TranslationSource):
  """data.source "tfds": a prepared TFDS translation dataset (TfdsData), e.g.
  wmt14_translate/de-en. Preparing it once needs TensorFlow for the WMT builders."""

  Data = TfdsData

  def __init__(self, data: TfdsData, task, args: SourceArgs):
    super().__init__(data, task, args)
    for split in ("train", "valid"):  # fails early, before anything is written
      self._data_source(split)

  @classmethod
  def example(cls, directory: str) -> Example:
    """A six-pair dataset prepared as array_record under `directory` (needs
    tensorflow-datasets: an ImportError without it)."""
    _example_builder()(data_dir=directory, file_format="array_record").download_and_prepare()
    data = dict(source="tfds", tfds_name="example_translation", tfds_dir=directory,
                vocab_size=40, max_len=16, decode_offset=5, test_split="")
    return Example({"data": data}, "a dog runs")

  def _data_source(self, split: str):
    return text.tfds_split(self.data.tfds_name, getattr(self.data, f"{split}_split"),
                           self.data.tfds_dir)

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if getattr(self.data, f"{split}_split")]

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


@functools.cache
def _example_builder():
  """A TFDS builder of six English-German pairs (train ×10, validation ×1): TfdsSource's
  example. Defined once: tfds registers a builder class by its name."""
  import tensorflow_datasets as tfds  # noqa: PLC0415 - optional: pip install '.[tfds]'

  pairs = [("a dog runs", "ein hund läuft"), ("the cat sleeps", "die katze schläft"),
           ("a big dog", "ein großer hund"), ("the small cat", "die kleine katze"),
           ("here now", "hier jetzt"), ("a cat runs", "eine katze läuft")]

  class ExampleTranslation(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self,
                                   features=tfds.features.Translation(languages=("en", "de")))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(10), "validation": self._generate_examples(1)}

    def _generate_examples(self, repeats):
      for i in range(repeats * len(pairs)):
        yield i, dict(zip(("en", "de"), pairs[i % len(pairs)]))

  return ExampleTranslation
