"""Ablation: positional encodings on the reverse task, 3 seeds each, with the `longer` split
at up to 2× the training length (17..32) for length extrapolation.

  python sweep.py --config configs/positions.py --sweep_dir sweeps/positions
"""

from configs import default
from transformer.sweep import axis, product


def get_config():
  config = default.get_config()
  config.task.longer_max_len = 2 * config.task.max_len
  return config


def get_sweep():
  positions = ["none", "sinusoidal", "learned", "rotary", "alibi", "t5"]
  return product(axis("model.position", positions), axis("seed", [0, 1, 2]))
