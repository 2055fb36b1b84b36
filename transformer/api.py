"""What config and sweep files import: the package's public surface for them, one import
path that stays put while the modules behind it move.

  from transformer.api import axis, product, schema

  def get_config():
    config = schema("synthetic")          # every field at its default
    config.task.update(name="reverse_string")
    return config

  def get_sweep():
    return product(axis("model.position", ["rotary", "alibi"]), axis("seed", [0, 1, 2]))

schema(source) and with_source(config, source): a config with every field at its default,
or switched to another data source; axis, product and with_overrides: a sweep's override
sets; lookup(registry, name, what): a registry's entry or one error naming the choices;
POSITIONS and SCORES: the positional encodings and the attention scorers by name; TASKS:
the generated tasks by name, CHOMSKY_PROBLEMS the 15 of Delétang et al. among them.
"""

from transformer.core.registry import lookup
from transformer.data.tasks import CHOMSKY_PROBLEMS, TASKS
from transformer.model.positions import POSITIONS
from transformer.model.scores import SCORES
from transformer.run.config import schema, with_source
from transformer.study.sweep import axis, product, with_overrides

__all__ = ["CHOMSKY_PROBLEMS", "POSITIONS", "SCORES", "TASKS", "axis", "lookup", "product", "schema", "with_overrides",
           "with_source"]
