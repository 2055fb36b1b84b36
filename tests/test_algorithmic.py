"""data.source "algorithmic" (data/tasks/algorithmic.py) and the tasks of data/chomsky (every
task's shapes, ranges and determinism: tests/test_tasks.py): the six tasks of the CPU
protocol against direct references and their papers' examples; the row layout, the splits
and the per-length accuracy against a direct computation; and configs/chomsky.py end to end
at tiny size, in every cast."""

import json
import os

import numpy as np
import pytest
from ml_collections import config_dict

from tests.support import TINY_WIDTH
from configs import chomsky
from transformer.core.errors import ConfigError
from transformer.core.vocab import EOS_ID, NUM_RESERVED
from transformer.data import SourceArgs, Targets
from transformer.data.tasks.algorithmic import AlgorithmicData, AlgorithmicSource, length_accuracy
from transformer.data.base import Split
from transformer.data.tasks.casts import CASTS
from transformer.data.tasks.chomsky import PROBLEMS as PAPERS_PROBLEMS
from transformer.data.tasks.chomsky.base import up_to_termination
from transformer.model.families import ARCHS
from transformer.run import optim
from transformer.run import workdir as workdir_lib
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
from transformer.study import figures, report_plots

LENGTHS = [1, 2, 3, 4, 5, 7, 40, 41, 100]
TASKS = AlgorithmicSource.Task.registry  # each problem with the papers' splits fields
SLOTS = CASTS["slots"]


def _sample(task, n, seed=0):
  return task.sample(np.random.default_rng([seed, n]), n)


# --------------------------------------------------------------------------- references


def _reference(name, x):
  """The answer to input x, computed directly."""
  x = [int(v) for v in x]
  n = len(x)
  if name == "reverse_string":
    return x[::-1]
  if name == "duplicate_string":
    return x + x
  if name == "odds_first":  # 0-based odd indices first, as DeepMind's code
    return [x[i] for i in range(1, n, 2)] + [x[i] for i in range(0, n, 2)]
  if name == "bucket_sort":
    return [s for s in range(5) for _ in range(x.count(s))]
  if name == "missing_duplicate_string":
    if n == 1:
      return [1]
    half = n // 2
    body = x[:2 * half]
    at = body.index(2)
    return [body[at + half] if at < half else body[at - half]]
  if name == "binary_addition":
    if 2 in x:
      plus = x.index(2)
      a, b = x[:plus], x[plus + 1:]
      total = int("".join(map(str, a[::-1])), 2) + int("".join(map(str, b[::-1])), 2)
    else:
      total = int("".join(map(str, x[::-1])), 2)
    digits = [int(c) for c in bin(total)[2:][::-1]] + [2]
    return digits + [0] * (n + 1 - len(digits))
  raise KeyError(name)


REFERENCED = ["reverse_string", "duplicate_string", "odds_first", "bucket_sort",
              "missing_duplicate_string", "binary_addition"]


@pytest.mark.parametrize("name", REFERENCED)
def test_task_matches_a_direct_reference(name):
  task = TASKS[name]()
  for n in LENGTHS + [500]:
    for seed in range(4):
      inputs, outputs = _sample(task, n, seed)
      assert outputs.tolist() == _reference(name, inputs), (n, seed, inputs)


@pytest.mark.parametrize("name,inputs,outputs", [
    # The examples in DeepMind's docstrings.
    ("reverse_string", "011010", "010110"),
    ("duplicate_string", "101", "101101"),
    # DeepMind's odds_first docstring says 00110101 -> 0100 0111 and 110 -> 10 1 (1-based
    # odd positions first); its code puts 0-based odd indices first: test_odds_first_*
    ("odds_first", "00110101", "01110100"),
    ("odds_first", "110", "110"),
    ("bucket_sort", "10204112", "00111224"),
    ("missing_duplicate_string", "01100210", "1"),
    ("missing_duplicate_string", "1011213", "0"),
    # 4 + 22 = 26 and 9 + 32 = 41, up to the termination symbol (the docstring's zero
    # padding is one short of the code's n + 1 symbols)
    ("binary_addition", "0012" + "01101", "010112"),
    ("binary_addition", "10012" + "000001", "1001012"),
])
def test_reference_gives_the_papers_examples(name, inputs, outputs):
  assert "".join(map(str, _reference(name, inputs))).startswith(outputs)


