"""Attention variants against their formulas: grouped-query / multi-query attention equals
multi-head attention with each key/value head repeated (every scorer and encoding),
its smaller KV cache, cached decoding = the full pass; QK-norm; logit soft-capping; a tiny
run with all three learns; sharded = unsharded with grouped K/V heads."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import DECODE_BATCH, TINY_MODEL, cached_logits, full_logits, make_tiny_config
from tests.support import assert_generation_is_the_full_pass, randomise, sharded_matches_single
from tests.support import train_losses
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.core.registry import UnknownName
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import EncoderDecoder, make_model
from transformer.model.kernels.reference import attention_weights, soft_cap
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, PositionalEncoding, make_positional_encoding
from transformer.model.qk_norm import EPSILON
from transformer.model.scores import SCORES, make_score
from transformer.run import sharding
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate

D_MODEL, H, HEAD_DIM, T = 16, 4, 4, 11
NONE = PositionalEncoding()


def _packed_mask(causal=True, window=None):
  """11 positions: two packed sequences in row 0 (the second padded), one in row 1."""
  seg = jnp.array([[1] * 6 + [2] * 3 + [0] * 2, [1] * T])
  pos = jnp.array([list(range(6)) + list(range(3)) + [0, 0], list(range(T))])
  return Mask(seg, seg, pos, pos, causal=causal, window=window)


def _encoding(name, causal=True):
  return make_positional_encoding(name, D_MODEL, H, 32, causal=causal, rngs=nnx.Rngs(1))


def _layer(kv_heads, **attention):
  return MultiHeadAttention(D_MODEL, H, AttentionConfig(**attention), num_kv_heads=kv_heads,
                            rngs=nnx.Rngs(0))



def _as_multi_head(grouped: MultiHeadAttention, **attention) -> MultiHeadAttention:
  """The multi-head layer computing what `grouped` computes: the same parameters, its K and V
  kernels' columns [d_model, kv_heads·head_dim] repeated per head, query head i getting kv
  head i // (heads / kv_heads)."""
  mha = _layer(0, **attention)
  repeat = H // grouped.num_kv_heads
  state = nnx.to_pure_dict(nnx.state(grouped))
  for name in ("key", "value"):
    kernel = state[name]["kernel"].reshape(D_MODEL, grouped.num_kv_heads, HEAD_DIM)
    state[name]["kernel"] = jnp.repeat(kernel, repeat, axis=1).reshape(D_MODEL, D_MODEL)
  mha_state = nnx.state(mha)
  nnx.replace_by_pure_dict(mha_state, state)
  nnx.update(mha, mha_state)
  return mha


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("score", sorted(SCORES))
def test_grouped_query_attention_is_multi_head_with_repeated_kv_heads(score, kv_heads):
  """GQA (2 kv heads for 4 query heads) and MQA (1) give the outputs, self- and
  cross-attention, of the multi-head layer whose K/V kernels repeat each kv head's
  columns, with every scorer (the reference kernel; every other kernel equals it with
  grouped heads: test_kernel_conformance)."""
  attention = dict(score=score, kernel="reference")
  grouped = randomise(_layer(kv_heads, **attention))
  assert grouped.key.kernel.shape == (D_MODEL, kv_heads * HEAD_DIM)
  mha = _as_multi_head(grouped, **attention)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, T, D_MODEL)), jnp.float32)
  source = jnp.asarray(rng.normal(size=(2, T, D_MODEL)), jnp.float32)
  mask, encoding = _packed_mask(), _encoding("rotary")
  np.testing.assert_allclose(grouped.self_attend(x, mask, encoding),
                             mha.self_attend(x, mask, encoding), rtol=1e-5, atol=1e-5)
  cross = _packed_mask(causal=False)
  np.testing.assert_allclose(grouped.cross_attend(x, source, cross, NONE),
                             mha.cross_attend(x, source, cross, NONE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_grouped_query_attention_with_every_encoding(position):
  """Every encoding's seams (rotations of the kv heads, biases and content biases over the
  query heads) see GQA as the repeated multi-head layer (reference kernel, causal)."""
  grouped = randomise(_layer(2))
  mha = _as_multi_head(grouped)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, T, D_MODEL)), jnp.float32)
  mask, encoding = _packed_mask(), _encoding(position)
  np.testing.assert_allclose(grouped.self_attend(x, mask, encoding),
                             mha.self_attend(x, mask, encoding), rtol=1e-5, atol=1e-5)


