"""Positional encodings against their formulas and defining properties."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.masks import Mask
from transformer.model.positions import (POSITIONS, ALiBi, CoPE, Fire, Kerple, PositionSettings,
                                         Rotary, T5Bias, XPos, alibi_slopes,
                                         make_positional_encoding, relative_position_bucket,
                                         rotate_half_pairs, sinusoid)

CAUSAL_ONLY = sorted(name for name, cls in POSITIONS.items() if cls.causal_only)


def stacks(name):
  """causal for each kind of stack the encoding `name` may serve: decoder (True) and,
  unless it declares causal_only, encoder (False)."""
  return (True,) if POSITIONS[name].causal_only else (False, True)


def randomised(enc, seed=0):
  """enc with every parameter drawn at random, so that a seam whose parameters start at
  zero (CoPE's table) acts."""
  state = nnx.state(enc, nnx.Param)
  leaves = jax.tree.leaves(nnx.to_pure_dict(state))
  keys = iter(jax.random.split(jax.random.key(seed), max(len(leaves), 1)))
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x: jax.random.normal(next(keys), x.shape, x.dtype), nnx.to_pure_dict(state)))
  nnx.update(enc, state)
  return enc


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


def _logits(b=2, t=5, h=2, seed=0):
  """Causal logits [b, h, t, t] as a kernel hands them to content_bias: −inf where masked."""
  logits = jax.random.normal(jax.random.key(seed), (b, h, t, t))
  return jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_every_encoding_keeps_shapes(name):
  for causal in stacks(name):
    enc = make_positional_encoding(name, 8, 2, 16, causal=causal, rngs=nnx.Rngs(0))
    x, pos = jnp.ones((2, 5, 8)), jnp.broadcast_to(jnp.arange(5), (2, 5))
    assert enc.embed(x, pos).shape == x.shape
    q = jnp.ones((2, 5, 2, 4))
    assert enc.rotate_queries(q, pos).shape == q.shape
    assert enc.rotate_keys(q, pos).shape == q.shape
    assert jnp.broadcast_shapes(enc.bias(pos, pos).shape, (2, 2, 5, 5)) == (2, 2, 5, 5)
    assert jnp.broadcast_shapes(enc.content_bias(q, _logits()).shape, (2, 2, 5, 5)) == (
        2, 2, 5, 5)


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_every_encoding_declares_whether_it_biases(name):
  """`biases` and `content_biases` (which kernels check) are true exactly when bias() and
  content_bias() are not zero, whatever the parameters (drawn at random: CoPE's table
  starts at zero)."""
  for causal in stacks(name):
    enc = randomised(make_positional_encoding(name, 8, 2, 16, causal=causal, rngs=nnx.Rngs(0)))
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    assert enc.biases == bool(np.any(np.asarray(enc.bias(pos, pos)) != 0))
    q = jax.random.normal(jax.random.key(1), (2, 5, 2, 4))
    assert enc.content_biases == bool(np.any(np.asarray(enc.content_bias(q, _logits())) != 0))


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_causal_only_encodings_are_refused_in_a_bidirectional_stack(name):
  """An encoding declaring causal_only serves decoder stacks and is refused, with one
  ConfigError saying what to use, for an encoder's, in every family that has one."""
  from transformer.model.config import ModelConfig  # noqa: PLC0415
  from transformer.model.families import ARCHS, make_model  # noqa: PLC0415
  message = (f"position '{name}' is defined for causal self-attention only (decoder stacks; "
             "keys never after the query), and this model has a bidirectional (encoder) stack: "
             "use another position, or a decoder-only model (model.arch=decoder) on data it learns")
  make_positional_encoding(name, 8, 2, 16, causal=True, rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match=re.escape(message)):
    make_positional_encoding(name, 8, 2, 16, causal=False, rngs=nnx.Rngs(0))
  for arch in ARCHS:
    build = lambda a=arch: nnx.eval_shape(  # noqa: E731
        lambda: make_model(ModelConfig(**TINY_MODEL, position=name, num_classes=2, arch=a),
                           rngs=nnx.Rngs(0)))
    if arch == "decoder":
      build()
    else:
      with pytest.raises(ConfigError, match=re.escape(message)):
        build()