def test_binary_addition_operands_and_masks():
  task = TASKS["binary_addition"]()
  for n in range(3, 30):
    inputs, outputs = _sample(task, n)
    a, b = "".join(map(str, inputs)).split("2")
    assert a and b and "1" in a and "1" in b  # two non-zero operands, each ≥ 1 digit
    mask = task.accuracy_mask(outputs)
    stop = outputs.tolist().index(2)
    assert mask.tolist() == [True] * (stop + 1) + [False] * (len(outputs) - stop - 1)
  assert up_to_termination(np.array([[0, 1, 0], [2, 0, 0]]), 2).tolist() == [
      [True, True, True], [True, False, False]]  # no terminator: all count


def test_missing_duplicate_has_one_gap_and_odd_padding():
  task = TASKS["missing_duplicate_string"]()
  for n in range(2, 30):
    inputs, _ = _sample(task, n)
    assert (inputs == 2).sum() == 1 and (inputs == 3).sum() == n % 2
    assert n % 2 == 0 or inputs[-1] == 3


def test_a_bad_task_field_is_refused():
  with pytest.raises(ConfigError, match="num_symbols"):
    TASKS["bucket_sort"](num_symbols=0)
  with pytest.raises(ConfigError, match="test_max_len"):
    TASKS["reverse_string"](max_len=10, test_max_len=5)


# --------------------------------------------------------------------------- the source


def _source(seed=0, eval_examples=20, batch_size=8, cast="slots", **task):
  task = AlgorithmicSource.Task.parse({"name": "binary_addition", **task}, "task")
  return AlgorithmicSource(AlgorithmicData("algorithmic", cast), task,
                           SourceArgs(seed, batch_size, eval_examples))


def test_rows_are_inputs_then_answer_slots():
  source = _source(min_len=3, max_len=6, test_max_len=9)
  task, slot = source.task, SLOTS.slot(source.task)
  batch = next(iter(source.train_batches()))
  assert batch["inputs"].shape == (8, 6 + 7)  # the longest row: 6 inputs and 7 slots
  for row in range(8):
    tokens, labels = batch["inputs"][row], batch["targets"][row]
    n = int(((tokens != 0) & (tokens != slot)).sum())
    assert 3 <= n <= 6
    real = n + task.output_length(n)
    assert (tokens[:n] >= NUM_RESERVED).all() and (tokens[n:real] == slot).all()
    assert (tokens[real:] == 0).all()
    assert batch["targets_segmentation"][row].tolist() == [0] * n + [1] * (real - n) + [0] * (
        len(tokens) - real)
    assert labels[n:real].tolist() == _reference("binary_addition", tokens[:n] - NUM_RESERVED)
    assert batch["inputs_positions"][row, :real].tolist() == list(range(real))


def test_seq2seq_rows_are_the_input_and_the_answer():
  source = _source(cast="seq2seq", min_len=3, max_len=6, test_max_len=9)
  assert source.targets.name == "SEQUENCE" and source.output_sizes(source.data, source.task) == (
      NUM_RESERVED + 3, 0)
  batch = next(iter(source.train_batches()))
  assert batch["inputs"].shape == batch["targets"].shape == (8, 6 + 2)  # 7 answer symbols, EOS
  for row in range(8):
    tokens, target = batch["inputs"][row], batch["targets"][row]
    n = int((tokens != 0).sum()) - 1
    assert tokens[n] == EOS_ID and target[n + 1] == EOS_ID
    assert (target[:n + 1] - NUM_RESERVED).tolist() == _reference(
        "binary_addition", tokens[:n] - NUM_RESERVED)
  split = source.eval_splits()["test"]
  predictions = split.arrays["targets"].copy()
  predictions[:, 0] = EOS_ID  # the first answer symbol wrong in every row
  got = length_accuracy(source.task, CASTS["seq2seq"], split, predictions)
  for n, value in got.items():
    counted = [r for r in range(len(predictions))
               if (split.arrays["inputs"][r] != 0).sum() - 1 == n]
    terminator = 2 + NUM_RESERVED  # the answer's termination symbol 2, as a token
    ends = [list(split.arrays["targets"][r]).index(terminator) + 1 for r in counted]
    assert value == pytest.approx(1 - len(counted) / sum(ends))
  assert source.encode("1 + 1").tolist() == [4, 5, 4, EOS_ID]


