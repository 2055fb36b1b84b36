"""Positional encodings against their formulas and defining properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.positions import (POSITIONS, alibi_slopes, make_positional_encoding,
                                   relative_position_bucket, rotate_half_pairs, sinusoid)
from transformer.registry import ConfigError


def test_sinusoid_worked_example_d4():
  table = np.asarray(sinusoid(jnp.arange(2), 4))
  np.testing.assert_allclose(table[0], [0, 1, 0, 1], atol=1e-7)
  np.testing.assert_allclose(table[1], [0.8415, 0.5403, 0.0100, 0.9999], atol=1e-4)


def test_sinusoid_matches_formula():
  d, positions = 16, np.arange(50)
  table = np.asarray(sinusoid(jnp.asarray(positions), d))
  for i in range(d // 2):
    angle = positions / 10000 ** (2 * i / d)
    np.testing.assert_allclose(table[:, 2 * i], np.sin(angle), atol=1e-5)
    np.testing.assert_allclose(table[:, 2 * i + 1], np.cos(angle), atol=1e-5)


def test_sinusoid_offset_is_a_fixed_linear_map():
  """P_{p+δ} = M_δ P_p with M_δ block-diagonal rotations independent of p."""
  d, delta = 8, 5
  table = np.asarray(sinusoid(jnp.arange(40), d), np.float64)
  m = np.zeros((d, d))
  for i in range(d // 2):
    w = delta / 10000 ** (2 * i / d)
    # [sin(a+w), cos(a+w)] = [[cos w, sin w], [-sin w, cos w]] [sin a, cos a]
    m[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[np.cos(w), np.sin(w)], [-np.sin(w), np.cos(w)]]
  np.testing.assert_allclose(table[:-delta] @ m.T, table[delta:], atol=1e-5)


def test_rope_scores_depend_only_on_offset():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)

  def score(m, n):
    rq = rotate_half_pairs(q, jnp.array([[m]]), 10000.0)
    rk = rotate_half_pairs(k, jnp.array([[n]]), 10000.0)
    return np.asarray(jnp.sum(rq * rk, -1))

  np.testing.assert_allclose(score(3, 1), score(12, 10), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(score(0, 7), score(20, 27), rtol=1e-5, atol=1e-5)
  assert not np.allclose(score(3, 1), score(3, 2), atol=1e-3)
  # A rotation preserves norms.
  rq = rotate_half_pairs(q, jnp.array([[9]]), 10000.0)
  np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_rope_position_zero_is_identity():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 2, 4)), jnp.float32)
  np.testing.assert_allclose(rotate_half_pairs(x, jnp.zeros((2, 3), jnp.int32), 10000.0), x)


def test_learned_rejects_sequences_longer_than_its_table():
  enc = make_positional_encoding("learned", 8, 2, 5, rngs=nnx.Rngs(0))
  ok = enc.embed(jnp.zeros((1, 5, 8)), jnp.arange(5)[None])
  assert ok.shape == (1, 5, 8)
  with pytest.raises(ConfigError, match="exceeds the learned position table"):
    enc.embed(jnp.zeros((1, 6, 8)), jnp.arange(6)[None])


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_every_encoding_keeps_shapes(name):
  enc = make_positional_encoding(name, 8, 2, 16, rngs=nnx.Rngs(0))
  x, pos = jnp.ones((2, 5, 8)), jnp.broadcast_to(jnp.arange(5), (2, 5))
  assert enc.embed(x, pos).shape == x.shape
  q = jnp.ones((2, 5, 2, 4))
  assert enc.rotate(q, pos).shape == q.shape
  assert jnp.broadcast_shapes(enc.bias(pos, pos).shape, (2, 2, 5, 5)) == (2, 2, 5, 5)


def test_unknown_position_lists_choices():
  with pytest.raises(ConfigError, match=r"unknown position .sinusodal.; choose one of: alibi, learned, none"):
    make_positional_encoding("sinusodal", 8, 2, 16, rngs=nnx.Rngs(0))


def test_jit_compatible():
  enc = make_positional_encoding("rotary", 8, 2, 16, rngs=nnx.Rngs(0))
  q = jnp.ones((1, 4, 2, 4))
  pos = jnp.arange(4)[None]
  out = jax.jit(lambda q: enc.rotate(q, pos))(q)
  assert out.shape == q.shape


def test_alibi_slopes():
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
  np.testing.assert_allclose(alibi_slopes(4), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
  # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence.
  np.testing.assert_allclose(alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                               2.0 ** -1, 2.0 ** -3])


def test_alibi_bias_is_minus_slope_times_distance():
  enc = make_positional_encoding("alibi", 8, 2, 0, rngs=nnx.Rngs(0))
  pos = jnp.arange(5)[None]
  bias = np.asarray(enc.bias(pos, pos))[0]  # [h, q, k]
  i, j = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
  for h, m in enumerate([2.0 ** -4, 2.0 ** -8]):
    np.testing.assert_allclose(bias[h], -m * np.abs(i - j))


BIDIRECTIONAL = {0: 0, -1: 1, 1: 17, -7: 7, 7: 23, -8: 8, -16: 10, -127: 15, -128: 15, -1000: 15,
                 1000: 31}
CAUSAL = {0: 0, -1: 1, -15: 15, -16: 16, -32: 21, -127: 31, -128: 31, -5000: 31, 3: 0}


@pytest.mark.parametrize("bidirectional,table", [(True, BIDIRECTIONAL), (False, CAUSAL)])
def test_t5_bucket_boundaries(bidirectional, table):
  relative = jnp.asarray(list(table))
  buckets = relative_position_bucket(relative, bidirectional=bidirectional)
  assert dict(zip(table, np.asarray(buckets).tolist())) == table


def test_t5_bias_reads_its_table_per_head_and_is_shift_invariant():
  enc = make_positional_encoding("t5", 8, 2, 0, causal=True, rngs=nnx.Rngs(0))
  pos = jnp.arange(6)[None]
  bias = np.asarray(enc.bias(pos, pos))[0]
  table = np.asarray(enc.table[...])
  assert bias.shape == (2, 6, 6)
  np.testing.assert_allclose(bias[:, 4, 1], table[3])  # key 3 before the query: bucket 3
  np.testing.assert_allclose(bias[:, 2, 5], table[0])  # causal: the future shares bucket 0
  np.testing.assert_allclose(enc.bias(pos + 7, pos + 7), enc.bias(pos, pos))


@pytest.mark.parametrize("name", ["alibi", "t5"])
def test_bias_encodings_depend_only_on_offsets(name):
  enc = make_positional_encoding(name, 8, 2, 0, rngs=nnx.Rngs(0))
  q, k = jnp.array([[2, 5]]), jnp.array([[0, 3, 9]])
  np.testing.assert_allclose(enc.bias(q + 11, k + 11), enc.bias(q, k))
