"""Device meshes: partition rules, a sharded 8-device run equal to the 1-device run, restoring
onto another mesh, gradient accumulation equal to the large batch."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from transformer import sharding
from transformer.config import parse
from transformer.errors import ConfigError
from tests.conftest import restore_and_evaluate
from transformer.training import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHARDED_RUN = """
import json, sys
import jax
from tests.conftest import make_tiny_config
from transformer import sharding
from transformer.config import parse
from transformer.training import train_and_evaluate
config = make_tiny_config(**json.loads(sys.argv[2]))
train_and_evaluate(parse(config), sys.argv[1])
mesh = sharding.make_mesh(config.mesh.to_dict())
print("MESH", dict(mesh.shape), "DEVICES", jax.device_count())
"""


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]


def test_partition_rules_split_weights_over_fsdp_and_tensor():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES)
  spec = lambda path, shape: sharding.partition_spec(path, shape, mesh)  # noqa: E731
  assert spec("params/encoder/layers/0/self_attention/query/kernel", (32, 32)) == P("fsdp", "tensor")
  assert spec("opt_state/0/mu/decoder/layers/1/ffn/wo/kernel", (64, 32)) == P("tensor", "fsdp")
  assert spec("params/embeddings/source_table/embedding", (9, 32)) == P(None, "fsdp")  # 9 odd
  assert spec("params/encoder/layers/0/attention_block/norm/scale", (32,)) == P()


def test_mesh_shape_errors_name_the_mesh():
  with pytest.raises(ConfigError, match=r"mesh \{'data': 3, 'fsdp': 1, 'tensor': 1\} does not fit 1 devices"):
    sharding.make_mesh({"data": 3})
  with pytest.raises(ConfigError, match="unknown mesh axis 'model'; choose from: data, fsdp, tensor"):
    sharding.make_mesh({"model": 1})


def test_sharded_run_on_8_devices_matches_one_device_and_restores_on_one(tmp_path, tiny_config):
  overrides = {"model.dropout": 0.0, "train.num_steps": 20, "train.log_every": 5}
  single = str(tmp_path / "single")
  train_and_evaluate(parse(tiny_config(**overrides)), single)

  sharded = str(tmp_path / "sharded")
  # The sharded run also scans its layers: the stacked layer states shard as the loop's do.
  mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.scan_layers": True}
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", SHARDED_RUN, sharded, json.dumps({**overrides, **mesh})],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "MESH {'data': 2, 'fsdp': 2, 'tensor': 2} DEVICES 8" in proc.stdout
  np.testing.assert_allclose(_train_losses(sharded), _train_losses(single), rtol=1e-5)

  # The checkpoint written under the 2x2x2 mesh restores onto this process's single device.
  step, results, _ = restore_and_evaluate(sharded)
  _, expected, _ = restore_and_evaluate(single)
  assert step == 20
  np.testing.assert_allclose(results["valid"]["loss"], expected["valid"]["loss"], rtol=1e-5)


def test_gradient_accumulation_matches_the_large_batch(tmp_path, tiny_config):
  overrides = {"model.dropout": 0.0, "train.num_steps": 10, "train.log_every": 5,
               "train.checkpoint_every": 10}
  whole, micro = str(tmp_path / "whole"), str(tmp_path / "micro")
  train_and_evaluate(parse(tiny_config(**overrides)), whole)
  train_and_evaluate(parse(tiny_config(**overrides, **{"train.accumulation_steps": 4})), micro)
  np.testing.assert_allclose(_train_losses(micro), _train_losses(whole), rtol=1e-5)
  with pytest.raises(ConfigError, match=r"batch_size \(32\) must be a multiple of .* "
                                        r"train.accumulation_steps \(3\)"):
    train_and_evaluate(parse(tiny_config(**{"train.accumulation_steps": 3})), str(tmp_path / "bad"))
