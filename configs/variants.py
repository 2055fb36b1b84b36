"""Ablation: the attention and block variants of today's language models, on the
decoder-only LM of configs/lm_extrapolation.py (pre-LN, rotary, windows of L = 64 tokens of
the Python standard library's source), evaluated at the training length.

  python train.py --config configs/variants.py --workdir workdirs/variants     # one run
  python sweep.py --config configs/variants.py --sweep_dir sweeps/variants
  python sweep.py --config configs/variants.py:attention --sweep_dir sweeps/variants_attention

The default sweep: K/V heads (MHA 4, GQA 2, MQA 1: model.num_kv_heads) × norm (LayerNorm,
RMSNorm: model.norm_type) × feed-forward (ReLU at d_ff; SwiGLU at ⌊2/3·d_ff⌋, the weights of
the ReLU layer, as Shazeer 2020 compares them) × 2 seeds: 24 runs.
`:attention`: QK-norm (none, rmsnorm) × logit soft-cap (off, 5) × z-loss (0, 1e-4) on the
MHA/LayerNorm/ReLU model, 2 seeds: 16 runs.
"""

from configs import lm_extrapolation
from transformer.api import axis, lookup, product

ARGS = {"": "blocks", "attention": "attention"}  # get_config's arguments: the sweep


def gated_width(d_ff: int) -> int:
  """The d_ff of a gated FFN with the weights of a plain one of width d_ff (less its biases):
  3·d·⌊2/3·d_ff⌋ ≈ 2·d·d_ff."""
  return 2 * d_ff // 3


def get_config(arg: str = ""):
  lookup(ARGS, arg, "configs/variants.py sweep")
  config = lm_extrapolation.get_config()
  config.data.update(max_factor=1, sliding=False)  # held out at the training length only
  config.model.update(position="rotary", max_len=64)
  config.train.update(num_steps=600)
  return config


def get_sweep(arg: str = ""):
  seeds = axis("seed", [0, 1])
  if lookup(ARGS, arg, "configs/variants.py sweep") == "attention":
    return product(axis("model.attention.qk_norm", ["none", "rmsnorm"]),
                   axis("model.attention.logit_softcap", [0.0, 5.0]),
                   axis("train.z_loss", [0.0, 1e-4]), seeds)
  d_ff = get_config().model.d_ff
  ffns = [{"model.ffn": "relu", "model.d_ff": d_ff},
          {"model.ffn": "swiglu", "model.d_ff": gated_width(d_ff)}]
  return product(axis("model.num_kv_heads", [4, 2, 1]),
                 axis("model.norm_type", ["layernorm", "rmsnorm"]), ffns, seeds)
