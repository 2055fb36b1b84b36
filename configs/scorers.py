"""Ablation: attention scoring functions on the reverse task, 3 seeds each.

  python sweep.py --config configs/scorers.py --sweep_dir sweeps/scorers
"""

from configs import default
from transformer.api import SCORES, axis, product


def get_config():
  return default.get_config()


def get_sweep():
  return product(axis("model.attention.score", sorted(SCORES)), axis("seed", [0, 1, 2]))