def test_training_batches_are_a_function_of_seed_and_step():
  first = list(zip(range(3), _source().train_batches()))
  again = list(zip(range(3), _source().train_batches()))
  other = list(zip(range(3), _source(seed=1).train_batches()))
  for (_, a), (_, b), (_, c) in zip(first, again, other):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_training_lengths_are_uniform():
  source = _source(name="reverse_string", batch_size=64, min_len=1, max_len=4)
  slot, counts = SLOTS.slot(source.task), np.zeros(5)
  for _, batch in zip(range(20), source.train_batches()):
    lengths = ((batch["inputs"] != 0) & (batch["inputs"] != slot)).sum(1)
    counts += np.bincount(lengths, minlength=5)
  assert counts[0] == 0
  # 1280 rows over 4 lengths: each count is 320 ± 15.5 (binomial sd); 5 sd is a failure.
  assert np.abs(counts[1:] - 320).max() < 5 * 15.5, counts


def test_training_lengths_per_batch_are_shared_by_a_batch_and_uniform():
  """task.train_lengths=per_batch (the papers' curriculum: a length per step): every row of a
  batch has the batch's length, and the batches' lengths are uniform over min..max; the
  rows' contents are still their own (per_row's, at that length)."""
  source = _source(name="reverse_string", batch_size=8, min_len=1, max_len=4,
                   train_lengths="per_batch")
  slot, counts = SLOTS.slot(source.task), np.zeros(5)
  for _, batch in zip(range(400), source.train_batches()):
    lengths = ((batch["inputs"] != 0) & (batch["inputs"] != slot)).sum(1)
    assert len(set(lengths.tolist())) == 1, lengths
    counts[lengths[0]] += 1
    if lengths[0] == 4:
      assert len({tuple(r) for r in batch["inputs"].tolist()}) > 1  # not one row repeated
  # 400 batches over 4 lengths: each count is 100 ± 8.7 (binomial sd); 5 sd is a failure.
  assert counts[0] == 0 and np.abs(counts[1:] - 100).max() < 5 * 8.7, counts
  per_row = next(iter(_source(name="reverse_string", batch_size=8, min_len=1, max_len=4
                              ).train_batches()))
  assert len(set(((per_row["inputs"] != 0) & (per_row["inputs"] != slot)).sum(1))) > 1


def test_splits_spread_examples_over_their_lengths():
  source = _source(min_len=2, max_len=5, test_max_len=8, eval_examples=10)
  splits = source.eval_splits()
  slot = SLOTS.slot(source.task)
  for name, lengths in (("valid", range(2, 6)), ("test", range(6, 9))):
    inputs = splits[name].arrays["inputs"]
    n = ((inputs != 0) & (inputs != slot)).sum(1)
    assert sorted(set(n.tolist())) == list(lengths)
    assert np.abs(np.bincount(n)[list(lengths)] - 10 / len(lengths)).max() < 1
  assert source.max_lengths() == {"task.max_len": 5 + 6, "task.test_max_len": 8 + 9}
  assert splits["test"].arrays["inputs"].shape[1] == 8 + 9
  one = _source(min_len=2, max_len=5, test_max_len=8, eval_examples=1).eval_splits()
  assert len(one["valid"]) == 4 and len(one["test"]) == 3  # at least one row per length


