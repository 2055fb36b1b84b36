"""Data sources, chosen by `config.data.source`: what the trainer and evaluator read.

A source gives the vocabulary size, an endless stream of training batches (a checkpointable
grain IterDataset), held-out splits as padded batches, and, for text, a tokenizer that turns
predictions back into sentences for BLEU/chrF.
"""

import types

import grain
import jax
import ml_collections
import numpy as np
import sacrebleu
from etils import epath
from jax.experimental import multihost_utils

from transformer import storage
from transformer.data import labelled, lm, pipeline, synthetic, text
from transformer.data.tokenizer import MODEL_TYPES, Tokenizer, train_tokenizer
from transformer.metrics import exact_matches
from transformer.registry import AT_LEAST_0, ConfigError, Range, check, check_ranges, dataclass_from, lookup
from transformer.vocab import EOS_ID, NUM_RESERVED, RESERVED_PIECES

TOKENIZER_FILE = "spm.model"


class SyntheticSource:
  """config.task: reverse/copy/sort of random strings, generated from the seed."""

  tokenizer = None
  archs = ("encoder_decoder",)  # the model families (model.ARCHS) that learn this data
  num_classes, pooled = 0, False  # an encoder's outputs; a label per sequence

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None):
    task = config.task.to_dict()
    self.longer_max_len = task.pop("longer_max_len")
    self.task = dataclass_from(synthetic.SyntheticTask, task, "task")
    check(isinstance(self.longer_max_len, int) and not isinstance(self.longer_max_len, bool),
          "config.task.longer_max_len", self.longer_max_len, "an integer")
    check(config.eval.num_examples >= 1, "config.eval.num_examples", config.eval.num_examples,
          "≥ 1 for a synthetic task")
    self.config = config
    self.vocab_size = self.task.vocab_size
    synthetic.eval_splits(self.task, config.seed, 1, self.longer_max_len)  # a string space
    synthetic.train_dataset(self.task, config.seed, 1)[0]  # without such strings fails here

  def max_lengths(self) -> dict[str, int]:
    """The longest sequences (tokens, EOS included) the config implies, by the field."""
    lengths = {"task.max_len": self.task.max_len + 1}
    if self.longer_max_len > self.task.max_len:
      lengths["task.longer_max_len"] = self.longer_max_len + 1
    return lengths

  def prepare(self) -> None:
    """Nothing to build: the data is a function of the seed."""

  def train_batches(self) -> grain.IterDataset:
    dataset = synthetic.train_dataset(self.task, self.config.seed, self.config.train.batch_size,
                                      jax.process_index(), jax.process_count())
    return dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))

  def eval_splits(self, num_examples: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """`valid` and `longer`, num_examples each (0: config.eval.num_examples)."""
    self.splits = synthetic.eval_splits(self.task, self.config.seed,
                                        num_examples or self.config.eval.num_examples,
                                        self.longer_max_len)
    return self.splits

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

  def text_metrics(self, split_name: str, predictions: np.ndarray):
    """No text; exact match per input length, for length-extrapolation curves. Returns
    (metrics, hypotheses)."""
    split = self.splits[split_name]
    lengths = (split["inputs"] != 0).sum(1) - 1  # symbols, EOS excluded
    exact = exact_matches(predictions, split["targets"])
    by_length = {str(n): float(exact[lengths == n].mean()) for n in np.unique(lengths)}
    return {"exact_match_by_length": by_length}, None


# Ranges of the text sources' numeric settings.
_TEXT_RANGES = {"vocab_size": Range(NUM_RESERVED + 2), "max_len": Range(2),
                "decode_offset": AT_LEAST_0}


class ParallelTextSource:
  """config.data: source/target files per split under `dir`, a sentencepiece vocabulary
  trained on the training pairs into the workdir (or `tokenizer`, an existing model)."""

  archs = ("encoder_decoder",)
  num_classes, pooled = 0, False

  def __init__(self, config: ml_collections.ConfigDict, workdir: str | None = None):
    self.config, self.data = config, config.data
    self.vocab_size = self.data.vocab_size
    self.tokenizer_path = self.data.tokenizer or storage.join(workdir or ".", TOKENIZER_FILE)
    self.tokenizer: Tokenizer | None = None
    self.references: dict[str, list[str]] = {}
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

  def prepare(self) -> None:
    """Loads the tokenizer, training it on the training pairs first if it does not exist."""
    if not epath.Path(self.tokenizer_path).exists() and jax.process_index() == 0:
      train_tokenizer((s for pair in self.pairs("train") for s in pair), self.tokenizer_path,
                      self.vocab_size, self.data.tokenizer_type)
    if jax.process_count() > 1:  # the others wait for process 0's tokenizer
      multihost_utils.sync_global_devices("tokenizer")
    self.tokenizer = Tokenizer(self.tokenizer_path)
    if self.tokenizer.vocab_size != self.vocab_size:
      raise ConfigError(f"{self.tokenizer_path} has {self.tokenizer.vocab_size} pieces but "
                        f"config.data.vocab_size is {self.vocab_size}")

  def _encode(self, pairs):
    return [(self.tokenizer.encode(s), self.tokenizer.encode(t)) for s, t in pairs]

  def encode(self, sentence: str) -> np.ndarray:
    return self.tokenizer.encode(sentence)

  def pieces(self, ids) -> list[str]:
    """A label per token id: its sentencepiece piece."""
    return [self.tokenizer.sp.id_to_piece(i) for i in np.asarray(ids).tolist()]

  def train_batches(self) -> grain.IterDataset:
    examples = self._encode(self.pairs("train"))
    return pipeline.train_batches(examples, seed=self.config.seed,
                                  batch_size=self.config.train.batch_size // jax.process_count(),
                                  max_len=self.data.max_len, pack=self.data.pack)

  def eval_splits(self, num_examples: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The first num_examples pairs (0: config.eval.num_examples; 0 there: all) of the
    `valid` and, if configured, `test` splits, none dropped."""
    limit = num_examples or self.config.eval.num_examples or None
    return {split: self._split(split, self.pairs(split)[:limit]) for split in self.held_out()}

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if self.data.get(f"{split}_source")]

  def file_split(self, source_path: str, reference_path: str):
    """({name: split}) for any source/reference file pair, named after the source file."""
    name = epath.Path(source_path).name.removesuffix(".gz")
    return {name: self._split(name, text.read_parallel(source_path, reference_path))}

  def _split(self, name: str, pairs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    """Padded arrays of the pairs; the raw references are kept for BLEU."""
    self.references[name] = [t for _, t in pairs]
    encoded = self._encode(pairs)
    return pipeline.pad_batch(encoded, max(max(len(s), len(t)) for s, t in encoded))

  def decode_len(self, split: dict[str, np.ndarray]) -> int:
    return split["inputs"].shape[1] + self.data.decode_offset

  def text_metrics(self, split_name: str, predictions: np.ndarray):
    """Corpus sacreBLEU and chrF of the detokenized predictions against the raw references.
    Returns (metrics, hypotheses)."""
    hypotheses = [self.tokenizer.decode(row) for row in predictions]
    references = [self.references[split_name]]
    bleu = sacrebleu.metrics.BLEU()
    metrics = {"bleu": bleu.corpus_score(hypotheses, references).score,
               "chrf": sacrebleu.metrics.CHRF().corpus_score(hypotheses, references).score,
               "bleu_signature": str(bleu.get_signature())}
    return metrics, hypotheses


class TfdsSource(ParallelTextSource):
  """config.data.tfds_name (e.g. wmt14_translate/de-en) read through tfds.data_source from
  array_record files under tfds_dir, without TensorFlow; source_lang → target_lang. The
  dataset must have been prepared once (that step needs TensorFlow for the WMT builders)."""

  def check(self) -> None:
    for split in ("train", "valid"):
      self._data_source(split)

  def _data_source(self, split: str):
    try:
      import tensorflow_datasets as tfds  # noqa: PLC0415 - optional: pip install '.[tfds]'
    except ImportError:
      raise ConfigError("data.source 'tfds' needs tensorflow-datasets: pip install -e '.[tfds]'"
                        ) from None
    name, data_dir = self.data.tfds_name, self.data.tfds_dir or None
    try:
      return tfds.data_source(name, split=self.data[f"{split}_split"], data_dir=data_dir,
                              download=False)
    except Exception as e:  # noqa: BLE001 - tfds raises assorted errors for an unprepared set
      raise ConfigError(
          f"TFDS dataset {name!r} (split {self.data[f'{split}_split']!r}) is not readable under "
          f"{data_dir or '~/tensorflow_datasets'} ({type(e).__name__}: "
          f"{' '.join(str(e).split())[:200]}). Prepare it once in array_record format: pip install "
          f"tensorflow tensorflow-datasets && python -c \"import tensorflow_datasets as tfds; "
          f"tfds.builder('{name}', data_dir={data_dir!r}, file_format='array_record')"
          f".download_and_prepare()\"") from None

  def held_out(self) -> list[str]:
    return [split for split in ("valid", "test") if self.data.get(f"{split}_split")]

  def pairs(self, split: str) -> list[tuple[str, str]]:
    text_of = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)  # noqa: E731
    src, tgt = self.data.source_lang, self.data.target_lang
    return [(text_of(ex[src]), text_of(ex[tgt])) for ex in self._data_source(split)]


SOURCES = {"synthetic": SyntheticSource, "text": ParallelTextSource, "tfds": TfdsSource,
           "labelled": labelled.LabelledSource, "lm": lm.LanguageModelSource}


def make_source(config: ml_collections.ConfigDict, workdir: str | None = None):
  return lookup(SOURCES, config.data.source, "data source")(config, workdir)
