"""Gated attention (transformer/model/gates.py) and differential attention
(transformer/model/differential.py) against their formulas in NumPy, with grouped-query
heads; each trains in every family, decodes with the cache as the full pass computes, runs
with every encoding and through each kernel as through the reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import adam_losses, randomised
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate
from transformer.model.differential import HEADS, lambda_init
from transformer.model.families import ARCHS, make_model
from transformer.model.gates import GATES
from transformer.model.kernels import KERNELS
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, PositionalEncoding

D_MODEL, H, D, T = 16, 4, 4, 7
NONE = PositionalEncoding()


def _layer(kv_heads=2, depth=0, **attention):
  return randomised(MultiHeadAttention(D_MODEL, H, AttentionConfig(**attention),
                                       num_kv_heads=kv_heads, causal=True, depth=depth,
                                       rngs=nnx.Rngs(0)))


def _inputs():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, T, D_MODEL)), jnp.float32)
  seg = jnp.array([[1] * 4 + [2] * 3, [1] * T])
  pos = jnp.array([[0, 1, 2, 3, 0, 1, 2], list(range(T))])
  return x, Mask(seg, seg, pos, pos, causal=True)


def _softmax_weights(q, k, mask):
  """Causal softmax of q·k/√d per head: q [b, t, h, d], k [b, t, h, d] -> [b, h, t, t]."""
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  visible = np.asarray(mask.dense())
  logits = np.where(visible, logits, -np.inf)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _projections(layer, x):
  """x W_Q, x W_K, x W_V of the layer in float64: [b, t, heads, d] each."""
  heads = lambda w, n: np.asarray(x @ w.kernel[...], np.float64).reshape(2, T, n, D)  # noqa: E731
  return heads(layer.query, H), heads(layer.key, 2), heads(layer.value, 2)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_multiplies_each_heads_output_by_sigmoid_of_the_input(gate):
  """W_O(heads ⊙ σ(x W_g)), σ per head (headwise: one score per head, shared by its d
  outputs) or per feature, heads the plain layer's grouped-query attention."""
  layer = _layer(gate=gate)
  x, mask = _inputs()
  q, k, v = _projections(layer, x)
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head i reads kv head i // 2
  heads = np.einsum("bhqk,bkhd->bqhd", _softmax_weights(q, k, mask), v)
  score = np.asarray(x @ layer.gate.gate.kernel[...], np.float64).reshape(2, T, H, -1)
  assert score.shape[-1] == (1 if gate == "headwise" else D)
  gated = (heads / (1 + np.exp(-score))).reshape(2, T, H * D)
  want = gated @ np.asarray(layer.out.kernel[...], np.float64)
  np.testing.assert_allclose(layer.self_attend(x, mask, NONE), want, rtol=1e-4, atol=1e-5)


