"""Layer-wise patterns (transformer/model/layer_pattern.py): model.position and
model.attention.window naming an entry per layer, cycled over each stack. A pattern's stack
is its layers taken one by one from uniform models; the entries' settings are the run's
identity; every layer's kernel is chosen for what it needs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.core import fields
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.model import layer_pattern
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.embeddings import inputs_mask
from transformer.model.families import make_model
from transformer.model.positions import PER_LAYER, POSITIONS, PositionPattern
from transformer.run import config as config_lib

# 3 decoder layers: a pattern of 2 or 4 entries repeats; 2 encoder layers: the second takes a
# pattern's second entry
TINY = {**TINY_MODEL, "num_encoder_layers": 2, "num_decoder_layers": 3, "max_len": 64,
        "arch": "decoder", "norm": "pre"}


def test_entries_are_cycled_over_the_layers():
  assert layer_pattern.entries("rotary") == ("rotary",)
  assert layer_pattern.entries("rotary+rotary+rotary+none") == ("rotary",) * 3 + ("none",)
  assert [layer_pattern.of_layer("rotary+rotary+rotary+none", i) for i in range(6)] == [
      "rotary", "rotary", "rotary", "none", "rotary", "rotary"]
  assert layer_pattern.period("a+b", "x+y+z") == 6
  assert layer_pattern.period("a", "x") == 1


def test_only_encodings_acting_inside_the_layers_may_vary_per_layer():
  """PER_LAYER is derived from the declarations: an encoding declaring `embeds` adds to the
  embeddings (and only those do), and a pattern naming one is refused with every allowed
  entry named."""
  x, positions = jnp.zeros((1, 5, 8)), jnp.arange(5)[None]
  for name, cls in POSITIONS.items():
    encoding = cls(8, 2, 16, causal=True, rngs=nnx.Rngs(0))
    assert cls.embeds == bool(np.any(encoding.embed(x, positions) != 0)), name
  assert set(PER_LAYER) == {"none", "rotary", "xpos", "alibi", "t5", "kerple", "fire", "cope"}
  with pytest.raises(FieldError, match=(
      r"position='learned\+rotary' is not allowed; .* a pattern of alibi, cope, fire, kerple, "
      r"none, rotary, t5, xpos joined by '\+'.*'learned' adds to the embeddings")):
    ModelConfig(**TINY, position="learned+rotary")


@pytest.mark.parametrize("value,allowed,bad", [
    ("rotary+rotry", "alibi, cope, fire", "'rotry' is not among them"),
    ("rotary+", "alibi, cope, fire", "an entry is empty")])
def test_a_bad_position_pattern_names_its_entry(value, allowed, bad):
  with pytest.raises(FieldError, match=f"position='{value}'".replace("+", r"\+")) as e:
    ModelConfig(**TINY, position=value)
  assert allowed in str(e.value) and bad in str(e.value)


def test_a_bad_window_pattern_names_its_entry():
  with pytest.raises(FieldError, match=r"window='local\+global' is not allowed.*full, local.*"
                                       r"'global' is not among them"):
    AttentionConfig(window="local+global")
  with pytest.raises(FieldError, match="random_positions=True"):
    ModelConfig(**TINY, random_positions=True, attention=AttentionConfig(window="full+local"))
  with pytest.raises(ConfigError, match="position 'cope' is defined for causal self-attention"):
    make_model(ModelConfig(**{**TINY, "arch": "encoder_decoder"}, position="rotary+cope"),
               rngs=nnx.Rngs(0))


def _copied(target, source):
  """target with source's parameters at the paths both have."""
  def merge(ours, theirs):
    return {k: merge(v, theirs.get(k)) if isinstance(v, dict) else theirs.get(k, v)
            for k, v in ours.items()} if isinstance(theirs, dict) else ours

  state = nnx.state(target, nnx.Param)
  nnx.replace_by_pure_dict(state, merge(nnx.to_pure_dict(state),
                                        nnx.to_pure_dict(nnx.state(source, nnx.Param))))
  nnx.update(target, state)
  return target