def test_unknown_position_lists_choices():
  choices = ", ".join(sorted(POSITIONS))
  with pytest.raises(ConfigError, match=re.escape(f"unknown position 'sinusodal'; choose one "
                                                  f"of: {choices}")):
    make_positional_encoding("sinusodal", 8, 2, 16, rngs=nnx.Rngs(0))


def test_jit_compatible():
  enc = make_positional_encoding("rotary", 8, 2, 16, rngs=nnx.Rngs(0))
  q = jnp.ones((1, 4, 2, 4))
  pos = jnp.arange(4)[None]
  out = jax.jit(lambda q: enc.rotate_queries(q, pos))(q)
  assert out.shape == q.shape


def test_alibi_slopes():
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
  np.testing.assert_allclose(alibi_slopes(4), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8])
  # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence.
  np.testing.assert_allclose(alibi_slopes(6), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                               2.0 ** -1, 2.0 ** -3])


def test_alibi_bias_is_minus_slope_times_distance():
  """Causal: −m·|i − j|; bidirectional with bidirectional_offset 0 (runs saved before it) the
  same, symmetric."""
  pos = jnp.arange(5)[None]
  i, j = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
  symmetric = ALiBi.Settings(bidirectional_offset=0.0)
  for causal, settings in [(True, None), (False, symmetric)]:
    enc = make_positional_encoding("alibi", 8, 2, 0, causal=causal, settings=PositionSettings(
        alibi=settings or ALiBi.Settings()), rngs=nnx.Rngs(0))
    bias = np.asarray(enc.bias(pos, pos))[0]  # [h, q, k]
    for h, m in enumerate([2.0 ** -4, 2.0 ** -8]):
      np.testing.assert_allclose(bias[h], -m * np.abs(i - j))


def deepmind_alibi(num_heads: int, q_len: int, k_len: int) -> np.ndarray:
  """The bidirectional ALiBi bias [h, q, k] as DeepMind's compute_alibi_encodings_biases
  (models/positional_encodings.py of randomized_positional_encodings and of
  neural_networks_chomsky_hierarchy) builds it: minus one for every strict lower triangle
  below (k = −1, −2, ...) and every strict upper one, so −|i − j|; plus 0.5 on the strict
  lower triangle (keys before the query); times the head's slope, the geometric sequence
  from 2^(−8/n) with ratio 2^(−8/n) for n a power of two."""
  alibi = np.zeros((q_len, k_len))
  for d in range(1, q_len):
    alibi -= np.tri(q_len, k_len, k=-d)
  for d in range(1, k_len):
    alibi -= np.tri(k_len, q_len, k=-d).T
  alibi += 0.5 * np.tri(q_len, k_len, k=-1)
  start = 2.0 ** (-8.0 / num_heads)
  slopes = np.array([start * start ** h for h in range(num_heads)])
  return alibi * slopes[:, None, None]


@pytest.mark.parametrize("heads", [2, 8])
def test_bidirectional_alibi_is_deepminds(heads):
  """An encoder's ALiBi by default is DeepMind's: keys before the query get m·0.5 more, so
  its two sides differ; as a function of positions it moves with them."""
  enc = make_positional_encoding("alibi", 16, heads, 0, causal=False, rngs=nnx.Rngs(0))
  pos = jnp.arange(7)[None]
  np.testing.assert_allclose(np.asarray(enc.bias(pos, pos))[0], deepmind_alibi(heads, 7, 7),
                             rtol=1e-6, atol=1e-7)
  gapped = jnp.array([[0, 2, 3, 7]])
  expected = np.abs(np.asarray(gapped).T - np.asarray(gapped)) - 0.5 * np.tri(4, k=-1)
  np.testing.assert_allclose(np.asarray(enc.bias(gapped, gapped))[0, 0],
                             -alibi_slopes(heads)[0] * expected, rtol=1e-6)


