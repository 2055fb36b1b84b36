"""Block variants (model.norm_type, model.ffn, train.z_loss) against their formulas; the
default model's parameters as before (earlier runs' checkpoints load); every family builds
and steps with each variant; a tiny run with all three learns."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.clirun import ROOT
from tests.support import TINY_MODEL, family_batch, jaxpr_equations, make_tiny_config
from transformer.core.metrics import loss_head_metrics, token_metrics
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.feedforward import FFNS
from transformer.model.layers import NORMS, RMSNorm
from transformer.run import config as config_lib
from transformer.run import step as step_lib
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import METRICS_FILE
from transformer.study import sweep


def _randomized(module, seed=0):
  """module with every parameter drawn at random (biases start at zero, scales at one)."""
  state = nnx.state(module, nnx.Param)
  pure = nnx.to_pure_dict(state)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(pure))))
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x: x + 0.5 * jax.random.normal(next(keys), x.shape), pure))
  nnx.update(module, state)
  return module


def _params(module) -> dict:
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


# --------------------------------------------------------------------------- RMSNorm


def _rms_formula(x, scale, eps=1e-6):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_rmsnorm_matches_its_formula_values_and_gradients():
  norm = _randomized(RMSNorm(16, epsilon=1e-6, rngs=nnx.Rngs(0)))
  assert set(_params(norm)) == {"scale"}  # no bias
  x = 3.0 * jax.random.normal(jax.random.key(1), (2, 5, 16)) + 1.0
  scale = norm.scale[...]
  np.testing.assert_allclose(norm(x), _rms_formula(x, scale), rtol=1e-5, atol=1e-6)
  dy = jax.random.normal(jax.random.key(2), x.shape)
  graphdef, state = nnx.split(norm)
  d_x, d_state = jax.grad(lambda x, s: jnp.sum(nnx.merge(graphdef, s)(x) * dy), (0, 1))(
      x, state)
  want = jax.grad(lambda x, s: jnp.sum(_rms_formula(x, s) * dy), (0, 1))(x, scale)
  np.testing.assert_allclose(d_x, want[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(d_state["scale"][...], want[1], rtol=1e-4, atol=1e-5)


def test_rmsnorm_computes_statistics_in_float32_and_returns_the_compute_dtype():
  norm = RMSNorm(8, epsilon=1e-6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = (jnp.arange(8.0) * 300.0).astype(jnp.bfloat16)[None]  # x² overflows nothing in f32
  y = norm(x)
  assert y.dtype == jnp.bfloat16
  want = _rms_formula(x.astype(jnp.float32), 1.0)
  np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=1e-2)


# --------------------------------------------------------------------------- feed-forward


def _gelu(z):  # x·Φ(x), exact
  return z * 0.5 * (1.0 + jax.scipy.special.erf(z / math.sqrt(2.0)))


def _silu(z):
  return z / (1.0 + jnp.exp(-z))


def _plain(act):
  return lambda p, x: act(x @ p["wi"]["kernel"] + p["wi"]["bias"]) @ p["wo"]["kernel"] \
      + p["wo"]["bias"]


def _gated(act):
  return lambda p, x: (act(x @ p["wi_0"]["kernel"]) * (x @ p["wi_1"]["kernel"])) \
      @ p["wo"]["kernel"]


# Each entry of FFNS against its formula, on the module's own parameters.
FORMULAS = {"relu": _plain(lambda z: jnp.maximum(z, 0.0)), "gelu": _plain(_gelu),
            "swiglu": _gated(_silu), "geglu": _gated(_gelu)}
# Weights at hidden width f (module docstring: d_ff is every variant's width as given).
SIZES = {"relu": lambda d, f: 2 * d * f + f + d, "gelu": lambda d, f: 2 * d * f + f + d,
         "swiglu": lambda d, f: 3 * d * f, "geglu": lambda d, f: 3 * d * f}


def test_every_ffn_has_a_formula():
  assert set(FORMULAS) == set(FFNS) == set(SIZES)


@pytest.mark.parametrize("name", sorted(FFNS))
def test_ffn_matches_its_formula_values_and_gradients(name):
  d, f = 8, 12
  ffn = _randomized(FFNS[name](d, f, rngs=nnx.Rngs(0)))
  params = _params(ffn)
  assert sum(x.size for x in jax.tree.leaves(params)) == SIZES[name](d, f)
  x = jax.random.normal(jax.random.key(3), (2, 5, d))
  np.testing.assert_allclose(ffn(x), FORMULAS[name](params, x), rtol=1e-5, atol=1e-5)
  dy = jax.random.normal(jax.random.key(4), (2, 5, d))
  graphdef, state = nnx.split(ffn)
  d_x, d_state = jax.grad(lambda x, s: jnp.sum(nnx.merge(graphdef, s)(x) * dy), (0, 1))(
      x, state)
  want = jax.grad(lambda x, p: jnp.sum(FORMULAS[name](p, x) * dy), (0, 1))(x, params)
  np.testing.assert_allclose(d_x, want[0], rtol=1e-4, atol=1e-5)
  got = nnx.to_pure_dict(d_state)
  assert _shapes(got) == _shapes(want[1])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# The gated layers' gradient under a mesh whose tensor axis splits the hidden units in two
# (the parameters' declared specs): the collectives XLA inserts, counted in the compiled HLO.
TENSOR_SPLIT = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from transformer.run import sharding
from transformer.model.feedforward import FFNS
mesh = sharding.make_mesh({"tensor": 2})
counts = {}
for name in ("swiglu", "geglu"):
  ffn = FFNS[name](16, 32, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(ffn)
  specs = jax.tree.map(lambda s: NamedSharding(mesh, s), sharding.param_specs(ffn),
                       is_leaf=lambda x: isinstance(x, P))
  loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)
  grad = jax.jit(jax.grad(loss), in_shardings=(specs, NamedSharding(mesh, P())))
  hlo = grad.lower(nnx.to_pure_dict(state), jnp.ones((8, 16))).compile().as_text()
  counts[name] = {op: hlo.count(op + "(") for op in
                  ("all-gather", "all-to-all", "collective-permute", "all-reduce")}
print(json.dumps(counts))
"""