def _randomised(model, seed=0):
  """model with every parameter drawn at random (biases and zero-initialised tables act)."""
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(pure))))
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x: 0.3 * jax.random.normal(next(keys), x.shape), pure))
  nnx.update(model, state)
  return model


@pytest.mark.parametrize("position,window", [
    ("rotary+none", "full"),  # a RoPE/NoPE hybrid (layer 2 rotary again)
    ("fire+alibi", "full"),  # FIRE's MLP shared by layers 0 and 2
    ("rotary", "local+full"),  # local and global attention alternating
    ("t5+rotary+none", "full+local")])  # period 6 over 3 layers
def test_a_pattern_stack_equals_its_layers_taken_from_uniform_models(position, window):
  """Layer i of the pattern's stack computes what layer i of a uniform model of its entries
  computes (same parameters, that model's encoding and window), layer after layer; and the
  pattern's stack is neither uniform model."""
  cfg = ModelConfig(**TINY, position=position,
                    attention=AttentionConfig(window=window, window_size=2))
  model = _randomised(make_model(cfg, rngs=nnx.Rngs(0)))
  kinds = [(layer_pattern.of_layer(position, i), layer_pattern.of_layer(window, i))
           for i in range(cfg.num_decoder_layers)]
  uniform = {}
  for kind in kinds:
    if kind not in uniform:
      one = make_model(dataclasses.replace(cfg, position=kind[0], attention=dataclasses.replace(
          cfg.attention, window=kind[1])), rngs=nnx.Rngs(1))
      uniform[kind] = _copied(one, model)  # embeddings, layers, final norm
      if isinstance(model.decoder.position, PositionPattern):  # the entry's shared parameters
        nnx.update(one.decoder.position, nnx.state(model.decoder.encodings()[kind[0]]))
  batch = {"inputs": jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 9)), jnp.int32)}
  inputs, mask = inputs_mask(batch, causal=True)
  x = model.embeddings.target(inputs)
  for i, kind in enumerate(kinds):
    stack = uniform[kind].decoder
    x = stack.layers[i](x, dataclasses.replace(mask, window=stack.windows[0]), stack.position,
                        None)
  by_hand = model.embeddings.logits(model.decoder.final_norm(x))
  np.testing.assert_allclose(model(batch), by_hand, rtol=2e-5, atol=2e-5)
  for one in uniform.values():
    assert np.max(np.abs(one(batch) - by_hand)) > 1e-3


def test_each_entry_is_built_once_per_stack_and_its_settings_are_the_identity():
  cfg = ModelConfig(**TINY, position="rotary+fire+rotary+fire")
  model = make_model(cfg, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert list(params["decoder"]["position"]["encodings"]) == ["fire"]  # rotary has none
  assert model.decoder.encodings()["fire"] is model.decoder.position.for_layer(3)
  identity = fields.identity(cfg, "model.")
  assert identity["model.position_settings.rotary.base"] == 10000.0
  assert identity["model.position_settings.fire.width"] == 32
  assert not any(".alibi." in path for path in identity)
  assert "model.position_settings.rotary.scaling" in fields.in_use(cfg, "model.")


def test_a_pattern_run_is_evaluated_with_a_scaling_of_its_rotary_layers(tiny_config):
  """The rotary entry's scaling is an execution field of a RoPE/NoPE hybrid as of a rotary
  run: eval.py may override it (run/overrides.py); its base may not."""
  from transformer.run import overrides  # noqa: PLC0415

  cfg = config_lib.parse(tiny_config(**{"model.position": "rotary+none"}))
  new, applied = overrides.apply(cfg, {"model.position_settings.rotary.scaling": "linear",
                                       "model.position_settings.rotary.factor": "2"})
  assert applied == {"model.position_settings.rotary.scaling": "linear",
                     "model.position_settings.rotary.factor": 2.0}
  with pytest.raises(ConfigError, match="rotary.base is part of the run's identity"):
    overrides.apply(cfg, {"model.position_settings.rotary.base": "500"})
