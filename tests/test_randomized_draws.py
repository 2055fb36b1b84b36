"""Randomized positions drawn as Ruoss et al.'s code draws them (model.random_positions_draw=
per_batch, positions/randomized.py) against direct re-implementations of that code's
semantics (google-deepmind/randomized_positional_encodings, models/positional_encodings.py
and models/transformer.py, written here from reading it):

  * noisy positions: jrandom.choice(key, arange(L), (n,), replace=False), sorted;
  * noisy relative distances: choice(arange(1, L), (n - 1,), replace=False), sorted, mirrored
    to the left (randomize_both_sides=False); noisy ALiBi lays them out as
    [dummy, −d reversed + 0.5, 0, −d] and relative-shifts the row: bias(i, j) = that row at
    n + j − i, times the head's slope;
  * one key per batch (all rows), a fresh one per attention layer (rotary, ALiBi, relative)
    and one for the embedding (sinusoidal, learned).

Also: the stack's draws per layer and per batch (and per_row's, once per row; the same
inside scan_layers and remat), evaluation
draws from a key the caller sets (afresh per batch, the same every time), per_batch in the
kernels (the Pallas kernel refuses a gathered bias), and runs saved before the settings
keeping their meaning."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from tests.support import TINY_MODEL
from transformer.core.errors import ConfigError
from transformer.model.blocks import EncoderLayer
from transformer.model.config import ModelConfig
from transformer.model.kernels.capabilities import Needs
from transformer.model.kernels.choice import check
from transformer.model.masks import Mask
from transformer.model.positions import (ALiBi, Kerple, T5Bias, alibi_slopes,
                                         relative_position_bucket)
from transformer.model.positions.randomized import (AtSampledOffsets, PerBatch, batch_offsets,
                                                    batch_positions, sample_positions)
from transformer.model.scores import make_score
from transformer.model.stack import Stack
from transformer.run import experiment
from transformer.run import workdir as workdir_lib
from transformer.run.config import parse
from transformer.run.evaluator import Evaluator

L = 9  # positions drawn from [0, L): small enough to count every subset


# --------------------------------------------------------------------------- their sampler


def their_positions(rng: np.random.Generator, n: int, max_position: int) -> np.ndarray:
  """noisy_fixed_positional_encodings' indexes: n of arange(max_position) without
  replacement, sorted."""
  return np.sort(rng.choice(np.arange(max_position), size=n, replace=False))


def their_distances(rng: np.random.Generator, n: int, max_position: int) -> np.ndarray:
  """The right-hand distances of their noisy relative encodings and noisy ALiBi: n − 1 of
  arange(1, max_position) without replacement, sorted."""
  return np.sort(rng.choice(np.arange(1, max_position), size=n - 1, replace=False))


def their_noisy_alibi(distances: np.ndarray, num_heads: int) -> np.ndarray:
  """compute_noisy_alibi_encodings_biases for n = len(distances) + 1 queries and keys and
  those sampled distances, randomize_both_sides=False: [h, n, n]."""
  n = len(distances) + 1
  symmetric = -np.sort(distances)  # −d_1, −d_2, ... (their −sort)
  right = symmetric[:n - 1]
  left = np.flip(symmetric)[:n - 1] + 0.5  # keys before the query: +0.5
  row = np.concatenate([[np.nan], left, [0.0], right])  # [2n]; entry 0 is never read
  # relative_shift (their _rel_shift_inner): output[i, j] = input[i, n + j − i]
  alibi = np.array([[row[n + j - i] for j in range(n)] for i in range(n)])
  start = 2.0 ** (-8.0 / num_heads)
  return alibi * np.array([start ** (h + 1) for h in range(num_heads)])[:, None, None]


def _subset_counts(samples: np.ndarray, values: np.ndarray) -> np.ndarray:
  """Counts of each distinct sorted sample (rows of `samples`) over the sorted rows `values`."""
  index = {tuple(v): i for i, v in enumerate(values)}
  return np.bincount([index[tuple(s)] for s in samples], minlength=len(values))


def _same_distribution(ours: np.ndarray, theirs: np.ndarray) -> float:
  """p-value of a chi-square test that two sets of sorted samples [draws, n] come from one
  distribution (a contingency table over the subsets either drew)."""
  values = np.unique(np.concatenate([ours, theirs]), axis=0)
  table = np.stack([_subset_counts(ours, values), _subset_counts(theirs, values)])
  return stats.chi2_contingency(table).pvalue


DRAWS = 6000


def _ours(fn, n):
  keys = jax.random.split(jax.random.key(11), DRAWS)
  return np.asarray(jax.vmap(fn)(keys)).reshape(DRAWS, -1)[:, :n]


@pytest.mark.parametrize("n", [2, 4])
def test_positions_drawn_per_batch_are_distributed_as_theirs(n):
  """A row of n tokens gets a sample distributed as their sorted choice (chi-square over the
  C(9, n) subsets, which rejects a near miss: sorted iid draws spread apart)."""
  row = jnp.arange(n)[None]
  ours = _ours(lambda k: batch_positions(k, row, jnp.ones_like(row), L), n)
  rng = np.random.default_rng(0)
  theirs = np.stack([their_positions(rng, n, L) for _ in range(DRAWS)])
  assert _same_distribution(ours, theirs) > 1e-3
  spread = np.sort(rng.integers(0, L - n + 1, (DRAWS, n)), axis=1) + np.arange(n)
  assert _same_distribution(spread, theirs) < 1e-6


@pytest.mark.parametrize("n", [3, 5])
def test_offsets_drawn_per_batch_are_distributed_as_theirs(n):
  """The sampled distances d_1 < ... < d_{n−1} of [1, L), d_0 = 0, as their choice."""
  ours = _ours(lambda k: batch_offsets(k, jnp.array([n]), n, L), n)
  assert np.all(ours[:, 0] == 0) and np.all(np.diff(ours, axis=1) > 0) and ours.max() < L
  rng = np.random.default_rng(1)
  theirs = np.stack([their_distances(rng, n, L) for _ in range(DRAWS)])
  assert _same_distribution(ours[:, 1:], theirs) > 1e-3


def test_one_draw_serves_the_batch():
  """Rows (and packed segments) of one length share their positions; a shorter one reads the
  same permutation's first entries (a subset of the longer's); padding is 0."""
  segments = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 2, 2, 2]])
  positions = jnp.array([[0, 1, 2, 3, 0], [0, 1, 2, 3, 0], [0, 1, 0, 1, 2]])
  drawn = np.asarray(batch_positions(jax.random.key(3), positions, segments, 64))
  np.testing.assert_array_equal(drawn[0], drawn[1])
  assert drawn[0, 4] == 0 and np.all(np.diff(drawn[0, :4]) > 0)
  assert set(drawn[2, :2]) < set(drawn[0, :4]) and set(drawn[2, 2:]) < set(drawn[0, :4])
  tables = np.asarray(batch_offsets(jax.random.key(3), jnp.array([4, 2]), 4, 64))
  assert set(tables[1, :2]) < set(tables[0])  # the row of 2 reads d_1 of the same draw
  assert tables[1, 2] >= 64 and tables[1, 3] >= 64  # past its length: never read


# --------------------------------------------------------------------------- relative encodings


def _at_offsets(encoding, n, key=jax.random.key(5), max_position=40):
  table = batch_offsets(key, jnp.array([n]), n, max_position)
  view = AtSampledOffsets(encoding, table)
  pos = jnp.arange(n)[None]
  return np.asarray(view.bias(pos, pos))[0], np.asarray(table)[0]


@pytest.mark.parametrize("heads", [2, 8])
def test_alibi_at_sampled_offsets_is_their_noisy_alibi(heads):
  bias, table = _at_offsets(ALiBi(16, heads, 0), 7)
  np.testing.assert_allclose(bias, their_noisy_alibi(table[1:], heads), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple"])
def test_a_relative_bias_at_sampled_offsets_is_a_function_of_j_minus_i(name):
  """Their noisy relative encodings' property: constant along every diagonal, and the
  encoding's formula at the signed sampled distance sign(j − i)·d_|j−i|; at positions drawn
  per row (per_row) the bias reads |p_i − p_j| and is not constant along diagonals."""
  encoding = {"alibi": ALiBi(16, 2, 0),
              "t5": T5Bias(16, 2, 0, settings=T5Bias.Settings(num_buckets=8, max_distance=12),
                           rngs=nnx.Rngs(0)),
              "kerple": Kerple(16, 2, 0, rngs=nnx.Rngs(0))}[name]
  n = 6
  bias, d = _at_offsets(encoding, n)
  i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
  for k in range(-n + 1, n):
    diagonal = bias[:, i - j == k]
    np.testing.assert_allclose(diagonal, diagonal[:, :1].repeat(diagonal.shape[1], 1),
                               rtol=1e-6)
  signed = np.sign(j - i) * d[np.abs(j - i)]
  if name == "alibi":
    slopes = np.array(alibi_slopes(2))[:, None, None]
    expected = -slopes * (np.abs(signed) - 0.5 * (signed < 0))
  elif name == "t5":
    buckets = np.asarray(relative_position_bucket(jnp.asarray(signed), bidirectional=True,
                                                  num_buckets=8, max_distance=12))
    expected = np.moveaxis(np.asarray(encoding.table[...])[buckets], -1, 0)
  else:
    r1, r2 = (np.exp(np.asarray(p[...]))[:, None, None] for p in (encoding.log_r1,
                                                                  encoding.log_r2))
    expected = -r1 * np.log1p(r2 * np.abs(signed))
  np.testing.assert_allclose(bias, expected, rtol=1e-5, atol=1e-6)
  drawn = sample_positions(jax.random.key(5), jnp.arange(n)[None], jnp.ones((1, n)), 40)
  per_row = np.asarray(encoding.bias(drawn, drawn))[0]
  assert not np.allclose(per_row[:, 1, 0], per_row[:, 2, 1])


def test_a_kernel_evaluating_biases_in_kernel_refuses_sampled_offsets():
  scorer = make_score("scaled_dot", 2, 8, rngs=nnx.Rngs(0))
  view = PerBatch(64).declared(ALiBi(16, 2, 0))
  needs = Needs.of(scorer, view, position="alibi")
  with pytest.raises(ConfigError, match="attention.kernel 'pallas' evaluates positional biases "
                                        "in-kernel from positions, and position 'alibi' with "
                                        "model.random_positions_draw=per_batch reads"):
    check("pallas", needs)
  for name in ("reference", "xla", "blockwise"):
    check(name, needs)
  check("pallas", Needs.of(scorer, ALiBi(16, 2, 0), position="alibi"))  # at positions: in-kernel


# --------------------------------------------------------------------------- the stack


class Recording(EncoderLayer):
  """A layer that only records the mask and encoding it is handed."""

  seen: list = []

  def __call__(self, x, mask, encoding, rngs, **cross):
    Recording.seen.append((np.asarray(mask.q_positions), encoding))
    return x


class CausalRecording(Recording):
  causal = True


# 3 layers a stack: per_batch draws each layer's positions
TINY = {**TINY_MODEL, "num_encoder_layers": 3, "num_decoder_layers": 3, "max_len": 8}
SEG = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
POS = jnp.array([[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 0, 0]])


def _layers_seen(position, draw, rngs=None, layer=Recording, key=None, seg=SEG, pos=POS):
  """(each layer's (positions, encoding), the embedding's positions) of one stack call."""
  cfg = ModelConfig(**TINY, position=position, random_positions=True, max_position=50,
                    random_positions_draw=draw)
  stack = Stack(cfg, layer, 3, rngs=nnx.Rngs(0))
  if key is not None:
    stack.random.draw_from(key)
  embedded = []
  embed = stack.position.embed
  stack.position.embed = lambda x, p: embedded.append(np.asarray(p)) or embed(x, p)
  Recording.seen = []
  stack(jnp.zeros((3, 6, 16)), Mask(seg, seg, pos, pos, causal=layer.causal), rngs)
  return Recording.seen, embedded[0]


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_per_batch_draws_once_per_batch_and_afresh_per_layer(position):
  seen, embedded = _layers_seen(position, "per_batch", nnx.Rngs(dropout=1))
  layers = [p for p, _ in seen]
  for p in [embedded, *layers]:
    np.testing.assert_array_equal(p[0], p[1])  # rows of one length: one draw
    assert set(p[2, :3]) < set(p[0, :5]) and np.all(np.diff(p[0, :5]) > 0)
  draws = {tuple(p[0]) for p in [embedded, *layers]}
  assert len(draws) == 4  # the embedding's and each layer's: four draws


def test_per_batch_relative_encodings_read_fresh_offsets_per_layer():
  seen, _ = _layers_seen("alibi", "per_batch", nnx.Rngs(dropout=1))
  tables = [np.asarray(e.table) for _, e in seen]
  for positions, encoding in seen:
    assert isinstance(encoding, AtSampledOffsets)
    np.testing.assert_array_equal(positions, POS)  # the mask keeps positions 0..n-1
  assert len({t[0, :5].tobytes() for t in tables}) == 3
  assert [t[:, :3].tolist() for t in tables] == [t[:, :3].tolist() for t in tables]
  np.testing.assert_array_equal(tables[0][0, :5], tables[0][1, :5])


def test_per_row_draws_each_row_once_for_every_layer():
  seen, embedded = _layers_seen("rotary", "per_row", nnx.Rngs(dropout=1))
  for positions, _ in seen:
    np.testing.assert_array_equal(positions, embedded)
  assert not np.array_equal(embedded[0], embedded[1])  # each row its own draw


def test_evaluation_draws_from_the_key_its_caller_sets():
  """Without rngs: per_batch from the key draw_from set (the evaluator's, one per batch;
  none: key 0), the same key the same draw; per_row from key 0 whatever key is set."""
  first = lambda draw, key: _layers_seen("rotary", draw, key=key)[0][0][0]  # noqa: E731
  k3, k4 = jax.random.key(3), jax.random.key(4)
  np.testing.assert_array_equal(first("per_batch", k3), first("per_batch", k3))
  assert not np.array_equal(first("per_batch", k3), first("per_batch", k4))
  assert not np.array_equal(first("per_batch", k3), first("per_batch", None))
  np.testing.assert_array_equal(first("per_row", k3), first("per_row", k4))
  np.testing.assert_array_equal(first("per_row", k3), first("per_row", None))


@pytest.mark.parametrize("position", ["rotary", "alibi"])
def test_cached_decoding_draws_the_full_pass_positions_of_its_slots(position):
  """A decoding step (keys: the 6 cache slots) maps its positions per layer as a full pass of
  6 tokens does, in every layer."""
  six = jnp.broadcast_to(jnp.arange(6), (3, 6))
  full, _ = _layers_seen(position, "per_batch", layer=CausalRecording, seg=jnp.ones_like(six),
                         pos=six)
  cfg = ModelConfig(**TINY, position=position, random_positions=True, max_position=50)
  stack = Stack(cfg, CausalRecording, 3, rngs=nnx.Rngs(0))
  slots = stack.slot_positions(3, 6)
  Recording.seen = []
  step = Mask(jnp.ones((3, 1)), jnp.ones((3, 6)), slots[:, 2:3], slots, causal=True)
  stack(jnp.zeros((3, 1, 16)), step, None, cached=True)
  for (p_full, e_full), (p_step, e_step) in zip(full, Recording.seen, strict=True):
    if position == "alibi":
      np.testing.assert_array_equal(np.asarray(e_step.table)[0], np.asarray(e_full.table)[0])
    else:
      np.testing.assert_array_equal(p_step[:, 0], p_full[0, 2])


def test_training_draws_from_the_steps_key():
  """A call with rngs draws from their dropout stream (the train step's key, folded from
  seed and step): the same key, the same draws; another key, others."""
  first = lambda seed: _layers_seen("rotary", "per_batch", nnx.Rngs(dropout=seed))[1]  # noqa: E731
  np.testing.assert_array_equal(first(5), first(5))
  assert not np.array_equal(first(5), first(6))


# --------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize("draw", ["per_batch", "per_row"])
def test_an_evaluation_draws_afresh_per_batch_and_the_same_every_time(draw, tiny_config):
  """Two batches of the same rows: per_batch draws each its own positions (their losses
  differ) from the batch's key, the same in every evaluation; per_row one fixed draw (runs
  saved before the setting evaluate as they did)."""
  config = tiny_config(**{"model.random_positions": True, "model.max_position": 24,
                          "model.position": "rotary", "model.random_positions_draw": draw,
                          "eval.batch_size": 8})
  exp = experiment.build(parse(config))
  params = jax.jit(exp.init)()["params"]
  arrays = exp.source.eval_splits()["valid"].arrays
  twice = {key: np.concatenate([value[:8], value[:8]]) for key, value in arrays.items()}
  nll = Evaluator(exp).row_sums(params, twice)["nll"]
  assert np.allclose(nll[:8], nll[8:]) == (draw == "per_row")
  np.testing.assert_array_equal(nll, Evaluator(exp).row_sums(params, twice)["nll"])


# --------------------------------------------------------------------------- old runs


def _saved(tmp_path, model: dict):
  """A workdir's config.json written before the settings existed (no random_positions_draw,
  no alibi bidirectional_offset), and its saved (typed) config."""
  raw = {"seed": 0, "data": {"source": "synthetic"}, "task": {"name": "copy"},
         "model": {"position_settings": {"alibi": {"max_bias": 8.0}}, **model}}
  (tmp_path / "config.json").write_text(json.dumps(raw))
  return raw, workdir_lib.saved_config(str(tmp_path))


def test_a_run_saved_before_the_settings_keeps_its_meaning(tmp_path):
  """Its randomized positions were drawn per row and its encoder's ALiBi was symmetric; a
  config written now draws per batch and has DeepMind's offset, another run: resuming the
  old one with it is refused. An old run without random positions is not another run."""
  raw, saved = _saved(tmp_path, {"position": "alibi", "random_positions": True})
  assert saved.model.random_positions_draw == "per_row"
  assert saved.model.position_settings.alibi.bidirectional_offset == 0.0
  now = parse(raw)
  assert now.model.random_positions_draw == "per_batch"
  assert now.model.position_settings.alibi.bidirectional_offset == 0.5
  with pytest.raises(ConfigError, match=r"different config.model \(differs in: "
                     r"position_settings.alibi.bidirectional_offset, random_positions_draw\)"):
    workdir_lib.check_identity(now, str(tmp_path), has_checkpoints=True)
  old = {**raw, "model": {**raw["model"], "random_positions_draw": "per_row",
                          "position_settings": {"alibi": {"bidirectional_offset": 0.0}}}}
  workdir_lib.check_identity(parse(old), str(tmp_path), has_checkpoints=True)
  raw, _ = _saved(tmp_path, {"position": "rotary"})
  workdir_lib.check_identity(parse(raw), str(tmp_path), has_checkpoints=True)


@pytest.mark.parametrize("position", ["rotary", "alibi"])
def test_scanned_and_rematerialised_layers_draw_as_the_loop_does(position):
  """Each layer's key reaches it inside lax.scan (scan_layers) and through nnx.remat."""
  cfg = ModelConfig(**TINY, position=position, random_positions=True, max_position=50)
  x = jax.random.normal(jax.random.key(2), (3, 6, 16))
  mask = Mask(SEG, SEG, POS, POS)

  def out(**options):
    stack = Stack(dataclasses.replace(cfg, **options), EncoderLayer, 3, rngs=nnx.Rngs(0))
    return np.asarray(stack(x, mask, nnx.Rngs(dropout=7)))

  loop = out()
  np.testing.assert_allclose(out(scan_layers=True), loop, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out(remat=True), loop, rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(Stack(cfg, EncoderLayer, 3, rngs=nnx.Rngs(0))(
      x, mask, nnx.Rngs(dropout=8))), loop, atol=1e-4)  # the draws matter