def test_the_kv_cache_shrinks_by_heads_over_kv_heads():
  for kv_heads in (0, 2, 1):
    layer = _layer(kv_heads)
    layer.init_self_cache(3, 10)
    assert layer.cache.k[...].shape == layer.cache.v[...].shape == (3, 10, kv_heads or H,
                                                                    HEAD_DIM)
    source = jnp.ones((3, 5, D_MODEL))
    layer.init_cross_cache(source, jnp.broadcast_to(jnp.arange(5), (3, 5)), NONE)
    assert layer.cache.k[...].shape == (3, 5, kv_heads or H, HEAD_DIM)


VARIANTS = [dict(num_kv_heads=1), dict(num_kv_heads=2, attention=dict(qk_norm="rmsnorm")),
            dict(num_kv_heads=2, attention=dict(qk_norm="layernorm", logit_softcap=2.0)),
            dict(num_kv_heads=2, attention=dict(kernel="xla"))]


def _config(position="rotary", num_kv_heads=0, attention=None, **kw):
  # H = 4 query heads (as 1, 2 or 4 key/value heads) of HEAD_DIM; 2 decoder layers' caches
  tiny = {**TINY_MODEL, "d_model": D_MODEL, "num_heads": H, "num_decoder_layers": 2}
  return ModelConfig(**tiny, position=position, num_kv_heads=num_kv_heads,
                     attention=AttentionConfig(**(attention or {})), **kw)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_cached_decoding_equals_the_full_pass_encoder_decoder(variant):
  model = EncoderDecoder(_config(**variant), rngs=nnx.Rngs(0))
  randomise(model)
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 13, (2, 7)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_cached_generation_equals_the_full_pass_decoder_only(variant):
  model = make_model(_config(arch="decoder", **variant), rngs=nnx.Rngs(0))
  randomise(model)
  assert_generation_is_the_full_pass(model)


# --------------------------------------------------------------------------- QK-norm


def _heads(x):
  return x.reshape(*x.shape[:2], -1, HEAD_DIM)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_qk_norm_normalises_each_head_before_the_rotation(norm):
  """The cached keys are rotary(norm(x W_K)) per head, the queries the same with their own
  norm, and the layer's output is the formula's attention of those (rms:
  x/√(mean x² + ε)·g; layernorm: (x − mean)/√(var + ε)·g + β, over head_dim, ε = 1e-6)."""
  layer = randomise(_layer(2, qk_norm=norm))
  encoding = _encoding("rotary")
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, T, D_MODEL)), jnp.float32)
  mask = _packed_mask()

  def formula(h, which):
    g = np.asarray(getattr(layer, f"{which}_norm").scale[...])
    h = np.asarray(h, np.float64)
    if norm == "rmsnorm":
      return h / np.sqrt((h * h).mean(-1, keepdims=True) + EPSILON) * g
    centred = h - h.mean(-1, keepdims=True)
    beta = np.asarray(getattr(layer, f"{which}_norm").bias[...])
    return centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + EPSILON) * g + beta

  k = formula(_heads(x @ layer.key.kernel[...]), "k")
  q = formula(_heads(x @ layer.query.kernel[...]), "q")
  k = encoding.rotate_keys(jnp.asarray(k, jnp.float32), mask.k_positions)
  q = encoding.rotate_queries(jnp.asarray(q, jnp.float32), mask.q_positions)
  got_k, got_v = layer.keys_values(x, mask.k_positions, encoding)
  np.testing.assert_allclose(got_k, k, rtol=1e-5, atol=1e-5)
  weights = attention_weights(q, k, mask, encoding, layer.score)
  heads = jnp.einsum("bhqk,bkhd->bqhd", weights, jnp.repeat(got_v, 2, axis=2))
  want = heads.reshape(2, T, D_MODEL) @ layer.out.kernel[...]
  np.testing.assert_allclose(layer.self_attend(x, mask, encoding), want, rtol=1e-5, atol=1e-5)


