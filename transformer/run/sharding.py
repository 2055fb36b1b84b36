"""The device mesh and the shardings of the train state and batches.

The mesh has three axes: `data` (batch split, parameters replicated), `fsdp` (batch split
and parameters/optimizer state split: ZeRO-3 style) and `tensor` (Megatron-style splits of
the attention heads, the FFN hidden units and the vocabulary). Each layer declares the mesh
axes of its parameters where it makes them (NNX `out_sharding` metadata, layers.mesh_axes);
undeclared parameters are replicated. The optimizer state follows its parameters through
optax's own structure (optax.tree_map_params). XLA's SPMD partitioner inserts the
collectives. The train step is one jax.jit with these explicit NamedShardings on 1 CPU, N
devices or several hosts alike.
"""

import math

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.core.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(shape: dict | None = None, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh; `shape` gives their sizes (default: all devices on data),
  one of which may be -1 for the devices left over."""
  devices = jax.devices() if devices is None else devices
  shape = dict(shape or {"data": -1})
  unknown = set(shape) - set(AXES)
  if unknown:
    raise ConfigError(f"unknown mesh axis {sorted(unknown)[0]!r}; choose from: {', '.join(AXES)}")
  sizes = [int(shape.get(axis, 1)) for axis in AXES]
  known = math.prod(s for s in sizes if s != -1)
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes) or len(devices) % known:
    raise ConfigError(f"mesh {dict(zip(AXES, sizes))} does not fit {len(devices)} devices "
                      "(sizes must multiply to the device count; at most one may be -1)")
  sizes = [len(devices) // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != len(devices):
    raise ConfigError(f"mesh {dict(zip(AXES, sizes))} has {math.prod(sizes)} devices; "
                      f"there are {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes), AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def process0_decides(value: bool) -> bool:
  """Process 0's `value` on every process: for decisions that lead into collectives (to
  evaluate or not, to train a sweep's run or skip it), which all processes must share."""
  if jax.process_count() == 1:
    return value
  return bool(multihost_utils.broadcast_one_to_all(np.int32(value)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def param_specs(abstract_model: nnx.Module) -> dict:
  """The PartitionSpec its layers declared for each of the model's parameters (P() where
  none), as a pure dict shaped like nnx.to_pure_dict(nnx.state(model)). The model may be
  abstract (nnx.eval_shape)."""
  return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(abstract_model)))


def fit_spec(spec: P, shape: tuple[int, ...], mesh) -> P:
  """`spec` for an array of `shape` on `mesh`, with any axis that does not divide its
  dimension dropped (that dimension is then not split)."""
  if len(spec) > len(shape):
    raise ValueError(f"{spec} names more dimensions than the array {shape} has")

  def divides(axes, dim):
    names = axes if isinstance(axes, tuple) else (axes,)
    return dim % math.prod(mesh.shape[a] for a in names) == 0

  return P(*(axes if axes is None or divides(axes, dim) else None
             for axes, dim in zip(spec, shape)))


def param_shardings(abstract_params, specs: dict, mesh) -> dict:
  """A NamedSharding per parameter (abstract_params: a pure dict of arrays or
  ShapeDtypeStructs; specs: param_specs of its model): for restoring parameters alone."""
  return jax.tree.map(lambda leaf, spec: NamedSharding(mesh, fit_spec(spec, leaf.shape, mesh)),
                      abstract_params, specs)


def state_shardings(abstract_state: dict, specs: dict,
                    optimizer: optax.GradientTransformation, mesh) -> dict:
  """A NamedSharding per leaf of the train state {"step", "params", "opt_state"}: the
  parameters' from `specs` (param_specs), each optimizer-state copy of the parameters
  (Adam's moments) as its parameter, found through the optimizer's own structure, and the
  rest (step, counts) replicated."""
  params = param_shardings(abstract_state["params"], specs, mesh)
  replicated = lambda _: NamedSharding(mesh, P())  # noqa: E731
  opt_state = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, abstract_state["opt_state"], params,
      transform_non_params=lambda tree: jax.tree.map(replicated, tree))
  return {"step": replicated(abstract_state["step"]), "params": params,
          "opt_state": opt_state}


def check_batch_size(batch_size: int, mesh: Mesh, accumulation_steps: int = 1) -> None:
  """Each micro-batch must split evenly over the data x fsdp devices."""
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if accumulation_steps < 1 or batch_size % (ways * accumulation_steps):
    raise ConfigError(f"train.batch_size ({batch_size}) must be a multiple of the data x fsdp "
                      f"mesh size ({ways}) x train.accumulation_steps ({accumulation_steps})")


def check_kv_heads(num_heads: int, num_kv_heads: int, mesh: Mesh) -> None:
  """With grouped-query attention (num_kv_heads below num_heads), the mesh's tensor axis
  splits the key/value heads with their query heads, so it must divide num_kv_heads (no K/V
  head is split across devices). Multi-head attention is unchanged (0: num_heads)."""
  kv, tensor = num_kv_heads or num_heads, mesh.shape["tensor"]
  if kv < num_heads and kv % tensor:
    raise ConfigError(f"model.num_kv_heads ({kv}) must be a multiple of mesh.tensor ({tensor}), "
                      "which splits the key/value heads; use a mesh.tensor that divides it or "
                      "more key/value heads")
