"""The train step: one pure function of (train state, batch), jitted once over the mesh with
the state's and the batch's shardings; what it minimises, in one place: batch_sums (logits →
loss → metrics). The training loop (training.py), the benchmarks and the tests run the same
compiled step."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from transformer.core.metrics import loss_head_metrics
from transformer.model.embeddings import target_weights
from transformer.run import experiment, sharding


def batch_sums(model, batch: dict[str, jax.Array], rngs: nnx.Rngs, *,
               label_smoothing: float = 0.0, loss_chunks: int = 1, z_loss: float = 0.0
               ) -> dict[str, jax.Array]:
  """What the train step minimises, and the metrics it logs, as sums over a batch's target
  tokens (weight w = 1 on a scored target, 0 on padding: embeddings.target_weights; ε = label_smoothing):

    logits [b, t, V] = y · w_outᵀ + bias, y = model.features(batch) [b, t, d] (the last
                       hidden states), (w_out [V, d], bias [V] or None) = model.projection
    loss             = Σ w · (logsumexp(logits) − (1 − ε)·logit_target − ε·mean(logits))
                       + z_loss · Σ w · logsumexp(logits)²
    metrics          nll (the loss at ε = 0 without z-loss), correct (the target's logit is a
                     largest), tokens (Σ w), z_loss (its term, when z_loss > 0)

  = core/metrics.py token_metrics(model(batch), ...) (plus the z-loss term), computed by the
  loss head (loss_head_metrics): the logits of 1/loss_chunks of the tokens at a time, with
  the loss's gradient in the same pass, so that the [b·t, V] logits never exist whole.
  `rngs`: dropout."""
  y = model.features(batch, rngs=rngs)  # [b, t, d]
  w_out, bias = model.projection(y.dtype)  # [V, d], [V] or None
  flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731 - [b, t, ...] -> [b·t, ...]
  weights = flat(target_weights(batch)).astype(jnp.float32)
  return loss_head_metrics(flat(y), w_out, bias, flat(batch["targets"]), weights,
                           label_smoothing, loss_chunks, z_loss)


def make_train_step(graphdef, optimizer, schedule, *, label_smoothing: float, seed: int,
                    accumulation_steps: int = 1, loss_chunks: int = 1, z_loss: float = 0.0):
  """(state, batch) -> (state, metric sums); dropout keys are folded from (seed, step), so
  a resumed run draws the same masks as an uninterrupted one.

  With accumulation_steps = k the batch is split into k micro-batches (rows i, i+k, ...)
  whose gradients of the summed loss are added up before dividing by the batch's token
  count: the update of the whole batch, in 1/k of the activation memory.

  The loss and the metric sums: batch_sums (label_smoothing, loss_chunks, z_loss).

  A step whose loss, gradient norm or update norm is not finite leaves the parameters and
  optimizer state as they were (the step counter still advances, so the data moves on);
  its sums are zero but for `nonfinite` = 1. optax.apply_if_finite does the same but adds
  counters to the optimizer state, which would change the checkpoints' structure.
  """

  def summed_loss(params, batch, key):
    sums = batch_sums(nnx.merge(graphdef, params), batch, nnx.Rngs(dropout=key),
                      label_smoothing=label_smoothing, loss_chunks=loss_chunks, z_loss=z_loss)
    return sums["loss"], sums

  grad_fn = jax.grad(summed_loss, has_aux=True)

  def gradients(params, batch, key):
    if accumulation_steps == 1:
      return grad_fn(params, batch, key)
    k = accumulation_steps
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                         batch)

    def add_micro_batch(total, xs):
      part = grad_fn(params, xs[0], jax.random.fold_in(key, xs[1]))
      return jax.tree.map(jnp.add, total, part), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, batch, key))
    return jax.lax.scan(add_micro_batch, zeros, (micro, jnp.arange(k)))[0]

  def train_step(state, batch, seed=seed):  # compile_step passes the seed as an argument
    key = jax.random.fold_in(jax.random.key(seed), state["step"])
    grads, sums = gradients(state["params"], batch, key)
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    grad_norm = optax.tree.norm(grads)
    finite = (jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
              & jnp.isfinite(optax.tree.norm(updates)))
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, optax.apply_updates(state["params"], updates), state["params"])
    sums = {k: jnp.where(finite, v, 0.0) for k, v in {**sums, "grad_norm": grad_norm}.items()}
    sums["nonfinite"] = (~finite).astype(jnp.float32)
    sums["learning_rate"] = schedule(state["step"])
    new_state = {"step": state["step"] + 1, "params": params,
                 "opt_state": jax.tree.map(keep, opt_state, state["opt_state"])}
    return new_state, sums

  return train_step


class CompiledStep(NamedTuple):
  """The train step of an experiment, wired to its mesh: what the training loop, the
  benchmarks and tests run, so that they all time and test the same computation."""

  state_sharding: Any  # a NamedSharding per leaf of the train state
  batch_sharding: NamedSharding  # batch rows over the mesh's data and fsdp axes
  init: Callable[[], dict]  # jitted: the initial state, laid out by state_sharding
  step: Callable  # jitted (state, batch) -> (state, metric sums); donates the state


class _Seeded:
  """A jitted (or compiled) fn(state, batch, seed) called as fn(state, batch) with a given
  seed; .lower(state, batch).compile() gives the same (benchmarks/train_step.py reads the
  compiled program: its other attributes are the wrapped one's)."""

  def __init__(self, fn, seed):
    self.fn, self.seed = fn, seed

  def __call__(self, state, batch):
    return self.fn(state, batch, self.seed)

  def lower(self, state, batch):
    return _Seeded(self.fn.lower(state, batch, self.seed), self.seed)

  def compile(self):
    return _Seeded(self.fn.compile(), self.seed)

  def __getattr__(self, name):
    return getattr(self.fn, name)


def compile_step(exp: experiment.Experiment) -> CompiledStep:
  """The one place the train state's sharding and the jitted step are built from an
  experiment's config (train.label_smoothing, accumulation_steps, loss_chunks, z_loss,
  seed).

  The seed is an argument of the compiled initialisation and step, not a constant in them:
  every seed of a sweep runs the same two programs, which the persistent compilation cache
  then holds once (run/compile_cache.py). The keys are those of the seed as a constant
  (jax.random.key of a uint32 is the int's key), so the results are the same; a seed from
  2**32 on, which a uint32 cannot hold, stays a constant."""
  cfg, seed = exp.train, exp.config.seed
  state_sharding = sharding.state_shardings(jax.eval_shape(exp.init), exp.param_specs,
                                            exp.optimizer, exp.mesh)
  batch_sharding = sharding.batch_sharding(exp.mesh)
  replicated = NamedSharding(exp.mesh, PartitionSpec())
  step = make_train_step(exp.graphdef, exp.optimizer, exp.schedule,
                         label_smoothing=cfg.label_smoothing, seed=seed,
                         accumulation_steps=cfg.accumulation_steps, loss_chunks=cfg.loss_chunks,
                         z_loss=cfg.z_loss)
  if seed < 2**32:
    argument = np.uint32(seed)
    init = jax.jit(exp.init, in_shardings=(replicated,), out_shardings=state_sharding)
    jitted = jax.jit(step, in_shardings=(state_sharding, batch_sharding, replicated),
                     out_shardings=(state_sharding, None), donate_argnums=0)
    return CompiledStep(state_sharding, batch_sharding, lambda: init(argument),
                        _Seeded(jitted, argument))
  return CompiledStep(state_sharding, batch_sharding,
                      jax.jit(exp.init, out_shardings=state_sharding),
                      jax.jit(step, in_shardings=(state_sharding, batch_sharding),
                              out_shardings=(state_sharding, None), donate_argnums=0))
