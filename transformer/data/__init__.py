"""Data sources. Every source yields batches as dicts of int32 numpy arrays:

  inputs, targets                          [batch, length] token ids (PAD_ID = 0 pads)
  inputs_positions, targets_positions      position within the segment, 0-based
  inputs_segmentation, targets_segmentation segment id, 0 on padding; a target is scored
                                           where its targets_segmentation > 0

A source that declares its training rows unpacked (base.DataSource.unpacked_batches: one
sequence per row from slot 0, padded at the right) leaves out the positions and segment ids
of its training batches (pipeline.unpacked); a target of such a batch is scored where it is
not PAD_ID. Held-out splits carry them all.

What `targets` hold is the source's declaration (Targets), which a model family must learn.
Where they are the next tokens of a prompt's answer (Targets.PROMPTED_ANSWERS), targets[t] is
inputs[t + 1] and only the answer is scored: a row's prompt is its tokens up to and including
its first scored position, and its answer the tokens at the scored positions' successors.
The interface every source meets: transformer/data/base.py; the registry: sources.py. The
generated tasks (reverse, copy, sort, the papers' 15, ListOps, duplicates) meet one more:
data/tasks/problem.py (problems, registered in data/tasks/registry.py), data/tasks/splits.py
(splits rules), data/tasks/casts.py (casts).
"""

import dataclasses
import enum


class Targets(enum.Enum):
  """What a source's batches ask a model to predict (data.base.DataSource.targets), and what
  a model family learns (families.ModelFamily.learns)."""

  SEQUENCE = "a target sequence for each input sequence"
  TOKEN_LABELS = "a label per input token"
  SEQUENCE_LABELS = "a label per input sequence, at its first token"
  NEXT_TOKENS = "the next token after each input token"
  PROMPTED_ANSWERS = ("the next tokens of an answer after each prompt, scored on the answer; "
                      "the answer generated after the prompt at evaluation")


@dataclasses.dataclass(frozen=True)
class SourceArgs:
  """What every data source takes besides its own config sections."""

  seed: int  # config.seed: the data's shuffles and generated examples
  batch_size: int  # config.train.batch_size: rows per training step over all processes
  eval_examples: int  # config.eval.num_examples: per held-out split (0: all, where allowed)
  workdir: str | None = None  # where a tokenizer trained by the run is kept
