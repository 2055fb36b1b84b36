"""data.source "synthetic": targets of reverse/copy/sort (their former names read in saved
configs only), batches a pure function of seed and step, held-out strings, the longer split,
bad settings; and the batching of generated rows."""

import numpy as np
import pytest

from tests.support import make_tiny_config
from transformer.core.errors import ConfigError
from transformer.core.vocab import EOS_ID, NUM_RESERVED
from transformer.data import SourceArgs
from transformer.data.base import SourceSection
from transformer.data.tasks.synthetic import RENAMED, SyntheticSource
from transformer.run import config as config_lib


def _strip(row):
  return row[:list(row).index(EOS_ID)]


def _source(name="reverse_string", seed=0, batch_size=16, eval_examples=50, **fields):
  task = SyntheticSource.Task.parse({"name": name, **fields}, "task")
  return SyntheticSource(SourceSection("synthetic"), task, SourceArgs(seed, batch_size,
                                                                      eval_examples))


def _batch(source, step):
  iterator = iter(source.train_batches())
  for _ in range(step):
    next(iterator)
  return next(iterator)


@pytest.mark.parametrize("name,fn", [("reverse_string", lambda s: s[::-1]),
                                     ("copy", lambda s: s), ("bucket_sort", sorted)])
def test_targets_follow_the_task(name, fn):
  source = _source(name, num_symbols=8, min_len=2, max_len=9)
  assert source.task.name == name
  batch = _batch(source, 5)
  assert batch["inputs"].shape == batch["targets"].shape == (16, 10)
  for src, tgt in zip(batch["inputs"], batch["targets"]):
    s, t = _strip(src), _strip(tgt)
    assert 2 <= len(s) <= 9
    assert all(NUM_RESERVED <= x < NUM_RESERVED + 8 for x in s)
    np.testing.assert_array_equal(t, fn(s))


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_a_former_task_name_is_read_in_a_saved_config_and_refused_in_a_new_one(old, new):
  raw = config_lib.to_dict(config_lib.parse(make_tiny_config()))
  raw["task"]["name"] = old
  assert config_lib.parse(raw, saved=True).task.name == new
  with pytest.raises(ConfigError, match=f"config.task.name='{old}' is the former name of "
                                        f"'{new}': write --config.task.name={new}"):
    config_lib.parse(raw)


def test_batches_are_a_pure_function_of_seed_and_step():
  a, b, c = _source(batch_size=8), _source(batch_size=8), _source(seed=1, batch_size=8)
  np.testing.assert_array_equal(_batch(a, 7)["inputs"], _batch(b, 7)["inputs"])
  assert not np.array_equal(_batch(a, 7)["inputs"], _batch(a, 8)["inputs"])
  assert not np.array_equal(_batch(a, 7)["inputs"], _batch(c, 7)["inputs"])


def test_training_rows_are_unpacked_and_held_out_segments_describe_the_padding():
  """seq2seq rows hold one example each: training batches leave out the segment ids and
  positions (pipeline.unpacked); a held-out split's describe its padding."""
  source = _source("copy", batch_size=4, max_len=6)
  assert source.unpacked_batches
  training = _batch(source, 0)
  assert sorted(training) == ["inputs", "targets"]
  for key in ("inputs", "targets"):
    real = training[key] != 0
    assert real[:, 0].all() and (real[:, :-1] >= real[:, 1:]).all()  # from slot 0
  batch = source.eval_splits(4)["valid"].arrays
  for key in ("inputs", "targets"):
    seg = batch[f"{key}_segmentation"]
    np.testing.assert_array_equal(seg, batch[key] != 0)
    np.testing.assert_array_equal(batch[f"{key}_positions"], np.arange(seg.shape[1]) * seg)


def test_heldout_strings_never_appear_in_training():
  source = _source(num_symbols=4, min_len=1, max_len=4, heldout_modulus=5, longer_max_len=6,
                   batch_size=64, eval_examples=200)
  heldout = {tuple(_strip(r)) for r in source.eval_splits()["valid"].arrays["inputs"]}
  iterator = iter(source.train_batches())
  seen = {tuple(_strip(r)) for _ in range(50) for r in next(iterator)["inputs"]}
  assert heldout and not heldout & seen
  assert len(seen) > 100  # the training stream still covers most of the small string space


def test_longer_split_is_longer_than_any_training_example():
  splits = _source(min_len=2, max_len=8, longer_max_len=12).eval_splits()
  lengths = (splits["longer"].arrays["inputs"] != 0).sum(1) - 1  # minus EOS
  assert lengths.min() == 9 and lengths.max() <= 12
  np.testing.assert_array_equal(lengths, splits["longer"].lengths)
  valid = (splits["valid"].arrays["inputs"] != 0).sum(1) - 1
  assert valid.min() >= 2 and valid.max() <= 8


def test_exact_match_by_length_counts_whole_answers():
  source = _source(num_symbols=4, min_len=2, max_len=4, longer_max_len=4, eval_examples=30)
  split = source.eval_splits()["valid"]
  predictions = split.arrays["targets"].copy()
  predictions[::2, 0] = EOS_ID  # every other row wrong
  got = source.split_results("valid", split, {"predictions": predictions}).metrics
  for n, value in got["exact_match_by_length"].items():
    rows = np.flatnonzero(split.lengths == int(n))
    assert value == pytest.approx(np.mean(rows % 2 == 1))


def test_bad_task_settings():
  with pytest.raises(ConfigError, match="unknown task 'revers'; choose one of: "
                     + ", ".join(sorted(SyntheticSource.Task.registry))):
    _source("revers")
  with pytest.raises(ValueError, match="min_len"):
    _source("copy", min_len=5, max_len=3)
  with pytest.raises(ConfigError, match="no held-out input of copy of lengths 1..1"):
    _source("copy", num_symbols=1, max_len=1, longer_max_len=1)


def test_generated_batches_give_each_process_its_share_of_the_same_rows():
  from transformer.data import pipeline  # noqa: PLC0415

  def first_batches(count, index, n=3):
    dataset = pipeline.generated_batches(6, lambda i: i * i, np.array, index, count)
    return [dataset[step] for step in range(n)]

  whole = first_batches(1, 0)
  np.testing.assert_array_equal(whole, np.arange(18).reshape(3, 6) ** 2)
  halves = [first_batches(2, p) for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves, axis=-1), whole)
