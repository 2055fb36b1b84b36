"""Wiring: builds the task, model and optimizer from an ml_collections config.

The only module that reads the config object; everything it builds takes plain values.
"""

import dataclasses

import grain
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from transformer import optim
from transformer.attention import AttentionConfig
from transformer.data import synthetic
from transformer.data.synthetic import SyntheticTask
from transformer.model import ModelConfig, Transformer
from transformer.registry import ConfigError


def _dataclass_from(cls, section: ml_collections.ConfigDict, name: str, **extra):
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(section.keys()) - fields)
  if unknown:
    raise ConfigError(f"unknown field(s) {', '.join(unknown)} in config.{name}; "
                      f"fields: {', '.join(sorted(fields - set(extra)))}")
  return cls(**{**section.to_dict(), **extra})


def make_task(config: ml_collections.ConfigDict) -> SyntheticTask:
  task = config.task.to_dict()
  task.pop("longer_max_len")
  return _dataclass_from(SyntheticTask, ml_collections.ConfigDict(task), "task")


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


def train_data(config: ml_collections.ConfigDict, task: synthetic.SyntheticTask):
  """The endless stream of training batches: a grain IterDataset whose iterators are
  checkpointable. Reading runs in background threads, ahead of the train step."""
  dataset = synthetic.train_dataset(task, config.seed, config.train.batch_size)
  return dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))


def eval_data(config: ml_collections.ConfigDict, task: synthetic.SyntheticTask):
  return synthetic.eval_splits(task, config.seed, config.eval.num_examples,
                               config.task.longer_max_len)
