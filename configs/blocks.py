"""Ablation: normalisation × feed-forward layer on the reverse task, 3 seeds each.

  python sweep.py --config configs/blocks.py --sweep_dir sweeps/blocks
  python sweep.py --config configs/blocks.py:same_width --sweep_dir sweeps/blocks_same_width

`matched` (the default) gives the gated layers (swiglu, geglu) d_ff = ⌊2/3·d_ff⌋, so that
every FFN has about the same number of weights, as Shazeer (2020) compares them;
`same_width` keeps d_ff for all (the gated layers then have 1.5× the FFN weights).
"""

from configs import default
from transformer.registry import lookup
from transformer.sweep import axis, product

WIDTHS = {"matched": True, "same_width": False}
GATED = ("swiglu", "geglu")


def gated_width(d_ff: int) -> int:
  """The d_ff of a gated FFN with the weights of a plain one of width d_ff: ⌊2/3·d_ff⌋."""
  return 2 * d_ff // 3


def get_config(width: str = "matched"):
  lookup(WIDTHS, width, "blocks sweep width")
  return default.get_config()


def get_sweep(width: str = "matched"):
  matched = lookup(WIDTHS, width, "blocks sweep width")
  d_ff = default.get_config().model.d_ff
  ffns = [{"model.ffn": ffn, "model.d_ff": gated_width(d_ff) if matched and ffn in GATED
           else d_ff} for ffn in ("relu", "gelu", *GATED)]
  return product(axis("model.norm_type", ["layernorm", "rmsnorm"]), ffns, axis("seed", [0, 1, 2]))
