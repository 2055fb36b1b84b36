"""Batching for every data source: padding, packing, shuffling and per-process sharding.

Batches are dicts of int32 arrays [batch, length] (see transformer/data/__init__.py).
"""

from collections.abc import Sequence

import grain
import jax
import numpy as np

KEYS = ("inputs", "targets")
OPEN_ROWS = 8  # rows the packer keeps open; more barely improves the fill (93% on Multi30k)


def pad_batch(pairs: list[tuple[np.ndarray, np.ndarray]], length: int) -> dict[str, np.ndarray]:
  """Pads (source, target) pairs to [batch, length] with positions and segment ids."""
  batch = {}
  for key, column in zip(KEYS, (0, 1)):
    tokens = np.zeros((len(pairs), length), np.int32)
    for row, pair in enumerate(pairs):
      tokens[row, :len(pair[column])] = pair[column]
    segments = (tokens != 0).astype(np.int32)
    batch[key] = tokens
    batch[f"{key}_segmentation"] = segments
    batch[f"{key}_positions"] = np.arange(length, dtype=np.int32)[None, :] * segments
  return batch


def assign_rows(lengths: np.ndarray, max_len: int, pack: bool):
  """Places examples (lengths [n, 2]: source and target, in stream order) into rows of
  max_len tokens per side. With `pack`, first fit over OPEN_ROWS open rows (the fullest is
  closed when none fits); otherwise one example per row. Returns (row [n], offset [n, 2],
  number of rows).

  Why not grain's FirstFitPackIterDataset: on Multi30k it gave ~100× fewer batches/s for
  1.5 points more fill (benchmarks/packers.py; README, "Data")."""
  if not pack:
    return np.arange(len(lengths)), np.zeros((len(lengths), 2), np.int64), len(lengths)
  rows, offsets = np.empty(len(lengths), np.int64), np.empty((len(lengths), 2), np.int64)
  open_rows, free_src, free_tgt, num_rows = [], [], [], 0
  for k, (a, b) in enumerate(lengths.tolist()):
    for j in range(len(open_rows)):
      if free_src[j] >= a and free_tgt[j] >= b:
        break
    else:  # open a new row, closing the fullest when OPEN_ROWS are open
      if len(open_rows) < OPEN_ROWS:
        open_rows.append(0), free_src.append(0), free_tgt.append(0)
      j = min(range(len(open_rows)), key=lambda i: free_src[i] + free_tgt[i])
      open_rows[j], free_src[j], free_tgt[j], num_rows = num_rows, max_len, max_len, num_rows + 1
    rows[k], offsets[k] = open_rows[j], (max_len - free_src[j], max_len - free_tgt[j])
    free_src[j], free_tgt[j] = free_src[j] - a, free_tgt[j] - b
  return rows, offsets, num_rows


def fill_rows(examples: Sequence, rows: np.ndarray, offsets: np.ndarray, num_rows: int,
              max_len: int) -> dict[str, np.ndarray]:
  """Writes the examples at their (row, offset) into [num_rows, max_len] arrays: tokens,
  segment ids (1, 2, ... within a row; 0 = padding) and positions restarting per segment."""
  order = np.argsort(rows, kind="stable")  # by row, then stream order = offset order
  sorted_rows = rows[order]
  segment = np.empty(len(rows), np.int32)
  segment[order] = np.arange(len(rows)) - np.searchsorted(sorted_rows, sorted_rows) + 1
  out = {}
  for side, key in enumerate(KEYS):
    seqs = [np.asarray(ex[side], np.int32) for ex in examples]
    lengths = np.array([len(s) for s in seqs])
    owner = np.repeat(np.arange(len(seqs)), lengths)
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    flat = rows[owner] * max_len + offsets[owner, side] + within
    for name, values in ((key, np.concatenate(seqs)), (f"{key}_segmentation", segment[owner]),
                         (f"{key}_positions", within)):
      array = np.zeros(num_rows * max_len, np.int32)
      array[flat] = values
      out[name] = array.reshape(num_rows, max_len)
  return out


class EpochBatches(grain.IterDataset):
  """Endless batches of rows: epoch e shuffles the examples with (seed, e), places them into
  rows (assign_rows) and yields the rows in order, batch_size at a time; the last partial
  batch of an epoch is dropped. The iterator's state is (epoch, batch), so restoring it
  repacks only that epoch."""

  def __init__(self, examples: Sequence, *, seed: int, batch_size: int, max_len: int,
               pack: bool):
    super().__init__()
    self.examples, self.seed, self.batch_size = examples, seed, batch_size
    self.max_len, self.pack = max_len, pack
    self.lengths = np.array([(len(s), len(t)) for s, t in examples], np.int64).reshape(-1, 2)

  def epoch(self, epoch: int) -> dict[str, np.ndarray]:
    order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
    rows, offsets, num_rows = assign_rows(self.lengths[order], self.max_len, self.pack)
    if num_rows < self.batch_size:
      raise ValueError(f"{len(self.examples)} training examples fill {num_rows} rows, fewer "
                       f"than one batch of {self.batch_size}")
    return fill_rows([self.examples[i] for i in order], rows, offsets, num_rows, self.max_len)

  def __iter__(self) -> grain.DatasetIterator:
    return _EpochBatchesIterator(self)


class _EpochBatchesIterator(grain.DatasetIterator):

  def __init__(self, dataset: EpochBatches):
    super().__init__()
    self.dataset = dataset
    self.set_state({"epoch": 0, "batch": 0})

  def set_state(self, state):
    self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
    self.rows = self.dataset.epoch(self.epoch)

  def get_state(self):
    return {"epoch": self.epoch, "batch": self.batch}

  def __next__(self) -> dict[str, np.ndarray]:
    size = self.dataset.batch_size
    if (self.batch + 1) * size > len(self.rows["inputs"]):
      self.set_state({"epoch": self.epoch + 1, "batch": 0})
    start = self.batch * size
    self.batch += 1
    return {k: v[start:start + size] for k, v in self.rows.items()}


def train_batches(examples: Sequence, *, seed: int, batch_size: int, max_len: int,
                  pack: bool = True) -> grain.IterDataset:
  """Endless training batches from (source ids, target ids) examples that end in EOS.

  Examples longer than `max_len` on either side are dropped; each process reads its own
  1/process_count of the examples; every epoch is reshuffled from `seed`. With `pack`,
  several pairs share a row, each with its own segment id and positions restarting at 0;
  otherwise one pair per row, padded. `batch_size` is this process's rows per batch.
  """
  fits = [ex for ex in examples if 0 < len(ex[0]) <= max_len and 0 < len(ex[1]) <= max_len]
  mine = fits[jax.process_index()::jax.process_count()]
  return EpochBatches(mine, seed=seed, batch_size=batch_size, max_len=max_len, pack=pack)
