"""Translation data, whatever the pairs' source (parallel text files: text.py; a prepared
TFDS dataset: tfds.py; a Hugging Face dataset: hf.py): a sentencepiece vocabulary trained on
a sample of the training pairs into the workdir (or an existing model, data.tokenizer). The
training pairs are encoded once into data.cache_dir (default: the tokenizer's directory;
data/encoded_corpus.py) and streamed from there in packed batches, each process reading its
own part.

load() reads what can be wrong before anything is written: the held-out splits, and the
training pairs whole when it trains the tokenizer (in memory: its sample draws from all of
them). prepare() then writes the tokenizer and encodes the training pairs (a second pass,
which a first run needs anyway). A run whose tokenizer exists but whose encoded corpus does
not (a given tokenizer, a deleted cache) reads the training pairs once, while encoding them:
an error there removes the shards written so far.
"""

import dataclasses
from collections.abc import Iterator

import grain
import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from transformer.core import storage
from transformer.core.fields import AT_LEAST_0, Range, check_ranges, execution
from transformer.core.metrics import text_scores
from transformer.core.registry import lookup
from transformer.core.vocab import NUM_RESERVED
from transformer.data import SourceArgs, Targets, encoded_corpus, pipeline, text_files
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.base import DataSource, Split, SplitResult
from transformer.data.encoded_corpus import EncodedCorpus
from transformer.data.tokenizer import MODEL_TYPES, TOKENIZER_FILE, Recipe, Tokenizer

ENCODED_DIR = "encoded_train"  # the encoded training corpus, under data.cache_dir


@dataclasses.dataclass(frozen=True)
class TranslationData:
  """What every translation source's config.data holds."""

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


class TranslationSource(DataSource):
  """What every translation source shares: the tokenizer, the encoded training corpus, the
  packed batches and the held-out splits with their reference texts. A subclass says where
  the pairs come from (held_out, pairs, train_pairs, corpus_identity)."""

  targets = Targets.SEQUENCE

  def __init__(self, data: TranslationData, task, args: SourceArgs):
    super().__init__(data, task, args)
    self.tokenizer_path = data.tokenizer or storage.join(args.workdir or ".", TOKENIZER_FILE)
    self.cache_dir = storage.join(data.cache_dir or str(epath.Path(self.tokenizer_path).parent),
                                  ENCODED_DIR)
    self.corpus: EncodedCorpus | None = None
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

  def encoded_corpus(self) -> EncodedCorpus:
    """The encoded training corpus, encoded first (by all processes) if the cache is
    missing, stale or damaged."""
    if self.corpus is None:
      key = encoded_corpus.make_key(self.tokenizer.proto, self.corpus_identity())
      dtype = encoded_corpus.dtype_for(self.data.vocab_size)
      manifest = encoded_corpus.check(self.cache_dir, key, dtype)
      if jax.process_count() > 1:  # no process rebuilds while another still checks
        multihost_utils.sync_global_devices("encoded_check")
      if manifest is None:
        manifest = encoded_corpus.build(
            self.cache_dir, key, self.train_pairs(), self.tokenizer.encode_batch,
            self.data.vocab_size, jax.process_index(), jax.process_count(),
            barrier=multihost_utils.sync_global_devices if jax.process_count() > 1
            else lambda name: None)
      self.corpus = EncodedCorpus(self.cache_dir, manifest)
    return self.corpus

  @property
  def unpacked_batches(self) -> bool:
    """data.pack off: one pair per row (pipeline.PackedStream)."""
    return not self.data.pack

  def train_batches(self, process_index: int | None = None,
                    process_count: int | None = None) -> grain.IterDataset:
    """Endless batches, packed unless data.pack is off, of this process's part of the
    training pairs (another process's with explicit process_index/process_count)."""
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
    return {name: self._split(text_files.read_parallel(source_path, reference_path))}

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
