"""Device meshes: the parameters' declared shardings (equal to the path rules they replaced)
and the optimizer state's, a sharded 8-device run equal to the 1-device run, restoring onto
another mesh, gradient accumulation equal to the large batch."""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import (TINY_CONFIG_MODEL, make_tiny_config, restore_and_evaluate,
                           sharded_matches_single, train_losses)
from transformer.core.errors import ConfigError
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.run import experiment, sharding
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate

# The path rules the declarations replaced, kept as the reference they must reproduce:
# (regex searched in a leaf's path, mesh axis per dimension); the first match of the same rank
# wins, unmatched leaves are replicated.
OLD_PARTITION_RULES = (
    (r"(query|key|value)/kernel$", ("fsdp", "tensor")),
    (r"out/kernel$", ("tensor", "fsdp")),
    (r"wi/kernel$", ("fsdp", "tensor")),
    (r"wi/bias$", ("tensor",)),
    (r"wo/kernel$", ("tensor", "fsdp")),
    (r"embedding$", ("tensor", "fsdp")),
    (r"output/kernel$", ("fsdp", "tensor")),
    (r"output/bias$", ("tensor",)),
)


def _old_rule_spec(path: str, ndim: int) -> P:
  for pattern, axes in OLD_PARTITION_RULES:
    if re.search(pattern, path) and len(axes) == ndim:
      return P(*axes)
  return P()