def test_no_qk_norm_adds_no_parameter():
  names = {path[0] for path, _ in nnx.to_flat_state(nnx.state(_layer(0), nnx.Param))}
  assert names == {"query", "key", "value", "out"}
  assert {path[0] for path, _ in nnx.to_flat_state(
      nnx.state(_layer(0, qk_norm="layernorm"), nnx.Param))} == names | {"q_norm", "k_norm"}


# --------------------------------------------------------------------------- soft-cap


@pytest.mark.parametrize("score", sorted(SCORES))
def test_softcap_logits_are_c_tanh_of_the_score_plus_the_bias(score):
  """attention_weights = softmax(c·tanh(score/c) + ALiBi bias) by NumPy: the distance
  bias is added after the cap, not bounded by it."""
  c = 1.5
  rng = np.random.default_rng(4)
  q, k = (jnp.asarray(3 * rng.normal(size=(2, T, H, HEAD_DIM)), jnp.float32) for _ in range(2))
  mask, encoding = _packed_mask(), _encoding("alibi")
  scorer = make_score(score, H, HEAD_DIM, rngs=nnx.Rngs(0))
  raw = np.asarray(scorer(q, k), np.float64)
  bias = np.asarray(encoding.bias(mask.q_positions, mask.k_positions), np.float64)
  logits = c * np.tanh(raw / c) + bias
  visible = np.asarray(mask.dense())
  logits = np.where(visible, logits, -np.inf)
  top = np.max(logits, -1, keepdims=True)
  e = np.where(visible, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0)
  want = e / np.maximum(e.sum(-1, keepdims=True), 1e-30)
  got = attention_weights(q, k, mask, encoding, scorer, softcap=c)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(bias).max() > c  # the bias exceeds the cap: it was not capped
  np.testing.assert_allclose(soft_cap(jnp.asarray(raw), c), c * np.tanh(raw / c), rtol=1e-6)
  uncapped = jnp.asarray(raw, jnp.float32)
  assert soft_cap(uncapped, 0.0) is uncapped  # 0: off, no operation


# --------------------------------------------------------------------------- config


def test_config_fields_are_checked():
  for kv in (3, -1, 5):
    with pytest.raises(FieldError, match=f"num_kv_heads={kv}"):
      _config(num_kv_heads=kv)
  assert _config(num_kv_heads=4).num_kv_heads == 4  # = num_heads: multi-head
  with pytest.raises(UnknownName, match="unknown attention qk_norm 'bogus'; choose one of: "
                                        "layernorm, none, rmsnorm"):
    AttentionConfig(qk_norm="bogus")
  with pytest.raises(FieldError, match=r"logit_softcap=-1.0.*≥ 0"):
    AttentionConfig(logit_softcap=-1.0)
  with pytest.raises(ConfigError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
    _layer(3)


def test_the_tensor_axis_must_divide_the_kv_heads():
  mesh = jax.sharding.AbstractMesh((1, 1, 2), sharding.AXES)
  with pytest.raises(ConfigError, match=r"model.num_kv_heads \(1\) must be a multiple of "
                                        r"mesh.tensor \(2\)"):
    sharding.check_kv_heads(4, 1, mesh)
  sharding.check_kv_heads(4, 2, mesh)
  sharding.check_kv_heads(3, 0, mesh)  # multi-head attention: unchanged (not refused)


# --------------------------------------------------------------------------- runs


def test_a_tiny_run_with_every_variant_learns(tmp_path):
  """Multi-query attention, RMS QK-norm and a logit soft-cap together: the loss falls."""
  config = make_tiny_config(**{"model.num_kv_heads": 1, "model.attention.qk_norm": "rmsnorm",
                               "model.attention.logit_softcap": 5.0, "train.num_steps": 40})
  train_and_evaluate(parse(config), str(tmp_path))
  losses = train_losses(str(tmp_path))
  assert losses[-1] < 0.7 * losses[0], losses


def test_sharded_grouped_query_run_matches_one_device(tmp_path):
  """4 query heads over 2 kv heads, split over a tensor axis of 2 (and data, fsdp of 2): the
  losses of the 1-device run."""
  overrides = {"model.dropout": 0.0, "model.num_heads": 4, "model.num_kv_heads": 2,
               "model.attention.qk_norm": "rmsnorm", "train.num_steps": 10, "train.log_every": 5}
  sharded_matches_single(tmp_path, overrides, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
