"""Orbax checkpoints under `workdir/checkpoints`: each step holds the train state (a pytree
of arrays) as item `state` and the training data iterator's position as item `data`, so a
resumed run sees exactly the batches an uninterrupted run would."""

import os

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from transformer.registry import ConfigError


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def manager(workdir: str, *, max_to_keep: int | None = None, read_only: bool = False):
  """A CheckpointManager that saves asynchronously and keeps the last `max_to_keep`."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=not read_only, read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state, data_iterator) -> None:
  """Starts an asynchronous save of `state` and the data iterator's position at `step`
  (never replaces an existing step)."""
  if step not in mngr.all_steps():
    mngr.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)))


def restore(mngr: ocp.CheckpointManager, abstract_state, shardings, step: int | None = None,
            data_iterator=None):
  """Restores `step` (default: the latest) into the structure and shapes of `abstract_state`
  (e.g. from jax.eval_shape), placed with `shardings` (a matching pytree), so a checkpoint
  loads onto whatever mesh the current run has. A given grain `data_iterator` is moved to
  the saved position. Returns (step, state)."""
  steps = mngr.all_steps()
  if not steps:
    raise ConfigError(f"no checkpoints in {mngr.directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise ConfigError(f"no checkpoint at step {step} in {mngr.directory}; steps: {sorted(steps)}")
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract_state, shardings)
  items = {"state": ocp.args.StandardRestore(target)}
  if data_iterator is not None:
    items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
  return step, mngr.restore(step, args=ocp.args.Composite(**items))["state"]


def restore_average(mngr: ocp.CheckpointManager, abstract_state, shardings, step: int | None,
                    count: int):
  """The parameters averaged over the last `count` checkpoints up to `step` (default: the
  latest), as the paper averages its last 5. Returns (steps averaged, state of `step` with
  the averaged params)."""
  step, state = restore(mngr, abstract_state, shardings, step)
  steps = [s for s in sorted(mngr.all_steps()) if s <= step][-count:]
  if len(steps) < count:
    raise ConfigError(f"cannot average {count} checkpoints: {mngr.directory} holds "
                      f"{len(steps)} up to step {step}: {steps}")
  total = state["params"]
  for other in steps[:-1]:
    total = jax.tree.map(jnp.add, total, restore(mngr, abstract_state, shardings, other)[1]["params"])
  return steps, {**state, "params": jax.tree.map(lambda x: x / count, total)}