def test_differential_attention_is_their_formula():
  """Pairs (2i, 2i+1) of query heads as one differential head over values of 2d:
  RMSNorm((A₁ − λA₂)V)·(1 − λ_init), λ = e^{λq1·λk1} − e^{λq2·λk2} + λ_init; their
  grouped-query layout: query sub-head j reads key sub-head j // n_rep, differential head i
  reads value head i // n_rep (n_rep = heads / kv_heads = 2 here: 2 differential heads of
  1 value head of 2d)."""
  layer = _layer(heads="differential", depth=2)
  x, mask = _inputs()
  q, k, v = _projections(layer, x)
  weights = _softmax_weights(q, np.repeat(k, 2, axis=2), mask)  # [b, 4 sub-heads, t, t]
  v = np.asarray(v).reshape(2, T, 1, 2 * D)  # their v.view(kv_heads / 2, 2d)
  mix = layer.head_mix
  p = {n: np.asarray(getattr(mix, n)[...], np.float64)
       for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
  init = float(mix.lambda_init[...])  # drawn away from its start by randomised()
  lam = np.exp(p["lambda_q1"] @ p["lambda_k1"]) - np.exp(p["lambda_q2"] @ p["lambda_k2"]) + init
  out = []
  for i in range(H // 2):
    diff = weights[:, 2 * i] - lam * weights[:, 2 * i + 1]  # [b, t, t]
    o = np.einsum("bqk,bkd->bqd", diff, v[:, :, i // 2])  # [b, t, 2d]
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-5) * np.asarray(mix.subln.scale[...])
    out.append(o * (1 - init))
  want = np.concatenate(out, -1) @ np.asarray(layer.out.kernel[...], np.float64)
  np.testing.assert_allclose(layer.self_attend(x, mask, NONE), want, rtol=1e-4, atol=1e-5)
  for depth in (0, 2):  # λ_init = 0.8 − 0.6·exp(−0.3·depth)
    fresh = MultiHeadAttention(D_MODEL, H, AttentionConfig(heads="differential"),
                               num_kv_heads=2, depth=depth, rngs=nnx.Rngs(0))
    assert float(fresh.head_mix.lambda_init[...]) == pytest.approx(
        0.8 - 0.6 * math.exp(-0.3 * depth)) == pytest.approx(lambda_init(depth))


def test_differential_attention_refuses_odd_heads_and_lambda_init_does_not_learn():
  with pytest.raises(ConfigError, match=r"num_kv_heads \(1\) must be even"):
    _layer(kv_heads=1, heads="differential")
  layer = _layer(heads="differential")
  x, mask = _inputs()
  graphdef, state = nnx.split(layer)
  grads = jax.grad(lambda s: nnx.merge(graphdef, s).self_attend(x, mask, NONE).sum())(state)
  assert float(grads["head_mix"]["lambda_init"][...]) == 0.0
  assert float(jnp.abs(grads["head_mix"]["lambda_q1"][...]).max()) > 0


# --------------------------------------------------------------------------- families

TINY = dict(vocab_size=19, d_model=D_MODEL, num_heads=H, d_ff=32, num_encoder_layers=1,
            num_decoder_layers=2, dropout=0.0, max_len=16)
VARIANTS = {**{f"gate={g}": dict(gate=g) for g in GATES if g != "none"},
            **{f"heads={h}": dict(heads=h) for h in HEADS if h != "plain"}}


def _model(arch, position="rotary", kv_heads=2, **attention):
  cfg = ModelConfig(**TINY, arch=arch, position=position, num_kv_heads=kv_heads,
                    num_classes=5 if arch == "encoder" else 0,
                    attention=AttentionConfig(**attention))
  return make_model(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_trains_in_every_family(variant, arch):
  model = make_model(ModelConfig(**{**TINY, "num_decoder_layers": 1}, arch=arch,
                                 position="rotary", num_kv_heads=2,
                                 num_classes=5 if arch == "encoder" else 0,
                                 attention=AttentionConfig(**VARIANTS[variant])),
                     rngs=nnx.Rngs(0))
  losses = adam_losses(model, arch)
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def _cached_equals_full(model, length=9):
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 4)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p: generate(m, p, jnp.array([2, 4]), length))(model, prompts)
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens,
                                            "inputs_segmentation": jnp.ones_like(tokens)})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_generation_equals_the_full_pass_with_gqa_and_qk_norm(variant):
  _cached_equals_full(randomised(_model("decoder", qk_norm="rmsnorm", **VARIANTS[variant])))


@pytest.mark.parametrize("position", ["alibi", "cope", "t5"])
def test_differential_gated_attention_with_a_bias_and_a_content_bias(position):
  """The logit seams see the sub-heads as heads: an ALiBi slope, a T5 table column, CoPE's
  gates per query sub-head; decoding equals the full pass."""
  _cached_equals_full(randomised(_model("decoder", position, heads="differential",
                                        gate="elementwise")), length=7)


def test_differential_gated_attention_takes_every_encoding():
  for position in sorted(POSITIONS):
    model = nnx.eval_shape(lambda p=position: _model("decoder", p, heads="differential",
                                                     gate="headwise", qk_norm="layernorm"))
    out = jax.eval_shape(lambda m: m({"inputs": jnp.ones((2, 8), jnp.int32)}), model)
    assert out.shape == (2, 8, 19), position


@pytest.mark.parametrize("kernel", sorted(n for n, k in KERNELS.items()
                                          if n != "reference" and k.backends is None))
def test_each_kernel_computes_what_the_reference_computes(kernel):
  """A layer with differential heads (values twice the queries' width) and a gate, GQA
  and ALiBi: the same outputs under every kernel that runs here."""
  x, mask = _inputs()
  encoding = POSITIONS["alibi"](D_MODEL, H, 32, causal=True)
  attention = dict(heads="differential", gate="headwise", block_size=4)
  want = _layer(kernel="reference", **attention).self_attend(x, mask, encoding)
  got = _layer(kernel=kernel, **attention).self_attend(x, mask, encoding)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
