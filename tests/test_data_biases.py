"""The data biases (transformer/model/data_biases.py), FoX's forget gate and selective
attention, against their formulas in NumPy, on packed rows and beside a positional bias;
each trains in the decoder-only family and the encoder-decoder's decoder self-attention and
is refused elsewhere; cached decoding equals the full pass; the kernels declaring them
compute what the reference computes (values and gradients); the kernels without them refuse
them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import adam_losses, family_batch, randomised
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.data_biases import DATA_BIASES
from transformer.model.decoding import generate
from transformer.model.families import ARCHS, cached_mask, make_model, shift_right
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS

D_MODEL, H, D, T = 16, 4, 4, 7


def _layer(kernel="reference", data_bias="forget", **attention):
  return randomised(MultiHeadAttention(
      D_MODEL, H, AttentionConfig(data_bias=data_bias, kernel=kernel, **attention),
      num_kv_heads=2, causal=True, max_len=32, rngs=nnx.Rngs(0)))


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


@pytest.mark.parametrize("position", ["alibi", "rotary", "none"])
def test_selective_attention_subtracts_the_earlier_queries_selections(position):
  """Every head's logit of query i and key j loses Σ_{k<i} ReLU(head 0's logit of k and j),
  the sum over the earlier queries k of its packed sequence that see j, leaving out each
  sequence's first token (slots 0 and 4 of row 0, 0 of row 1, whose positions start at 3,
  as randomized positions may) and k's own key; head 0's logits with the encoding's bias
  (ALiBi's) or of its rotated queries and keys (rotary's, by its own seams)."""
  layer = _layer(data_bias="selective")
  x, mask = _inputs()
  mask = dataclasses.replace(mask, q_positions=mask.q_positions.at[1].add(3),
                             k_positions=mask.k_positions.at[1].add(3))
  encoding = POSITIONS[position](D_MODEL, H, 32, causal=True)
  xs = np.asarray(x, np.float64)
  heads = lambda w, n: (xs @ np.asarray(w.kernel[...])).reshape(2, T, n, D)  # noqa: E731
  q, k, v = heads(layer.query, H), heads(layer.key, 2), heads(layer.value, 2)
  q = np.asarray(encoding.rotate_queries(jnp.asarray(q, jnp.float32), mask.q_positions))
  k = np.asarray(encoding.rotate_keys(jnp.asarray(k, jnp.float32), mask.k_positions))
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  visible = np.asarray(mask.dense())[:, 0]
  logits = (np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
            + np.asarray(encoding.bias(mask.q_positions, mask.k_positions)))
  firsts = {(0, 0), (0, 4), (1, 0)}
  chosen = np.zeros((2, T, T))
  for r, kq, j in np.ndindex(2, T, T):
    if visible[r, kq, j] and j != kq and (r, j) not in firsts:
      chosen[r, kq, j] = max(logits[r, 0, kq, j], 0.0)
  masked = np.zeros((2, T, T))
  for r, i, j in np.ndindex(2, T, T):
    masked[r, i, j] = chosen[r, :i, j].sum()
  assert np.abs(np.where(visible, masked, 0)).max() > 0.1  # the selections act
  logits = np.where(visible[:, None], logits - masked[:, None], -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  want = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(2, T, -1) @ np.asarray(layer.out.kernel[...])
  np.testing.assert_allclose(layer.self_attend(x, mask, encoding), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("data_bias", "kernel"), [("forget", "xla"), ("forget", "pallas"),
                                                   ("selective", "xla")])
def test_kernel_computes_the_reference_values_and_gradients(data_bias, kernel):
  """xla adds the bias as an array; pallas reads FoX's c per block beside ALiBi's BiasSpec,
  and gives c's gradient (row and column sums of the logits'), which the cumulative sum
  carries to the gate's parameters. Every parameter's gradient is the reference's
  (selective attention's reaches head 0's queries and keys through F)."""
  x, mask = _inputs()
  alibi = POSITIONS["alibi"](D_MODEL, H, 32, causal=True)

  def run(kernel):
    graphdef, state = nnx.split(_layer(kernel, data_bias))
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s).self_attend(x, mask, alibi) ** 2)  # noqa: E731
    return jax.value_and_grad(loss)(state)

  (got, got_grad), (want, want_grad) = run(kernel), run("reference")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  if data_bias == "forget":
    assert float(jnp.abs(want_grad["data_bias"]["proj"]["bias"][...]).max()) > 0


@pytest.mark.parametrize(("data_bias", "kernel", "words"), [
    ("forget", "blockwise", "cannot add a data-dependent logit bias .*; use kernel "
                            "'reference' or 'xla'"),
    ("selective", "blockwise", "cannot add a data-dependent logit bias"),
    ("selective", "pallas", r"takes a data-dependent logit bias as two vectors per head only, "
                            r"and this layer's \(model.attention.data_bias\) is a whole "
                            r"\[tq, tk\] array .*; use kernel 'reference' or 'xla'")])
def test_kernels_without_a_data_bias_refuse_it(data_bias, kernel, words):
  with pytest.raises(ConfigError, match=f"attention.kernel '{kernel}' {words}"):
    _layer(kernel, data_bias)


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
  """A causal-only data bias acts in causal self-attention: the decoder-only model's, the
  encoder-decoder's decoder self-attention (its encoder and cross-attention take none); an
  encoder-only model refuses it."""
  if DATA_BIASES[name].causal_only and arch == "encoder":
    with pytest.raises(ConfigError, match=f"data_bias={name!r} is defined for causal "
                                          r"self-attention only .*: use model.arch=decoder"):
      _model(arch, data_bias=name)
    return
  model = _model(arch, data_bias=name)
  for stack in model.stacks().values():
    for layer in stack.layers:
      biased = type(layer.self_attention.data_bias) is DATA_BIASES[name]
      assert biased == (stack is model.decoder or not DATA_BIASES[name].causal_only)
      if hasattr(layer, "cross_attention"):
        assert type(layer.cross_attention.data_bias) is DATA_BIASES["none"]
  losses = adam_losses(model, arch)
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def test_cross_attention_refuses_a_causal_only_data_bias():
  with pytest.raises(ConfigError, match="data_bias='selective' is defined for causal"):
    MultiHeadAttention(D_MODEL, H, AttentionConfig(data_bias="selective"), cross=True,
                       causal=True, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(("name", "position", "normalizer"), [
    ("forget", "alibi", "softmax"), ("selective", "alibi", "softmax"),
    ("selective", "rotary", "sink"), ("selective", "none", "sigmoid"),
    ("selective", "rotary", "stick_breaking")])
def test_cached_chunks_equal_the_full_pass(name, position, normalizer):
  """A layer's cache fed 3, 1 and 3 tokens gives the full pass's outputs: FoX's cumulative
  sums continue the cached ones; selective attention's queries read the selections of the
  queries cached before them and of the earlier ones of their own chunk, under each
  encoding and normaliser."""
  x, _ = _inputs()
  encoding = POSITIONS[position](D_MODEL, H, 32, causal=True)
  ones, slots = jnp.ones((2, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (2, T))
  layer = _layer(data_bias=name, normalizer=normalizer)
  want = layer.self_attend(x, Mask(ones, ones, slots, slots, causal=True), encoding)
  layer.init_self_cache(2, T)
  got = [layer.self_attend(x[:, i:j], cached_mask(j - i, i, slots), encoding)
         for i, j in ((0, 3), (3, 4), (4, T))]
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(set(DATA_BIASES) - {"none"}))
def test_cached_generation_equals_the_full_pass(name):
  """FoX's cache holds the cumulative sums at its slots; each step's continue them.
  Selective attention's carries each slot's selections by the queries decoded so far."""
  model = randomised(_model("decoder", data_bias=name, qk_norm="rmsnorm"))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 4)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p: generate(m, p, jnp.array([2, 4]), 9))(model, prompts)
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens,
                                            "inputs_segmentation": jnp.ones_like(tokens)})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(set(DATA_BIASES) - {"none"}))
def test_encoder_decoder_cached_decoding_equals_the_full_pass(name):
  """The decoder's self-attention caches carry the data bias: logits of teacher-forced
  decode_step calls, one token each, equal the full pass's."""
  model = randomised(_model("encoder_decoder", data_bias=name))
  batch = {k: jnp.asarray(v) for k, v in family_batch("encoder_decoder").items()}
  full = nnx.jit(lambda m, b: m(b))(model, batch)
  model.init_decoding(batch, batch["targets"].shape[1])
  shifted = shift_right(batch["targets"], jnp.broadcast_to(jnp.arange(8), (2, 8)))
  step = nnx.jit(lambda m, token, t: m.decode_step(token, t))
  cached = jnp.concatenate([step(model, shifted[:, t:t + 1], t) for t in range(8)], axis=1)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=5e-5, rtol=1e-4)
