"""Randomized positions (model.random_positions, Ruoss et al. 2023): per_row's sampler's
distribution, the stacks that draw them, cached decoding at the drawn positions (per_row and
per_batch), relative encodings still relative, and a run that trains, evaluates and resumes
exactly. per_batch against Ruoss et al.'s code: tests/test_randomized_draws.py."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from tests.support import DECODE_BATCH, DECODE_LEN, TINY_MODEL, cached_logits, checkpoint_params
from tests.support import full_logits, read_records
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.model.blocks import CausalLayer
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate
from transformer.model.families import DecoderOnly, EncoderDecoder
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, make_positional_encoding
from transformer.model.positions.randomized import sample_positions
from transformer.model.stack import Stack
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate

TINY = {**TINY_MODEL, "num_decoder_layers": 2}  # two layers of cached decoding
TAKES_POSITIONS = sorted(name for name, cls in POSITIONS.items() if cls.takes_positions)
# Packed rows: segments of 3, 2 and 4 tokens with padding between and after.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 0, 0]])
POSITIONS_OF = np.array([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 0, 0]])


def _draw(key, batch=1, max_position=16):
  return np.asarray(sample_positions(key, jnp.tile(POSITIONS_OF, (batch, 1)),
                                     jnp.tile(SEGMENTS, (batch, 1)), max_position))


def test_each_segment_gets_sorted_distinct_positions_in_range():
  drawn = _draw(jax.random.key(0), batch=200)
  for row in drawn:
    values = [row[SEGMENTS[0] == s] for s in (1, 2, 3)]
    for v in values:
      assert np.all(np.diff(v) > 0) and v.min() >= 0 and v.max() < 16, row
    assert len(set(np.concatenate(values))) == 9  # one permutation per row: disjoint segments
    assert np.all(row[SEGMENTS[0] == 0] == 0)
  # Random, not consecutive: most samples of 4 from [0, 16) are not 0..3.
  assert np.mean([np.array_equal(r[6:10], np.arange(4)) for r in drawn]) < 0.05


def test_same_key_same_positions_another_key_others():
  np.testing.assert_array_equal(_draw(jax.random.key(3), 4), _draw(jax.random.key(3), 4))
  assert not np.array_equal(_draw(jax.random.key(3), 4), _draw(jax.random.key(4), 4))


def _subset_pvalue(samples, m, n):
  """Chi-square p-value of samples [draws, n] (sorted) against uniform over C(m, n) subsets."""
  subsets = {s: i for i, s in enumerate(itertools.combinations(range(m), n))}
  counts = np.bincount([subsets[tuple(r)] for r in samples], minlength=len(subsets))
  assert counts.sum() == len(samples) and len(counts) == math.comb(m, n)
  return stats.chisquare(counts).pvalue


@pytest.mark.parametrize("segment,n", [(1, 3), (3, 4)])
def test_every_subset_is_equally_likely(segment, n):
  """Chi-square over all C(12, n) subsets of [0, 12) a segment can get, which has the power
  to reject a near miss: sorted iid draws spread apart (u₍ᵢ₎ + i), distinct and sorted but
  favouring evenly spread subsets."""
  m, draws = 12, 8000
  drawn = _draw(jax.random.key(7), batch=draws, max_position=m)[:, SEGMENTS[0] == segment]
  assert _subset_pvalue(drawn, m, n) > 1e-3
  iid = np.sort(np.random.default_rng(0).integers(0, m - n + 1, (draws, n)), axis=1)
  assert _subset_pvalue(iid + np.arange(n), m, n) < 1e-6
  # The first position's marginal: P(min = k) = C(m - 1 - k, n - 1) / C(m, n).
  expected = np.array([math.comb(m - 1 - k, n - 1) for k in range(m)]) / math.comb(m, n)
  np.testing.assert_allclose(np.bincount(drawn[:, 0], minlength=m) / draws, expected, atol=0.02)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple", "rotary", "xpos"])
def test_relative_encodings_stay_shift_invariant_at_drawn_positions(name):
  """Logits (q·k after rotation, plus the bias) at drawn positions p equal those at p + c:
  they depend on the gaps between the drawn positions only. (FIRE normalises by the query's
  position, so it is relative only below its threshold; tests/test_positions.py.)"""
  enc = make_positional_encoding(name, 16, 2, 64, causal=True, rngs=nnx.Rngs(0))
  p = sample_positions(jax.random.key(1), jnp.broadcast_to(jnp.arange(6), (2, 6)),
                       jnp.ones((2, 6), jnp.int32), 64)
  q, k = jax.random.normal(jax.random.key(2), (2, 2, 6, 2, 8))

  def logits(pos):
    scores = jnp.einsum("bqhd,bkhd->bhqk", enc.rotate_queries(q, pos), enc.rotate_keys(k, pos))
    return scores + enc.bias(pos, pos)

  np.testing.assert_allclose(logits(p + 37), logits(p), rtol=1e-4, atol=1e-4)
  consecutive = jnp.broadcast_to(jnp.arange(6), (2, 6))
  assert not np.allclose(logits(p), logits(consecutive), atol=1e-3)  # the gaps matter


def _config(position="learned", **kw):
  return ModelConfig(**{**TINY, "max_len": 8}, position=position, random_positions=True,
                     max_position=40, **kw)


@pytest.mark.parametrize("draw", ["per_batch", "per_row"])
def test_a_stack_draws_from_its_rngs_or_a_fixed_key_when_deterministic(draw):
  """Training draws from the rngs' key (the step's), a deterministic call from a fixed one;
  a row longer than the range drawn from is refused."""
  stack = Stack(_config("rotary", random_positions_draw=draw), CausalLayer, 1,
                rngs=nnx.Rngs(0))
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask = Mask(jnp.ones((2, 5)), jnp.ones((2, 5)), positions, positions, causal=True)
  x = jax.random.normal(jax.random.key(0), (2, 5, TINY["d_model"]))
  out = lambda rngs: np.asarray(stack(x, mask, rngs))  # noqa: E731
  np.testing.assert_array_equal(out(None), out(None))
  np.testing.assert_array_equal(out(nnx.Rngs(dropout=5)), out(nnx.Rngs(dropout=5)))
  assert not np.allclose(out(nnx.Rngs(dropout=5)), out(nnx.Rngs(dropout=6)))
  plain = Stack(ModelConfig(**{**TINY, "max_len": 8}, position="rotary"), CausalLayer, 1,
                rngs=nnx.Rngs(0))
  assert not np.allclose(out(None), plain(x, mask, None))
  with pytest.raises(ConfigError, match="length 41 exceeds model.max_position=40"):
    stack.check_length(41)


def test_the_learned_table_covers_max_position_and_the_switch_changes_the_model():
  model = EncoderDecoder(_config(), rngs=nnx.Rngs(0))
  assert model.encoder.position.table.embedding[...].shape == (40, TINY["d_model"])
  plain = EncoderDecoder(ModelConfig(**{**TINY, "max_len": 40}, position="learned"),
                         rngs=nnx.Rngs(0))
  targets = jnp.full((2, DECODE_LEN), 4, jnp.int32)
  assert not np.allclose(full_logits(model, DECODE_BATCH, targets),
                         full_logits(plain, DECODE_BATCH, targets), atol=1e-3)


# per_batch's rotations: the generation test below, and each layer's draw of a decoding step:
# tests/test_randomized_draws.py
@pytest.mark.parametrize("position,draw", [("learned", "per_row"), ("alibi", "per_batch")])
def test_cached_decoding_equals_the_full_pass_at_the_drawn_positions(position, draw):
  """Decoding draws its max_len slots' positions (per_batch: each layer's, or its sampled
  offsets) as a full pass of max_len tokens does."""
  model = EncoderDecoder(_config(position, random_positions_draw=draw), rngs=nnx.Rngs(0))
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 13, (2, DECODE_LEN)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("draw", ["per_row", "per_batch"])
def test_cached_generation_equals_the_full_pass_at_the_drawn_positions(draw):
  model = DecoderOnly(_config("xpos", arch="decoder", random_positions_draw=draw),
                      rngs=nnx.Rngs(0))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 13, (3, 4)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p, n: generate(m, p, n, 10))(model, prompts,
                                                                   jnp.array([1, 2, 4]))
  full = nnx.jit(lambda m, t: m({"inputs": t, "inputs_segmentation": jnp.ones_like(t)}))(
      model, tokens)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("position", ["none", "cope"])
def test_encodings_without_positions_refuse_the_switch(position):
  with pytest.raises(FieldError, match=f"position '{position}', which takes no positions"):
    ModelConfig(**TINY, position=position, random_positions=True, arch="decoder")


def test_a_run_trains_evaluates_and_resumes_exactly(tmp_path, tiny_config):
  """per_batch (the default): every draw a function of (seed, step), or of the evaluation
  batch's number."""
  config = tiny_config(**{"model.random_positions": True, "model.max_position": 24,
                          "model.position": "rotary"})
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train_and_evaluate(parse(config), straight)
  calls = []
  assert train_and_evaluate(parse(config), resumed,
                            should_stop=lambda: calls.append(1) or len(calls) == 18) == 17
  assert train_and_evaluate(parse(config), resumed) == 40
  jax.tree.map(np.testing.assert_array_equal, checkpoint_params(straight, 40),
               checkpoint_params(resumed, 40))
  records = read_records(straight)
  train = [r for r in records if r["split"] == "train"]
  assert train[-1]["loss"] < 0.7 * train[0]["loss"], train  # it learns (2.25 -> 1.37)
  final = {r["split"]: r for r in records if r["split"] != "train"}
  assert set(final) == {"valid", "longer"} and final["valid"]["accuracy"] > 0.3, final