def _paths(tree) -> dict:
  """{"a/b/c": leaf} over a pure dict."""
  return {"/".join(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract_model(**fields):
  return nnx.eval_shape(lambda: make_model(ModelConfig(**fields), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("share_embeddings", [False, True])
def test_declared_specs_of_the_base_model_equal_the_old_path_rules(share_embeddings):
  model = _abstract_model(vocab_size=37000, share_embeddings=share_embeddings)
  shapes = _paths(nnx.to_pure_dict(nnx.state(model)))
  specs = _paths(sharding.param_specs(model))
  assert specs.keys() == shapes.keys()
  expected = {path: _old_rule_spec("params/" + path, len(leaf.shape))
              for path, leaf in shapes.items()}
  assert specs == expected
  # Split per encoder layer: Q, K, V, O kernels, wi kernel and bias, wo kernel; a decoder
  # layer adds cross-attention's four; then the tables (and the untied output layer).
  split = [path for path, spec in specs.items() if spec != P()]
  assert len(split) == 6 * 7 + 6 * 11 + (1 if share_embeddings else 4)


def test_fires_output_layer_is_replicated_and_the_vocabulary_projection_split():
  # The tiny config's model, with its copy task's vocabulary (9 tokens).
  model = _abstract_model(**TINY_CONFIG_MODEL, vocab_size=9, position="fire",
                          share_embeddings=False)
  specs = sharding.param_specs(model)
  fire = specs["encoder"]["position"]
  assert fire["output"] == {"kernel": P(), "bias": P()}  # [width, heads]: not the vocabulary
  assert _old_rule_spec("params/encoder/position/output/kernel", 2) == P("fsdp", "tensor")
  assert specs["embeddings"]["output"] == {"kernel": P("fsdp", "tensor"), "bias": P("tensor")}


def test_an_axis_that_does_not_divide_its_dimension_is_dropped():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES)
  assert sharding.fit_spec(P("tensor", "fsdp"), (9, 32), mesh) == P(None, "fsdp")  # 9 odd
  assert sharding.fit_spec(P(("data", "fsdp"), None), (6, 3), mesh) == P(None, None)
  assert sharding.fit_spec(P(), (6, 3), mesh) == P()


@pytest.mark.parametrize("grad_clip_norm", [0.0, 1.0])
def test_optimizer_state_is_sharded_as_its_parameters(tiny_config, grad_clip_norm):
  config = tiny_config(**{"train.weight_decay": 0.1, "train.grad_clip_norm": grad_clip_norm})
  exp = experiment.build(parse(config))  # vocab 9: odd, not split
  abstract = jax.eval_shape(exp.init)
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES)
  shardings = sharding.state_shardings(abstract, exp.param_specs, exp.optimizer, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
  params = _paths(shardings["params"])
  assert params["embeddings/source_table/embedding"].spec == P(None, "fsdp")
  assert params["encoder/layers/0/ffn/wi/kernel"].spec == P("fsdp", "tensor")
  assert shardings["step"].spec == P()
  # An optimizer-state leaf whose path ends with a parameter's path is a copy of it (mu, nu).
  copies = 0
  leaves = jax.tree_util.tree_flatten_with_path(shardings["opt_state"])[0]
  for path, leaf in leaves:
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    param = next((p for p in params if names[-len(p.split("/")):] == p.split("/")), None)
    assert leaf == (params[param] if param else NamedSharding(mesh, P())), names
    copies += param is not None
  assert copies == 2 * len(params)  # Adam's two moments; the counts replicated


def test_mesh_shape_errors_name_the_mesh():
  with pytest.raises(ConfigError,
                     match=r"mesh \{'data': 3, 'fsdp': 1, 'tensor': 1\} does not fit 1 devices"):
    sharding.make_mesh({"data": 3})
  with pytest.raises(ConfigError,
                     match="unknown mesh axis 'model'; choose from: data, fsdp, tensor"):
    sharding.make_mesh({"model": 1})


def test_sharded_run_on_8_devices_matches_one_device_and_restores_on_one(tmp_path):
  overrides = {"model.dropout": 0.0, "train.num_steps": 20, "train.log_every": 5}
  # The sharded run also scans its layers: the stacked layer states shard as the loop's do.
  mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.scan_layers": True}
  single, sharded = sharded_matches_single(tmp_path, overrides, mesh)

  # The checkpoint written under the 2x2x2 mesh restores onto this process's single device.
  step, results, _ = restore_and_evaluate(sharded)
  _, expected, _ = restore_and_evaluate(single)
  assert step == 20
  np.testing.assert_allclose(results["valid"]["loss"], expected["valid"]["loss"], rtol=1e-5)


def test_latent_attention_parameters_split_over_the_mesh_axes():
  """model.attention.kv=latent: the latent's down projection and the shared rotary key
  split over fsdp by their rows, the up projection over tensor by its columns (head-major
  [k_C | v] per head: whole heads per device, as the queries'). Training on the mesh is
  test_sharded_run_on_8_devices_matches_one_device_and_restores_on_one's machinery with
  these specs."""
  overrides = {"model.attention.kv": "latent", "model.position": "rotary",
               "model.position_settings.rotary.rotated_fraction": 0.5}
  model = nnx.eval_shape(lambda: make_model(parse(make_tiny_config(**overrides)).model,
                                            rngs=nnx.Rngs(0)))
  prefix = "decoder/layers/0/self_attention/latent/"
  latent = {path[len(prefix):]: spec for path, spec in _paths(sharding.param_specs(model)).items()
            if path.startswith(prefix)}
  assert latent == {"down/kernel": P("fsdp", None), "norm/scale": P(),
                    "rotary_key/kernel": P("fsdp", None), "up/kernel": P(None, "tensor")}


def test_gradient_accumulation_matches_the_large_batch(tmp_path, tiny_config):
  overrides = {"model.dropout": 0.0, "train.num_steps": 10, "train.log_every": 5,
               "train.checkpoint_every": 10}
  whole, micro = str(tmp_path / "whole"), str(tmp_path / "micro")
  train_and_evaluate(parse(tiny_config(**overrides)), whole)
  train_and_evaluate(parse(tiny_config(**overrides, **{"train.accumulation_steps": 4})), micro)
  np.testing.assert_allclose(train_losses(micro), train_losses(whole), rtol=1e-5)
  with pytest.raises(ConfigError, match=r"batch_size \(32\) must be a multiple of .* "
                                        r"train.accumulation_steps \(3\)"):
    train_and_evaluate(parse(tiny_config(**{"train.accumulation_steps": 3})), str(tmp_path / "bad"))
