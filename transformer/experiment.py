"""Wiring: builds the model, optimizer and initial train state from an ml_collections config.

Data sources are built from the config in transformer/data/sources.py; the model and
optimizer modules themselves take plain values, never the config object.
"""

import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from transformer import optim
from transformer.attention import AttentionConfig
from transformer.model import ModelConfig, Transformer
from transformer.registry import dataclass_from


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
  model = config.model.to_dict()
  attention = dataclass_from(AttentionConfig, model.pop("attention"), "model.attention")
  return dataclass_from(ModelConfig, model, "model", vocab_size=vocab_size, attention=attention)


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
