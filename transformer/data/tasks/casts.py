"""Casts: how a generated task's instances (problem.Instance: input and answer symbols) are
presented to a model family. Each cast is one small object; CASTS is data.cast's registry.

  slots         an encoder reads the input followed by one answer slot per answer symbol and
                predicts each answer symbol at its slot, in one pass (the papers' cast);
  seq2seq       an encoder-decoder reads the input and decodes the answer;
  label         an encoder reads a CLS token and the input and predicts the answer, one label,
                at the CLS token (classification: ListOps);
  token_labels  an encoder reads the input and predicts one answer symbol per input symbol
                (sequence labelling: duplicates);
  decoder       a decoder-only model reads the prompt (the input, then a separator) and
                continues it with the answer: next tokens, the loss on the answer only;
                evaluation generates the answer after the prompt.

Input symbol s is token NUM_RESERVED + s; so is answer symbol s where the answer is decoded
or generated (seq2seq, decoder: one vocabulary for both); where it is a label it is class s.
A cast declares the targets it makes (data.Targets, which a family must learn) and which
answers it fits (unfit).
"""

import abc
from typing import ClassVar

import numpy as np

from transformer.core.vocab import BOS_ID, EOS_ID, NUM_RESERVED, RESERVED_PIECES
from transformer.data import Targets, pipeline
from transformer.data.tasks.problem import Answer, Instance


def label_batch(examples, length: int, pack: bool = False) -> dict[str, np.ndarray]:
  """Rows of `length` tokens from (tokens, labels, weights) examples: one per row, padded,
  or with `pack` several per row in order (a new row when the next one does not fit), each
  with its own segment id and positions from 0. targets_segmentation is the segment id
  where a label is scored, 0 elsewhere."""
  rows: list[list] = []
  for ex in examples:
    if not rows or not pack or sum(len(e[0]) for e in rows[-1]) + len(ex[0]) > length:
      rows.append([])
    rows[-1].append(ex)
  out = {k: np.zeros((len(rows), length), np.int32) for k in (
      "inputs", "inputs_positions", "inputs_segmentation", "targets", "targets_segmentation")}
  for r, row in enumerate(rows):
    start = 0
    for segment, (tokens, labels, weights) in enumerate(row, start=1):
      span = slice(start, start + len(tokens))
      out["inputs"][r, span], out["targets"][r, span] = tokens, labels
      out["inputs_positions"][r, span] = np.arange(len(tokens))
      out["inputs_segmentation"][r, span] = segment
      out["targets_segmentation"][r, span] = segment * weights
      start += len(tokens)
  return out


class Cast(abc.ABC):
  """A way to present a generated task (module docstring)."""

  targets: ClassVar[Targets]
  # Its batches hold one example per row from slot 0, every target but padding scored
  # (DataSource.unpacked_batches): then training batches leave out segment ids and positions.
  unpacked: ClassVar[bool] = False

  def unfit(self, task) -> str | None:
    """Why this cast cannot present `task` (its declared Problem.answer), or None if it can."""
    del task
    return None

  @abc.abstractmethod
  def vocab_size(self, task) -> int:
    """Token ids 0..vocab_size-1 of its rows."""

  def num_classes(self, task) -> int:
    """Classes of its labels; 0 where the targets are tokens."""
    return task.output_size

  @abc.abstractmethod
  def width(self, task, lengths: range) -> int:
    """Tokens of the longest row of an instance of any of these lengths."""

  @abc.abstractmethod
  def row(self, task, instance: Instance):
    """One instance as the batcher takes it."""

  @abc.abstractmethod
  def batch(self, rows: list, width: int) -> dict[str, np.ndarray]:
    """Rows padded to `width` in the batch layout (data/__init__.py)."""

  def answers(self, arrays: dict[str, np.ndarray], predictions: np.ndarray):
    """(answer, predicted answer) symbols of each row of a split's arrays: the scored
    labels, by default."""
    scored = arrays["targets_segmentation"] > 0
    for row, mask in enumerate(scored):
      yield arrays["targets"][row, mask], predictions[row, mask]

  @abc.abstractmethod
  def encode(self, task, symbols: np.ndarray) -> np.ndarray:
    """An input's symbols as the tokens a model reads (with no answer)."""

  def names(self, task) -> dict[int, str]:
    """A name per token id of its rows but the reserved ones: the input symbols'."""
    return dict(enumerate(task.pieces(), start=NUM_RESERVED))

  def pieces(self, task, ids) -> list[str]:
    """A label per token id: names(), then the reserved pieces, else the symbol's number."""
    names = self.names(task)
    return [names.get(i, RESERVED_PIECES.get(i, str(i - NUM_RESERVED)))
            for i in np.asarray(ids).tolist()]

  def decode_length(self, arrays: dict[str, np.ndarray]) -> int:
    """Tokens to decode per row (a cast whose targets are Targets.SEQUENCE)."""
    raise NotImplementedError(f"{type(self).__name__} is not decoded")


