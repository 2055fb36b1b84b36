"""The typed configuration: a config file's ConfigDict parsed once, at the boundary, into one
frozen tree of dataclasses that everything below takes (or only the fields it needs).

The tree mirrors the config's layout: `seed`, `data` (the data source's section: the
dataclass its registry entry declares), `task` (the source's task section, None for a
source without one), `model` (model.config.ModelConfig with its attention and settings sections),
`train`, `eval` and `mesh`. Parsing checks every value (types, ranges, names against their
registries: ConfigErrors naming the field and what it allows) and moves the fields of older
layouts to today's places (migration.migrate, from the fields' own `moved_from` declarations).

The dataclasses are the schema: `schema(source)` is the ConfigDict of every field with its
default, the data and task sections those of a data source; a config file returns it (or
another config file's) changed by its deltas, and `with_source` switches a config's source.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from transformer.core import fields, migration, storage
from transformer.core.errors import ConfigError
from transformer.core.fields import (AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, check,
                                     check_ranges, dataclass_from, execution, identity_field)
from transformer.core.registry import lookup
from transformer.data.sources import SOURCES
from transformer.model.config import ModelConfig
from transformer.model.families import ARCHS
from transformer.model.sampling import Sampling
from transformer.run import optim

WANDB_RESERVED = "/\\#?%:"  # not in a W&B project name (wandb refuses them)
SEED_PLACE = "{seed}"  # in train.init_from: the run's seed


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """config.train: the optimiser (AdamW, β 0.9 and 0.98, ε 1e-9: run/optim.py) and the
  training loop's schedule."""

  batch_size: int = 64  # rows per step over all devices and processes
  num_steps: int = 2000
  schedule: str = "rsqrt"  # a key of optim.SCHEDULES
  # rsqrt: lr = learning_rate · d_model^-0.5 · min(n^-0.5, n·warmup^-1.5);
  # constant: lr = learning_rate · min(1, n/warmup)
  learning_rate: float = 1.0
  warmup_steps: int = 4000
  label_smoothing: float = 0.1
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0  # 0: off
  accumulation_steps: int = 1  # micro-batches per step (gradients summed): the same update
  loss_chunks: int = 4  # logits of 1/loss_chunks of the target tokens at a time
  # adds z_loss·log²Z per target token (Z: the softmax's normaliser; PaLM: 1e-4); 0: off
  z_loss: float = 0.0
  log_every: int = 100
  eval_every: int = 0  # 0: only at the end
  eval_examples: int = 0  # per held-out split during training; 0: eval.num_examples
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3  # the latest ones; the lowest-loss checkpoint is kept besides
  # A step whose loss, gradient or update is not finite is never applied; this many in a
  # row are skipped (the data moves on), one more stops the run. 0: stop at once.
  skip_nonfinite: int = 0
  profile_steps: int = 0  # steps traced by jax.profiler into WORKDIR/profile; 0: none
  # Weights & Biases (transformer/run/tracking.py): the project ("": off), entity ("": the
  # login's default) and group (""; a sweep groups its runs under its directory's name).
  wandb_project: str = ""
  wandb_entity: str = ""
  wandb_group: str = ""
  # A workdir (or WORKDIR/checkpoints/STEP) whose parameters the run starts from, with a
  # fresh optimizer state at step 0 (run/init_from.py); "": random ones. The run's identity,
  # kept as an absolute path; `{seed}` in it stands for config.seed (a sweep's seeds each
  # from the source run of their seed: sweeps/lm/model.position=rotary,seed={seed}).
  init_from: str = identity_field("")

  def __post_init__(self):
    lookup(optim.SCHEDULES, self.schedule, "train.schedule")
    check_ranges(self, batch_size=AT_LEAST_1, num_steps=AT_LEAST_1, learning_rate=POSITIVE,
                 warmup_steps=AT_LEAST_1, label_smoothing=FRACTION, weight_decay=AT_LEAST_0,
                 grad_clip_norm=AT_LEAST_0, accumulation_steps=AT_LEAST_1,
                 loss_chunks=AT_LEAST_1, z_loss=AT_LEAST_0, log_every=AT_LEAST_1,
                 eval_every=AT_LEAST_0,
                 eval_examples=AT_LEAST_0, checkpoint_every=AT_LEAST_1,
                 keep_checkpoints=AT_LEAST_1, skip_nonfinite=AT_LEAST_0,
                 profile_steps=AT_LEAST_0)
    check(len(self.wandb_project) <= 128 and self.wandb_project.isprintable()
          and not set(self.wandb_project) & set(WANDB_RESERVED), "wandb_project",
          self.wandb_project, "'' (off) or a W&B project name: at most 128 printable "
          f"characters, none of {' '.join(WANDB_RESERVED)}")
    if self.init_from:  # the identity of a run: the same source from any working directory
      object.__setattr__(self, "init_from", storage.absolute(self.init_from))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """config.eval: held-out evaluation (eval.py, and during training)."""

  num_examples: int = 0  # per held-out split; 0: all (text sources)
  batch_size: int = 128
  # How decoding (a family that decodes) and eval.py --generate (a language model) pick each
  # token: greedy by default; eval.py's --temperature, --top_k, --top_p, --min_p and
  # --sample_seed override these per evaluation.
  sampling: Sampling = dataclasses.field(default_factory=Sampling)
  sample_seed: int = 0  # the seed of the draws

  def __post_init__(self):
    check_ranges(self, num_examples=AT_LEAST_0, batch_size=AT_LEAST_1, sample_seed=AT_LEAST_0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """config.mesh: devices per mesh axis (transformer/run/sharding.py): the batch is split over
  data × fsdp, parameters and optimizer state over fsdp and tensor; -1: the devices left over."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run's configuration (module docstring). Identity: data, task and model (less
  their execution fields) and train.init_from; the rest may change when a run is resumed or
  evaluated."""

  data: Any  # the data source's section: SOURCES[data.source].Data
  task: Any  # the source's task section (SOURCES[data.source].Task), or None
  model: ModelConfig
  seed: int = execution(0)
  train: TrainConfig = execution(TrainConfig())
  eval: EvalConfig = execution(EvalConfig())
  mesh: MeshConfig = execution(MeshConfig())

  @property
  def source(self):
    """The data source class (a registry entry of SOURCES)."""
    return SOURCES[self.data.source]


SECTIONS = ("seed", "data", "task", "model", "train", "eval", "mesh")


def schema(source: str = "synthetic") -> ml_collections.ConfigDict:
  """Every config field with its dataclass's default (fields.schema): data and task are the
  sections that SOURCES[source] declares (no task section for a source without one). A
  field without a default (task.name; every field of a task chosen by name, whose defaults
  are the chosen task's) is unset, None until the config sets it."""
  entry = lookup(SOURCES, source, "data source")
  data = fields.schema(entry.Data, source=source)
  task = (entry.Task.schema() if isinstance(entry.Task, fields.Chosen) else
          fields.schema(entry.Task) if entry.Task is not None else None)
  sections = fields.schema(Config, data=data, task=task)
  if task is None:
    del sections["task"]
  return ml_collections.ConfigDict(sections)


def with_source(config: ml_collections.ConfigDict, source: str) -> ml_collections.ConfigDict:
  """`config` with the data and task sections of `source`'s schema in place of its own (a
  config that switches sources keeps its other fields); changed in place and returned."""
  new = schema(source)
  config.data = new.data
  if "task" in new:
    config.task = new.task
  elif "task" in config:
    del config.task
  return config


def parse(config: ml_collections.ConfigDict | Mapping[str, Any], saved: bool = False) -> Config:
  """The typed Config of a config file's ConfigDict or of a run's saved config.json (a
  nested dict, possibly of an older layout; `saved`: read as it meant when saved, see
  migrate); a ConfigError for any bad field. A `task` section is ignored by a source that
  reads none."""
  raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  unknown = sorted(set(raw) - set(SECTIONS))
  if unknown:
    raise ConfigError(f"unknown section(s) {', '.join(unknown)} in config; sections: "
                      f"{', '.join(SECTIONS)}")
  seed = raw.get("seed")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise fields.FieldError("config.seed", seed, "an integer ≥ 0")
  source = lookup(SOURCES, _section(raw, "data").get("source"), "data source")
  raw = migrate(raw, saved)
  data = dataclass_from(source.Data, _section(raw, "data"), "data")
  task = None
  if source.Task is not None:
    task = (source.Task.parse(_section(raw, "task"), "task")
            if isinstance(source.Task, fields.Chosen) else
            dataclass_from(source.Task, _section(raw, "task"), "task"))
  vocab_size, num_classes = source.output_sizes(data, task)
  model = dataclass_from(ModelConfig, _section(raw, "model"), "model", vocab_size=vocab_size,
                         num_classes=num_classes)
  lookup(ARCHS, model.arch, "model arch")  # families import blocks: checked here, not there
  train = dataclass_from(TrainConfig, _section(raw, "train"), "train")
  if SEED_PLACE in train.init_from:  # each seed of a sweep from its own source run
    train = dataclasses.replace(train, init_from=train.init_from.replace(SEED_PLACE, str(seed)))
  return Config(data=data, task=task, model=model, seed=seed, train=train,
                eval=dataclass_from(EvalConfig, _section(raw, "eval"), "eval"),
                mesh=dataclass_from(MeshConfig, _section(raw, "mesh"), "mesh"))


def migrate(raw: dict[str, Any], saved: bool = False) -> dict[str, Any]:
  """A whole config (nested dicts) of any older layout in today's (migration.migrate); a run's
  `saved` config also with the values that keep its meaning for fields added since
  (migration.as_saved for the model's, DataSource.saved for the source's)."""
  raw = migration.migrate(raw, ModelConfig, ("model",))
  if saved and isinstance(raw.get("model"), Mapping):
    raw = {**raw, "model": migration.as_saved(ModelConfig, raw["model"])}
  data = raw.get("data")
  name = data.get("source") if saved and isinstance(data, Mapping) else None
  return SOURCES[name].saved(raw) if isinstance(name, str) and name in SOURCES else raw


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
  section = raw.get(name, {})
  if not isinstance(section, Mapping):
    raise ConfigError(f"config.{name} must be a section of fields, got {section!r}")
  return section


def to_dict(cfg: Config) -> dict[str, Any]:
  """The config file's fields of a typed Config (what parse reads back): a run's config.json."""
  out = fields.to_dict(cfg)
  if cfg.task is None:
    del out["task"]
  return out


def replace(cfg, path: str, value):
  """A copy of a typed config (or section) with the field at the dotted `path` replaced."""
  head, _, rest = path.partition(".")
  return dataclasses.replace(cfg, **{head: replace(getattr(cfg, head), rest, value)
                                     if rest else value})
