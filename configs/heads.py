"""Ablation: attention heads at a fixed d_model (the paper's Table 3, rows (A)) on Multi30k
En→De: 1 / 2 / 4 / 8 heads, so d_k = d_v = d_model / heads, with validation and test BLEU.

  python sweep.py --config configs/heads.py --sweep_dir sweeps/heads          # 3 seeds
  python sweep.py --config configs/heads.py:gpu --sweep_dir sweeps/heads      # same, bf16
  python sweep.py --config configs/heads.py:cpu --sweep_dir sweeps/heads_cpu  # 1 seed, CPU

`full` and `gpu` are the shipped Multi30k recipe (d_model 256, 3+3 layers, 8000 steps), `gpu`
computing in bfloat16 (about 3 min per run on one H100). `cpu` is a smaller model
(d_model 128, 2+2 layers, batch 32, 1500 steps) that a 2-core CPU trains in minutes per run.
"""

from configs import multi30k
from transformer.api import axis, lookup, product, with_overrides

SIZES = {
    "full": {},
    "gpu": {"model.dtype": "bfloat16"},
    "cpu": {"model.d_model": 128, "model.d_ff": 512, "model.num_encoder_layers": 2,
            "model.num_decoder_layers": 2, "model.dropout": 0.1, "train.batch_size": 32,
            "train.num_steps": 1500, "train.warmup_steps": 500, "train.eval_every": 500,
            "train.eval_examples": 200, "train.checkpoint_every": 500,
            "train.keep_checkpoints": 1, "eval.num_examples": 200},
}
SEEDS = {"full": [0, 1, 2], "gpu": [0, 1, 2], "cpu": [0]}
ARGS = tuple(SIZES)  # get_config's arguments


def get_config(size: str = "full"):
  return with_overrides(multi30k.get_config(), lookup(SIZES, size, "heads sweep size"))


def get_sweep(size: str = "full"):
  return product(axis("model.num_heads", [1, 2, 4, 8]), axis("seed", SEEDS[size]))
