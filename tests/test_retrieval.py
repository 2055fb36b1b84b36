"""Retrieval evaluations of the decoder-only family: passkey retrieval (data/lm/passkey.py, the
LM source's lenW_passkey splits) and MQAR (data/lm/mqar.py, a data source). The generators
against direct computations; metrics that score a model given the answer 1.0 and a random
one near chance; greedy retrieval from one teacher-forced pass = KV-cached greedy decoding;
a tiny model trained and evaluated end to end, its metrics in the report's table, grid and
heatmap."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from tests.support import make_tiny_config, passkey_lm_config
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.core.vocab import BOS_ID, EOS_ID, NUM_RESERVED
from transformer.data import SourceArgs
from transformer.data.lm import mqar, passkey
from transformer.data.base import Split
from transformer.data.lm.mqar import MQARData, MQARSource
from transformer.model.decoding import generate
from transformer.run import config as config_lib
from transformer.run import restored_run
from transformer.run import workdir as workdir_lib
from transformer.run.training import train_and_evaluate
from transformer.study import compare, report_grids

# --------------------------------------------------------------------------- passkey


def _words(text: str) -> list[int]:
  """A toy tokenizer: a token per character, the space before a word its first (as a
  sentencepiece model's "▁"), so segments at word boundaries encode as the whole text."""
  return [100 + (ord(c) % 50) for c in " " + " ".join(text.split())]


PHRASES = passkey.Phrases.encode(_words, 400)


@pytest.mark.parametrize("length", [120, 200, 400])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_key_is_where_the_depth_says_in_filler_of_the_exact_length(length, depth):
  for key in (_words("7"), _words("48213")):
    tokens, start = passkey.prompt(PHRASES, key, length, depth)
    assert len(tokens) == length + 1
    fixed = (1 + 4 + len(_words(passkey.HEAD)) + len(_words(passkey.REMEMBER))
             + len(_words(passkey.TAIL)) + len(_words(passkey.QUESTION)) + 3 * len(key))
    filler = length + 1 - fixed
    before = int(np.floor(depth * filler + 0.5))
    expected = ([BOS_ID] + PHRASES.filler[:before] + [EOS_ID] + _words(passkey.HEAD) + key
                + [EOS_ID] + _words(passkey.REMEMBER) + key + _words(passkey.TAIL) + [EOS_ID]
                + PHRASES.filler[:filler - before] + [EOS_ID] + _words(passkey.QUESTION) + key)
    assert tokens.tolist() == expected
    assert start == 1 + before + 1 and tokens[start:start + 4].tolist() == _words("The")
    # the filler is the sentences repeated, exactly `filler` tokens of them in all
    assert PHRASES.filler[:len(_words(passkey.FILLER))] == _words(passkey.FILLER)
    assert (tokens == EOS_ID).sum() == 4


def test_passkey_rows_score_only_the_answer_and_depend_only_on_the_seed():
  keys = passkey.draw_keys(3, 4)
  assert keys == passkey.draw_keys(3, 4) and keys != passkey.draw_keys(4, 4)
  assert keys[:2] == passkey.draw_keys(3, 2)  # key i is a function of (seed, i) alone
  assert all(1 <= k <= 50_000 for k in passkey.draw_keys(0, 200))
  encoded = [_words(str(k)) for k in keys]
  depths = passkey.Passkey(examples=4, depths=3).depth_values
  assert depths == [0.0, 0.5, 1.0]
  arrays = passkey.rows(PHRASES, encoded, 160, depths)
  assert arrays["inputs"].shape == (12, 160)
  for d, depth in enumerate(depths):
    for i, key in enumerate(encoded):
      row = d * 4 + i
      tokens, _ = passkey.prompt(PHRASES, key, 160, depth)
      np.testing.assert_array_equal(arrays["inputs"][row], tokens[:-1])
      np.testing.assert_array_equal(arrays["targets"][row], tokens[1:])
      scored = arrays["targets_segmentation"][row] > 0
      assert scored.sum() == len(key) and scored[-len(key):].all()
      assert arrays["targets"][row][scored].tolist() == key


def test_a_prompt_longer_than_the_window_is_refused():
  with pytest.raises(ConfigError, match="passkey prompt takes .* tokens .* data.passkey"):
    passkey.prompt(PHRASES, _words("12345"), 40, 0.5)
  with pytest.raises(FieldError, match="depths=1"):
    passkey.Passkey(examples=1, depths=1)


def _induction(inputs: np.ndarray, order: int = 8) -> np.ndarray:
  """A copying model that reads only the inputs: at each position, the token that followed
  the last earlier occurrence of the `order` tokens ending there (0 if none): an induction
  head, the mechanism passkey retrieval asks for."""
  out = np.zeros_like(inputs)
  for r, row in enumerate(inputs.tolist()):
    for t in range(order - 1, len(row)):
      context = row[t - order + 1:t + 1]
      for s in range(t - 1, order - 2, -1):
        if row[s - order + 1:s + 1] == context:
          out[r, t] = row[s + 1]
          break
  return out


def test_passkey_metric_is_one_for_a_copying_model_and_near_zero_at_random():
  depths = [0.0, 0.5, 1.0]
  arrays = passkey.rows(PHRASES, [_words(str(k)) for k in passkey.draw_keys(0, 5)], 200,
                        depths)
  copied = passkey.results(200, depths, arrays, _induction(arrays["inputs"]))
  assert copied == {"exact_match": 1.0, passkey.GRID: {200: {"0": 1.0, "0.5": 1.0, "1": 1.0}}}
  rng = np.random.default_rng(0)
  guessed = passkey.results(200, depths, arrays, rng.integers(100, 150, arrays["inputs"].shape))
  assert guessed["exact_match"] == 0.0  # chance: 50^-(key tokens) per key
  # one wrong answer token at depth 0.5 only: that cell alone falls, by the right amount
  wrong = arrays["targets"].copy()
  wrong[5, -1] += 1
  assert passkey.results(200, depths, arrays, wrong)[passkey.GRID] == {
      200: {"0": 1.0, "0.5": 0.8, "1": 1.0}}


# --------------------------------------------------------------------------- MQAR


def test_mqar_sequences_as_zoology_writes_them():
  for seed in range(20):
    inputs, targets, scored = mqar.sequence(np.random.default_rng(seed), 64, 6, 40, 0.01)
    keys, values = inputs[0:12:2], inputs[1:12:2]
    assert len(set(keys)) == 6 and (keys < 20).all()
    assert len(set(values)) == 6 and ((values >= 20) & (values < 40)).all()
    queries = np.flatnonzero(scored)
    assert len(queries) == 6 and (queries >= 12).all() and ((queries - 12) % 2 == 0).all()
    assert sorted(inputs[queries]) == sorted(keys)  # each key asked once
    lookup = dict(zip(keys.tolist(), values.tolist()))
    assert [targets[q] for q in queries] == [lookup[inputs[q]] for q in queries]
    assert (targets[~scored] == 0).all() and (inputs >= 0).all() and (inputs < 40).all()
    again = mqar.sequence(np.random.default_rng(seed), 64, 6, 40, 0.01)
    for a, b in zip((inputs, targets, scored), again):
      np.testing.assert_array_equal(a, b)


def test_mqar_query_gaps_follow_the_power_law():
  space, a = 6, 0.3
  gaps = [(np.flatnonzero(mqar.sequence(np.random.default_rng(i), 2 + 2 * space, 1, 8, a)[2])[0]
           - 2) // 2 for i in range(3000)]
  p = np.arange(1, space + 1) ** (a - 1.0)
  p /= p.sum()
  counts = np.bincount(gaps, minlength=space)
  np.testing.assert_allclose(counts / 3000, p, atol=4 * np.sqrt(p * (1 - p) / 3000).max())


def test_mqar_fields_and_the_evaluation_grid():
  data = MQARData(vocab_size=64, max_len=32, num_kv_pairs=2, max_factor=4)
  assert data.eval_lengths == [32, 64, 128]
  assert [data.eval_pairs(w) for w in data.eval_lengths] == [[2, 4, 8], [2, 4, 8, 16],
                                                             [2, 4, 8, 16, 32]]
  assert MQARData(vocab_size=8, max_len=64, num_kv_pairs=2).eval_pairs(64) == [2, 4]
  for bad, match in [(dict(num_kv_pairs=17), "num_kv_pairs=17.*max_len/4 = 16"),
                     (dict(vocab_size=7), "vocab_size=7.*even"),
                     (dict(max_len=31, num_kv_pairs=2), "max_len=31.*even"),
                     (dict(vocab_size=6), "num_kv_pairs=4.*vocab_size/2 = 3"),
                     (dict(max_factor=3), "max_factor=3.*power of 2"),
                     (dict(power_a=0.0), "power_a=0.0")]:
    with pytest.raises(FieldError, match=match):
      MQARData(**bad)


def _recall(inputs: np.ndarray, pairs: int) -> np.ndarray:
  """The answer by rule from the inputs alone: each key's value from the pairs (0 else)."""
  out = np.zeros_like(inputs)
  for r, row in enumerate(inputs):
    lookup = dict(zip(row[0:2 * pairs:2].tolist(), row[1:2 * pairs:2].tolist()))
    out[r] = [lookup.get(x, 0) for x in row.tolist()]
  return out


def test_mqar_metrics_are_one_given_the_answer_and_chance_at_random():
  source = MQARSource(MQARData(vocab_size=64, max_len=32, num_kv_pairs=2, max_factor=2), None,
                      SourceArgs(seed=0, batch_size=8, eval_examples=40))
  splits = source.eval_splits()
  assert list(splits) == ["valid", "len32", "len64"]
  split = splits["len64"]
  pairs = np.repeat([2, 4, 8, 16], 40)  # the rows, grouped by their number of pairs
  recalled = np.concatenate([_recall(split.arrays["inputs"][pairs == p], p) for p in (2, 4, 8,
                                                                                      16)])
  got = source.split_results("len64", split, {"predictions": recalled}).metrics
  assert got == {"accuracy_by_length": {64: 1.0},
                 mqar.GRID: {64: {"2": 1.0, "4": 1.0, "8": 1.0, "16": 1.0}}}
  rng = np.random.default_rng(0)  # a value at random: chance is 1/32
  guessed = rng.integers(NUM_RESERVED + 32, NUM_RESERVED + 64, split.arrays["inputs"].shape)
  grid = source.split_results("len64", split, {"predictions": guessed}).metrics[mqar.GRID][64]
  for p, accuracy in grid.items():
    n = 40 * int(p)
    assert abs(accuracy - 1 / 32) < 4 * np.sqrt(1 / 32 * (31 / 32) / n) + 1e-9, (p, accuracy)
  assert source.split_results("valid", splits["valid"], {"predictions": guessed[:40]}
                              ).metrics == {}  # loss and accuracy alone (the evaluator's)
  again = source.eval_splits()  # held-out rows: the same, whatever the seed
  other = MQARSource(source.data, None, SourceArgs(seed=5, batch_size=8, eval_examples=40))
  for name in splits:
    np.testing.assert_array_equal(again[name].arrays["inputs"], splits[name].arrays["inputs"])
    np.testing.assert_array_equal(other.eval_splits()[name].arrays["targets"],
                                  splits[name].arrays["targets"])


# --------------------------------------------------------------------------- end to end

def _lm_config(directory: pathlib.Path, **passkey_fields):
  """A tiny language model on a corpus whose vocabulary writes the prompt's words whole."""
  return config_lib.parse(passkey_lm_config(directory, **passkey_fields))


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  """A tiny LM trained 2 steps with passkey evaluation on: its workdir."""
  directory = tmp_path_factory.mktemp("passkey")
  cfg = _lm_config(directory, examples=2, depths=3)
  workdir = str(directory / "run")
  assert train_and_evaluate(cfg, workdir) == 2
  return workdir


def test_passkey_splits_in_the_run_evaluation_and_the_report(lm_run, tmp_path):
  final = {r["split"]: r for r in workdir_lib.read_metrics(lm_run) if r["split"] != "train"}
  assert set(final) == {"len64", "len128", "len128_sliding", "len64_passkey",
                        "len128_passkey"}
  for w in (64, 128):
    m = final[f"len{w}_passkey"]
    assert m["examples"] == 6 and 0.0 <= m["exact_match"] <= 1.0
    assert m[passkey.GRID] == {str(w): {"0": m[passkey.GRID][str(w)]["0"],
                                        "0.5": m[passkey.GRID][str(w)]["0.5"],
                                        "1": m[passkey.GRID][str(w)]["1"]}}
  # eval.py --config.data.passkey.examples=1 --config.data.passkey.depths=2: the same run
  run = restored_run.restore_run(lm_run, override={"data.passkey.examples": "1",
                                                 "data.passkey.depths": "2"})
  _, results, output = restored_run.evaluate_run(run)
  assert results["len128_passkey"]["examples"] == 2 and output.endswith(
      "eval_step_2,passkey.depths=2,passkey.examples=1.json")
  assert results["len128_passkey"][passkey.GRID].keys() == {128}
  assert set(results["len128_passkey"][passkey.GRID][128]) == {"0", "1"}

  out = tmp_path / "report"
  md = compare.compare([lm_run], str(out))
  header = md.split("\n| variant |", 1)[1].split("\n", 1)[0]
  columns = [c.strip() for c in header.split("|")]
  assert columns.index("len64/perplexity") < columns.index("len64_passkey/exact_match") < \
      columns.index("len128/perplexity") < columns.index("len128_passkey/exact_match") < \
      columns.index("len128_sliding/perplexity")  # by length, beside perplexity
  grid = md.split(f"(`{passkey.GRID}`)\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
  assert grid[0].split("|")[2:6] == [" evaluation length (tokens) ", " 0 ", " 0.5 ", " 1 "]
  cells = {row.split("|")[2].strip(): [c.strip() for c in row.split("|")[3:6]]
           for row in grid[2:]}
  assert cells == {str(w): [f"{final[f'len{w}_passkey'][passkey.GRID][str(w)][d]:.4f}"
                            for d in ("0", "0.5", "1")] for w in (64, 128)}
  assert (out / f"{passkey.GRID}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_greedy_retrieval_from_one_pass_is_greedy_decoding(lm_run):
  run = restored_run.restore_run(lm_run)
  exp = run.experiment
  arrays = exp.source.passkey_splits()["len64_passkey"].arrays
  model = nnx.merge(exp.graphdef, run.params)
  answer = arrays["targets_segmentation"] > 0
  lengths = 65 - answer.sum(1)  # the prompt: the row's tokens before the key's
  tokens, _ = generate(model, arrays["inputs"], lengths, 65)
  tokens = np.asarray(tokens)
  greedy = [t[n:] for t, n in zip(tokens, lengths)]

  def teacher_forced(inputs, targets):
    batch = {**arrays, "inputs": inputs, "targets": targets}
    predictions = np.asarray(jax.numpy.argmax(model(batch), axis=-1))
    return predictions, passkey.retrieved(predictions, targets, answer)

  predictions, hit = teacher_forced(arrays["inputs"], arrays["targets"])
  keys = [t[a] for t, a in zip(arrays["targets"], answer)]
  assert hit.tolist() == [list(g) == list(k) for g, k in zip(greedy, keys)]
  assert [p[a][0] for p, a in zip(predictions, answer)] == [g[0] for g in greedy]
  # rows whose answer is the model's own greedy continuation: retrieved, every one
  inputs, targets = tokens[:, :64].copy(), tokens[:, 1:65].copy()
  assert teacher_forced(inputs, targets)[1].all()


def test_mqar_trains_evaluates_and_reports_by_length_and_pairs(tmp_path):
  raw = make_tiny_config(**{"train.num_steps": 2, "train.log_every": 1,
                            "train.checkpoint_every": 2, "eval.num_examples": 4,
                            "eval.batch_size": 8, "train.batch_size": 4,
                            "model.max_len": 32}).to_dict()
  raw["data"] = dict(source="mqar", vocab_size=16, max_len=16, num_kv_pairs=2, max_factor=2)
  raw["model"].update(arch="decoder")
  raw.pop("task", None)
  workdir = str(tmp_path / "run")
  train_and_evaluate(config_lib.parse(raw), workdir)
  results = {r["split"]: r for r in workdir_lib.read_metrics(workdir) if r["split"] != "train"}
  assert list(results) == ["valid", "len16", "len32"]
  assert results["len32"]["examples"] == 4 * 3  # pairs 2, 4, 8
  assert set(results["len32"][mqar.GRID]["32"]) == {"2", "4", "8"}
  assert results["len32"]["accuracy_by_length"] == {"32": results["len32"][mqar.GRID]["32"]["2"]}
  out = tmp_path / "report"
  md = compare.compare([workdir], str(out))
  assert "valid/accuracy" in md.split("\n| variant |", 1)[1].split("\n", 1)[0]
  assert "## MQAR accuracy by sequence length (tokens) × key-value pairs" in md
  for picture in ("extrapolation.png", f"{mqar.GRID}.png"):
    assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_grid_is_the_mean_over_seeds(tmp_path):
  """Grids from several runs' records (as a sweep's): each cell the mean over the runs
  that have it; a run without the grid adds nothing."""
  finals = {"a": [{"len64_passkey": {passkey.GRID: {"64": {"0": 1.0, "1": 0.5}}},
                   "len128_passkey": {passkey.GRID: {"128": {"0": 0.5, "1": 0.0}}}},
                  {"len64_passkey": {passkey.GRID: {"64": {"0": 0.0, "1": 0.5}}}}],
            "b": [{"len64": {"perplexity": 3.0}}]}
  rows, columns, table = report_grids.means(finals["a"], passkey.GRID)
  assert (rows, columns) == (["64", "128"], ["0", "1"])
  np.testing.assert_array_equal(table, [[0.5, 0.5], [0.5, 0.0]])
  lines = report_grids.markdown(finals)
  assert lines[-2:] == ["| a | 64 | 0.5000 | 0.5000 |", "| a | 128 | 0.5000 | 0.0000 |"]
  assert report_grids.plot(str(tmp_path), finals) == [f"{passkey.GRID}.png"]
  assert os.path.getsize(tmp_path / f"{passkey.GRID}.png") > 0
  assert report_grids.markdown({"b": finals["b"]}) == []
  assert json.dumps(lines)  # plain text
