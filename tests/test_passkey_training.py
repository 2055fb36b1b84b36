"""Passkey rows in a language model's training batches (data/lm/passkey.py's Mix,
data.passkey.train_fraction): none at the default, the batches then bit for bit the windows
of (seed, 0, i); the expected share of passkey rows, each the prompt at L of a training key;
training keys and evaluation keys disjoint; a batch a pure function of its step (resume
exact); the field part of the run's identity, an old run's missing field meaning 0; and a
tiny model that learns to retrieve at L from them."""

import dataclasses
import json
import re

import numpy as np
import pytest

from tests.support import passkey_lm_config
from transformer.core import fields
from transformer.core.errors import ConfigError
from transformer.core.vocab import BOS_ID
from transformer.data import SourceArgs, pipeline
from transformer.data.lm import passkey
from transformer.data.lm.source import LanguageModelSource, window_batch
from transformer.run import config as config_lib
from transformer.run import workdir as workdir_lib
from transformer.run.training import train_and_evaluate

L, BATCH, SEED = 64, 16, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  directory = tmp_path_factory.mktemp("corpus")
  passkey_lm_config(directory)  # writes the corpus
  return directory


def _source(corpus, seed=SEED, **passkey_fields) -> LanguageModelSource:
  cfg = config_lib.parse(passkey_lm_config(corpus, **passkey_fields))
  source = LanguageModelSource(cfg.data, None, SourceArgs(seed, BATCH, 2, str(corpus / "wd")))
  source.load()
  return source


def _batches(source, steps) -> list[dict]:
  iterator = iter(source.train_batches())
  return [next(iterator) for _ in range(steps)]


@pytest.fixture(scope="module")
def plain(corpus):
  return _source(corpus)


@pytest.fixture(scope="module")
def mixed(corpus):
  return _source(corpus, train_fraction=0.25, examples=40, depths=3)


def test_no_mix_by_default_gives_the_windows_of_the_seed_bit_for_bit(plain, mixed):
  assert plain.mix is None and plain.data.passkey.train_fraction == 0
  stream = plain.streams["train"]
  for step, batch in enumerate(_batches(plain, 3)):
    starts = [int(np.random.default_rng([SEED, 0, step * BATCH + r]).integers(len(stream) - L))
              for r in range(BATCH)]
    expected = pipeline.unpacked(window_batch(stream, starts, L))  # whole windows
    assert batch.keys() == expected.keys()
    for k in expected:
      assert batch[k].dtype == expected[k].dtype
      np.testing.assert_array_equal(batch[k], expected[k])
  # with a mix, a row that is not a passkey row is the window it is without one
  for step, (a, b) in enumerate(zip(_batches(plain, 3), _batches(mixed, 3))):
    text = [mixed.mix.draw(step * BATCH + r) is None for r in range(BATCH)]
    assert 0 < sum(text) < BATCH
    for k in a:
      np.testing.assert_array_equal(a[k][text], b[k][text])


def test_the_share_of_passkey_rows_is_the_fraction_and_each_is_the_prompt_at_L(mixed):
  n, f = 4000, 0.25
  drawn = [mixed.mix.draw(i) for i in range(n)]
  share = np.mean([d is not None for d in drawn])
  assert abs(share - f) < 4 * np.sqrt(f * (1 - f) / n), share
  befores = [d.before for d in drawn if d is not None]
  assert min(befores) == 0 and max(befores) >= 15  # every place of the line is drawn
  batches = _batches(mixed, 8)
  template = re.compile(r"(.*)\nThe pass key is (\d+)\nRemember it\. \2 is the pass key\.\n"
                        r"(.*)\nWhat is the pass key\? The pass key is \2")
  rows = 0
  for step, batch in enumerate(batches):
    for r in range(BATCH):
      row = mixed.mix.draw(step * BATCH + r)
      if row is None:
        continue
      rows += 1
      tokens = np.concatenate([batch["inputs"][r], batch["targets"][r, -1:]])
      assert tokens.shape == (L + 1,) and tokens[0] == BOS_ID
      np.testing.assert_array_equal(batch["targets"][r][:-1], batch["inputs"][r][1:])
      assert (batch["inputs_segmentation"][r] == 1).all()
      assert (batch["targets_segmentation"][r] == 1).all()  # the whole row is scored
      np.testing.assert_array_equal(batch["inputs_positions"][r], np.arange(L))
      match = template.fullmatch(mixed.detokenize(tokens))
      assert match, mixed.detokenize(tokens)
      key = int(match.group(2))
      assert key == mixed.mix.keys[row.key] and passkey.training_keys([key])[0]
      for part in (match.group(1), match.group(3)):  # filler: the sentences, cut short
        assert f"{passkey.FILLER} {passkey.FILLER}".startswith(part), part
  assert rows >= 8


