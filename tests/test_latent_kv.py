"""Multi-head latent attention (model.attention.kv=latent) against its formula: keys and
values projected up from a normalised latent, a rotary key shared by the heads, the
queries' leading dimensions rotated; the cache holds the latent; cached decoding = the
full pass; every kernel, encoding and scorer takes it; refusals; it trains in every family."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import (DECODE_BATCH, TINY_MODEL, adam_losses, family_batch,
                           assert_generation_is_the_full_pass, cached_logits, full_logits,
                           make_tiny_config, randomise)
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import ARCHS, EncoderDecoder, make_model
from transformer.model.latent_kv import EPSILON, KVSettings, LatentKV
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, PositionSettings, make_positional_encoding
from transformer.model.positions.rotary import rope
from transformer.model.scores import SCORES
from transformer.run.config import parse

D_MODEL, H, HEAD_DIM, T, RANK = 16, 4, 4, 9, 6
HALF = dataclasses.replace(POSITIONS["rotary"].Settings(), rotated_fraction=0.5)


def _latent(**settings):
  return AttentionConfig(kv="latent",
                         kv_settings=KVSettings(latent=LatentKV.Settings(RANK, **settings)))


LATENT = _latent()


def _rotary():
  return make_positional_encoding("rotary", D_MODEL, H, 32, causal=True,
                                  settings=PositionSettings(rotary=HALF), rngs=nnx.Rngs(1))



def _rms(x, scale):
  return x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + EPSILON) * scale


@pytest.mark.parametrize("query_rank,place", [(0, "concat"), (5, "concat"), (0, "within")])
def test_latent_attention_is_its_formula(query_rank, place):
  """softmax(q·kᵀ/√d_qk)·v with c = RMSNorm(x W_D), [k_C | v] = c W_U per head, the shared
  key k_R = RoPE(x W_R), k = [k_R | k_C], q = [RoPE(q_R) | q_C] (DeepSeek-V2's MLA; r = 2,
  what the rotary encoding turns of a head of 4): k_C of 4 beside k_R (concat: d_qk = 6) or
  of 2 within the head (d_qk = 4); q projected from x or (query_rank) RMSNorm(x W_DQ)."""
  encoding = _rotary()
  layer = randomise(MultiHeadAttention(D_MODEL, H, _latent(query_rank=query_rank,
                                                           rotary_place=place),
                                        encoding=encoding, causal=True, rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, T, D_MODEL)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = Mask(jnp.ones((2, T), jnp.int32), jnp.ones((2, T), jnp.int32), pos, pos, causal=True)
  got = layer.self_attend(x, mask, encoding)

  p = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  r, d = 2, HEAD_DIM
  content = d if place == "concat" else d - r
  c = _rms(x @ p["latent"]["down"]["kernel"], p["latent"]["norm"]["scale"])
  up = (c @ p["latent"]["up"]["kernel"]).reshape(2, T, H, content + d)
  k_c, v = up[..., :content], up[..., content:]
  k_r = rope((x @ p["latent"]["rotary_key"]["kernel"])[:, :, None, :], pos, HALF)
  k = jnp.concatenate([jnp.broadcast_to(k_r, (2, T, H, r)), k_c], -1)
  q_in = _rms(x @ p["latent"]["query_down"]["kernel"], p["latent"]["query_norm"]["scale"]) if (
      query_rank) else x
  assert p["query"]["kernel"].shape == (query_rank or D_MODEL, H * (content + r))
  q = (q_in @ p["query"]["kernel"]).reshape(2, T, H, content + r)
  q = jnp.concatenate([rope(q[..., :r], pos, HALF), q[..., r:]], -1)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(content + r)
  logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
  heads = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(2, T, D_MODEL)
  np.testing.assert_allclose(got, heads @ p["out"]["kernel"], rtol=2e-5, atol=2e-5)

  layer.init_self_cache(2, 12)
  assert layer.cache.k[...].shape == (2, 12, RANK) and layer.cache.v[...].shape == (2, 12, r)
  assert not hasattr(layer, "key") and not hasattr(layer, "value")


def test_every_kernel_takes_its_heads_of_two_widths():
  """Queries and keys of 6 (head_dim 4 + the rotary 2), values of 4: each kernel running
  here gives the reference kernel's outputs and parameter gradients."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, T, D_MODEL)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = Mask(jnp.ones((2, T), jnp.int32), jnp.ones((2, T), jnp.int32), pos, pos, causal=True)
  encoding = _rotary()
  loss = lambda layer: jnp.sum(jnp.sin(layer.self_attend(x, mask, encoding)))  # noqa: E731
  got = {}
  for kernel in ["reference", "xla", "blockwise", "pallas"]:
    layer = randomise(MultiHeadAttention(D_MODEL, H, dataclasses.replace(
        LATENT, kernel=kernel, block_size=4), encoding=encoding, causal=True, rngs=nnx.Rngs(0)))
    assert layer.kernel_choice.name == kernel
    got[kernel] = nnx.value_and_grad(loss)(layer)
  for kernel, (value, grads) in got.items():
    np.testing.assert_allclose(value, got["reference"][0], rtol=1e-5, err_msg=kernel)
    for a, b in zip(jax.tree.leaves(nnx.state(grads)),
                    jax.tree.leaves(nnx.state(got["reference"][1]))):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=kernel)


