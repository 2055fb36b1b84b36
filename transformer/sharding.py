"""The device mesh and the shardings of the train state and batches.

The train step is one jax.jit with explicit NamedShardings: parameters and optimizer state
replicated, batches split along the `data` axis. The same code runs on 1 CPU or N devices.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer.registry import ConfigError


def make_mesh(devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
  if batch_size % mesh.size:
    raise ConfigError(f"train.batch_size ({batch_size}) must be a multiple of the number of "
                      f"devices ({mesh.size})")
