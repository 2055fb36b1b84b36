"""FoX's forget gate (transformer/model/data_biases.py) against its formula in NumPy, on
packed rows and beside a positional bias; it trains in the decoder-only family and is
refused elsewhere; cached decoding equals the full pass; xla and pallas compute what the
reference computes (values and the gate's gradients); the kernels without a data bias
refuse it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import adam_losses, randomised
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.data_biases import DATA_BIASES
from transformer.model.decoding import generate
from transformer.model.families import ARCHS, make_model
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS

D_MODEL, H, D, T = 16, 4, 4, 7


def _layer(kernel="reference", **attention):
  return randomised(MultiHeadAttention(
      D_MODEL, H, AttentionConfig(data_bias="forget", kernel=kernel, **attention),
      num_kv_heads=2, causal=True, rngs=nnx.Rngs(0)))


def _inputs():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, T, D_MODEL)), jnp.float32)
  seg = jnp.array([[1] * 4 + [2] * 3, [1] * T])
  pos = jnp.array([[0, 1, 2, 3, 0, 1, 2], list(range(T))])
  return x, Mask(seg, seg, pos, pos, causal=True)


def test_forget_gate_adds_the_sum_of_log_forgets_between_key_and_query():
  """softmax(q·k/√d + m·(j − i) + Σ_{l=j+1..i} log σ(x_l w_h + b_h)) per head, causal
  within each packed sequence, with ALiBi's bias beside it."""
  layer = _layer()
  x, mask = _inputs()
  alibi = POSITIONS["alibi"](D_MODEL, H, 32, causal=True)
  xs = np.asarray(x, np.float64)
  heads = lambda w, n: (xs @ np.asarray(w.kernel[...])).reshape(2, T, n, D)  # noqa: E731
  q, k, v = heads(layer.query, H), heads(layer.key, 2), heads(layer.value, 2)
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  proj = layer.data_bias.proj
  logit = xs @ np.asarray(proj.kernel[...]) + np.asarray(proj.bias[...])  # [b, t, h]
  log_f = -np.log1p(np.exp(-logit))
  between = np.zeros((2, H, T, T))
  for r, i, j in np.ndindex(2, T, T):
    between[r, :, i, j] = log_f[r, j + 1:i + 1].sum(0) if j <= i else 0.0
  logits = (np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + between
            + np.asarray(alibi.bias(mask.q_positions, mask.k_positions)))
  logits = np.where(np.asarray(mask.dense()), logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  want = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(2, T, -1) @ np.asarray(layer.out.kernel[...])
  np.testing.assert_allclose(layer.self_attend(x, mask, alibi), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_kernel_computes_the_reference_values_and_gate_gradients(kernel):
  """xla adds the bias as an array; pallas reads c per block beside ALiBi's BiasSpec, and
  gives c's gradient (row and column sums of the logits'), which the cumulative sum
  carries to the gate's parameters."""
  x, mask = _inputs()
  alibi = POSITIONS["alibi"](D_MODEL, H, 32, causal=True)

  def run(kernel):
    graphdef, state = nnx.split(_layer(kernel))
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s).self_attend(x, mask, alibi) ** 2)  # noqa: E731
    return jax.value_and_grad(loss)(state)

  (got, got_grad), (want, want_grad) = run(kernel), run("reference")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(got_grad["data_bias"]["proj"][name][...],
                               want_grad["data_bias"]["proj"][name][...], rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(want_grad["data_bias"]["proj"]["bias"][...]).max()) > 0


@pytest.mark.parametrize("kernel", ["blockwise"])
def test_kernels_without_a_data_bias_refuse_it(kernel):
  with pytest.raises(ConfigError, match=f"attention.kernel '{kernel}' cannot add a data-"
                                        "dependent logit bias .*; use kernel 'reference' or "
                                        "'xla'"):
    _layer(kernel)


TINY = dict(vocab_size=19, d_model=D_MODEL, num_heads=H, num_kv_heads=2, d_ff=32,
            num_encoder_layers=1, num_decoder_layers=1, dropout=0.0, max_len=16)


def _model(arch, **attention):
  cfg = ModelConfig(**TINY, arch=arch, position="rotary",
                    num_classes=5 if arch == "encoder" else 0,
                    attention=AttentionConfig(**attention))
  return make_model(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(set(DATA_BIASES) - {"none"}))
def test_each_data_bias_trains_in_every_family_it_declares(name, arch):
  if DATA_BIASES[name].causal_only and arch != "decoder":
    with pytest.raises(ConfigError, match=f"data_bias={name!r} is defined for causal"):
      _model(arch, data_bias=name)
    return
  losses = adam_losses(_model(arch, data_bias=name), arch)
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def test_cached_generation_equals_the_full_pass():
  """The cache holds the cumulative sums at its slots; each step's continue them."""
  model = randomised(_model("decoder", data_bias="forget", qk_norm="rmsnorm"))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 4)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p: generate(m, p, jnp.array([2, 4]), 9))(model, prompts)
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens,
                                            "inputs_segmentation": jnp.ones_like(tokens)})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5, rtol=1e-4)