def _config(position, arch="decoder", rotary=HALF, latent=(), **kw):
  tiny = {**TINY_MODEL, "d_model": D_MODEL, "num_heads": H, "num_decoder_layers": 2}
  return ModelConfig(**tiny, position=position, position_settings=PositionSettings(rotary=rotary),
                     arch=arch, attention=_latent(**dict(latent)), **kw)


@pytest.mark.parametrize("position,fraction,latent", [
    ("rotary", 0.5, {}), ("rotary", 1.0, {"query_rank": 8}),
    ("rotary", 0.5, {"rotary_place": "within"}), ("alibi", 1.0, {})])
def test_cached_generation_equals_the_full_pass_decoder_only(position, fraction, latent):
  """The rotary part beside the head (r = 2, or the whole head's 4) or within it; none
  under ALiBi."""
  rotary = dataclasses.replace(HALF, rotated_fraction=fraction)
  model = randomise(make_model(_config(position, rotary=rotary, latent=latent),
                               rngs=nnx.Rngs(0)))
  assert_generation_is_the_full_pass(model)


def test_cached_decoding_equals_the_full_pass_encoder_decoder():
  """The decoder's self-attention latent (its cross-attention keeps per-head K/V)."""
  model = randomise(EncoderDecoder(_config("rotary", arch="encoder_decoder"),
                                    rngs=nnx.Rngs(0)))
  assert model.decoder.layers[0].cross_attention.latent is None
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 13, (2, 7)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


def test_every_encoding_and_scorer_takes_the_latent():
  """A decoder with kv=latent under every encoding (the rotary ones with their part beside
  the head: queries and keys of head_dim + r) and every scorer: its logits' shapes."""
  batch = family_batch("decoder")
  for position, score in itertools.product(sorted(POSITIONS), sorted(SCORES)):
    config = _config(position)
    config = dataclasses.replace(config, attention=dataclasses.replace(config.attention,
                                                                       score=score))
    model = nnx.eval_shape(lambda c=config: make_model(c, rngs=nnx.Rngs(0)))
    out = jax.eval_shape(lambda m, b: m(b), model, batch)
    assert out.shape == (2, 8, TINY_MODEL["vocab_size"]), (position, score)


@pytest.mark.parametrize(("change", "words"), [
    ({"num_kv_heads": 2}, "takes no model.num_kv_heads"),
    ({"attention": dataclasses.replace(LATENT, qk_norm="rmsnorm")}, "no model.attention.qk_norm"),
    ({"attention": _latent(rotary_place="within"), "position_settings": PositionSettings()},
     "rotates all 4 dimensions of each head, and .*rotary_place='within'"),
    ({"attention": _latent(rotary_place="within"), "position": "xpos"}, "rotates all 4"),
    ({"position_settings": PositionSettings(rotary=dataclasses.replace(HALF, partial="p_rope"))},
     "does not rotate a leading block"),
])
def test_latent_refuses_what_it_cannot_form(change, words):
  config = dataclasses.replace(_config("rotary"), **change)
  with pytest.raises(ConfigError, match=words):
    make_model(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_latent_attention_trains_in_every_family(arch):
  cfg = dataclasses.replace(_config("rotary", arch=arch), num_classes=5 if arch == "encoder" else 0)
  losses = adam_losses(make_model(cfg, rngs=nnx.Rngs(0)), arch)
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def test_the_config_reaches_the_layers():
  config = parse(make_tiny_config(**{"model.attention.kv": "latent",
                                     "model.attention.kv_settings.latent.rank": 8,
                                     "model.attention.kv_settings.latent.query_rank": 12,
                                     "model.position": "alibi"}))
  model = make_model(config.model, rngs=nnx.Rngs(0))
  layer = model.decoder.layers[0].self_attention
  assert layer.latent.rank == 8 and layer.latent.rotary == 0
  assert layer.latent.query_down.out_features == 12 == layer.query.in_features
  for field, bad in [("rank", -1), ("query_rank", -1), ("rotary_place", "after")]:
    with pytest.raises(ConfigError, match=field):
      parse(make_tiny_config(**{f"model.attention.kv_settings.latent.{field}": bad}))
