"""Wiring: checks a whole config and builds its parts (data source, model, optimizer, mesh).

`build(config)` is the one place a config is validated: every section becomes a checked
dataclass (unknown keys, wrong types and out-of-range values are ConfigErrors naming the
field and what it allows), the model is traced once abstractly (constructor checks), and
the cross-field constraints are checked (batch vs mesh, sequence lengths vs a learned
position table, the attention kernel vs this backend). Nothing is written. The model and
optimizer modules themselves take plain values, never the config object.
"""

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh

from transformer import optim, sharding
from transformer.blocks import ModelConfig
from transformer.data import sources
from transformer.errors import ConfigError
from transformer.families import ARCHS, make_model
from transformer.fields import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, check_ranges,
                                dataclass_from)
from transformer.kernels import KERNELS
from transformer.positions import POSITIONS, make_positional_encoding
from transformer.registry import lookup

log = logging.getLogger("transformer")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """config.train: the optimiser and the training loop's schedule."""

  batch_size: int = 64  # rows per step over all devices and processes
  num_steps: int = 2000
  learning_rate: float = 1.0  # scale of lr = scale · d_model^-0.5 · min(n^-0.5, n·warmup^-1.5)
  warmup_steps: int = 4000
  label_smoothing: float = 0.1
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0  # 0: off
  accumulation_steps: int = 1  # micro-batches per step (gradients summed): the same update
  loss_chunks: int = 4  # logits of 1/loss_chunks of the target tokens at a time
  log_every: int = 100
  eval_every: int = 0  # 0: only at the end
  eval_examples: int = 0  # per held-out split during training; 0: eval.num_examples
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3  # the latest ones; the lowest-loss checkpoint is kept besides
  skip_nonfinite: int = 0  # consecutive non-finite steps skipped before the run stops
  profile_steps: int = 0  # steps traced by jax.profiler into WORKDIR/profile; 0: none

  def __post_init__(self):
    check_ranges(self, batch_size=AT_LEAST_1, num_steps=AT_LEAST_1, learning_rate=POSITIVE,
                 warmup_steps=AT_LEAST_1, label_smoothing=FRACTION, weight_decay=AT_LEAST_0,
                 grad_clip_norm=AT_LEAST_0, accumulation_steps=AT_LEAST_1,
                 loss_chunks=AT_LEAST_1, log_every=AT_LEAST_1, eval_every=AT_LEAST_0,
                 eval_examples=AT_LEAST_0, checkpoint_every=AT_LEAST_1,
                 keep_checkpoints=AT_LEAST_1, skip_nonfinite=AT_LEAST_0,
                 profile_steps=AT_LEAST_0)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """config.eval: held-out evaluation (eval.py, and during training)."""

  num_examples: int = 0  # per held-out split; 0: all (text sources)
  batch_size: int = 128

  def __post_init__(self):
    check_ranges(self, num_examples=AT_LEAST_0, batch_size=AT_LEAST_1)


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  return dataclass_from(TrainConfig, config.train.to_dict(), "train")


def model_config(config: ml_collections.ConfigDict, vocab_size: int,
                 num_classes: int = 0) -> ModelConfig:
  """config.model as a ModelConfig, each nested section (attention, the settings sections)
  checked; a model section written before the settings sections (an older run's
  config.json) is migrated first. vocab_size and num_classes come from the data source."""
  model = dataclass_from(ModelConfig, migrate_model(config.model.to_dict()), "model",
                         vocab_size=vocab_size, num_classes=num_classes)
  lookup(ARCHS, model.arch, "model arch")
  return model


# Flat model.attention fields of configs written before each scorer had its settings
# section: old name -> (scorer, its Settings field).
OLD_SCORE_FIELDS = {"additive_dim": ("additive", "dim"), "gaussian_sigma": ("gaussian", "sigma"),
                    "learn_sigma": ("gaussian", "learn_sigma")}


def migrate_model(model: dict) -> dict:
  """A config.model dict with the old flat scorer fields (OLD_SCORE_FIELDS) moved into
  attention.score_settings, where their values replace those given there."""
  attention = dict(model.get("attention", {}))
  old = {name: attention.pop(name) for name in OLD_SCORE_FIELDS if name in attention}
  if not old:
    return model
  sections = {key: dict(section) for key, section in attention.get("score_settings", {}).items()}
  for name, value in old.items():
    scorer, field = OLD_SCORE_FIELDS[name]
    sections.setdefault(scorer, {})[field] = value
  return {**model, "attention": {**attention, "score_settings": sections}}


