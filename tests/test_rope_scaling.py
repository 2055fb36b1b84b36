"""RoPE's scalings and partial rotation (transformer/model/positions/rope_scaling.py,
rotary.py) against the papers' definitions, and evaluating a trained run under them (eval.py
--config.FIELD=VALUE, transformer/run/overrides.py) without retraining and as the same run."""

import dataclasses
import importlib
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.clirun import CliRunner
from tests.support import TINY_MODEL, write_lm_config
from transformer.core import fields
from transformer.api import with_overrides
from transformer.core.errors import ConfigError
from transformer.core.fields import FieldError
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate
from transformer.model.families import make_model
from transformer.model.positions import PositionSettings, Rotary, XPos
from transformer.model.positions.rope_scaling import SCALINGS, Frequencies, yarn_interpolation
from transformer.model.positions.rotary import rope, rotate_pairs, xpos_scale
from transformer.run import config as config_lib
from transformer.run import overrides
from transformer.run import workdir as workdir_lib

ROTARY = "model.position_settings.rotary."


def _x(shape=(2, 5, 2, 16), seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _positions(b=2, t=5, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


# --------------------------------------------------------------------------- frequencies

# d = 8, base 10^4, s = 4, L = 64, α = 1, β = 32, worked by hand from each paper's formula:
#   none: θ_i = (10^4)^(-2i/8) = 10^(-i): 1, 0.1, 0.01, 0.001.
#   linear (Chen et al. 2023): θ_i / 4.
#   ntk: b' = 10^4 · 4^(8/6), θ'_i = b'^(-i/4) = 10^(-i) · 4^(-i/3): the lowest, 0.001/4, as PI's.
#   yarn: c(r) = 8·ln(64/(2πr))/(2 ln 10^4): c(32) = -0.497 -> lo = 0, c(1) = 1.008 -> hi = 2;
#     γ = clip(i/2, 0, 1) = 0, 0.5, 1, 1: θ'_1 = 0.5·0.1 + 0.5·0.1/4 = 0.0625.
EXPECTED = {
    "none": [1.0, 0.1, 0.01, 0.001],
    "linear": [0.25, 0.025, 0.0025, 0.00025],
    "ntk": [1.0, 0.1 * 4 ** (-1 / 3), 0.01 * 4 ** (-2 / 3), 0.00025],
    "yarn": [1.0, 0.0625, 0.0025, 0.00025],
}


def test_every_scaling_has_hand_computed_frequencies():
  assert sorted(EXPECTED) == sorted(SCALINGS)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_frequencies_of_each_scaling(scaling):
  freq = Frequencies(scaling=scaling, factor=1.0 if scaling == "none" else 4.0,
                     original_length=64)
  np.testing.assert_allclose(np.asarray(freq.scaled(8)), EXPECTED[scaling], rtol=2e-6)


def test_yarn_ramp_at_llama_sizes():
  """d = 128, base 10^4, L = 4096 (YaRN's Llama 2 runs): lo = ⌊c(32)⌋ = ⌊20.94⌋ = 20 and
  hi = ⌈c(1)⌉ = ⌈45.03⌉ = 46, so γ_i = (i − 20)/26 between them; and, as the paper defines
  the ramp, every pair turning more than β = 32 times over L is kept (γ = 0) and every one
  turning less than α = 1 time is interpolated (γ = 1)."""
  weight = yarn_interpolation(128, 10000.0, 4096, 1.0, 32.0)
  assert weight.shape == (64,)
  np.testing.assert_allclose(weight[[0, 20, 21, 33, 45, 46, 63]],
                             [0, 0, 1 / 26, 13 / 26, 25 / 26, 1, 1], atol=1e-12)
  rotations = 4096 * 10000.0 ** (-np.arange(0, 128, 2) / 128) / (2 * math.pi)
  assert np.all(weight[rotations > 32] == 0) and np.all(weight[rotations < 1] == 1)


@pytest.mark.parametrize("factor,m", [(1.0, 1.0), (2.0, 1.0693147180559945),
                                      (4.0, 1.138629436111989), (16.0, 1.2772588722239782)])
def test_yarn_temperature(factor, m):
  """m = 0.1·ln s + 1 on the queries and on the keys: the logits times m² (the paper's 1/t),
  over the whole head; the other scalings have none."""
  freq = Frequencies(scaling="yarn", factor=factor, original_length=64)
  assert freq.temperature == pytest.approx(m, abs=1e-12)
  for other in ("linear", "ntk"):
    assert Frequencies(scaling=other, factor=factor).temperature == 1.0
  q, k, pos = _x(seed=1), _x(seed=2), _positions()
  plain = jnp.einsum("bqhd,bkhd->bhqk", rotate_pairs(q, pos, freq.scaled(16)),
                     rotate_pairs(k, pos, freq.scaled(16)))
  logits = jnp.einsum("bqhd,bkhd->bhqk", rope(q, pos, freq), rope(k, pos, freq))
  np.testing.assert_allclose(logits, plain * m ** 2, rtol=1e-5, atol=1e-5)
  for partial in ("neox", "p_rope"):  # the unrotated dimensions too
    half = jnp.einsum("bqhd,bkhd->bhqk", rope(q, pos, freq, 4, partial),
                      rope(k, pos, freq, 4, partial))
    unscaled = jnp.einsum("bqhd,bkhd->bhqk", _partial_reference(q, pos, freq, 4, partial),
                          _partial_reference(k, pos, freq, 4, partial))
    np.testing.assert_allclose(half, unscaled * m ** 2, rtol=1e-5, atol=1e-5)


def _partial_reference(x, positions, freq, pairs, partial):
  """Partial rotation without a temperature, pair by pair in NumPy (module docstring of
  rotary.py): neox turns pairs (i, i + n) of the first 2n dimensions by θ_i over D = 2n;
  p_rope turns pairs (i, i + d/2), i < n, by θ_i over D = d; the rest is x."""
  x, positions = np.asarray(x, np.float64), np.asarray(positions, np.float64)
  d = x.shape[-1]
  out = x.copy()
  span, inv = (2 * pairs, np.asarray(freq.scaled(2 * pairs), np.float64)) if partial == "neox" \
      else (d, np.asarray(freq.scaled(d), np.float64))
  for i in range(pairs):
    a, b = x[..., i], x[..., i + span // 2]
    angle = positions[:, :, None] * inv[i]
    out[..., i] = a * np.cos(angle) - b * np.sin(angle)
    out[..., i + span // 2] = b * np.cos(angle) + a * np.sin(angle)
  return out


# --------------------------------------------------------------------------- partial rotation


@pytest.mark.parametrize("partial,pairs,untouched", [
    ("neox", 2, list(range(4, 16))),  # the first 4 dimensions turn, the last 12 pass
    ("p_rope", 4, [*range(4, 8), *range(12, 16)])])  # the 4 lowest-frequency pairs stay
def test_partial_rotation(partial, pairs, untouched):
  """A head of d = 16 with rotated_fraction 0.25 (neox: ⌊4⌋ // 2 = 2 pairs) or 0.5 (p_rope:
  4 pairs): the unrotated dimensions are x bit for bit, the rotated ones the formula."""
  fraction = 2 * pairs / 16
  settings = Rotary.Settings(base=100.0, rotated_fraction=fraction, partial=partial)
  enc = Rotary(32, 2, 64, settings=settings)
  assert enc.pairs == pairs
  x, pos = _x(), _positions(start=3)
  got = np.asarray(enc.rotate_queries(x, pos))
  np.testing.assert_array_equal(got[..., untouched], np.asarray(x)[..., untouched])
  np.testing.assert_allclose(got, _partial_reference(x, pos, settings, pairs, partial),
                             rtol=1e-5, atol=1e-5)
  rotated = sorted(set(range(16)) - set(untouched))
  assert not np.allclose(got[..., rotated], np.asarray(x)[..., rotated])


def test_partial_scores_depend_only_on_the_offset():
  for partial in ("neox", "p_rope"):
    enc = Rotary(16, 2, 64, settings=Rotary.Settings(rotated_fraction=0.5, partial=partial,
                                                     scaling="yarn", factor=4.0,
                                                     original_length=16))
    q, k = _x((1, 1, 2, 8), 1), _x((1, 1, 2, 8), 2)
    score = lambda m, n, enc=enc, q=q, k=k: np.asarray(jnp.sum(
        enc.rotate_queries(q, jnp.array([[m]])) * enc.rotate_keys(k, jnp.array([[n]])), -1))
    np.testing.assert_allclose(score(3, 1), score(40, 38), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- none = today


def _todays_rotary(x, positions, base):
  """rotary.py's rotate_half_pairs as it was before the scalings (commit cd93f86)."""
  d = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def test_scaling_none_is_todays_rotary_and_xpos_bit_for_bit():
  """Eagerly and jitted (XLA fuses the two alike; a jitted and an eager result may differ
  in the last bit, as before)."""
  x, pos = _x(), _positions(start=7)
  rotary = Rotary(32, 2, 64, settings=PositionSettings().rotary)
  xpos = XPos(32, 2, 64)

  def todays_xpos(x, pos, sign):
    return _todays_rotary(x, pos, 1e4) * xpos_scale(sign * (pos - 32), 16, gamma=0.4,
                                                    scale_base=512.0)

  for call in (lambda f, *a: f(*a), lambda f, *a: jax.jit(f)(*a)):
    np.testing.assert_array_equal(call(rotary.rotate_keys, x, pos),
                                  call(lambda x, p: _todays_rotary(x, p, 1e4), x, pos))
    for method, sign in ((xpos.rotate_queries, 1.0), (xpos.rotate_keys, -1.0)):
      np.testing.assert_array_equal(call(method, x, pos),
                                    call(lambda x, p, s=sign: todays_xpos(x, p, s), x, pos))


# --------------------------------------------------------------------------- decoding

TINY = {**TINY_MODEL, "num_decoder_layers": 2, "max_len": 64, "arch": "decoder"}
SCALED = {"linear": dict(scaling="linear", factor=2.0, rotated_fraction=0.5),
          "ntk": dict(scaling="ntk", factor=3.0, rotated_fraction=0.5, partial="p_rope"),
          "yarn": dict(scaling="yarn", factor=4.0, original_length=4)}


@pytest.mark.parametrize("position,scaling", [*(("rotary", s) for s in sorted(SCALED)),
                                              ("xpos", "yarn")])
def test_cached_decoding_equals_full_forward(position, scaling):
  settings = {k: v for k, v in SCALED[scaling].items()
              if position == "rotary" or k not in ("rotated_fraction", "partial")}
  sections = PositionSettings()
  section = type(getattr(sections, position))(**settings)
  cfg = ModelConfig(**TINY, position=position,
                    position_settings=PositionSettings(**{position: section}))
  model = make_model(cfg, rngs=nnx.Rngs(0))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (2, 4)), jnp.int32)
  tokens, cached = nnx.jit(lambda m, p, n: generate(m, p, n, 10))(model, prompts,
                                                                  jnp.array([2, 4]))
  full = nnx.jit(lambda m, b: m(b))(model, {"inputs": tokens,
                                           "inputs_segmentation": jnp.ones_like(tokens)})
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full)[:, :-1], atol=5e-5,
                             rtol=1e-4)


# --------------------------------------------------------------------------- overrides


def test_override_file_names():
  assert overrides.suffix({}) == ""
  assert overrides.suffix({ROTARY + "scaling": "yarn", ROTARY + "factor": 4.0}) == \
      ",rotary.factor=4.0,rotary.scaling=yarn"
  # two fields whose last names read alike are named whole
  assert overrides.suffix({"model.a.b": 1, "data.a.b": 2}) == ",data.a.b=2,model.a.b=1"
  # a value that does not fit a file name: a digest (the JSON records the overrides)
  named = overrides.suffix({"data.dir": "/some/where"})
  assert named.startswith(",overrides-") and "/" not in named
  assert named != overrides.suffix({"data.dir": "/else/where"})


def test_an_old_rotary_run_resumes_under_a_scaling_but_not_partly_rotated():
  """A rotary run saved before these fields existed (tests/fixtures/workdirs_043b6c9) rotated
  every dimension: resuming it with rotated_fraction 0.5 is another model (refused), under
  YaRN the same run."""
  old = os.path.join(os.path.dirname(__file__), "fixtures", "workdirs_043b6c9",
                     "decoder_lm_rotary")
  assert "rotated_fraction" not in pathlib.Path(old, "config.json").read_text()
  cfg = workdir_lib.saved_config(old)
  section = cfg.model.position_settings.rotary
  partly = config_lib.replace(cfg, "model.position_settings.rotary",
                              dataclasses.replace(section, rotated_fraction=0.5))
  with pytest.raises(ConfigError, match="differs in: position_settings.rotary.rotated_fraction"):
    workdir_lib.check_identity(partly, old, has_checkpoints=True)
  scaled = config_lib.replace(cfg, "model.position_settings.rotary", dataclasses.replace(
      section, scaling="yarn", factor=2.0, original_length=16))
  workdir_lib.check_identity(scaled, old, has_checkpoints=True)


YARN = [f"--config.{ROTARY}scaling=yarn", f"--config.{ROTARY}factor=2",
        f"--config.{ROTARY}original_length=8"]


def test_a_trained_run_evaluates_under_yarn_as_the_same_run(tmp_path):
  """A tiny rotary LM, trained once, evaluated plainly and under YaRN (s = 2, L = 8) at 8
  and 16 tokens: the YaRN evaluation goes to its own file, which records the overrides; the
  plain file, the config and the checkpoints are untouched; the overridden config has the
  run's identity (train.py would resume it); the metrics differ."""
  workdir = str(tmp_path / "run")
  cli = CliRunner()
  trained = cli.run("train.py", "--config", write_lm_config(tmp_path), "--workdir", workdir,
                    "--config.model.position=rotary", "--config.data.max_factor=2")
  assert trained.returncode == 0, trained.stderr[-3000:]
  plain = cli.run("eval.py", "--workdir", workdir)
  assert plain.returncode == 0, plain.stderr[-3000:]
  files = {name: pathlib.Path(workdir, name).read_bytes()
           for name in ("config.json", "eval_step_5.json")}
  scaled = cli.run("eval.py", "--workdir", workdir, *YARN)
  assert scaled.returncode == 0, scaled.stderr[-3000:]
  name = "eval_step_5,rotary.factor=2.0,rotary.original_length=8,rotary.scaling=yarn.json"
  assert f"metrics written to {os.path.join(workdir, name)}" in scaled.stdout
  assert f"overrides: {ROTARY}factor=2.0, {ROTARY}original_length=8, {ROTARY}scaling='yarn'" \
      in scaled.stdout
  for kept, content in files.items():
    assert pathlib.Path(workdir, kept).read_bytes() == content, kept
  plain_record = json.loads(files["eval_step_5.json"])
  record = json.loads(pathlib.Path(workdir, name).read_text())
  assert plain_record["overrides"] == {}
  assert record["overrides"] == {ROTARY + "scaling": "yarn", ROTARY + "factor": 2.0,
                                 ROTARY + "original_length": 8}
  for split in plain_record["splits"]:  # the same windows, other numbers
    assert record["splits"][split]["examples"] == plain_record["splits"][split]["examples"]
    assert record["splits"][split]["loss"] != plain_record["splits"][split]["loss"]
  saved = workdir_lib.saved_config(workdir)
  overridden, applied = overrides.apply(saved, {p.split("=")[0][len("--config."):]:
                                                p.split("=")[1] for p in YARN})
  assert applied == record["overrides"]
  assert fields.identity(overridden) == fields.identity(saved)
  workdir_lib.check_identity(overridden, workdir, has_checkpoints=True)  # the same run
  # An evaluation under other overrides is not written over the plain one.
  refused = cli.run("eval.py", "--workdir", workdir, *YARN, "--output",
                    os.path.join(workdir, "eval_step_5.json"))
  assert refused.returncode == 2
  assert "holds another evaluation (its overrides: none (this one:" in refused.stderr
  assert pathlib.Path(workdir, "eval_step_5.json").read_bytes() == files["eval_step_5.json"]
  # YaRN without the length trained on: the run's own (data.max_len = 8), logged; the same
  # evaluation as with it given, in the same file.
  defaulted = cli.run("eval.py", "--workdir", workdir, *YARN[:2])
  assert defaulted.returncode == 0, defaulted.stderr[-3000:]
  assert f"metrics written to {os.path.join(workdir, name)}" in defaulted.stdout
  assert f"{ROTARY}original_length = 8: the run's training length" in defaulted.stdout
  assert json.loads(pathlib.Path(workdir, name).read_text())["splits"] == record["splits"]
  # On a rotary run, the rotated fraction is its identity.
  result = cli.run("eval.py", "--workdir", workdir, f"--config.{ROTARY}rotated_fraction=0.5")
  assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
  assert result.stderr.startswith("error: ")
  assert f"{ROTARY}rotated_fraction is part of the run's identity" in result.stderr


@pytest.mark.parametrize("config,length", [("lm_extrapolation", 64), ("multi30k", None)])
def test_yarn_takes_the_runs_training_length_where_its_source_says_one(config, length):
  """Under YaRN without original_length, a trained run's config gets its training length
  (its source's train_length: an LM's window) and names it among the overrides; one given
  stays; a run whose source says no training length (translation) is still refused."""
  module = importlib.import_module(f"configs.{config}")
  cfg = config_lib.parse(with_overrides(module.get_config(), {"model.position": "rotary"}))
  yarn = {ROTARY + "scaling": "yarn", ROTARY + "factor": "4"}
  if length is None:
    with pytest.raises(FieldError, match=f"{ROTARY}original_length=0 is not allowed"):
      overrides.apply(cfg, yarn)
    return
  scaled, applied = overrides.apply(cfg, yarn)
  assert cfg.source.train_length(cfg.data, cfg.task) == length
  assert applied == {ROTARY + "scaling": "yarn", ROTARY + "factor": 4.0,
                     ROTARY + "original_length": length}
  assert scaled.model.position_settings.rotary.original_length == length
  _, given = overrides.apply(cfg, {**yarn, ROTARY + "original_length": "32"})
  assert given[ROTARY + "original_length"] == 32
  _, linear = overrides.apply(cfg, {ROTARY + "scaling": "linear", ROTARY + "factor": "4"})
  assert ROTARY + "original_length" not in linear  # a scaling that does not read it
