"""Synthetic tasks: determinism, correctness of targets, held-out disjointness, lengths."""

import numpy as np
import pytest

from transformer.core.errors import ConfigError
from transformer.core.vocab import EOS_ID, NUM_RESERVED
from transformer.data.synthetic import TRANSFORMS, SyntheticTask, eval_splits, train_dataset


def _strip(row):
  return row[:list(row).index(EOS_ID)]


@pytest.mark.parametrize("name,fn", [("reverse", lambda s: s[::-1]), ("copy", lambda s: s),
                                     ("sort", sorted)])
def test_targets_follow_the_task(name, fn):
  task = SyntheticTask(name, num_symbols=8, min_len=2, max_len=9)
  batch = train_dataset(task, seed=3, batch_size=16)[5]
  assert batch["inputs"].shape == batch["targets"].shape == (16, 10)
  for src, tgt in zip(batch["inputs"], batch["targets"]):
    s, t = _strip(src), _strip(tgt)
    assert 2 <= len(s) <= 9
    assert all(NUM_RESERVED <= x < task.vocab_size for x in s)
    np.testing.assert_array_equal(t, fn(s))


def test_batches_are_a_pure_function_of_seed_and_step():
  task = SyntheticTask("reverse")
  a, b = train_dataset(task, 0, 8), train_dataset(task, 0, 8)
  np.testing.assert_array_equal(a[7]["inputs"], b[7]["inputs"])
  assert not np.array_equal(a[7]["inputs"], a[8]["inputs"])
  assert not np.array_equal(a[7]["inputs"], train_dataset(task, 1, 8)[7]["inputs"])


def test_positions_and_segments_describe_the_padding():
  batch = train_dataset(SyntheticTask("copy", max_len=6), 0, 4)[0]
  for key in ("inputs", "targets"):
    seg = batch[f"{key}_segmentation"]
    np.testing.assert_array_equal(seg, batch[key] != 0)
    np.testing.assert_array_equal(batch[f"{key}_positions"], np.arange(7) * seg)


def test_heldout_strings_never_appear_in_training():
  task = SyntheticTask("reverse", num_symbols=4, min_len=1, max_len=4, heldout_modulus=5,
                       longer_max_len=6)
  splits = eval_splits(task, seed=0, num_examples=200)
  heldout = {tuple(_strip(r)) for r in splits["valid"]["inputs"]}
  ds = train_dataset(task, 0, 64)
  seen = {tuple(_strip(r)) for i in range(50) for r in ds[i]["inputs"]}
  assert heldout and not heldout & seen
  assert len(seen) > 100  # the training stream still covers most of the small string space


def test_longer_split_is_longer_than_any_training_example():
  task = SyntheticTask("reverse", min_len=2, max_len=8, longer_max_len=12)
  splits = eval_splits(task, seed=0, num_examples=50)
  lengths = (splits["longer"]["inputs"] != 0).sum(1) - 1  # minus EOS
  assert lengths.min() == 9 and lengths.max() <= 12
  valid = (splits["valid"]["inputs"] != 0).sum(1) - 1
  assert valid.min() >= 2 and valid.max() <= 8


def test_bad_task_settings():
  with pytest.raises(ConfigError, match="unknown task 'revers'; choose one of: "
                     + ", ".join(sorted(TRANSFORMS))):
    SyntheticTask("revers")
  with pytest.raises(ValueError, match="min_len"):
    SyntheticTask("copy", min_len=5, max_len=3)


def test_generated_batches_give_each_process_its_share_of_the_same_rows():
  from transformer.data import pipeline  # noqa: PLC0415

  def first_batches(count, index, n=3):
    dataset = pipeline.generated_batches(6, lambda i: i * i, np.array, index, count)
    return [dataset[step] for step in range(n)]

  whole = first_batches(1, 0)
  np.testing.assert_array_equal(whole, np.arange(18).reshape(3, 6) ** 2)
  halves = [first_batches(2, p) for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves, axis=-1), whole)
