"""TensorBoard event files of a run, beside metrics.jsonl (which the reports read).

WORKDIR/tensorboard/<split>/ holds the scalars of `train` (loss, accuracy, learning rate,
gradient norm, tokens/s, ...) and of each held-out split (loss, accuracy, exact match,
BLEU, chrF), so TensorBoard draws training and held-out curves in one chart per metric;
`tensorboard --logdir SWEEP_DIR` overlays every run of a sweep. Written by process 0 with
tensorboardX (no TensorFlow; a gs:// workdir needs google-cloud-storage installed). Every
invocation's writer purges the events after the step it starts from (0 for a run begun
again from scratch, killed before its first checkpoint), as metrics.jsonl drops its
records, so re-trained steps are drawn once.
"""

import os
import uuid

import jax

from transformer.core import storage

SUMMARY_DIR = "tensorboard"


def numbers(record: dict) -> dict:
  """The scalars of a metrics record: its numbers (not flags), less its step."""
  return {name: value for name, value in record.items()
          if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step"}


class TensorBoard:
  """Scalars per split, written under WORKDIR/tensorboard; a no-op on processes > 0."""

  def __init__(self, workdir: str, resumed_at: int = 0):
    self.workdir, self.resumed_at = workdir, resumed_at
    self.writers = {}

  def _writer(self, split: str):
    if split not in self.writers:
      from tensorboardX import SummaryWriter  # noqa: PLC0415 - imported by what writes
      self.writers[split] = SummaryWriter(
          storage.join(self.workdir, SUMMARY_DIR, split),
          purge_step=self.resumed_at + 1,  # TensorBoard hides earlier files' later events
          filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")  # never another's file
    return self.writers[split]

  def scalars(self, split: str, step: int, values: dict) -> None:
    if jax.process_index() != 0:
      return
    writer = self._writer(split)
    for name, value in numbers(values).items():
      writer.add_scalar(name, value, step)
    writer.flush()

  def close(self, failed: bool = False) -> None:
    del failed  # event files record no run status
    for writer in self.writers.values():
      writer.close()
    self.writers = {}