def _labelled_row(tokens, labels, weights):
  return (tokens.astype(np.int32), np.asarray(labels, np.int32), np.asarray(weights, np.int32))


class AnswerSlots(Cast):
  """`slots`: [input symbols…, SLOT × output_length]; SLOT is the token after the input
  symbols', and the answer's symbols (classes) are the targets at the slots, the only
  weighted positions (the loss is over every slot, as in DeepMind's code)."""

  targets = Targets.TOKEN_LABELS

  def slot(self, task) -> int:
    return NUM_RESERVED + task.input_size

  def vocab_size(self, task) -> int:
    return self.slot(task) + 1

  def width(self, task, lengths):
    return max(task.input_length(n) + task.output_length(n) for n in lengths)

  def row(self, task, instance):
    inputs, outputs = instance.inputs, instance.outputs
    zeros, ones = np.zeros(len(inputs), np.int32), np.ones(len(outputs), np.int32)
    return _labelled_row(np.concatenate([inputs + NUM_RESERVED, self.slot(task) * ones]),
                         np.concatenate([zeros, outputs]), np.concatenate([zeros, ones]))

  def batch(self, rows, width):
    return label_batch(rows, width)

  def encode(self, task, symbols):
    slots = np.full(task.output_length(len(symbols)), self.slot(task), np.int32)
    return np.concatenate([symbols + NUM_RESERVED, slots]).astype(np.int32)

  def names(self, task):
    return {**super().names(task), self.slot(task): "?"}


class Seq2Seq(Cast):
  """`seq2seq`: the input and the answer as token sequences ending in EOS, one vocabulary
  for both sides; evaluation decodes."""

  targets = Targets.SEQUENCE
  unpacked = True  # pipeline.pad_batch: one example per row, each side scored up to its EOS

  def vocab_size(self, task) -> int:
    return NUM_RESERVED + max(task.input_size, task.output_size)

  def num_classes(self, task) -> int:
    return 0

  def width(self, task, lengths):
    return max(max(task.input_length(n), task.output_length(n)) + 1 for n in lengths)

  def row(self, task, instance):
    eos = np.array([EOS_ID], np.int32)
    return (np.concatenate([instance.inputs + NUM_RESERVED, eos]).astype(np.int32),
            np.concatenate([instance.outputs + NUM_RESERVED, eos]).astype(np.int32))

  def batch(self, rows, width):
    return pipeline.pad_batch(rows, width)

  def answers(self, arrays, predictions):
    """The target up to its EOS, and as many predicted tokens, as symbols."""
    for target, predicted in zip(arrays["targets"], predictions):
      k = list(target).index(EOS_ID)
      yield target[:k] - NUM_RESERVED, predicted[:k] - NUM_RESERVED

  def encode(self, task, symbols):
    return np.concatenate([symbols + NUM_RESERVED, [EOS_ID]]).astype(np.int32)

  def decode_length(self, arrays):
    return arrays["targets"].shape[1]  # the whole answer and its EOS


