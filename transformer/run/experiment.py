"""Wiring: builds the parts of a typed Config (transformer/run/config.py) — data source, model
family, optimizer, mesh — and checks the constraints between sections: the family learns
what the source's batches hold, the batch splits over the mesh, the positional encoding
covers the longest sequences, the attention kernel runs on this backend. The model is traced
once abstractly, which runs its constructors' checks. Nothing is written.
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
from transformer.model.families import ARCHS, ModelFamily
from transformer.model.kernel_choice import AUTO, kernel_choices
from transformer.model.kernels import KERNELS
from transformer.run import optim, sharding, tracking
from transformer.run.config import Config, EvalConfig, TrainConfig, replace

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


def build(cfg: Config, workdir: str | None = None, *, evaluating: bool = False) -> Experiment:
  """Checks `cfg` (module docstring) and returns its parts; writes nothing. `evaluating`: the
  run is evaluated here, not trained, so the execution choices of its training need not
  hold on this machine: a kernel this backend cannot run is replaced by its stand-in, and
  the mesh is every device on `data`, and its trackers (W&B) need not be installed."""
  cfg = runnable_kernel(cfg, substitute=evaluating)
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
  make = lambda: family(cfg.model, rngs=nnx.Rngs(params=cfg.seed))  # noqa: E731
  try:
    abstract_model = nnx.eval_shape(make)  # runs the constructors' checks
  except ConfigError as e:
    if not evaluating or cfg.model.attention.kernel == AUTO:
      raise
    # A kernel is an execution choice: one refused here (a newer check, another dtype) need
    # not keep a trained run from being evaluated.
    log.info("model.attention.kernel %r cannot run this model here (%s); evaluating with "
             "'auto'", cfg.model.attention.kernel, e)
    cfg = replace(cfg, "model.attention.kernel", AUTO)  # `make` reads cfg when called
    abstract_model = nnx.eval_shape(make)
  for line in kernel_choices(abstract_model):  # what `auto` chose, once per layer
    log.info("attention %s", line)

  def init():
    params = nnx.to_pure_dict(nnx.state(make()))
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": optimizer.init(params)}

  mesh = sharding.make_mesh(None if evaluating else dataclasses.asdict(cfg.mesh))
  if not evaluating:
    sharding.check_batch_size(cfg.train.batch_size, mesh, cfg.train.accumulation_steps)
    tracking.check(cfg.train)  # wandb installed, if the run logs to it
  sharding.check_kv_heads(cfg.model.num_heads, cfg.model.num_kv_heads, mesh)
  check_kernels_on_mesh(abstract_model, mesh)
  for what, length in source.max_lengths().items():
    check_length(abstract_model, length, what)
  return Experiment(cfg, source, family, abstract_model, nnx.graphdef(abstract_model),
                    sharding.param_specs(abstract_model), mesh, optimizer, schedule, init)


def make_source(cfg: Config, workdir: str | None = None) -> DataSource:
  """The data source of cfg.data.source, given its sections and what every source takes."""
  return cfg.source(cfg.data, cfg.task, SourceArgs(
      seed=cfg.seed, batch_size=cfg.train.batch_size, eval_examples=cfg.eval.num_examples,
      workdir=workdir))


def runnable_kernel(cfg: Config, substitute: bool) -> Config:
  """`cfg` if its attention kernel runs on this backend. Otherwise a ConfigError, or with
  `substitute` (evaluating a run trained elsewhere) a copy using the kernel's stand-in that
  computes the same function here, with a log line."""
  name = cfg.model.attention.kernel
  if name == AUTO:  # chosen per layer for this backend
    return cfg
  kernel, backend = KERNELS[name], jax.default_backend()
  if backend in kernel.slow_on:
    if substitute:
      log.info("model.attention.kernel %r runs emulated on %s; evaluating with %r, which "
               "computes the same function", name, backend, kernel.stand_in)
      return replace(cfg, "model.attention.kernel", kernel.stand_in)
    log.warning("model.attention.kernel %r runs emulated on %s (Pallas' interpret mode): "
                "slow, for tests; %r computes the same function here", name, backend,
                kernel.stand_in)
  if kernel.backends is None or backend in kernel.backends:
    return cfg
  if not substitute:
    raise ConfigError(f"model.attention.kernel={name!r} runs on {' or '.join(kernel.backends)} "
                      f"only; this machine's JAX backend is {backend}: use "
                      f"{kernel.stand_in!r} (the same computation) or 'reference'")
  log.info("model.attention.kernel %r does not run on %s; using %r, which computes the same "
           "function", name, backend, kernel.stand_in)
  return replace(cfg, "model.attention.kernel", kernel.stand_in)


def check_kernels_on_mesh(model: ModelFamily, mesh: Mesh) -> None:
  """A ConfigError if an attention layer's kernel cannot be partitioned over a mesh of
  several devices (Kernel.multi_device) and the mesh has more than one."""
  if mesh.size == 1:
    return
  for _, node in nnx.iter_modules(model):
    choice = getattr(node, "kernel_choice", None)
    if choice is not None and not KERNELS[choice.name].multi_device:
      raise ConfigError(f"model.attention.kernel={choice.name!r} runs on one device (its "
                        f"kernel is not partitioned over a mesh yet) and this run's mesh has "
                        f"{mesh.size}; use kernel 'auto' or "
                        f"{' or '.join(repr(k) for k, v in KERNELS.items() if v.multi_device)}")


def check_length(model: ModelFamily, length: int, what: str) -> None:
  """A ConfigError if `what` (a config field or a data split) gives sequences of `length`
  tokens that a stack's positional encoding cannot encode (a learned table)."""
  for stack in model.stacks().values():
    try:
      stack.check_length(length)
    except ConfigError as e:
      raise ConfigError(f"{what} gives sequences of {length} tokens: {e}") from None