def _alibi_encoder(offset: float, seed: int = 0):
  """An encoder whose only positions are ALiBi's, mean-pooled into 2 classes. max_bias 2
  (slopes 1/2, 1/4): the offset's logit shift, m·offset, is large enough to learn from in a
  few hundred steps."""
  alibi = ALiBi.Settings(max_bias=2.0, bidirectional_offset=offset)
  # 12 tokens, max_len 8: the size the accuracies after 300 steps below were measured at
  cfg = ModelConfig(**{**TINY_MODEL, "vocab_size": 12, "max_len": 8}, position="alibi",
                    arch="encoder", pooling="mean", num_classes=2,
                    position_settings=PositionSettings(alibi=alibi))
  return make_model(cfg, rngs=nnx.Rngs(seed))


def _trained_accuracy(model, inputs, labels, steps=300):
  """Accuracy on (inputs, labels) after `steps` of full-batch Adam (learning rate 0.01)."""
  graphdef, params = nnx.split(model, nnx.Param)
  batch, optimizer = {"inputs": jnp.asarray(inputs)}, optax.adam(1e-2)

  def loss(params):
    logits = nnx.merge(graphdef, params)(batch)[:, 0]  # the pooled logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  @jax.jit
  def step(params, state):
    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jnp.mean(jnp.argmax(logits, -1) == labels)

  state = optimizer.init(params)
  for _ in range(steps):
    params, state, accuracy = step(params, state)
  return float(accuracy)


def test_an_encoder_with_alibi_alone_tells_a_sequence_from_its_reverse():
  """Symmetric (bidirectional_offset 0), the bias depends on |i − j| alone: the encoder's
  outputs reverse with its input, so its mean-pooled outputs of x and of x reversed are the
  same and it cannot learn which of the two it reads (exactly half right). With DeepMind's
  0.5 (the default) the outputs differ, and it learns to tell them apart."""
  rng = np.random.default_rng(0)
  strings = rng.integers(3, 12, (200, 3))
  strings = np.unique(strings[strings[:, 0] != strings[:, -1]], axis=0)[:48]
  inputs = np.concatenate([strings, strings[:, ::-1]]).astype(np.int32)
  labels = jnp.asarray(np.arange(96) >= 48, jnp.int32)  # which of the two orders
  def forward(model, x):  # the encoder stack's outputs, before pooling
    return np.asarray(model.encoder(model.embeddings.source(x), _self_mask(x), None))

  for offset, reverses in [(0.0, True), (0.5, False)]:
    model = _alibi_encoder(offset)
    out, out_reversed = forward(model, inputs[:48]), forward(model, inputs[48:])
    assert np.allclose(out_reversed, out[:, ::-1], atol=1e-5) == reverses
  assert _trained_accuracy(_alibi_encoder(0.0), inputs, labels) == 0.5
  assert _trained_accuracy(_alibi_encoder(0.5), inputs, labels) > 0.8


def _self_mask(inputs) -> Mask:
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  return Mask(jnp.ones_like(positions), jnp.ones_like(positions), positions, positions)


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


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple"])
def test_bias_encodings_depend_only_on_offsets(name):
  enc = make_positional_encoding(name, 8, 2, 0, rngs=nnx.Rngs(0))
  q, k = jnp.array([[2, 5]]), jnp.array([[0, 3, 9]])
  np.testing.assert_allclose(enc.bias(q + 11, k + 11), enc.bias(q, k))


# --------------------------------------------------------------------------- settings


def test_settings_change_what_the_encodings_compute():
  """Each knob reaches its formula: ALiBi's max_bias its slopes, T5's num_buckets its
  table, rotary's base its angles."""
  np.testing.assert_allclose(alibi_slopes(4, 4.0), [2.0 ** -1, 2.0 ** -2, 2.0 ** -3, 2.0 ** -4])
  alibi = ALiBi(8, 4, 0, settings=ALiBi.Settings(max_bias=4.0))
  np.testing.assert_allclose(alibi.slopes, alibi_slopes(4, 4.0))
  t5 = T5Bias(8, 2, 0, settings=T5Bias.Settings(num_buckets=8, max_distance=20),
              rngs=nnx.Rngs(0))
  assert t5.table.shape == (8, 2)
  bucket = relative_position_bucket(jnp.array([-19, 3]), bidirectional=True, num_buckets=8,
                                    max_distance=20)
  pos = jnp.array([[0, 19, 22]])
  bias = np.asarray(t5.bias(pos, pos))[0]
  np.testing.assert_allclose(bias[:, 1, 0], np.asarray(t5.table[...])[int(bucket[0])])
  np.testing.assert_allclose(bias[:, 1, 2], np.asarray(t5.table[...])[int(bucket[1])])
  x = jnp.ones((1, 1, 1, 4))
  rotary = Rotary(4, 1, 0, settings=Rotary.Settings(base=100.0))
  np.testing.assert_allclose(rotary.rotate_keys(x, jnp.array([[3]])),
                             rotate_half_pairs(x, jnp.array([[3]]), 100.0))


