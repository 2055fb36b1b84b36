"""The attention normalisers (transformer/model/normalizers.py) against their formulas in
NumPy; each trains in every family it declares and refuses the others with one error;
cached decoding equals the full pass for each; the kernel choice refuses a normaliser a
kernel does not declare. Kernels against the reference over the normalisers they declare:
tests/test_kernel_conformance.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import DECODE_BATCH, TINY_MODEL, adam_losses, cached_logits, full_logits
from tests.support import randomised
from transformer.core.errors import ConfigError
from transformer.core.registry import UnknownName
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate
from transformer.model.families import ARCHS, EncoderDecoder, make_model
from transformer.model.kernels import choose
from transformer.model.kernels.capabilities import Needs
from transformer.model.masks import Mask
from transformer.model.normalizers import NORMALIZERS, NormalizerSettings, Sigmoid, Sink
from transformer.model.normalizers import StickBreaking, make_normalizer
from transformer.model.positions import PositionalEncoding
from transformer.model.scores import make_score

H, T = 2, 9


def _mask(causal=True):
  """Row 0: two packed sequences (5 + 2 tokens) and 2 of padding; row 1: one of 9."""
  seg = jnp.array([[1] * 5 + [2] * 2 + [0] * 2, [1] * T])
  pos = jnp.array([list(range(5)) + [0, 1, 0, 0], list(range(T))])
  return Mask(seg, seg, pos, pos, causal=causal)


def _logits(seed=0):
  return jnp.asarray(2 * np.random.default_rng(seed).normal(size=(2, H, T, T)), jnp.float32)


def _weights(name, settings=None, causal=True, **kw):
  normalizer = make_normalizer(name, H, settings, max_len=64, causal=causal, rngs=nnx.Rngs(0))
  mask = _mask(causal)
  visible = mask.dense()
  return normalizer, np.asarray(normalizer(_logits(), visible, mask), np.float64), (
      np.asarray(_logits(), np.float64), np.broadcast_to(np.asarray(visible), (2, H, T, T)))


def test_sigmoid_is_sigma_of_the_logit_minus_log_n():
  """σ(x − log n) at the visible keys, n = model.max_len (64) unless set; 0 elsewhere."""
  for settings, n in ((None, 64), (NormalizerSettings(sigmoid=Sigmoid.Settings(length=1000)),
                                   1000)):
    _, got, (x, visible) = _weights("sigmoid", settings)
    want = np.where(visible, 1 / (1 + np.exp(-(x - math.log(n)))), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_sink_is_softmax_with_one_more_logit_per_head():
  """exp(x_j) / (exp(s_h) + Σ exp(x_k)) over the visible keys: rows sum to less than 1, by
  exactly the sink's share; with the sink at −∞ it is softmax; a padding row is all 0."""
  normalizer, got, (x, visible) = _weights("sink")
  nnx.update(normalizer, nnx.State({"sink": nnx.Param(jnp.array([0.5, -1.0]))}))
  mask = _mask()
  got = np.asarray(normalizer(_logits(), mask.dense(), mask), np.float64)
  sink = np.array([0.5, -1.0])[None, :, None, None]
  e = np.where(visible, np.exp(x), 0.0)
  want = e / (np.exp(sink) + e.sum(-1, keepdims=True))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert got[0, :, 7:].max() == 0  # padding queries
  nnx.update(normalizer, nnx.State({"sink": nnx.Param(jnp.array([-1e30, -1e30]))}))
  softmax = make_normalizer("softmax", H, max_len=64, causal=True, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(normalizer(_logits(), mask.dense(), mask),
                             softmax(_logits(), mask.dense(), mask), atol=1e-7)


def test_off_by_one_sink_is_fixed_at_zero():
  """learned=False: s_h = 0, and no gradient reaches it."""
  settings = NormalizerSettings(sink=Sink.Settings(learned=False))
  normalizer, got, (x, visible) = _weights("sink", settings)
  e = np.where(visible, np.exp(x), 0.0)
  np.testing.assert_allclose(got, e / (1 + e.sum(-1, keepdims=True)), rtol=1e-5, atol=1e-7)
  mask = _mask()
  graphdef, state = nnx.split(normalizer)
  grad = jax.grad(lambda s: nnx.merge(graphdef, s)(_logits(), mask.dense(), mask).sum())(state)
  assert float(jnp.abs(grad["sink"][...]).max()) == 0.0


def _stick_breaking(x, visible, q_pos, k_pos, attend_current):
  """Tan et al.'s weights by loops: from the nearest key backward, each takes β = σ(x) of
  what is left; the rest goes to the query's own key."""
  out = np.zeros_like(x)
  b, h, tq, tk = x.shape
  for r, head, i in np.ndindex(b, h, tq):
    left = 1.0
    keys = [j for j in range(tk) if visible[r, head, i, j] and (
        k_pos[r, j] < q_pos[r, i] or (attend_current and k_pos[r, j] == q_pos[r, i]))]
    for j in sorted(keys, key=lambda j: -k_pos[r, j]):
      beta = 1 / (1 + np.exp(-x[r, head, i, j]))
      out[r, head, i, j] = beta * left
      left *= 1 - beta
    own = [j for j in range(tk) if visible[r, head, i, j] and k_pos[r, j] == q_pos[r, i]]
    for j in own:
      out[r, head, i, j] += left
  return out


@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_against_the_stick_broken_by_hand(attend_current):
  settings = NormalizerSettings(stick_breaking=StickBreaking.Settings(attend_current))
  _, got, (x, visible) = _weights("stick_breaking", settings)
  mask = _mask()
  want = _stick_breaking(x, visible, np.asarray(mask.q_positions), np.asarray(mask.k_positions),
                         attend_current)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  real = np.asarray(mask.q_segments) > 0  # every real query's weights sum to 1
  np.testing.assert_allclose(got.sum(-1).transpose(0, 2, 1)[real], 1.0, rtol=1e-6)


def test_unknown_and_refused_normalizers():
  with pytest.raises(UnknownName, match="unknown attention normalizer 'soft'; choose one of: "
                                        "sigmoid, sink, softmax, stick_breaking"):
    AttentionConfig(normalizer="soft")
  with pytest.raises(ConfigError, match="'stick_breaking' is defined for causal self-attention"):
    make_normalizer("stick_breaking", H, max_len=8, causal=False, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- families

TINY = {**TINY_MODEL, "max_len": 16}
FAMILIES = [(name, arch) for name in sorted(NORMALIZERS) for arch in sorted(ARCHS)]


def _model(arch, normalizer, **kw):
  cfg = ModelConfig(**TINY, arch=arch, num_classes=5 if arch == "encoder" else 0,
                    attention=AttentionConfig(normalizer=normalizer, **kw))
  return make_model(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name,arch", FAMILIES)
def test_each_normalizer_trains_in_every_family_it_declares(name, arch):
  """Six Adam steps on one batch lower its loss; a causal-only normaliser in a family with
  bidirectional or cross-attention is refused with one error."""
  if NORMALIZERS[name].causal_only and arch != "decoder":
    with pytest.raises(ConfigError, match=f"normalizer={name!r} is defined for causal"):
      _model(arch, name)
    return
  losses = adam_losses(_model(arch, name), arch)
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", sorted(n for n, cls in NORMALIZERS.items()
                                        if not cls.causal_only and n != "softmax"))
def test_cached_decoding_equals_the_full_pass_encoder_decoder(name):
  """(softmax: tests/test_decoding.py)"""
  model = randomised(EncoderDecoder(ModelConfig(**TINY, position="rotary", num_kv_heads=1,
                                                attention=AttentionConfig(normalizer=name)),
                                    rngs=nnx.Rngs(0)))
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 7)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(NORMALIZERS))
def test_cached_generation_equals_the_full_pass_decoder_only(name):
  model = randomised(_model("decoder", name, qk_norm="rmsnorm"))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (3, 5)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p, n: generate(m, p, n, 10))(model, prompts,
                                                                  jnp.array([1, 3, 5]))
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens,
                                            "inputs_segmentation": jnp.ones_like(tokens)})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5, rtol=1e-4)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("name", sorted(NORMALIZERS))
