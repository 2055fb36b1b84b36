"""Language modelling data for the decoder-only family: documents as one contiguous token
stream, cut into windows of `data.max_len` tokens for training and evaluated at 1, 2, 4,
... × that length (length extrapolation), without and with a sliding window, and, when
data.passkey.examples > 0, passkey retrieval at each of those lengths (passkey.py).

Corpora (`data.corpus`): see corpora.py.

Each line is encoded by a sentencepiece model (trained on the training documents into the
workdir, as for translation) and ends in EOS, which stands for the newline; a document
starts with BOS. Sentencepiece drops runs of spaces, so indentation is not modelled.

The held-out documents are read when the source is built (they are small): a held-out text
too short for the evaluation windows is refused there, before anything is written (a
sweep's plan refuses such a variant before any run trains), by a bound that holds for any
tokenizer (max_tokens); the exact count is checked once the text is encoded (load).
"""

import dataclasses
import math
import pathlib
import unicodedata

import grain
import numpy as np

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_1, Range, check, check_ranges, execution
from transformer.core.metrics import language_model_metrics
from transformer.core.registry import lookup
from transformer.core.vocab import BOS_ID, EOS_ID, NUM_RESERVED
from transformer.data import SourceArgs, Targets, hf_datasets, pipeline, text_files
from transformer.data.lm import passkey
from transformer.data import tokenizer as tokenizer_lib
from transformer.data.base import DataSource, Example, Grid, Split, SplitResult
from transformer.data.lm.corpora import CORPORA, corpus_identity, stdlib_files
from transformer.data.lm.passkey import Passkey
from transformer.data.tokenizer import MODEL_TYPES, TOKENIZER_FILE, Recipe, Tokenizer

_TRAIN_STREAM = 0
_TOKENIZER_LINES = 300_000  # lines the tokenizer is trained on (the first ones)


@dataclasses.dataclass(frozen=True)
class LMData:
  """config.data for data.source "lm"."""

  source: str = "lm"
  corpus: str = "stdlib"  # a key of CORPORA
  python_version: str = ""  # stdlib: "MAJOR.MINOR" of the interpreter the files come from
  stdlib_scope: str = "top"  # stdlib: top (top-level modules) | all (with packages)
  heldout_modulus: int = 10  # stdlib: 1/heldout_modulus of the files are held out
  dir: str = execution("")  # files: the directory of the globs
  train_files: str = ""
  valid_files: str = ""
  tfds_name: str = ""
  tfds_dir: str = execution("")
  hf_path: str = ""  # hf: a hub dataset, or a builder of local files (hf_datasets.LOCAL_BUILDERS)
  hf_name: str = ""  # hf: the hub dataset's config; "": its default
  hf_revision: str = ""  # hf: a branch, tag or commit; "": the default branch
  hf_streaming: bool = execution(False)  # hf: read rows as they arrive
  hf_cache_dir: str = execution("")  # hf: datasets' cache; "": $HF_DATASETS_CACHE
  text_key: str = "text"  # tfds: the feature; hf: the column (a path: "a.b" inside "a")
  train_split: str = "train"  # tfds, hf (hub)
  valid_split: str = "validation"
  vocab_size: int = 2048
  tokenizer_type: str = "bpe"
  tokenizer: str = ""  # an existing sentencepiece model instead of training one
  max_len: int = 64  # L: the training window
  max_factor: int = 8  # evaluation at L, 2L, 4L, ... up to max_factor·L
  sliding: bool = True  # also evaluate each length with a sliding window of stride L
  # passkey retrieval at each evaluation length (passkey.py); off by default
  passkey: Passkey = execution(Passkey())

  def __post_init__(self):
    lookup(CORPORA, self.corpus, "data.corpus")
    lookup({"top": 0, "all": 0}, self.stdlib_scope, "data.stdlib_scope")
    lookup({t: t for t in MODEL_TYPES}, self.tokenizer_type, "data.tokenizer_type")
    check_ranges(self, heldout_modulus=Range(2), vocab_size=Range(NUM_RESERVED + 2),
                 max_len=Range(2), max_factor=AT_LEAST_1)
    check(self.max_factor & (self.max_factor - 1) == 0, "max_factor", self.max_factor,
          "a power of 2")
    if self.corpus == "hf":
      hf_datasets.check_fields(self, ("train", "valid"))

  @property
  def eval_lengths(self) -> list[int]:
    return [self.max_len * 2**i for i in range(int(math.log2(self.max_factor)) + 1)]