@pytest.mark.parametrize("cls,field,value,allowed", [
    (ALiBi, "max_bias", 0.0, "> 0"), (ALiBi, "bidirectional_offset", -0.5, "≥ 0"),
    (T5Bias, "num_buckets", 2, "≥ 4"),
    (T5Bias, "max_distance", 16, "> num_buckets // 2 (16)"), (Rotary, "base", 1.0, "> 1"),
    (XPos, "scale_base", -1.0, "> 0"), (Kerple, "max_init_r2", 0.0, "> 0.01"),
    (Fire, "width", 0, "≥ 1"), (CoPE, "max_positions", 1, "≥ 2")])
def test_settings_reject_values_outside_their_range(cls, field, value, allowed):
  with pytest.raises(FieldError, match=re.escape(f"{field}={value!r} is not allowed; "
                                                 f"it must be {allowed}")):
    cls.Settings(**{field: value})


def test_position_settings_has_a_section_per_encoding_with_knobs():
  sections = PositionSettings()
  assert sorted(f.name for f in dataclasses.fields(sections)) == sorted(
      name for name, cls in POSITIONS.items() if dataclasses.fields(cls.Settings))
  assert {f.name: f.type for f in dataclasses.fields(sections)}["t5"] is T5Bias.Settings
  assert sections.xpos == XPos.Settings(base=10000.0, scale_base=512.0, gamma=0.4)
  custom = dataclasses.replace(sections, t5=T5Bias.Settings(num_buckets=16))
  enc = make_positional_encoding("t5", 8, 2, 0, settings=custom, rngs=nnx.Rngs(0))
  assert enc.table.shape == (16, 2)
  hash(custom)  # a static part of the model's graph


# --------------------------------------------------------------------------- xPos