def test_gated_ffn_split_over_the_tensor_axis_needs_no_gather():
  """W and V fused column by column: each device's share of the hidden units holds its gate
  and value columns, so the split layer needs only wo's all-reduce (fused [W | V] halves
  would need all-gathers)."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", TENSOR_SPLIT], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name, counts in json.loads(proc.stdout.strip().splitlines()[-1]).items():
    assert counts["all-reduce"] >= 1, (name, counts)  # the split is real
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, \
        (name, counts)


def test_gelu_is_exact_not_tanh():
  ffn = FFNS["gelu"](1, 1, rngs=nnx.Rngs(0))
  ffn.wi.kernel[...] = jnp.ones((1, 1))
  ffn.wo.kernel[...] = jnp.ones((1, 1))
  y = float(ffn(jnp.full((1, 1), -3.0))[0, 0])
  assert abs(y - float(_gelu(-3.0))) < 1e-6
  assert abs(y - float(jax.nn.gelu(-3.0, approximate=True))) > 1e-4  # they differ here


# --------------------------------------------------------------------------- z-loss


def _problem(n=24, d=8, vocab=11, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  y = jax.random.normal(keys[0], (n, d))
  w_out = jax.random.normal(keys[1], (vocab, d))
  bias = jax.random.normal(keys[2], (vocab,)) + 2.0  # log Z well away from 0
  targets = jax.random.randint(keys[3], (n,), 0, vocab)
  weights = (jax.random.uniform(keys[4], (n,)) > 0.25).astype(jnp.float32) * 1.5
  return y, w_out, bias, targets, weights


def _z_reference(y, w_out, bias, targets, weights, smoothing, z):
  """The smoothed cross-entropy plus z·log²Z per token, both under the token weights."""
  logits = y @ w_out.T + (0.0 if bias is None else bias)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  ce = token_metrics(logits[None], targets[None], weights[None], smoothing)["loss"]
  z_term = jnp.sum(weights * z * log_z ** 2)
  return ce + z_term, z_term


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_z_loss_value_and_gradient_against_the_formula(chunks, with_bias):
  y, w_out, bias, targets, weights = _problem()
  bias = bias if with_bias else None
  smoothing, z = 0.1, 0.3
  got = loss_head_metrics(y, w_out, bias, targets, weights, smoothing, chunks, z)
  loss, z_term = _z_reference(y, w_out, bias, targets, weights, smoothing, z)
  assert float(z_term) > 1.0  # the term matters in this problem
  np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
  np.testing.assert_allclose(got["z_loss"], z_term, rtol=1e-5)
  plain = loss_head_metrics(y, w_out, bias, targets, weights, smoothing, chunks)
  assert "z_loss" not in plain
  for key in ("nll", "correct", "tokens"):  # the metrics are the cross-entropy's
    np.testing.assert_allclose(got[key], plain[key], rtol=1e-6)

  argnums = (0, 1, 2) if with_bias else (0, 1)
  fused = jax.grad(lambda *a: loss_head_metrics(
      *a, targets, weights, smoothing, chunks, z)["loss"], argnums)(y, w_out, bias)
  want = jax.grad(lambda *a: _z_reference(*a, targets, weights, smoothing, z)[0],
                  argnums)(y, w_out, bias)
  for a, b in zip(fused, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  scaled = jax.jit(jax.grad(lambda y: 2.0 * loss_head_metrics(
      y, w_out, bias, targets, weights, smoothing, chunks, z)["loss"]))(y)
  np.testing.assert_allclose(scaled, 2.0 * want[0], rtol=1e-4, atol=1e-4)


def test_z_loss_gradient_per_logit_is_2_z_log_z_softmax():
  """One row whose feature is 1, so w_out's column is the logits: d/dlogits of the z-term
  alone is 2·z·log Z·softmax."""
  logits = jnp.array([1.0, 2.5, -0.5, 0.3])
  z = 0.25
  grad = lambda z: jax.grad(lambda lg: loss_head_metrics(  # noqa: E731
      jnp.ones((1, 1)), lg[:, None], None, jnp.array([1]), jnp.ones(1), 0.0, 1, z)["loss"])(
          logits)
  log_z = jax.nn.logsumexp(logits)
  np.testing.assert_allclose(grad(z) - grad(0.0), 2 * z * log_z * jax.nn.softmax(logits),
                             rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- models


def _model(arch="encoder_decoder", **kw):
  cfg = ModelConfig(**TINY_MODEL, arch=arch, num_classes=5 if arch == "encoder" else 0, **kw)
  return make_model(cfg, rngs=nnx.Rngs(0))


def _shapes(tree):
  return jax.tree.map(lambda x: tuple(x.shape), tree)


def test_the_default_model_keeps_its_parameter_names_and_shapes():
  """What checkpoints of runs from before these options hold: FFN wi/wo with biases, each
  norm a LayerNorm's scale and bias."""
  params = _params(nnx.eval_shape(lambda: _model(norm="pre")))
  layer = params["decoder"]["layers"][0]
  assert _shapes(layer["ffn"]) == {"wi": {"kernel": (16, 32), "bias": (32,)},
                                   "wo": {"kernel": (32, 16), "bias": (16,)}}
  for norm in (layer["attention_block"]["norm"], layer["cross_block"]["norm"],
               layer["ffn_block"]["norm"], params["encoder"]["final_norm"]):
    assert _shapes(norm) == {"scale": (16,), "bias": (16,)}
  default = ModelConfig(**TINY_MODEL)
  assert (default.norm_type, default.ffn) == ("layernorm", "relu")