def max_tokens(documents: list[str]) -> int:
  """An upper bound on the tokens encode_documents gives for `documents`, whatever the
  sentencepiece model: each piece covers at least one byte of its normalized line (a
  character, or a byte with byte fallback), plus the "▁" it prefixes, EOS per line and BOS
  per document. The normalized text is at most the longest of the raw, NFKC and casefolded
  NFKC forms (sentencepiece's normalizers; NFKC may expand a ligature)."""
  total = 0
  for doc in documents:
    size = max(len(form.encode()) for form in (
        doc, unicodedata.normalize("NFKC", doc), unicodedata.normalize("NFKC", doc.casefold())))
    total += size + 2 * (doc.count("\n") + 1) + 1
  return total


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
  """One int32 stream: per document BOS, then each line's pieces followed by EOS."""
  parts = []
  for doc in documents:
    lines = doc.split("\n")
    ids = tokenizer.sp.encode(lines)
    parts.append(np.array([BOS_ID], np.int32))
    parts.extend(np.asarray(line + [EOS_ID], np.int32) for line in ids)
  return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def window_batch(stream: np.ndarray, starts, length: int, ends=None, scored_from=None) -> dict:
  """Rows inputs = stream[s : e], targets = stream[s + 1 : e + 1] for each start s, with
  e = min(s + length, ends[i], the stream's end), padded to `length`; targets_segmentation
  is 0 where a target is not scored (before scored_from[i] within row i, or padding)."""
  n = len(starts)
  out = {k: np.zeros((n, length), np.int32) for k in (
      "inputs", "targets", "inputs_positions", "inputs_segmentation", "targets_positions",
      "targets_segmentation")}
  for i, s in enumerate(starts):
    m = min(length, len(stream) - 1 - s, length if ends is None else ends[i] - s)
    out["inputs"][i, :m], out["targets"][i, :m] = stream[s:s + m], stream[s + 1:s + m + 1]
    out["inputs_positions"][i, :m] = out["targets_positions"][i, :m] = np.arange(m)
    out["inputs_segmentation"][i, :m] = 1
    first = 0 if scored_from is None else scored_from[i]
    out["targets_segmentation"][i, first:m] = 1
  return out