class SequenceLabel(Cast):
  """`label`: [CLS, input symbols…] (CLS is BOS_ID); the answer, one label, is the target
  at the CLS token, the only weighted position."""

  targets = Targets.SEQUENCE_LABELS

  def unfit(self, task):
    return None if task.answer is Answer.LABEL else "its answers are not one label"

  def vocab_size(self, task) -> int:
    return NUM_RESERVED + task.input_size

  def width(self, task, lengths):
    return max(task.input_length(n) for n in lengths) + 1

  def row(self, task, instance):
    tokens = np.concatenate([[BOS_ID], instance.inputs + NUM_RESERVED])
    labels = np.zeros(len(tokens), np.int32)
    labels[0] = instance.outputs[0]
    return _labelled_row(tokens, labels, np.arange(len(tokens)) == 0)

  def batch(self, rows, width):
    return label_batch(rows, width)

  def encode(self, task, symbols):
    return np.concatenate([[BOS_ID], symbols + NUM_RESERVED]).astype(np.int32)

  def names(self, task):
    return {**super().names(task), BOS_ID: "<cls>"}


class TokenLabels(Cast):
  """`token_labels`: the input symbols; the answer symbol at each is its label."""

  targets = Targets.TOKEN_LABELS

  def unfit(self, task):
    if task.answer is Answer.PER_SYMBOL:
      return None
    return "its answers are not one symbol per input symbol"

  def vocab_size(self, task) -> int:
    return NUM_RESERVED + task.input_size

  def width(self, task, lengths):
    return max(task.input_length(n) for n in lengths)

  def row(self, task, instance):
    tokens = instance.inputs + NUM_RESERVED
    return _labelled_row(tokens, instance.outputs, np.ones(len(tokens), np.int32))

  def batch(self, rows, width):
    return label_batch(rows, width)

  def encode(self, task, symbols):
    return (symbols + NUM_RESERVED).astype(np.int32)


class DecoderAnswer(Cast):
  """`decoder`: [input symbols…, SEP, answer symbols…] read causally; targets are the next
  tokens (inputs shifted left by one), weighted only where they are the answer's, so the
  loss is on the answer alone. SEP is the token after both alphabets'. The prompt (input and
  SEP) is what encode gives and evaluation continues (Targets.PROMPTED_ANSWERS): the answer
  has output_length(n) symbols, so as many are generated, with no EOS (as the slots cast,
  which knows it too). A row is one token longer than a slots row: its last answer token is
  read but predicts nothing, and the longest generation fits in the row's width."""

  targets = Targets.PROMPTED_ANSWERS

  def separator(self, task) -> int:
    return NUM_RESERVED + max(task.input_size, task.output_size)

  def vocab_size(self, task) -> int:
    return self.separator(task) + 1

  def num_classes(self, task) -> int:
    return 0

  def width(self, task, lengths):
    return max(task.input_length(n) + 1 + task.output_length(n) for n in lengths)

  def row(self, task, instance):
    """(prompt, answer) tokens."""
    return self.encode(task, instance.inputs), (instance.outputs + NUM_RESERVED).astype(np.int32)

  def batch(self, rows, width):
    examples = []
    for prompt, answer in rows:
      tokens = np.concatenate([prompt, answer])
      weights = np.arange(len(tokens)) >= len(prompt) - 1  # targets from SEP's on: the answer
      weights[-1] = False  # the last token has no successor in the row
      examples.append((tokens, np.append(tokens[1:], 0), weights.astype(np.int32)))
    return label_batch(examples, width)

  def answers(self, arrays, predictions):
    """The answer's symbols and the predicted ones (predictions aligned with the targets:
    at t, the token after t)."""
    for target, predicted in super().answers(arrays, predictions):
      yield target - NUM_RESERVED, predicted - NUM_RESERVED

  def encode(self, task, symbols):
    return np.append(symbols + NUM_RESERVED, self.separator(task)).astype(np.int32)

  def names(self, task):
    return {**super().names(task), self.separator(task): "<sep>"}


CASTS: dict[str, Cast] = {
    "slots": AnswerSlots(),  # an encoder: the input, then a slot per answer symbol
    "seq2seq": Seq2Seq(),  # an encoder-decoder: input -> answer
    "label": SequenceLabel(),  # an encoder with pooling: one label, read at a CLS token
    "token_labels": TokenLabels(),  # an encoder: a label per input symbol
    "decoder": DecoderAnswer(),  # a decoder-only model: prompt, separator, answer
}
