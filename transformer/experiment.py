"""Wiring: builds the task, model and optimizer from an ml_collections config.

The only module that reads the config object; everything it builds takes plain values.
"""

import dataclasses

import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from transformer import optim
from transformer.attention import AttentionConfig
from transformer.model import ModelConfig, Transformer
from transformer.registry import ConfigError


def _dataclass_from(cls, section: ml_collections.ConfigDict, name: str, **extra):
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(section.keys()) - fields)
  if unknown:
    raise ConfigError(f"unknown field(s) {', '.join(unknown)} in config.{name}; "
                      f"fields: {', '.join(sorted(fields - set(extra)))}")
  return cls(**{**section.to_dict(), **extra})


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  model = config.model.to_dict()
  attention = _dataclass_from(AttentionConfig, ml_collections.ConfigDict(model.pop("attention")),
                              "model.attention")
  return _dataclass_from(ModelConfig, ml_collections.ConfigDict(model), "model",
                         vocab_size=vocab_size, attention=attention)


def build_model(config: ml_collections.ConfigDict, vocab_size: int, seed: int) -> Transformer:
  return Transformer(model_config(config, vocab_size), rngs=nnx.Rngs(params=seed))


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  return optim.rsqrt_schedule(config.model.d_model, config.train.warmup_steps,
                              config.train.learning_rate)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optim.make_optimizer(make_schedule(config), weight_decay=config.train.weight_decay,
                              grad_clip_norm=config.train.grad_clip_norm)


def make_init(config: ml_collections.ConfigDict, vocab_size: int, optimizer):
  """Returns (graphdef, init) where init() builds the train state: a dict of
  `step`, `params` (a pure dict) and `opt_state`."""
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: build_model(config, vocab_size, config.seed)))

  def init():
    params = nnx.to_pure_dict(nnx.state(build_model(config, vocab_size, config.seed)))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer.init(params)}

  return graphdef, init