class LanguageModelSource(DataSource):
  """data.source "lm": a causal language model (model.arch=decoder) on a corpus of long
  documents (see the module docstring)."""

  Data = LMData
  targets = Targets.NEXT_TOKENS
  grids = {passkey.GRID: Grid("passkey retrieval (exact match)", "evaluation length (tokens)",
                              "depth of the key")}

  def __init__(self, data: LMData, task, args: SourceArgs):
    super().__init__(data, task, args)
    check(args.eval_examples >= 1, "config.eval.num_examples", args.eval_examples,
          f"≥ 1 (windows of {data.eval_lengths[-1]} tokens evaluated)")
    self.tokenizer_path = data.tokenizer or storage.join(args.workdir or ".", TOKENIZER_FILE)
    self.tokenizer: Tokenizer | None = None
    self.mix: passkey.Mix | None = None  # passkey rows in training (load)
    self.streams: dict[str, np.ndarray] = {}
    if data.corpus == "stdlib":
      train, valid = stdlib_files(data)
      check(bool(train and valid), "config.data.heldout_modulus", data.heldout_modulus,
            "one that leaves training and held-out files")
    elif data.corpus == "files":
      text_files.split_files(data, "train")
    elif data.corpus == "hf":
      hf_datasets.check_split(data, "train")
    self.valid_documents = CORPORA[data.corpus](data, "valid")
    bound, need = max_tokens(self.valid_documents), self._need()
    if bound <= need:
      raise ConfigError(
          f"the held-out documents ({sum(map(len, self.valid_documents))} characters) give at "
          f"most {bound} tokens, too few for eval.num_examples={args.eval_examples} windows "
          f"of {data.eval_lengths[-1]} tokens ({need + 1} needed): lower eval.num_examples or "
          f"data.max_factor, or hold out more text")

  def _need(self) -> int:
    """The held-out stream must be longer than this (the windows, and one target more)."""
    return self.args.eval_examples * self.data.eval_lengths[-1] + 1

  @classmethod
  def output_sizes(cls, data: LMData, task) -> tuple[int, int]:
    return data.vocab_size, 0

  @classmethod
  def train_length(cls, data: LMData, task) -> int:
    return data.max_len  # tokens per window, as eval_length counts them

  @classmethod
  def example(cls, directory: str) -> Example:
    for split, n in (("train", 300), ("valid", 60)):
      (pathlib.Path(directory) / f"{split}.py").write_text("\n".join(
          f"def f{i}(x):\n  return x * {i % 7} + {i % 5}" for i in range(n)))
    data = dict(source="lm", corpus="files", dir=directory, train_files="train.py",
                valid_files="valid.py", vocab_size=64, max_len=16, max_factor=2)
    return Example({"data": data, "model": {"arch": "decoder"}}, "def f(")

  def max_lengths(self) -> dict[str, int]:
    return {"data.max_len": self.data.max_len,
            "data.max_factor × data.max_len": self.data.eval_lengths[-1]}

  def load(self, has_checkpoints: bool = False) -> None:
    """Reads the training documents, loads the tokenizer or trains it in memory
    (tokenizer.load_or_train) and encodes the train and valid documents; writes nothing."""
    if self.tokenizer is not None:
      return
    documents = {"train": CORPORA[self.data.corpus](self.data, "train"),
                 "valid": self.valid_documents}
    self.tokenizer = tokenizer_lib.load_or_train(
        self.tokenizer_path,
        lambda: (line for doc in documents["train"] for line in doc.split("\n")),
        Recipe(corpus_identity(self.data), self.data.vocab_size, self.data.tokenizer_type,
               max_sentences=_TOKENIZER_LINES),
        given=bool(self.data.tokenizer), has_checkpoints=has_checkpoints)
    self.streams = {split: encode_documents(self.tokenizer, docs)
                    for split, docs in documents.items()}
    need = self._need()
    for split, stream in self.streams.items():
      if len(stream) <= (need if split == "valid" else self.data.max_len + 1):
        wanted = (f"eval.num_examples windows of {self.data.eval_lengths[-1]}"
                  if split == "valid" else "one window")
        raise ConfigError(f"the {split} documents have {len(stream)} tokens, too few for "
                          f"{wanted}")
    if self.data.passkey.train_fraction:
      self.mix = passkey.Mix(self.data.passkey.train_fraction, self.args.seed,
                             self.data.max_len, self.tokenizer.sp.encode)

  def prepare(self) -> None:
    """load(), then writes a tokenizer it trained into the workdir."""
    self.load()
    tokenizer_lib.save(self.tokenizer)

  @property
  def unpacked_batches(self) -> bool:
    """Without passkey rows: each training row is a whole window of the stream (its start
    leaves `max_len` + 1 tokens), one sequence from slot 0, every target scored. A passkey
    row scores its answer only (passkey.Mix)."""
    return not self.data.passkey.train_fraction

  def train_batches(self) -> grain.IterDataset:
    """Endless batches of random windows, a data.passkey.train_fraction of the rows passkey
    rows (passkey.Mix); batch `step` is a pure function of (seed, step). Without passkey
    rows, without segment ids and positions (unpacked_batches)."""
    stream, length, seed = self.streams["train"], self.data.max_len, self.args.seed
    mix = self.mix
    start = lambda i: int(np.random.default_rng([seed, _TRAIN_STREAM, i]  # noqa: E731
                                                ).integers(len(stream) - length))
    windows = lambda starts: window_batch(stream, starts, length)  # noqa: E731
    if mix is not None:
      row, batch = lambda i: mix.draw(i) or start(i), lambda rows: mix.batch(rows, windows)
    else:  # whole windows (unpacked_batches)
      row, batch = start, lambda starts: pipeline.unpacked(windows(starts))
    return pipeline.generated_batches(self.args.batch_size, row, batch
                                      ).to_iter_dataset(pipeline.READ_OPTIONS)

  def eval_splits(self, num_examples: int = 0) -> dict[str, Split]:
    """The first num_examples × max_factor·L held-out tokens (0: eval.num_examples), scored
    at each evaluation length W: `lenW` in non-overlapping windows of W tokens, and
    `lenW_sliding` in windows of up to W tokens moved by L, each scoring its last L; and
    the passkey splits (passkey_splits: data.passkey.examples keys per cell, whatever
    num_examples)."""
    n = num_examples or self.args.eval_examples
    stream, lengths, step = self.streams["valid"], self.data.eval_lengths, self.data.max_len
    total = n * lengths[-1]
    splits = {}
    for w in lengths:
      splits[f"len{w}"] = Split(window_batch(stream, range(0, total, w), w))
    for w in lengths[1:] if self.data.sliding else []:
      ends = list(range(step, total + 1, step))
      starts = [max(0, e - w) for e in ends]
      splits[f"len{w}_sliding"] = Split(window_batch(
          stream, starts, w, ends, [e - step - s for e, s in zip(ends, starts)]))
    return {**splits, **self.passkey_splits()}

  def passkey_splits(self) -> dict[str, Split]:
    """`lenW_passkey` at each evaluation length W when data.passkey.examples > 0: the
    passkey prompts (passkey.rows) through the run's tokenizer; a ConfigError if the
    prompt does not fit the shortest."""
    settings = self.data.passkey
    if not settings.examples:
      return {}
    encode = self.tokenizer.sp.encode
    phrases = passkey.Phrases.encode(encode, self.data.eval_lengths[-1])
    held_out = settings.train_fraction > 0  # keys no training row has (passkey.Mix)
    keys = [encode(str(k)) for k in passkey.draw_keys(settings.seed, settings.examples,
                                                      held_out)]
    return {f"len{w}{passkey.SUFFIX}": Split(passkey.rows(phrases, keys, w,
                                                          settings.depth_values))
            for w in self.data.eval_lengths}

  def encode(self, sentence: str) -> np.ndarray:
    """A prompt: its pieces, after BOS, without a final EOS."""
    return np.asarray([BOS_ID] + self.tokenizer.sp.encode(sentence), np.int32)

  def pieces(self, ids) -> list[str]:
    return [self.tokenizer.sp.id_to_piece(i) for i in np.asarray(ids).tolist()]

  def detokenize(self, ids) -> str:
    """Text of token ids: EOS ends a line; BOS and padding are dropped."""
    lines, line = [], []
    for i in np.asarray(ids).tolist():
      if i == EOS_ID:
        lines.append(self.tokenizer.sp.decode(line))
        line = []
      elif i not in (BOS_ID, 0):
        line.append(i)
    return "\n".join(lines + [self.tokenizer.sp.decode(line)])

  def split_results(self, name, split, outputs) -> SplitResult:
    """metrics.language_model_metrics of the split's per-token losses; of a passkey split,
    passkey.results of its predictions."""
    if name.endswith(passkey.SUFFIX):
      return SplitResult(passkey.results(split.arrays["inputs"].shape[1],
                                         self.data.passkey.depth_values, split.arrays,
                                         outputs["predictions"]))
    return SplitResult(language_model_metrics(outputs["nll"],
                                              split.arrays["targets_segmentation"] > 0))
