"""ListOps (Long Range Arena's ListOps task, Tay et al. 2021): classify the value (0-9) of
nested MAX/MIN/MED/SM expressions with an encoder (model.arch=encoder) and a CLS token.

  python train.py --config configs/listops.py --workdir workdirs/listops       # CPU-sized
  python train.py --config configs/listops.py:lra --workdir workdirs/listops_lra  # LRA-sized
  python sweep.py --config configs/listops.py --sweep_dir sweeps/listops      # positions × scorers

The CPU-sized task has expressions of 10..64 tokens and depth ≤ 4; `lra` has LRA's lengths
(500..2000 tokens), depth ≤ 10 and ≤ 10 arguments, and LRA's model (4 layers, d 512, 8
heads, ff 1024, mean pooling; vanilla Transformer 36.4% in LRA Table 1). Data is generated
from the seed; held-out expressions never occur in training.
"""

from configs import default
from transformer.api import axis, product, with_source

ARGS = ("", "lra")  # get_config's arguments


def get_config(arg: str = ""):
  config = with_source(default.get_config(), "labelled")
  config.task.name = "listops"  # its defaults are the CPU-sized task (docstring)
  config.model.update(arch="encoder", pooling="cls", d_model=64, num_heads=4, d_ff=128,
                      num_encoder_layers=2, max_len=64, dropout=0.0)
  config.train.update(batch_size=32, num_steps=3000, learning_rate=0.25, warmup_steps=300,
                      label_smoothing=0.0, eval_every=1000, loss_chunks=1)
  config.eval.update(num_examples=1000, batch_size=250)
  if arg == "lra":
    config.task.update(min_len=500, max_len=2000, max_depth=10, max_args=10)
    config.model.update(pooling="mean", d_model=512, num_heads=8, d_ff=1024,
                        num_encoder_layers=4, max_len=2000, dropout=0.1)
    config.train.update(batch_size=32, num_steps=5000, learning_rate=1.0, warmup_steps=1000,
                        eval_every=1000)
    config.eval.update(num_examples=2000, batch_size=32)
  elif arg:
    raise ValueError(f"configs/listops.py takes '' or 'lra', not {arg!r}")
  return config


def get_sweep(arg: str = ""):
  del arg
  return product(axis("model.position", ["none", "sinusoidal", "learned", "rotary", "alibi"]),
                 axis("model.attention.score", ["scaled_dot", "additive"]),
                 axis("seed", [0, 1]))
