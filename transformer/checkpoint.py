"""Orbax checkpoints of the train state (a pytree of arrays) under `workdir/checkpoints`."""

import os

import jax
import orbax.checkpoint as ocp

from transformer.registry import ConfigError


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def manager(workdir: str, *, max_to_keep: int | None = None, read_only: bool = False):
  """A CheckpointManager that saves asynchronously and keeps the last `max_to_keep`."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=not read_only, read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state) -> None:
  """Starts an asynchronous save of `state` at `step` (never replaces an existing step)."""
  if step not in mngr.all_steps():
    mngr.save(step, args=ocp.args.StandardSave(state), force=True)


def restore(mngr: ocp.CheckpointManager, abstract_state, shardings, step: int | None = None):
  """Restores `step` (default: the latest) into the structure and shapes of `abstract_state`
  (e.g. from jax.eval_shape), placed with `shardings` (a matching pytree), so a checkpoint
  loads onto whatever mesh the current run has. Returns (step, state)."""
  steps = mngr.all_steps()
  if not steps:
    raise ConfigError(f"no checkpoints in {mngr.directory}")
  step = max(steps) if step is None else step
  if step not in steps:
    raise ConfigError(f"no checkpoint at step {step} in {mngr.directory}; steps: {sorted(steps)}")
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        abstract_state, shardings)
  return step, mngr.restore(step, args=ocp.args.StandardRestore(target))
