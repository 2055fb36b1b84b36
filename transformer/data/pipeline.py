"""Batching for every data source: padding, packing, shuffling and per-process sharding.

Batches are dicts of int32 arrays [batch, length] (see transformer/data/__init__.py).
"""

import concurrent.futures
from collections.abc import Callable

import grain
import jax
import numpy as np

KEYS = ("inputs", "targets")
# What a batch says of its rows' structure; a batch of unpacked rows leaves it out (unpacked).
STRUCTURE_KEYS = tuple(f"{key}_{part}" for key in KEYS for part in ("segmentation", "positions"))
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


def unpacked(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """`batch` without its segment ids and positions (STRUCTURE_KEYS): the layout of a source
  that declares its training rows unpacked (DataSource.unpacked_batches): one sequence per
  row of inputs and of targets from slot 0, at positions 0, 1, ..., padded at the right with
  PAD_ID, every target that is not PAD_ID scored. A batch's keys are known when the step is
  traced, so the model reads this structure statically (embeddings.inputs_mask,
  target_weights) and hands cuDNN sequence lengths and a causal flag instead of a dense mask
  (model/kernels/cudnn_mask.py). The arrays it drops are what the model computes without
  them on every scored token, so the losses are the same either way."""
  return {k: v for k, v in batch.items() if k not in STRUCTURE_KEYS}


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


def fill_rows(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rows: np.ndarray,
              offsets: np.ndarray, num_rows: int, max_len: int) -> dict[str, np.ndarray]:
  """Writes the examples at their (row, offset) into [num_rows, max_len] arrays: tokens,
  segment ids (1, 2, ... within a row; 0 = padding) and positions restarting per segment.
  Example k's side s is tokens[starts[k, s]:][:lengths[k, s]]."""
  order = np.argsort(rows, kind="stable")  # by row, then stream order = offset order
  sorted_rows = rows[order]
  segment = np.empty(len(rows), np.int32)
  segment[order] = np.arange(len(rows)) - np.searchsorted(sorted_rows, sorted_rows) + 1
  out = {}
  for side, key in enumerate(KEYS):
    length = lengths[:, side]
    owner = np.repeat(np.arange(len(length)), length)
    within = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
    flat = rows[owner] * max_len + offsets[owner, side] + within
    for name, values in ((key, tokens[starts[owner, side] + within]),
                         (f"{key}_segmentation", segment[owner]), (f"{key}_positions", within)):
      array = np.zeros(num_rows * max_len, np.int32)
      array[flat] = values
      out[name] = array.reshape(num_rows, max_len)
  return out


def permute(positions: np.ndarray, n: int, seed: int, epoch: int, rounds: int = 4) -> np.ndarray:
  """The indices at `positions` of a pseudorandom permutation of range(n) fixed by (seed,
  epoch): a Feistel network on the smallest even power of two >= n, cycle-walked into
  range(n). Lazy and vectorised: any slice of an epoch's order in O(slice) time and memory."""
  half = max(1, ((int(n) - 1).bit_length() + 1) // 2)
  mask = np.uint64((1 << half) - 1)
  keys = np.random.default_rng([seed, epoch, n]).integers(0, 1 << 62, rounds, dtype=np.uint64)
  out = np.asarray(positions, np.uint64).copy()
  todo = np.arange(len(out))
  while len(todo):
    x = out[todo]
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
      z = (right ^ key) * np.uint64(0x9E3779B97F4A7C15)
      z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
      left, right = right, left ^ ((z ^ (z >> np.uint64(29))) & mask)
    out[todo] = (left << np.uint64(half)) | right
    todo = todo[out[todo] >= n]  # outside range(n): walk on along the cycle
  return out.astype(np.int64)


class PackedStream(grain.IterDataset):
  """Endless batches of rows from a random-access corpus, for one process of several.

  The process reads the examples process_index, process_index + process_count, ... (the
  processes' parts are disjoint and cover the corpus). Epoch e visits them in the order of
  permute(., seed, e), `window` at a time: each window's examples that fit max_len are
  placed into rows (assign_rows) and the rows stream on across windows and epochs, so a
  batch may span both and no step waits for more than one window's packing. Memory holds
  one window. The iterator's state is (epoch, window, row): restoring repacks one window.
  Without `pack` each row holds one pair from slot 0, and the batches leave out segment ids
  and positions (unpacked).
  """

  def __init__(self, pairs, *, seed: int, batch_size: int, max_len: int, pack: bool,
               window: int = 8192, process_index: int = 0, process_count: int = 1):
    super().__init__()
    self.pairs, self.seed, self.batch_size = pairs, seed, batch_size
    self.max_len, self.pack, self.window = max_len, pack, window
    self.process_index, self.process_count = process_index, process_count
    self.size = len(range(process_index, len(pairs), process_count))
    self.num_windows = -(-self.size // window)
    if not self.size:
      raise ValueError(f"process {process_index} of {process_count} has no training "
                       f"examples: the corpus holds {len(pairs)}")

  def indices(self, epoch: int, window: int) -> np.ndarray:
    """The corpus indices of this process's examples in a window of an epoch."""
    positions = np.arange(window * self.window, min((window + 1) * self.window, self.size))
    return self.process_index + permute(positions, self.size, self.seed, epoch
                                        ) * self.process_count

  def rows(self, epoch: int, window: int) -> dict[str, np.ndarray]:
    tokens, starts, lengths = self.pairs.read(self.indices(epoch, window))
    fits = ((lengths > 0) & (lengths <= self.max_len)).all(1)
    starts, lengths = starts[fits], lengths[fits]
    rows, offsets, num_rows = assign_rows(lengths, self.max_len, self.pack)
    arrays = fill_rows(tokens, starts, lengths, rows, offsets, num_rows, self.max_len)
    return arrays if self.pack else unpacked(arrays)  # one pair per row from slot 0

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedStreamIterator(self)


class _PackedStreamIterator(grain.DatasetIterator):
  """Packs the next window in a background thread while the current one is consumed (the
  training step releases the GIL), so a batch rarely waits for packing."""

  def __init__(self, dataset: PackedStream):
    super().__init__()
    self.dataset = dataset
    self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pack")
    self.ahead = None  # ((epoch, window), future of its rows)
    self.set_state({"epoch": 0, "window": 0, "row": 0})

  def set_state(self, state):
    if "window" not in state:  # an EpochBatches state (epoch, batch): the epoch's start
      state = {"epoch": int(state["epoch"]) + 1, "window": 0, "row": 0}
    self.epoch, self.window, self.row = (int(state[k]) for k in ("epoch", "window", "row"))
    self.current = self._rows(self.epoch, self.window)

  def get_state(self):
    return {"epoch": self.epoch, "window": self.window, "row": self.row}

  def _following(self, epoch: int, window: int) -> tuple[int, int]:
    return (epoch + 1, 0) if window + 1 == self.dataset.num_windows else (epoch, window + 1)

  def _rows(self, epoch: int, window: int) -> dict[str, np.ndarray]:
    """The window's rows (from the background packer if it has them), and starts packing
    the one after."""
    ahead, self.ahead = self.ahead, None
    rows = ahead[1].result() if ahead else None  # always waited for: one reader at a time
    if not ahead or ahead[0] != (epoch, window):
      rows = self.dataset.rows(epoch, window)
    following = self._following(epoch, window)
    self.ahead = following, self.executor.submit(self.dataset.rows, *following)
    return rows

  def __next__(self) -> dict[str, np.ndarray]:
    pieces, need, empty = [], self.dataset.batch_size, 0
    while need:
      available = len(self.current["inputs"]) - self.row
      if not available:
        empty += 1
        if empty > self.dataset.num_windows:
          raise ValueError(f"no training example fits max_len {self.dataset.max_len}")
        self.epoch, self.window = self._following(self.epoch, self.window)
        self.current, self.row = self._rows(self.epoch, self.window), 0
        continue
      take = min(need, available)
      pieces.append({k: v[self.row:self.row + take] for k, v in self.current.items()})
      self.row, need, empty = self.row + take, need - take, 0
    if len(pieces) == 1:
      return pieces[0]
    return {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}


READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)  # generated batches


def generated_batches(batch_size: int, row: Callable[[int], object],
                      batch: Callable[[list], dict[str, np.ndarray]],
                      process_index: int | None = None,
                      process_count: int | None = None) -> grain.MapDataset:
  """Endless batches of rows made on demand (the synthetic, labelled and LM sources):
  `row(i)` is global row i, a pure function of i, and `batch(rows)` stacks this process's
  share; `dataset[step]` is that share of step's batch. Process p of P (default: this JAX
  process) takes rows p·b/P ... (p+1)·b/P - 1 of every batch of b, so batch `step` is the
  same rows on any number of processes."""
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  rows = batch_size // process_count
  dataset = grain.MapDataset.range(2**62).map(
      lambda j: row((j // rows) * batch_size + process_index * rows + j % rows))
  return dataset.batch(rows, batch_fn=batch)
