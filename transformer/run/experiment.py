"""Wiring: builds the parts of a typed Config (transformer/run/config.py) — data source, model
family, optimizer, mesh — and checks the constraints between sections: the family learns
what the source's batches hold, the batch splits over the mesh, the positional encoding
covers the longest sequences; each attention layer's kernel is chosen for this backend and
mesh (transformer/model/kernels/choice.py). The model is traced once abstractly, which runs
its constructors' checks. Nothing is written.
"""

import dataclasses
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.data import SourceArgs
from transformer.data.base import DataSource
from transformer.model.config import ModelConfig
from transformer.model.families import ARCHS, ModelFamily, make_model
from transformer.model.kernels import Target, kernel_choices, kernel_warnings
from transformer.model.positions import CausalOnly
from transformer.run import optim, sharding, tracking
from transformer.run.config import Config, EvalConfig, TrainConfig

log = logging.getLogger("transformer")


@dataclasses.dataclass(frozen=True)
class Experiment:
  """The parts of a checked Config."""

  config: Config
  source: DataSource
  family: type[ModelFamily]
  abstract_model: ModelFamily  # the model's structure and shapes (nnx.eval_shape), no values
  graphdef: nnx.GraphDef
  param_specs: dict  # the parameters' declared PartitionSpecs (sharding.param_specs)
  mesh: Mesh
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  init: Callable[[], dict]  # builds the train state: {"step", "params" (a pure dict), "opt_state"}

  @property
  def model(self) -> ModelConfig:
    return self.config.model

  @property
  def train(self) -> TrainConfig:
    return self.config.train

  @property
  def eval(self) -> EvalConfig:
    return self.config.eval


def build(cfg: Config, workdir: str | None = None, *, evaluating: bool = False,
          announce: bool = True) -> Experiment:
  """Checks `cfg` (module docstring) and returns its parts; writes nothing. `evaluating`: the
  run is evaluated here, not trained, so the execution choices of its training need not
  hold on this machine: the mesh is every device on `data`, a kernel refused or emulated
  here is replaced (transformer/model/kernels/choice.py), and its trackers (W&B) need not be installed.
  `announce`: log the attention kernels chosen, once per distinct choice (off for a sweep
  that only checks its runs)."""
  source = make_source(cfg, workdir)
  family = lookup(ARCHS, cfg.model.arch, "model arch")
  if source.targets not in family.learns:
    fitting = [name for name, f in ARCHS.items() if source.targets in f.learns]
    instead = source.alternatives(family.learns)
    raise ConfigError(f"config.model.arch={cfg.model.arch!r} cannot learn data.source "
                      f"{cfg.data.source!r} ({source.targets.value}); it needs one of: "
                      f"{', '.join(fitting)}" + (f"; or keep model.arch {cfg.model.arch!r} "
                                                 f"with {instead}" if instead else ""))
  family.check_targets(cfg.model, source.targets, cfg.data.source)
  sampling = cfg.eval.sampling
  if not (sampling.greedy or family.decodes or family.generates):
    raise ConfigError(f"config.eval.sampling ({sampling}) would change nothing: model.arch "
                      f"{cfg.model.arch!r} neither decodes nor generates (its held-out splits "
                      "are scored token by token); set config.eval.sampling.temperature=0 "
                      "and its filters off (top_k=0, top_p=1, min_p=0)")
  schedule = optim.SCHEDULES[cfg.train.schedule](cfg.model.d_model, cfg.train.warmup_steps,
                                  cfg.train.learning_rate)
  optimizer = optim.make_optimizer(schedule, weight_decay=cfg.train.weight_decay,
                                   grad_clip_norm=cfg.train.grad_clip_norm)
  mesh = sharding.make_mesh(None if evaluating else dataclasses.asdict(cfg.mesh))
  if not evaluating:
    sharding.check_batch_size(cfg.train.batch_size, mesh, cfg.train.accumulation_steps)
    tracking.check(cfg.train)  # wandb installed, if the run logs to it
  sharding.check_kv_heads(cfg.model.num_heads, cfg.model.num_kv_heads, mesh)
  # Each attention layer's kernel is chosen for this backend, mesh and purpose.
  target = Target(jax.default_backend(), mesh.abstract_mesh, evaluating)

  def make(seed=cfg.seed):  # seed: an int, or a traced one (run/step.py's one program)
    return make_model(cfg.model, rngs=nnx.Rngs(params=jax.random.key(seed)), target=target)

  try:
    abstract_model = nnx.eval_shape(make)  # runs the constructors' checks
  except CausalOnly as e:  # say which configs take it: model.arch=decoder alone may not fit
    raise ConfigError(f"{e}; decoder-only configs take it, e.g. "
                      f"{'; '.join(decoder_only_commands(cfg.model.position))}") from None
  if announce:
    for line in kernel_choices(abstract_model):
      log.info("attention %s", line)
    for line in kernel_warnings(abstract_model):
      log.warning("%s", line)

  def init(seed=cfg.seed):
    params = nnx.to_pure_dict(nnx.state(make(seed)))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer.init(params)}

  for what, length in source.max_lengths().items():
    check_length(abstract_model, length, what)
  return Experiment(cfg, source, family, abstract_model, nnx.graphdef(abstract_model),
                    sharding.param_specs(abstract_model), mesh, optimizer, schedule, init)


# Configs of a decoder-only model (model.arch=decoder), with the overrides that make one:
# an encoding defined for causal self-attention only fits them (tests/test_cope.py builds each).
DECODER_ONLY = (("configs/lm_extrapolation.py", ()), ("configs/mqar.py", ()),
                ("configs/chomsky.py", ("data.cast=decoder", "model.arch=decoder")))


def decoder_only_commands(position: str) -> list[str]:
  """Commands that train a decoder-only model with `position` (DECODER_ONLY)."""
  return [" ".join(["python train.py --config", path, "--workdir workdirs/" + position,
                    *(f"--config.{o}" for o in (*overrides, f"model.position={position}"))])
          for path, overrides in DECODER_ONLY]


def make_source(cfg: Config, workdir: str | None = None) -> DataSource:
  """The data source of cfg.data.source, given its sections and what every source takes."""
  return cfg.source(cfg.data, cfg.task, SourceArgs(
      seed=cfg.seed, batch_size=cfg.train.batch_size, eval_examples=cfg.eval.num_examples,
      workdir=workdir))


def check_length(model: ModelFamily, length: int, what: str) -> None:
  """A ConfigError if `what` (a config field or a data split) gives sequences of `length`
  tokens that a stack's positional encoding cannot encode (a learned table)."""
  for stack in model.stacks().values():
    try:
      stack.check_length(length)
    except ConfigError as e:
      raise ConfigError(f"{what} gives sequences of {length} tokens: {e}") from None
