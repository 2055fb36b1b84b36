"""The device mesh and the shardings of the train state and batches.

The mesh has three axes: `data` (batch split, parameters replicated), `fsdp` (batch split
and parameters/optimizer state split: ZeRO-3 style) and `tensor` (Megatron-style splits of
the attention heads, the FFN hidden units and the vocabulary). Parameters are mapped to
the mesh by PARTITION_RULES over their paths in the state, so the model code carries no
sharding annotations; XLA's SPMD partitioner inserts the collectives. The train step is one
jax.jit with these explicit NamedShardings on 1 CPU, N devices or several hosts alike.
"""

import math
import re

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# (regex searched in a leaf's path, mesh axis per array dimension); the first match wins,
# unmatched leaves are replicated. Optimizer moments match through their parameter's path.
# The classifier head/kernel [d_model, classes] stays replicated: with a few classes it is
# a few thousand parameters (5120 at base dims and 10 classes), not worth a collective.
PARTITION_RULES = (
    (r"(query|key|value)/kernel$", ("fsdp", "tensor")),  # [d_model, heads·head_dim]
    (r"out/kernel$", ("tensor", "fsdp")),
    (r"wi/kernel$", ("fsdp", "tensor")),  # [d_model, d_ff]
    (r"wi/bias$", ("tensor",)),
    (r"wo/kernel$", ("tensor", "fsdp")),
    (r"embedding$", ("tensor", "fsdp")),  # [vocab, d_model]
    (r"output/kernel$", ("fsdp", "tensor")),
    (r"output/bias$", ("tensor",)),
)


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


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def _path(key_path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in key_path)


def partition_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """The rule's spec for a leaf, with any axis that does not divide its dimension dropped."""
  for pattern, axes in PARTITION_RULES:
    if re.search(pattern, path) and len(axes) == len(shape):
      return P(*(a if dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, shape)))
  return P()


def state_shardings(abstract_state, mesh: Mesh):
  """NamedShardings for every leaf of a (params, optimizer state, ...) pytree."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, partition_spec(_path(path), leaf.shape, mesh)),
      abstract_state)


def check_batch_size(batch_size: int, mesh: Mesh, accumulation_steps: int = 1) -> None:
  """Each micro-batch must split evenly over the data x fsdp devices."""
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  if accumulation_steps < 1 or batch_size % (ways * accumulation_steps):
    raise ConfigError(f"train.batch_size ({batch_size}) must be a multiple of the data x fsdp "
                      f"mesh size ({ways}) x train.accumulation_steps ({accumulation_steps})")
