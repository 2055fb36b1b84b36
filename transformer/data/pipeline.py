"""Batching for every data source: padding, packing, shuffling and per-process sharding.

Batches are dicts of int32 arrays [batch, length] (see transformer/data/__init__.py).
"""

import grain
import jax
import numpy as np
from grain.experimental import FirstFitPackIterDataset


def pad_batch(pairs: list[tuple[np.ndarray, np.ndarray]], length: int) -> dict[str, np.ndarray]:
  """Pads (source, target) pairs to [batch, length] with positions and segment ids."""
  batch = {}
  for key, column in (("inputs", 0), ("targets", 1)):
    tokens = np.zeros((len(pairs), length), np.int32)
    for row, pair in enumerate(pairs):
      tokens[row, :len(pair[column])] = pair[column]
    segments = (tokens != 0).astype(np.int32)
    batch[key] = tokens
    batch[f"{key}_segmentation"] = segments
    batch[f"{key}_positions"] = np.arange(length, dtype=np.int32)[None, :] * segments
  return batch


def _rename_packed(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """grain's packer names segment ids `*_segment_ids`; the model reads `*_segmentation`."""
  return {k.replace("_segment_ids", "_segmentation"): v.astype(np.int32) for k, v in row.items()}


def train_batches(examples: grain.MapDataset, *, seed: int, batch_size: int, max_len: int,
                  pack: bool = True) -> grain.IterDataset:
  """Endless training batches from (source ids, target ids) examples that end in EOS.

  Examples longer than `max_len` on either side are dropped; each process reads its own
  1/process_count of the examples; every epoch is reshuffled from `seed`. With `pack`,
  several pairs share a row (first-fit), each with its own segment id and positions
  restarting at 0; otherwise one pair per row, padded. The batch size is per process.
  """
  fits = lambda ex: 0 < len(ex[0]) <= max_len and 0 < len(ex[1]) <= max_len  # noqa: E731
  examples = examples.filter(fits)[jax.process_index()::jax.process_count()]
  stream = examples.shuffle(seed=seed).repeat(None)
  if not pack:
    return stream.to_iter_dataset().batch(batch_size,
                                          batch_fn=lambda pairs: pad_batch(pairs, max_len))
  as_dict = stream.map(lambda ex: {"inputs": ex[0], "targets": ex[1]}).to_iter_dataset()
  packed = FirstFitPackIterDataset(as_dict, length_struct={"inputs": max_len, "targets": max_len},
                                   num_packing_bins=batch_size, shuffle_bins=False)
  return packed.map(_rename_packed).batch(batch_size)