def test_a_kernel_refuses_a_normalizer_it_does_not_offer(name):
  """Named by hand, xla computes softmax only, pallas the normalisers of a flash form
  (softmax, sink, sigmoid), blockwise the online ones, reference every one; `auto` on the
  CPU takes the reference."""
  cls = NORMALIZERS[name]
  normalizer = make_normalizer(name, H, max_len=8, causal=True, rngs=nnx.Rngs(0))
  needs = Needs.of(make_score("scaled_dot", H, 4, rngs=nnx.Rngs(0)), PositionalEncoding(),
                   normalizer=normalizer)
  assert choose("reference", needs)[0].name == choose("auto", needs)[0].name == "reference"
  whole_row = ("computes its normaliser block by block, and normalizer '{}' needs each "
               "query's whole row of logits; use kernel 'reference'")
  able = " or ".join(repr(kernel) for kernel, computes in (
      ("reference", True), ("blockwise", cls.online), ("pallas", cls.flash)) if computes)
  refusals = {"xla": "computes softmax only, and normalizer '{}' is not softmax; use kernel "
                     f"{able} or model",
              "blockwise": whole_row, "pallas": whole_row}
  for kernel, computes in (("xla", cls.plain_softmax), ("blockwise", cls.online),
                           ("pallas", cls.flash)):
    if computes:
      assert choose(kernel, needs)[0].name == kernel
    else:
      with pytest.raises(ConfigError, match=f"attention.kernel '{kernel}' "
                                            + refusals[kernel].format(name)):
        choose(kernel, needs)
