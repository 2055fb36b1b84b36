"""Each scorer's and encoding's own settings section: defaults from its Settings, overridable
on the command line and by a sweep, checked whole (unknown keys and bad values are
ConfigErrors naming the section), and the migration of configs written before the sections
existed (flat model.attention.additive_dim, gaussian_sigma, learn_sigma)."""

import dataclasses
import json
import os

import jax
import ml_collections
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from tests.support import ROOT, make_tiny_config
from transformer.core.errors import ConfigError
from transformer.model.families import EncoderDecoder
from transformer.model.positions import ALiBi, PositionSettings, T5Bias, make_positional_encoding
from transformer.model.scores import ScoreSettings
from transformer.run import config as config_lib
from transformer.run import experiment, workdir
from transformer.run.config import parse
from transformer.study import sweep


def _model_config(config):
  return parse(config).model


def test_defaults_are_the_settings_dataclasses():
  cfg = _model_config(make_tiny_config())
  assert cfg.position_settings == PositionSettings()
  assert cfg.attention.score_settings == ScoreSettings()
  assert cfg.position_settings.alibi == ALiBi.Settings(max_bias=8.0)
  assert cfg.position_settings.t5 == T5Bias.Settings(num_buckets=32, max_distance=128)


def test_settings_are_overridable_on_the_command_line():
  """--config.model.position_settings.<name>.<field> reaches the encoding the model builds."""
  argv = ["train.py", f"--config={os.path.join(ROOT, 'configs', 'default.py')}",
          "--config.model.position=alibi", "--config.model.position_settings.alibi.max_bias=4",
          "--config.model.position_settings.t5.num_buckets=16",
          "--config.model.attention.score_settings.cosine.init_temperature=2.5"]
  values = flags.FlagValues()  # train.py's config flag, parsing argv as the CLIs do
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  values(argv)
  cfg = _model_config(values.config)
  assert cfg.position_settings.alibi.max_bias == 4.0
  assert cfg.position_settings.t5.num_buckets == 16
  assert cfg.attention.score_settings.cosine.init_temperature == 2.5
  model = nnx.eval_shape(lambda: EncoderDecoder(cfg, rngs=nnx.Rngs(0)))
  assert model.encoder.position.slopes[-1] == 2.0 ** -4  # 4 heads: 2^(-4·h/4), h = 4


def test_settings_are_sweepable():
  """A sweep axis over a setting gives one model per value."""
  runs = sweep.product(sweep.axis("model.position", ["xpos"]),
                       sweep.axis("model.position_settings.xpos.scale_base", [64.0, 256.0]))
  scale_bases = []
  for overrides in runs:
    cfg = _model_config(sweep.with_overrides(make_tiny_config(), overrides))
    model = nnx.eval_shape(lambda cfg=cfg: EncoderDecoder(cfg, rngs=nnx.Rngs(0)))
    scale_bases.append(model.decoder.position.scale_base)
  assert scale_bases == [64.0, 256.0]
  assert sweep.run_name(runs[0]) == ("model.position=xpos,"
                                     "model.position_settings.xpos.scale_base=64.0")
  with pytest.raises(ConfigError, match="no field 'model.position_settings.alibi.slope'"):
    sweep.with_overrides(make_tiny_config(), {"model.position_settings.alibi.slope": 4.0})


@pytest.mark.parametrize("section,key,value,message", [
    ("model.position_settings.alibi", "foo", 1,
     "unknown field(s) foo in config.model.position_settings.alibi; fields: "
     "bidirectional_offset, max_bias"),
    ("model.position_settings", "alibii", {"max_bias": 1.0},
     "unknown field(s) alibii in config.model.position_settings; fields: "
     + ", ".join(sorted(f.name for f in dataclasses.fields(PositionSettings)))),
    ("model.attention.score_settings.gaussian", "width", 2.0,
     "unknown field(s) width in config.model.attention.score_settings.gaussian; fields: "
     "learn_sigma, sigma"),
    ("model.position_settings.t5", "num_buckets", 2,
     "config.model.position_settings.t5.num_buckets=2 is not allowed; it must be ≥ 4"),
    ("model.position_settings.fire", "width", 1.5,
     "config.model.position_settings.fire.width=1.5 is not allowed; it must be an integer"),
    ("model.attention.score_settings.additive", "dim", -1,
     "config.model.attention.score_settings.additive.dim=-1 is not allowed; it must be ≥ 0"),
])
def test_every_section_is_checked_whichever_entry_is_chosen(section, key, value, message):
  """A config file's unknown key or bad value in any section is a ConfigError naming it,
  though the model uses sinusoidal positions and scaled_dot scores."""
  config = make_tiny_config().to_dict()
  node = config
  for name in section.split("."):
    node = node[name]
  node[key] = value
  with pytest.raises(ConfigError) as e:
    _model_config(ml_collections.ConfigDict(config))
  assert str(e.value) == message