def test_a_config_of_an_earlier_run_parses_with_the_defaults():
  raw = config_lib.to_dict(parse(make_tiny_config()))
  for key in ("norm_type", "ffn"):
    del raw["model"][key]
  del raw["train"]["z_loss"]
  cfg = parse(raw)
  assert (cfg.model.norm_type, cfg.model.ffn, cfg.train.z_loss) == ("layernorm", "relu", 0.0)


@pytest.mark.parametrize("norm_type", sorted(NORMS))
@pytest.mark.parametrize("ffn", sorted(FFNS))
def test_parameters_follow_the_choices(norm_type, ffn):
  params = _params(nnx.eval_shape(lambda: _model(norm="pre", norm_type=norm_type, ffn=ffn)))
  layer = params["encoder"]["layers"][0]
  norm_params = {"scale", "bias"} if norm_type == "layernorm" else {"scale"}
  assert set(layer["ffn_block"]["norm"]) == set(params["encoder"]["final_norm"]) == norm_params
  ffn_params = {"wi": {"kernel", "bias"}, "wo": {"kernel", "bias"}} if ffn in ("relu", "gelu") \
      else {"wi_0": {"kernel"}, "wi_1": {"kernel"}, "wo": {"kernel"}}
  assert {k: set(v) for k, v in layer["ffn"].items()} == ffn_params