def _xpos_numpy(x, position, *, sign, d, offset, gamma=0.4, scale_base=512.0, base=10000.0):
  """xPos of one vector x [d] by the formula: rotate pair (x_i, x_{i+d/2}) by position·θ_i,
  then scale both by ζ_i^(sign·(position − offset)/scale_base)."""
  out = np.zeros(d)
  for i in range(d // 2):
    theta = position * base ** (-2 * i / d)
    zeta = (2 * i / d + gamma) / (1 + gamma)
    scale = zeta ** (sign * (position - offset) / scale_base)
    a, b = x[i], x[i + d // 2]
    out[i] = (a * np.cos(theta) - b * np.sin(theta)) * scale
    out[i + d // 2] = (b * np.cos(theta) + a * np.sin(theta)) * scale
  return out


def test_xpos_formula():
  rng = np.random.default_rng(0)
  d, max_len = 8, 64
  enc = XPos(16, 2, max_len, settings=XPos.Settings(scale_base=32.0))
  x = rng.normal(size=(1, 3, 2, d)).astype(np.float32)
  positions = jnp.array([[0, 5, 300]])
  q, k = np.asarray(enc.rotate_queries(x, positions)), np.asarray(enc.rotate_keys(x, positions))
  for t, p in enumerate([0, 5, 300]):
    for h in range(2):
      for got, sign in ((q, 1), (k, -1)):
        want = _xpos_numpy(x[0, t, h], p, sign=sign, d=d, offset=max_len // 2, scale_base=32.0)
        np.testing.assert_allclose(got[0, t, h], want, rtol=1e-4, atol=1e-5)


def test_xpos_scores_depend_only_on_offset_and_decay_with_distance():
  """⟨xpos_q(q, m), xpos_k(k, n)⟩ depends on m − n only (up to float32 rounding), even far
  from the offset, and stays finite at thousands of positions; it is rotary's score with
  each pair i weighted by ζ_i^((m − n)/scale_base)."""
  rng = np.random.default_rng(1)
  d = 8
  enc = make_positional_encoding("xpos", 16, 2, 64, rngs=nnx.Rngs(0))
  q = jnp.asarray(rng.normal(size=(1, 1, 2, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 2, d)), jnp.float32)

  def score(encoding, m, n):
    rq = encoding.rotate_queries(q, jnp.array([[m]]))
    rk = encoding.rotate_keys(k, jnp.array([[n]]))
    return np.asarray(jnp.sum(rq * rk, -1), np.float64)

  np.testing.assert_allclose(score(enc, 3, 1), score(enc, 12, 10), rtol=1e-5)
  np.testing.assert_allclose(score(enc, 3, 1), score(enc, 4003, 4001), rtol=1e-3)
  np.testing.assert_allclose(score(enc, 0, 7), score(enc, 20, 27), rtol=1e-5)
  big = np.asarray(enc.rotate_keys(k, jnp.array([[5000]])))
  assert np.all(np.isfinite(big))
  # Pair by pair: rotary's term times ζ_i^((m − n)/512).
  rotary = make_positional_encoding("rotary", 16, 2, 64, rngs=nnx.Rngs(0))
  zeta = (np.arange(0, d, 2) / d + 0.4) / 1.4
  m, n = 40, 10
  rq = np.asarray(rotary.rotate_queries(q, jnp.array([[m]])))[0, 0]
  rk = np.asarray(rotary.rotate_keys(k, jnp.array([[n]])))[0, 0]
  weights = np.concatenate([zeta, zeta]) ** ((m - n) / 512)
  np.testing.assert_allclose(score(enc, m, n)[0, 0], np.sum(rq * rk * weights, -1), rtol=1e-5)


# --------------------------------------------------------------------------- KERPLE


def test_kerple_formula_and_init():
  enc = make_positional_encoding("kerple", 8, 4, 0, rngs=nnx.Rngs(0))
  r1, r2 = np.exp(np.asarray(enc.log_r1[...])), np.exp(np.asarray(enc.log_r2[...]))
  assert np.all((0.01 <= r1) & (r1 <= 2.0)) and np.all((0.01 <= r2) & (r2 <= 1.0))
  enc.log_r1[...] = jnp.log(jnp.array([0.5, 1.0, 2.0, 3.0]))
  enc.log_r2[...] = jnp.log(jnp.array([1.0, 0.1, 2.0, 0.5]))
  q, k = jnp.array([[0, 4]]), jnp.array([[0, 1, 7]])
  bias = np.asarray(enc.bias(q, k))[0]  # [h, q, k]
  for h, (a, b) in enumerate([(0.5, 1.0), (1.0, 0.1), (2.0, 2.0), (3.0, 0.5)]):
    for i, qi in enumerate([0, 4]):
      for j, kj in enumerate([0, 1, 7]):
        np.testing.assert_allclose(bias[h, i, j], -a * np.log(1 + b * abs(qi - kj)), rtol=1e-5)
  grads = nnx.grad(lambda e: jnp.sum(e.bias(q, k)))(enc)
  assert np.all(np.asarray(grads["log_r1"][...]) != 0)


# --------------------------------------------------------------------------- FIRE


def _fire_numpy(enc, i, j):
  """FIRE's bias [h] for query position i and key position j, by the formula."""
  c = abs(float(enc.c[...]))
  threshold = abs(float(enc.threshold_scale[...]) * enc.init_threshold)
  psi = lambda x: np.log(c * x + 1)  # noqa: E731
  x = np.sign(i - j) * psi(abs(i - j)) / (psi(max(i, j, threshold)) + Fire.EPS)
  w1, b1 = np.asarray(enc.hidden.kernel[...]), np.asarray(enc.hidden.bias[...])
  w2, b2 = np.asarray(enc.output.kernel[...]), np.asarray(enc.output.bias[...])
  return np.maximum(np.array([x]) @ w1 + b1, 0) @ w2 + b2


def test_fire_formula():
  """The causal half (keys at or before the query) is the paper's f(ψ(i − j)/ψ(max(i, L)));
  keys after the query read the signed distance normalised by the key's position."""
  enc = Fire(8, 2, 0, settings=Fire.Settings(width=6, init_c=0.5, init_threshold=4.0),
             rngs=nnx.Rngs(0))
  enc.hidden.bias[...] = jnp.linspace(-0.3, 0.3, 6)  # non-zero, so the ReLU cuts somewhere
  q, k = jnp.array([[0, 3, 9]]), jnp.array([[0, 2, 9, 12]])
  bias = np.asarray(enc.bias(q, k))[0]  # [h, q, k]
  assert bias.shape == (2, 3, 4)
  for a, i in enumerate([0, 3, 9]):
    for b, j in enumerate([0, 2, 9, 12]):
      np.testing.assert_allclose(bias[:, a, b], _fire_numpy(enc, i, j), rtol=1e-4, atol=1e-6)
  # The paper's input for j ≤ i: ψ(i − j)/ψ(max(i, L)), L = 4: the query 9 normalises by itself.
  psi = lambda x: np.log(0.5 * x + 1)  # noqa: E731
  np.testing.assert_allclose(enc.normalised_distance(q, k)[0, 2, 1], psi(7) / psi(9), rtol=1e-5)
  np.testing.assert_allclose(enc.normalised_distance(q, k)[0, 1, 1], psi(1) / psi(4), rtol=1e-5)
  np.testing.assert_allclose(enc.normalised_distance(q, k)[0, 1, 3], -psi(9) / psi(12), rtol=1e-5)


def test_fire_input_takes_its_normaliser_per_row_and_column_bit_for_bit():
  """fire_input's ψ(max(i, j, L)), taken on the rows where i ≥ j and on the columns
  elsewhere, is the elementwise ψ(max(i, j, L)) bit for bit (gapped, equal and far
  positions, either side of L)."""
  from transformer.model.positions.relative import fire_input
  rng = np.random.default_rng(0)
  i = jnp.asarray(np.r_[0, 3, 4, 5, 9, 300, rng.integers(0, 5000, 10)])[:, None]
  j = jnp.asarray(np.r_[0, 2, 4, 9, 12, 300, rng.integers(0, 5000, 10)])[None, :]

  def elementwise(c, threshold, i, j):
    psi = lambda x: jnp.log1p(c * x)  # noqa: E731
    i, j = i.astype(jnp.float32), j.astype(jnp.float32)
    sign = jnp.where(i > j, 1.0, jnp.where(i < j, -1.0, 0.0))
    return sign * psi(jnp.abs(i - j)) / (psi(jnp.maximum(jnp.maximum(i, j), threshold))
                                         + Fire.EPS)

  args = (jnp.float32(0.37), jnp.float32(4.5), i, j)
  np.testing.assert_array_equal(np.asarray(jax.jit(fire_input)(*args)),
                                np.asarray(jax.jit(elementwise)(*args)))


def test_fire_is_relative_below_its_threshold_and_interpolates_beyond():
  """Below L every position shares the normaliser ψ(L): the bias depends on i − j only.
  Beyond it the input is progressively normalised: |input| ≤ 1 at any length."""
  enc = make_positional_encoding("fire", 8, 2, 0, rngs=nnx.Rngs(0))
  q, k = jnp.array([[2, 5]]), jnp.array([[0, 3, 9]])
  np.testing.assert_allclose(enc.bias(q + 100, k + 100), enc.bias(q, k), rtol=1e-5, atol=1e-6)
  far = jnp.concatenate([jnp.array([3, 300]), jnp.arange(0, 20000, 997)])[None]
  x = np.asarray(enc.normalised_distance(far, far))
  assert np.all(np.abs(x) <= 1.0) and np.all(np.isfinite(np.asarray(enc.bias(far, far))))
  grads = nnx.grad(lambda e: jnp.sum(e.bias(far, far) ** 2))(enc)
  assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))  # c and L learn