OLD = {"additive_dim": 8, "gaussian_sigma": 2.0, "learn_sigma": False}


def _old_config_json(tmp_path, **old) -> str:
  """A workdir whose config.json was written before the settings sections: no
  score_settings or position_settings, the scorer settings flat in model.attention."""
  config = make_tiny_config().to_dict()
  del config["model"]["position_settings"], config["model"]["attention"]["score_settings"]
  config["model"]["attention"].update(old)
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(config))
  return str(tmp_path)


def test_a_config_written_before_the_sections_loads_for_evaluation(tmp_path):
  """The old flat fields move into their sections (their values kept), absent sections
  take the defaults (the old class constants), and the model has the parameter tree the
  old code built."""
  old = parse(workdir.load_config(_old_config_json(tmp_path, **OLD)))
  exp = experiment.build(old, str(tmp_path), evaluating=True)
  settings = exp.model.attention.score_settings
  assert (settings.additive.dim, settings.gaussian.sigma, settings.gaussian.learn_sigma) == (
      8, 2.0, False)
  assert exp.model.position_settings == PositionSettings()
  new = make_tiny_config()
  new.model.attention.score_settings.additive.dim = 8
  new_params = jax.eval_shape(experiment.build(parse(new), str(tmp_path)).init)["params"]
  old_params = jax.eval_shape(exp.init)["params"]
  assert jax.tree.structure(old_params) == jax.tree.structure(new_params)
  assert jax.tree.map(lambda x: x.shape, old_params) == jax.tree.map(lambda x: x.shape, new_params)


def _migrate_model(model: dict) -> dict:
  return config_lib.migrate({"model": model})["model"]


def test_migration_of_the_old_flat_scorer_fields():
  """The old flat fields move to the sections whose fields declare them (moved_from)."""
  model = {"d_model": 8, "attention": {"score": "additive", **OLD, "dropout": 0.1}}
  assert _migrate_model(model) == {"d_model": 8, "attention": {
      "score": "additive", "dropout": 0.1, "score_settings": {
          "additive": {"dim": 8}, "gaussian": {"sigma": 2.0, "learn_sigma": False}}}}
  # Beside a new section (a config file setting an old field on the new default config),
  # the old field's value is the one given.
  both = {"attention": {"additive_dim": 4, "score_settings": {"additive": {"dim": 0},
                                                              "cosine": {"init_temperature": 3.0}}}}
  assert _migrate_model(both)["attention"]["score_settings"] == {
      "additive": {"dim": 4}, "cosine": {"init_temperature": 3.0}}
  current = {"model": {"attention": {"score_settings": {"additive": {"dim": 4}}}}}
  assert config_lib.migrate(current) is current
  with pytest.raises(ConfigError, match="gaussian.sigma=-1.0 is not allowed"):
    _model_config(ml_collections.ConfigDict(
        {**make_tiny_config().to_dict(),
         "model": {**make_tiny_config().model.to_dict(),
                   "attention": {"score": "gaussian", "gaussian_sigma": -1.0}}}))


def test_every_encoding_and_scorer_builds_from_its_section():
  """make_positional_encoding reads its own section of the sections dataclass."""
  cfg = _model_config(sweep.with_overrides(
      make_tiny_config(), {"model.position_settings.kerple.max_init_r1": 0.02}))
  enc = make_positional_encoding("kerple", 8, 2, 0, settings=cfg.position_settings,
                                 rngs=nnx.Rngs(0))
  assert float(jax.numpy.exp(enc.log_r1[...]).max()) <= 0.02


def test_a_run_s_identity_counts_only_the_chosen_entries_settings(tmp_path):
  """An older run's config.json (flat scorer fields) resumes under today's config; the knobs
  of a scorer or encoding the run does not use are not its identity; the chosen ones are."""
  run = _old_config_json(tmp_path, **OLD)  # scaled_dot and sinusoidal: OLD is unused
  config = make_tiny_config()
  workdir.check_identity(parse(config), run, has_checkpoints=True)
  config.model.position_settings.alibi.max_bias = 4.0
  config.model.attention.score_settings.additive.dim = 16
  workdir.check_identity(parse(config), run, has_checkpoints=True)
  additive = _old_config_json(tmp_path, **OLD, score="additive")
  config = make_tiny_config(**{"model.attention.score": "additive"})
  config.model.attention.score_settings.additive.dim = 8  # what the old run had
  workdir.check_identity(parse(config), additive, has_checkpoints=True)
  config.model.attention.score_settings.additive.dim = 16
  with pytest.raises(ConfigError, match=r"differs in: attention.score_settings.additive.dim"):
    workdir.check_identity(parse(config), additive, has_checkpoints=True)
