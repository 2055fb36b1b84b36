"""Scorers against their formulas, attention against a direct computation, masks, the
reference kernel's content bias; a dot-scorer subclass computed as it declares. Every other
kernel against the reference: tests/test_kernel_conformance.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.kernels.registry import KERNELS
from transformer.model.kernels.reference import attention_weights, reference_kernel
from transformer.model.masks import (WINDOWS, Mask, causal_mask, local_window, masked_softmax,
                                     segment_mask)
from transformer.model.positions import (ALiBi, PositionalEncoding)
from transformer.model.scores import SCORES, ScaledDot, make_score, unit

B, TQ, TK, H, D = 2, 3, 4, 2, 4
NONE = PositionalEncoding()


def _qk(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, TQ, H, D)).astype(np.float32),
          rng.normal(size=(B, TK, H, D)).astype(np.float32))


def _make_score(name, **settings):
  return make_score(name, H, D, rngs=nnx.Rngs(0)) if not settings else (
      SCORES[name](H, D, SCORES[name].Settings(**settings), rngs=nnx.Rngs(0)))


def test_scaled_dot_formula():
  q, k = _qk()
  expected = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
  np.testing.assert_allclose(_make_score("scaled_dot")(q, k), expected, rtol=1e-5, atol=1e-6)


def test_dot_formula():
  q, k = _qk()
  np.testing.assert_allclose(_make_score("dot")(q, k), np.einsum("bqhd,bkhd->bhqk", q, k),
                             rtol=1e-5, atol=1e-6)


def test_additive_formula():
  q, k = _qk()
  score = _make_score("additive", dim=5)
  wq, wk, wv = (np.asarray(p[...]) for p in (score.w_q, score.w_k, score.w_v))
  expected = np.zeros((B, H, TQ, TK), np.float32)
  for b in range(B):
    for h in range(H):
      for i in range(TQ):
        for j in range(TK):
          expected[b, h, i, j] = wv[h] @ np.tanh(q[b, i, h] @ wq[h] + k[b, j, h] @ wk[h])
  np.testing.assert_allclose(score(q, k), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sigma", [0.7, 2.0])
def test_gaussian_formula(sigma):
  q, k = _qk()
  score = _make_score("gaussian", sigma=sigma)
  sq = ((q[:, :, None] - k[:, None, :]) ** 2).sum(-1)  # [b, q, k, h]
  expected = np.transpose(-sq / (2 * sigma ** 2), (0, 3, 1, 2))
  np.testing.assert_allclose(score(q, k), expected, rtol=1e-4, atol=1e-4)


def test_gaussian_default_width_and_fixed_sigma_gets_no_gradient():
  assert np.allclose(np.exp(_make_score("gaussian").log_sigma[...]), D ** 0.25)
  q, k = _qk()
  for learn, moves in ((True, True), (False, False)):
    score = _make_score("gaussian", learn_sigma=learn)
    grads = nnx.grad(lambda s: jnp.sum(s(q, k) ** 2))(score)
    assert bool(jnp.any(grads["log_sigma"][...] != 0)) == moves


def test_cosine_formula_with_a_temperature_per_head():
  """τ_h · q·k / (‖q‖ ‖k‖): by NumPy, per head, blind to the lengths of q and k, and τ
  learned (it gets a gradient) from init_temperature."""
  q, k = _qk()
  score = _make_score("cosine", init_temperature=5.0)
  np.testing.assert_allclose(np.exp(score.log_temperature[...]), [5.0, 5.0], rtol=1e-6)
  cos = np.einsum("bqhd,bkhd->bhqk", q / np.linalg.norm(q, axis=-1, keepdims=True),
                  k / np.linalg.norm(k, axis=-1, keepdims=True))
  np.testing.assert_allclose(score(q, k), 5.0 * cos, rtol=1e-5, atol=1e-5)
  score.log_temperature[...] = jnp.log(jnp.array([2.0, 3.0]))
  expected = cos * np.array([2.0, 3.0])[None, :, None, None]
  np.testing.assert_allclose(score(q, k), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(score(3.0 * q, 0.5 * k), expected, rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda s: jnp.sum(s(q, k) ** 2))(score)
  assert np.all(np.asarray(grads["log_temperature"][...]) != 0)


def test_unknown_score_lists_choices():
  choices = ", ".join(sorted(SCORES))
  with pytest.raises(ConfigError, match=re.escape(f"unknown attention score 'cosin'; choose one "
                                                  f"of: {choices}")):
    MultiHeadAttention(8, 2, AttentionConfig(score="cosin"), rngs=nnx.Rngs(0))


def test_heads_must_divide_d_model():
  with pytest.raises(ConfigError, match=r"num_heads \(3\) must divide d_model \(8\)"):
    MultiHeadAttention(8, 3, AttentionConfig(), rngs=nnx.Rngs(0))


def _attention(score="scaled_dot", d_model=8, heads=2):
  return MultiHeadAttention(d_model, heads, AttentionConfig(score=score), rngs=nnx.Rngs(0))


def _mask(b, tq, tk, segments=None, causal=False):
  """A Mask with positions 0.. on both sides and one segment (or the given [b, t] ids)."""
  q_seg = jnp.ones((b, tq), jnp.int32) if segments is None else segments
  k_seg = jnp.ones((b, tk), jnp.int32) if segments is None else segments
  return Mask(q_seg, k_seg, jnp.broadcast_to(jnp.arange(tq), (b, tq)),
              jnp.broadcast_to(jnp.arange(tk), (b, tk)), causal=causal)


def _call(attn, xq, xkv, mask):
  return attn(xq, attn.keys_values(xkv, mask.k_positions, NONE), mask, encoding=NONE)


def test_scaled_dot_attention_equals_direct_softmax():
  rng = np.random.default_rng(0)
  xq, xkv = rng.normal(size=(B, TQ, 8)), rng.normal(size=(B, TK, 8))
  attn = _attention()
  out = _call(attn, jnp.asarray(xq, jnp.float32), jnp.asarray(xkv, jnp.float32),
              _mask(B, TQ, TK))
  wq, wk, wv, wo = (np.asarray(m.kernel[...], np.float64)
                    for m in (attn.query, attn.key, attn.value, attn.out))
  heads = []
  for h in range(2):
    sl = slice(4 * h, 4 * h + 4)
    q, k, v = xq @ wq[:, sl], xkv @ wk[:, sl], xkv @ wv[:, sl]
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(4)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    heads.append((w / w.sum(-1, keepdims=True)) @ v)
  expected = np.concatenate(heads, -1) @ wo
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_masked_softmax_gives_exact_zeros_and_no_nan():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 3, 4)) * 50, jnp.float32)
  mask = jnp.array([[[[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]]], bool)
  w = np.asarray(masked_softmax(logits, mask))
  assert np.all(w[~np.asarray(mask)] == 0.0)
  np.testing.assert_allclose(w[0, 0, :2].sum(-1), 1.0, rtol=1e-6)
  assert w[0, 0, 1, 3] == 1.0
  assert np.all(w[0, 0, 2] == 0.0) and not np.isnan(w).any()
  grads = jax.grad(lambda x: jnp.sum(masked_softmax(x, mask) ** 2))(logits)
  assert not np.isnan(np.asarray(grads)).any()


@pytest.mark.parametrize("score", sorted(SCORES))
def test_masked_keys_do_not_influence_output(score):
  """Changing the keys/values at masked positions leaves every output unchanged."""
  rng = np.random.default_rng(1)
  attn = _attention(score)
  xq = jnp.asarray(rng.normal(size=(1, 4, 8)), jnp.float32)
  xkv = rng.normal(size=(1, 4, 8)).astype(np.float32)
  mask = _mask(1, 4, 4, causal=True)
  base = _call(attn, xq, jnp.asarray(xkv), mask)
  for t in range(1, 4):  # perturb key/value t: outputs of queries < t must not move
    changed = xkv.copy()
    changed[0, t] += 10.0
    out = _call(attn, xq, jnp.asarray(changed), mask)
    np.testing.assert_array_equal(out[0, :t], base[0, :t])
    assert not np.allclose(out[0, t:], base[0, t:])


def test_fully_masked_query_outputs_zero():
  attn = _attention()
  x = jnp.ones((1, 3, 8))
  seg = jnp.array([[1, 1, 0]])
  out = _call(attn, x, x, _mask(1, 3, 3, segments=seg))
  assert not np.isnan(np.asarray(out)).any()
  np.testing.assert_array_equal(out[0, 2], 0.0)


def test_segment_mask_blocks_padding_and_other_segments():
  seg = jnp.array([[1, 1, 2, 2, 0]])
  m = np.asarray(segment_mask(seg, seg))[0, 0]
  s = np.asarray(seg)[0]
  expected = (s[:, None] == s[None, :]) & (s[:, None] != 0) & (s[None, :] != 0)
  np.testing.assert_array_equal(m, expected)


def test_causal_mask_uses_positions():
  pos = jnp.array([[0, 1, 2, 0, 1]])  # two packed segments
  m = np.asarray(causal_mask(pos, pos))[0, 0]
  p = np.asarray(pos)[0]
  np.testing.assert_array_equal(m, p[None, :] <= p[:, None])


@pytest.mark.parametrize("size", [0, 1, 3])
def test_local_window_matches_numpy_reference(size):
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  m = np.asarray(local_window(pos, pos, size))[0, 0]
  i, j = np.meshgrid(np.arange(9), np.arange(9), indexing="ij")
  np.testing.assert_array_equal(m, np.abs(i - j) <= size)


def test_windows_registry_and_mask_composition():
  assert WINDOWS["full"](3) is None and WINDOWS["local"](3) == 3
  seg, pos = jnp.array([[1, 1, 1, 2, 2, 0]]), jnp.array([[0, 1, 2, 0, 1, 0]])
  mask = Mask(seg, seg, pos, pos, causal=True, window=1)
  expected = segment_mask(seg, seg) & causal_mask(pos, pos) & local_window(pos, pos, 1)
  np.testing.assert_array_equal(mask.dense(), expected)
  np.testing.assert_array_equal(mask.block(1, 3, 2, 4).dense(), expected[:, :, 1:4, 2:6])


DOT_SCORES = sorted(name for name in SCORES if _make_score(name).dot_product is not None)


def test_dot_product_declarations():
  """The paper's scorer declares its dot product, and each declaration is its formula, the
  row term included (the Gaussian's)."""
  assert {"scaled_dot", "gaussian"} <= set(DOT_SCORES)
  q, k = _qk()
  for name in DOT_SCORES:
    product = _make_score(name).dot_product
    expected = np.einsum("bqhd,bkhd->bhqk", product.queries(q), product.keys(k)) * product.scale
    if product.row_term is not None:
      expected = expected + product.row_term(q)
    np.testing.assert_allclose(_make_score(name)(q, k), expected, rtol=1e-5, atol=1e-5)


class UnitScaledDot(ScaledDot):
  """A scorer written as a subclass of ScaledDot: q and k normalised, then the scaled dot."""

  def queries(self, q):
    return unit(q)

  def keys(self, k):
    return unit(k)


def test_a_subclass_of_a_dot_scorer_is_never_miscomputed():
  """The fused kernels compute what a dot-scorer subclass declares, which is what it
  computes (its own transforms, not ScaledDot's plain q·k), and a subclass that redefines
  the score itself instead of its declaration is refused when it is defined."""
  q, k = _qk()
  scorer = UnitScaledDot(H, D)
  unit_np = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  expected = np.einsum("bqhd,bkhd->bhqk", unit_np(q), unit_np(k)) / np.sqrt(D)
  np.testing.assert_allclose(scorer(q, k), expected, rtol=1e-5, atol=1e-6)
  rng = np.random.default_rng(4)
  v = jnp.asarray(rng.normal(size=(B, TK, H, D)), jnp.float32)
  q4 = jnp.asarray(rng.normal(size=(B, TK, H, D)) * 5, jnp.float32)
  mask = _mask(B, TK, TK)
  args = (q4, jnp.asarray(k), v, mask, NONE, scorer, nnx.Dropout(0.0), None)
  np.testing.assert_allclose(KERNELS["xla"].make(block_size=512)(*args), reference_kernel(*args),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="Renormalised overrides __call__ of a dot-product scorer"):
    class Renormalised(ScaledDot):  # noqa: F841 - refused as it is defined
      def __call__(self, q, k):
        return super().__call__(unit(q), unit(k))


class CountingProbe(ALiBi):
  """ALiBi plus a content bias c · q_sum · tanh(logits), which records the logits it is
  handed: a positional bias and a content bias of known formulas."""

  content_biases = True

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.seen = []

  def content_bias(self, q, logits):
    self.seen.append(logits)
    return 0.3 * jnp.transpose(q.sum(-1), (0, 2, 1))[..., None] * jnp.tanh(logits)


def test_reference_adds_the_content_bias_of_the_biased_masked_logits():
  """The reference kernel and attention_weights give softmax(s + b + c(q, s + b)) over the
  visible keys, with c handed s + b in float32 and −inf exactly at the masked keys."""
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 6, H, D)), jnp.float32) for _ in range(3))
  seg = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
  pos = jnp.array([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
  mask = Mask(seg, seg, pos, pos, causal=True)
  probe, scorer = CountingProbe(8, H, 16), _make_score("scaled_dot")
  weights = np.asarray(attention_weights(q, k, mask, probe, scorer))
  out = reference_kernel(q, k, v, mask, probe, scorer, nnx.Dropout(0.0), None)
  visible = np.asarray(mask.dense())
  logits = np.asarray(scorer(q, k)) + np.asarray(probe.bias(pos, pos))
  assert len(probe.seen) == 2
  for seen in probe.seen:
    assert seen.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(seen)[np.broadcast_to(visible, seen.shape)],
                               logits[np.broadcast_to(visible, logits.shape)], rtol=1e-6)
    assert np.all(np.asarray(seen)[~np.broadcast_to(visible, seen.shape)] == -np.inf)
  q_sum = np.transpose(np.asarray(q).sum(-1), (0, 2, 1))[..., None]
  total = np.where(visible, logits + 0.3 * q_sum * np.tanh(logits), -np.inf)
  top = np.max(np.where(visible, total, -1e30), -1, keepdims=True)
  want = np.where(visible, np.exp(total - top), 0.0)
  want /= np.maximum(want.sum(-1, keepdims=True), 1e-30)
  np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", want, v), rtol=1e-5, atol=1e-5)