def build_model(config: ml_collections.ConfigDict, vocab_size: int, seed: int,
                num_classes: int = 0) -> nnx.Module:
  """The model of config.model.arch (model.ARCHS)."""
  return make_model(model_config(config, vocab_size, num_classes), rngs=nnx.Rngs(params=seed))


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  train = train_config(config)
  return optim.rsqrt_schedule(config.model.d_model, train.warmup_steps, train.learning_rate)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  train = train_config(config)
  return optim.make_optimizer(make_schedule(config), weight_decay=train.weight_decay,
                              grad_clip_norm=train.grad_clip_norm)


def make_init(config: ml_collections.ConfigDict, vocab_size: int, optimizer,
              num_classes: int = 0):
  """Returns (graphdef, init) where init() builds the train state: a dict of
  `step`, `params` (a pure dict) and `opt_state`."""
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: build_model(config, vocab_size, config.seed, num_classes)))

  def init():
    params = nnx.to_pure_dict(nnx.state(
        build_model(config, vocab_size, config.seed, num_classes)))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer.init(params)}

  return graphdef, init


@dataclasses.dataclass(frozen=True)
class Experiment:
  """The parts of a validated config."""

  config: ml_collections.ConfigDict
  train: TrainConfig
  eval: EvalConfig
  model: ModelConfig
  source: Any  # a data source of transformer/data/sources.py
  mesh: Mesh
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  graphdef: nnx.GraphDef
  init: Callable[[], dict]  # builds the train state


def runnable_kernel(config: ml_collections.ConfigDict, substitute: bool) -> ml_collections.ConfigDict:
  """The config if its attention kernel runs on this backend. Otherwise a ConfigError, or
  with `substitute` (evaluating a run trained elsewhere) a copy using the kernel's
  stand-in that computes the same function here, with a log line."""
  name = config.model.attention.kernel
  kernel = KERNELS.get(name)
  backend = jax.default_backend()
  if kernel is None or kernel.backends is None or backend in kernel.backends:
    return config
  if not substitute:
    raise ConfigError(f"model.attention.kernel={name!r} runs on {' or '.join(kernel.backends)} "
                      f"only; this machine's JAX backend is {backend}: use "
                      f"{kernel.stand_in!r} (the same computation) or 'reference'")
  log.info("model.attention.kernel %r does not run on %s; using %r, which computes the same "
           "function", name, backend, kernel.stand_in)
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.attention.kernel = kernel.stand_in
  return config


def build(config: ml_collections.ConfigDict, workdir: str | None = None, *,
          evaluating: bool = False) -> Experiment:
  """Validates `config` (see the module docstring) and returns its parts; writes nothing.
  `evaluating`: the run is evaluated here, not trained, so the execution choices of its
  training need not hold on this machine: a kernel this backend cannot run is replaced by
  its stand-in, and the mesh is every device on `data`."""
  seed = config.get("seed")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ConfigError(f"config.seed={seed!r} is not allowed; it must be an integer ≥ 0")
  config = runnable_kernel(config, substitute=evaluating)
  train = train_config(config)
  evaluation = dataclass_from(EvalConfig, config.eval.to_dict(), "eval")
  source = sources.make_source(config, workdir)
  model = model_config(config, source.vocab_size, source.num_classes)
  if model.arch not in source.archs:
    raise ConfigError(f"config.model.arch={model.arch!r} cannot learn data.source "
                      f"{config.data.source!r}; it needs one of: {', '.join(source.archs)}")
  if model.arch == "encoder" and (model.pooling != "none") != source.pooled:
    raise ConfigError(
        f"config.model.pooling={model.pooling!r} does not fit data.source "
        f"{config.data.source!r}: {'cls or mean' if source.pooled else 'none'} "
        f"({'a label per sequence' if source.pooled else 'a label per token'})")
  optimizer = make_optimizer(config)
  # runs the constructors' checks
  graphdef, init = make_init(config, source.vocab_size, optimizer, source.num_classes)
  mesh = sharding.make_mesh(None if evaluating else config.mesh.to_dict())
  if not evaluating:
    sharding.check_batch_size(train.batch_size, mesh, train.accumulation_steps)
  for what, length in source.max_lengths().items():
    check_length(model, length, what)
  return Experiment(config, train, evaluation, model, source, mesh, optimizer,
                    make_schedule(config), graphdef, init)


def check_length(model: ModelConfig, length: int, what: str) -> None:
  """A ConfigError if `what` (a config field or a data split) gives sequences of `length`
  tokens that the model's positional encoding cannot encode (a learned table)."""
  causal_only = lookup(POSITIONS, model.position, "position").causal_only
  for causal in (True,) if causal_only else (False, True):  # the stacks it may serve
    encoding = nnx.eval_shape(lambda c=causal: make_positional_encoding(
        model.position, model.d_model, model.num_heads, model.max_len, causal=c,
        settings=model.position_settings, rngs=nnx.Rngs(0)))
    try:
      encoding.check_length(length)
    except ConfigError as e:
      raise ConfigError(f"{what} gives sequences of {length} tokens: {e}") from None