def test_training_keys_are_never_evaluation_keys(mixed, plain):
  keys = np.arange(1, 50_001)
  half = passkey.training_keys(keys)
  assert abs(half.mean() - 0.5) < 0.01
  for place in range(5):  # each half has about half the keys with digit d at each place
    digit = keys // 10 ** place % 10
    shares = [half[(digit == d) & (keys >= 10 ** place)].mean()
              for d in (range(10) if place < 4 else range(1, 5))]  # 10000..49999: 1-4
    assert 0.47 < min(shares) and max(shares) < 0.53, (place, shares)
  assert set(mixed.mix.keys) == set(keys[half])
  held_out = passkey.draw_keys(0, 2000, held_out=True)
  assert not passkey.training_keys(held_out).any()
  legacy = passkey.draw_keys(0, 2000)  # unchanged: the first draw of (seed, i)
  assert legacy == [int(np.random.default_rng([0, i]).integers(1, 50_001)) for i in range(2000)]
  assert [a for a, b in zip(held_out, legacy) if a == b] == [
      k for k in legacy if not passkey.training_keys([k])[0]]
  # the run's evaluation rows: held-out keys with a mix, the legacy keys without one
  split = mixed.passkey_splits()["len64_passkey"].arrays
  answer = split["targets_segmentation"] > 0
  evaluated = {int(mixed.detokenize(t[a]).strip()) for t, a in zip(split["targets"], answer)}
  assert len(evaluated) > 30 and not passkey.training_keys(sorted(evaluated)).any()
  assert evaluated == set(passkey.draw_keys(0, 40, held_out=True))
  trained = {int(mixed.mix.keys[d.key]) for d in map(mixed.mix.draw, range(4000)) if d}
  assert not trained & evaluated
  plain_keys = plain.passkey_splits()  # examples=0: none
  assert plain_keys == {}


def test_a_batch_is_a_function_of_its_step_so_resume_is_exact(corpus, mixed):
  uninterrupted = _batches(mixed, 6)
  iterator = iter(mixed.train_batches())
  for _ in range(4):
    next(iterator)
  state = iterator.get_state()
  fresh = _source(corpus, train_fraction=0.25, examples=40, depths=3)  # a new process
  resumed = iter(fresh.train_batches())
  resumed.set_state(state)
  for step in (4, 5):
    batch = next(resumed)
    for k in batch:
      np.testing.assert_array_equal(batch[k], uninterrupted[step][k])
  other = _batches(_source(corpus, seed=SEED + 1, train_fraction=0.25), 1)[0]
  assert not np.array_equal(other["inputs"], uninterrupted[0]["inputs"])


def test_the_fraction_is_identity_and_a_run_without_it_had_none(corpus, tmp_path):
  cfg = config_lib.parse(passkey_lm_config(corpus, train_fraction=0.5))
  assert fields.identity(cfg)["data.passkey.train_fraction"] == 0.5
  assert "data.passkey.examples" not in fields.identity(cfg)  # still an execution field
  workdir = tmp_path / "old"
  workdir.mkdir()
  raw = passkey_lm_config(corpus, examples=2)  # as an old run saved it: no train_fraction
  (workdir / workdir_lib.CONFIG_FILE).write_text(json.dumps(raw))
  old = workdir_lib.saved_config(str(workdir))
  assert old.data.passkey.train_fraction == 0.0
  workdir_lib.check_identity(config_lib.parse(raw), str(workdir), has_checkpoints=True)
  with pytest.raises(ConfigError, match=r"config.data \(differs in: passkey.train_fraction\)"):
    workdir_lib.check_identity(cfg, str(workdir), has_checkpoints=True)
  for bad in (1.0, -0.1, 1.5):
    with pytest.raises(ConfigError, match=r"train_fraction=.* it must be in \[0, 1\)"):
      config_lib.parse(passkey_lm_config(corpus, train_fraction=bad))


def test_a_training_row_longer_than_L_is_refused(corpus):
  cfg = config_lib.parse(passkey_lm_config(corpus, train_fraction=0.5))
  short = dataclasses.replace(cfg.data, max_len=40)
  source = LanguageModelSource(short, None, SourceArgs(0, BATCH, 2, str(corpus / "wd")))
  with pytest.raises(ConfigError, match=r"a passkey training row takes at least \d+ tokens .* "
                                        r"window of 40 .*train_fraction=0"):
    source.load()
  assert passkey.STREAM != 0  # source.py's windows are stream 0


def test_a_tiny_model_learns_to_retrieve_held_out_keys_at_L(corpus, tmp_path):
  """d 64, 4 heads, 2 layers, 450 steps of 32 rows, 90% of them passkey rows: it retrieves
  held-out keys at L (1.0, 0.93 and 0.92 of 60 rows for seeds 0, 1, 2; ~35 s here); a
  run without the mix at configs/lm_context.py's size retrieved none of 50."""
  raw = passkey_lm_config(corpus, train_fraction=0.9, examples=20, depths=3)
  raw["train"].update(schedule="constant", learning_rate=3e-3, warmup_steps=50,
                      num_steps=450, batch_size=32, log_every=450, checkpoint_every=450)
  raw["model"].update(position="rotary", num_decoder_layers=2, d_model=64, d_ff=128,
                      num_heads=4)
  workdir = str(tmp_path / "run")
  assert train_and_evaluate(config_lib.parse(raw), workdir) == 450
  final = {r["split"]: r for r in workdir_lib.read_metrics(workdir) if r["split"] != "train"}
  assert final["len64_passkey"]["exact_match"] >= 0.5, final["len64_passkey"]
  assert final["len64_passkey"]["examples"] == 60
