"""Multi-head latent attention (model.attention.kv=latent) against its formula: keys and
values projected up from a normalised latent, a rotary key shared by the heads, the
queries' leading dimensions rotated; the cache holds the latent; cached decoding = the
full pass; refusals; it trains in every family."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import (DECODE_BATCH, TINY_MODEL, adam_losses,
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
from transformer.run.config import parse

D_MODEL, H, HEAD_DIM, T, RANK = 16, 4, 4, 9, 6
LATENT = AttentionConfig(kv="latent", kv_settings=KVSettings(latent=LatentKV.Settings(RANK)))
HALF = dataclasses.replace(POSITIONS["rotary"].Settings(), rotated_fraction=0.5)


def _rotary():
  return make_positional_encoding("rotary", D_MODEL, H, 32, causal=True,
                                  settings=PositionSettings(rotary=HALF), rngs=nnx.Rngs(1))



def _rms(x, scale):
  return x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + EPSILON) * scale


@pytest.mark.parametrize("query_rank", [0, 5])
def test_latent_attention_is_its_formula(query_rank):
  """softmax(q·kᵀ/√d)·v with c = RMSNorm(x W_D), [k_C | v] = c W_U per head, the shared
  key k_R = RoPE(x W_R), q = [RoPE(q_R) | q_C] (DeepSeek-V2's MLA, r = 2 of 4 dims), q
  projected from x or (query_rank) from RMSNorm(x W_DQ)."""
  encoding = _rotary()
  settings = KVSettings(latent=LatentKV.Settings(RANK, query_rank=query_rank))
  layer = randomise(MultiHeadAttention(D_MODEL, H, dataclasses.replace(LATENT, kv_settings=settings),
                                        encoding=encoding, causal=True, rngs=nnx.Rngs(0)))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, T, D_MODEL)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = Mask(jnp.ones((2, T), jnp.int32), jnp.ones((2, T), jnp.int32), pos, pos, causal=True)
  got = layer.self_attend(x, mask, encoding)

  p = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
  r, d = 2, HEAD_DIM
  c = _rms(x @ p["latent"]["down"]["kernel"], p["latent"]["norm"]["scale"])
  up = (c @ p["latent"]["up"]["kernel"]).reshape(2, T, H, 2 * d - r)
  k_c, v = up[..., :d - r], up[..., d - r:]
  k_r = rope((x @ p["latent"]["rotary_key"]["kernel"])[:, :, None, :], pos, HALF)
  k = jnp.concatenate([jnp.broadcast_to(k_r, (2, T, H, r)), k_c], -1)
  q_in = _rms(x @ p["latent"]["query_down"]["kernel"], p["latent"]["query_norm"]["scale"]) if (
      query_rank) else x
  assert p["query"]["kernel"].shape == (query_rank or D_MODEL, D_MODEL)
  q = (q_in @ p["query"]["kernel"]).reshape(2, T, H, d)
  q = jnp.concatenate([rope(q[..., :r], pos, HALF), q[..., r:]], -1)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d)
  logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
  heads = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(2, T, D_MODEL)
  np.testing.assert_allclose(got, heads @ p["out"]["kernel"], rtol=2e-5, atol=2e-5)

  layer.init_self_cache(2, 12)
  assert layer.cache.k[...].shape == (2, 12, RANK) and layer.cache.v[...].shape == (2, 12, r)
  assert not hasattr(layer, "key") and not hasattr(layer, "value")


def _config(position, arch="decoder", **kw):
  tiny = {**TINY_MODEL, "d_model": D_MODEL, "num_heads": H, "num_decoder_layers": 2}
  return ModelConfig(**tiny, position=position, position_settings=PositionSettings(rotary=HALF),
                     arch=arch,
                     attention=LATENT, **kw)


@pytest.mark.parametrize("position,query_rank", [("rotary", 0), ("alibi", 8)])
def test_cached_generation_equals_the_full_pass_decoder_only(position, query_rank):
  settings = KVSettings(latent=LatentKV.Settings(RANK, query_rank=query_rank))
  config = _config(position)
  config = dataclasses.replace(config, attention=dataclasses.replace(config.attention,
                                                                     kv_settings=settings))
  model = randomise(make_model(config, rngs=nnx.Rngs(0)))
  assert_generation_is_the_full_pass(model)


def test_cached_decoding_equals_the_full_pass_encoder_decoder():
  """The decoder's self-attention latent (its cross-attention keeps per-head K/V)."""
  model = randomise(EncoderDecoder(_config("rotary", arch="encoder_decoder"),
                                    rngs=nnx.Rngs(0)))
  assert model.decoder.layers[0].cross_attention.latent is None
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 13, (2, 7)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("change", "words"), [
    ({"num_kv_heads": 2}, "takes no model.num_kv_heads"),
    ({"attention": dataclasses.replace(LATENT, qk_norm="rmsnorm")}, "no model.attention.qk_norm"),
    ({"position_settings": PositionSettings()}, "rotated_fraction below 1"),
    ({"position": "xpos"}, "rotates all 4 dimensions"),
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
  for field in ("rank", "query_rank"):
    with pytest.raises(ConfigError, match=field):
      parse(make_tiny_config(**{f"model.attention.kv_settings.latent.{field}": -1}))