def test_length_accuracy_is_the_masked_accuracy_per_length():
  source = _source(min_len=3, max_len=4, test_max_len=4, eval_examples=6)
  split = source.eval_splits()["valid"]
  arrays, slot = split.arrays, SLOTS.slot(source.task)
  rng = np.random.default_rng(0)
  predictions = np.where(rng.random(arrays["targets"].shape) < 0.6, arrays["targets"],
                         rng.integers(0, 3, arrays["targets"].shape))
  expected = {}
  for row in range(len(arrays["inputs"])):
    tokens = arrays["inputs"][row]
    n = int(((tokens != 0) & (tokens != slot)).sum())
    answer = arrays["targets"][row, n:2 * n + 1].tolist()
    counted = answer.index(2) + 1  # up to the termination symbol
    hits = sum(predictions[row, n + k] == answer[k] for k in range(counted))
    expected.setdefault(n, [0, 0])
    expected[n][0] += hits
    expected[n][1] += counted
  got = length_accuracy(source.task, SLOTS, split, predictions)
  assert got.keys() == {3, 4}
  for n, (hits, total) in expected.items():
    assert got[n] == pytest.approx(hits / total)
  results = source.split_results("valid", split, {"predictions": predictions}).metrics
  assert results["mean_accuracy"] == pytest.approx((got[3] + got[4]) / 2)
  perfect = source.split_results("valid", split, {"predictions": arrays["targets"]})
  assert perfect.metrics["mean_accuracy"] == 1.0
  assert isinstance(split, Split)


def test_encode_and_pieces():
  source = _source()
  tokens = source.encode("0 1 + 1")
  slot = SLOTS.slot(source.task)
  assert tokens.tolist() == [3, 4, 5, 4] + [slot] * 5
  assert source.pieces(tokens) == ["0", "1", "+", "1"] + ["?"] * 5
  with pytest.raises(ConfigError, match="give space-separated symbols of 0 1 \\+"):
    source.encode("0 7")


def test_constant_schedule_formula():
  schedule = optim.constant_schedule(64, 100, scale=1e-3)
  for step in (0, 49, 99, 100, 5000):
    np.testing.assert_allclose(schedule(step), 1e-3 * min(1, (step + 1) / 100), rtol=1e-6)


# --------------------------------------------------------------------------- end to end


def _protocol_config(arg="cpu", cast="slots", **train):
  """configs/chomsky.py at tiny size in `cast`, on missing_duplicate_string or, for a cast
  that cannot present it, the first task it can; the model family that learns the cast's
  targets, pooled where they are one label per sequence."""
  config = chomsky.get_config(arg)
  config.data.cast = cast
  targets = CASTS[cast].targets
  arch = next(name for name, family in sorted(ARCHS.items()) if targets in family.learns)
  config.model.update(arch=arch, num_decoder_layers=1,
                      pooling="cls" if targets is Targets.SEQUENCE_LABELS else "none")
  fields = dict(max_len=6, test_max_len=9)
  name = next(n for n in ("missing_duplicate_string", *sorted(TASKS))
              if CASTS[cast].unfit(TASKS[n](**fields)) is None)
  config.task.update(name=name, **fields)
  config.model.update(**TINY_WIDTH, num_encoder_layers=1, max_len=16, max_position=32,
                      random_positions=True, position="rotary")
  config.train.update(batch_size=8, num_steps=6, log_every=3, checkpoint_every=6,
                      warmup_steps=2, **train)
  config.eval.update(num_examples=8, batch_size=8)
  return config


@pytest.mark.parametrize("cast", sorted(CASTS))
def test_the_protocol_config_trains_end_to_end(cast, tmp_path):
  train_and_evaluate(parse(_protocol_config(cast=cast)), str(tmp_path))
  finals = {r["split"]: r for r in workdir_lib.read_metrics(str(tmp_path))
            if r["split"] != "train"}
  assert set(finals) == {"valid", "test"}
  assert [int(n) for n in finals["valid"]["accuracy_by_length"]] == list(range(1, 7))
  assert [int(n) for n in finals["test"]["accuracy_by_length"]] == [7, 8, 9]
  for record in finals.values():
    curve = list(record["accuracy_by_length"].values())
    assert record["mean_accuracy"] == pytest.approx(np.mean(curve))
    assert all(0 <= v <= 1 for v in curve)
  saved = json.load(open(os.path.join(tmp_path, "config.json")))
  assert saved["train"]["schedule"] == "constant" and saved["data"]["cast"] == cast