@pytest.mark.parametrize("arch", ["encoder_decoder", "encoder", "decoder"])
def test_every_family_builds_and_steps_with_each_variant(arch):
  import optax  # noqa: PLC0415
  for norm, norm_type in (("post", "rmsnorm"), ("pre", "rmsnorm"), ("pre", "layernorm")):
    for ffn in sorted(FFNS):
      model = nnx.eval_shape(lambda n=norm, nt=norm_type, f=ffn: _model(
          arch, norm=n, norm_type=nt, ffn=f))
      graphdef, params = nnx.split(model)
      params = nnx.to_pure_dict(params)
      optimizer = optax.adam(1e-3)
      step = step_lib.make_train_step(graphdef, optimizer, lambda s: 1e-3, label_smoothing=0.1,
                                      seed=0, loss_chunks=2, z_loss=1e-3)
      state = {"step": jnp.zeros((), jnp.int32), "params": params,
               "opt_state": jax.eval_shape(optimizer.init, params)}
      _, sums = jax.eval_shape(step, state, family_batch(arch))
      assert sums["loss"].shape == sums["z_loss"].shape == ()


def test_a_tiny_model_with_rmsnorm_swiglu_and_z_loss_learns(tmp_path):
  workdir = str(tmp_path / "run")
  config = make_tiny_config(**{
      "model.norm": "pre", "model.norm_type": "rmsnorm", "model.ffn": "swiglu",
      "train.z_loss": 1e-3, "train.num_steps": 120, "train.log_every": 20,
      "train.checkpoint_every": 120})
  assert train_and_evaluate(parse(config), workdir) == 120
  with open(os.path.join(workdir, METRICS_FILE)) as f:
    train = [r for r in map(json.loads, f) if r["split"] == "train"]
  assert train[-1]["loss"] < 0.5 * train[0]["loss"], train
  assert all(0 < r["z_loss"] < r["loss"] for r in train)


@pytest.mark.parametrize("arch,ffn", [("encoder_decoder", "swiglu"), ("decoder", "geglu")])
def test_bfloat16_variants_compute_in_bfloat16(arch, ffn):
  model = _model(arch, norm="pre", norm_type="rmsnorm", ffn=ffn, dtype="bfloat16")
  jaxpr = jax.make_jaxpr(lambda m, b: m(b))(model, family_batch(arch)).jaxpr
  dots = jaxpr_equations(jaxpr, "dot_general")
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_the_variants_sweep_counts_its_weights():
  """configs/variants.py: each variant's parameter count is the MHA/LayerNorm/ReLU model's
  less the K/V columns of the heads it shares (2·d·(h − kv)·d_head per layer), less a bias
  per norm (rmsnorm; pre-LN decoder: 2 per layer and the final one), plus the FFN's
  difference (SIZES); and SwiGLU at ⌊2/3·d_ff⌋ has ReLU's FFN weights to within 2% (ReLU's
  biases, the floor)."""
  base, overrides = sweep.load(os.path.join(ROOT, "configs", "variants.py"))
  assert len(overrides) == 3 * 2 * 2 * 2
  m = base.model
  d, f, layers, h = m.d_model, m.d_ff, m.num_decoder_layers, m.num_heads
  norms = 2 * layers + 1
  counts = {}
  for o in overrides:
    cfg = parse(sweep.with_overrides(base, o))
    model = nnx.eval_shape(lambda c=cfg: make_model(c.model, rngs=nnx.Rngs(0)))
    counts[o["model.num_kv_heads"], o["model.norm_type"], o["model.ffn"]] = (
        o["model.d_ff"], sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
  reference = counts[h, "layernorm", "relu"][1]
  for (kv, norm_type, ffn), (width, n) in counts.items():
    assert width == (2 * f // 3 if ffn == "swiglu" else f)
    expected = (reference - layers * 2 * d * (h - kv) * (d // h)
                - (norms * d if norm_type == "rmsnorm" else 0)
                + layers * (SIZES[ffn](d, width) - SIZES["relu"](d, f)))
    assert n == expected, (kv, norm_type, ffn)
    assert abs(SIZES[ffn](d, width) - SIZES["relu"](d, f)) < 0.02 * SIZES["relu"](d, f)