# --------------------------------------------------------------------------- fixed tasks


def _raw(task, cast="slots"):
  return {"seed": 0, "data": {"source": "algorithmic", "cast": cast}, "task": task,
          "model": {"arch": "encoder", "pooling": "none"}}


@pytest.mark.parametrize("name,field,new,old", [
    ("odds_first", "indexing", "0-based", "1-based"),
    ("modular_arithmetic", "even_lengths", "shorter", "blank")])
def test_a_run_saved_before_a_fix_keeps_its_meaning(name, field, new, old, tmp_path):
  """A config file without the field gets the fix; a saved config.json without it (written
  before the field existed) means what that code computed; one with it keeps its value; and
  the fixed task is another run: resuming the old one with it is refused."""
  raw = _raw({"name": name, "min_len": 1, "max_len": 6, "test_max_len": 9})
  assert getattr(parse(raw).task, field) == new
  assert getattr(parse(raw, saved=True).task, field) == old
  assert getattr(parse(_raw({**raw["task"], field: new}), saved=True).task, field) == new
  (tmp_path / "config.json").write_text(json.dumps(raw))
  assert getattr(workdir_lib.saved_config(str(tmp_path)).task, field) == old
  with pytest.raises(ConfigError, match=f"different config.task .differs in: {field}"):
    workdir_lib.check_identity(parse(raw), str(tmp_path), has_checkpoints=True)
  workdir_lib.check_identity(parse(_raw({**raw["task"], field: old})), str(tmp_path), True)


def test_modular_arithmetic_even_lengths_are_reported_at_their_length():
  """DeepMind's per-length accuracy of an even length n is over its n − 1 symbol inputs:
  the splits keep the length drawn, and the metric is keyed by it."""
  source = _source(name="modular_arithmetic", min_len=1, max_len=6, test_max_len=9,
                   eval_examples=18)
  for split in source.eval_splits().values():
    slot = SLOTS.slot(source.task)
    symbols = ((split.arrays["inputs"] != 0) & (split.arrays["inputs"] != slot)).sum(1)
    np.testing.assert_array_equal(symbols, split.lengths - (split.lengths % 2 == 0))
    got = source.split_results("", split, {"predictions": split.arrays["targets"]}).metrics
    assert list(got["accuracy_by_length"]) == sorted(set(split.lengths.tolist()))


def test_the_protocol_sweeps_cover_the_papers_grid():
  full, cpu = chomsky.get_sweep(), chomsky.get_sweep("cpu")
  # none takes no positions to randomize: plain only
  assert len(full) == len(PAPERS_PROBLEMS) * (5 * 2 + 1) * 3 * 3
  assert len(cpu) == 5 * (3 * 2 + 1) * 3
  assert {run["task.name"] for run in cpu} <= set(PAPERS_PROBLEMS)
  for arg in ("", "cpu"):
    config = chomsky.get_config(arg)
    for run in chomsky.get_sweep(arg)[:: 37]:
      variant = config_dict.ConfigDict(config.to_dict())
      for key, value in run.items():
        *path, field = key.split(".")
        node = variant
        for part in path:
          node = node[part]
        node[field] = value
      parse(variant)  # every planned run is a valid config


def test_length_curves_are_plotted_in_panels_by_task(tmp_path):
  variants = [f"task.name={t},model.position={p}" for t in ("a", "b") for p in "wxyzv"]
  assert report_plots.panels(variants) == {
      f"task.name={t}": [v for v in variants if v.startswith(f"task.name={t},")]
      for t in ("a", "b")}
  assert report_plots.panels(variants[:5]) == {"": variants[:5]}  # few: one panel
  finals = {v: [{"test": {"accuracy_by_length": {"41": 0.5 + s / 10, "42": 0.5}}}
                for s in range(3)] for v in variants}
  report_plots.plot_by_length(figures.pyplot(), str(tmp_path), finals,
                              "accuracy_by_length", 40)
  assert os.path.getsize(tmp_path / "extrapolation.png") > 0
