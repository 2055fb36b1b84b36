"""Context extension of a small language model: the LM of configs/lm_extrapolation.py
(d 128, 4 heads, 2 pre-LN layers, 800 steps of 32 windows) trained at L = 64 on the Python
standard library, scored by perplexity at L, 2L, 4L and 8L and by passkey retrieval at each
of those lengths; 3 seeds. The variants: rotary (the baseline), partial rotary (a quarter of
each head's dimensions turn, GPT-NeoX's rotary_pct), ALiBi, FIRE, no positions (NoPE) and a
RoPE/NoPE hybrid (`rotary+none`: layer 1 rotary, layer 2 none; model/layer_pattern.py).

A quarter of the training rows are passkey rows at L (data.passkey.train_fraction = 0.25,
data/lm/passkey.py's Mix; their keys never among the evaluation's), so the model learns the
retrieval format at L and the passkey columns at 2L, 4L, 8L ask whether it survives at
lengths never trained. Trained on text alone this LM retrieves nothing at any length. A
rotary run (seed 0) per fraction retrieved, of 50 held-out rows at L, 2L, 4L, 8L / its
perplexity at L:
  fraction 0     0.00 0.00 0.00 0.00 / 46.9
  fraction 0.1   0.02 0.00 0.00 0.00 / 50.3
  fraction 0.25  0.26 0.06 0.00 0.00 / 49.9
  fraction 0.5   0.10 0.02 0.00 0.00 / 59.4

  python sweep.py --config configs/lm_context.py --sweep_dir sweeps/lm_context \\
      --baseline model.position=rotary

Position interpolation, NTK-aware scaling and YaRN at evaluation, on the trained rotary
runs, each against its own unscaled evaluation (sweeps.md, evaluation-time sweeps):

  python sweep.py --config configs/lm_context.py --sweep_dir sweeps/lm_context \\
      --only model.position=rotary \\
      --eval_sweep model.position_settings.rotary.scaling=linear,ntk,yarn \\
      --eval_sweep model.position_settings.rotary.factor=2,4,8 \\
      --eval_sweep model.position_settings.rotary.original_length=64

YaRN after a short fine-tune at 2L: `:finetune` starts each seed from the trained rotary
run of its seed (train.init_from, `{seed}` standing for the seed; a fresh optimizer) and
trains 100 steps of 16 windows of 128 tokens (an eighth of the pre-training's tokens) under
YaRN with s = 2, and, as the control that tells YaRN from the extra training at 2L, the same
fine-tune without a scaling. Both keep the mixture, a quarter of passkey rows, now at 2L
(their passkey at 2L is trained, at 4L and 8L not). Both are evaluated at 2L, 4L and 8L on
the same held-out tokens as the runs above (max_factor 4 of 2L); compare.py puts them
beside the rotary runs (the first variant given is the baseline of the paired differences):

  python sweep.py --config configs/lm_context.py:finetune --sweep_dir sweeps/lm_context_finetune
  python compare.py sweeps/lm_context/model.position=rotary,seed=* \\
      sweeps/lm_context_finetune/*seed=* --ignore train.init_from \\
      --output sweeps/lm_context_finetune/compared

The sweep keeps lm_extrapolation's LM and corpus; it scores no sliding windows (they are
not needed here, and they cost most of an evaluation).
"""

from configs import lm_extrapolation
from transformer.api import axis, product

ROTARY = "model.position_settings.rotary."
L = 64  # the training length
PASSKEY_FRACTION = 0.25  # of the training rows (docstring: 0.1 too few, 0.5 costs perplexity)
VARIANTS = [{"model.position": "rotary"},  # rotary (the config's position) first: the baseline
            {ROTARY + "rotated_fraction": 0.25},  # partial rotary, GPT-NeoX's 25%
            {"model.position": "alibi"},
            {"model.position": "fire"},
            {"model.position": "none"},
            {"model.position": "rotary+none"}]  # a RoPE/NoPE hybrid, layer by layer
FINETUNES = [{},  # at 2L without a scaling: the control
             {ROTARY + "scaling": "yarn", ROTARY + "factor": 2.0, ROTARY + "original_length": L}]
SEEDS = [0, 1, 2]
SOURCES = "sweeps/lm_context/model.position=rotary,seed={seed}"  # the fine-tunes' starts
ARGS = ("", "finetune")  # get_config's arguments


def get_config(arg: str = ""):
  if arg not in ARGS:
    raise ValueError(f"configs/lm_context.py takes '' or 'finetune', not {arg!r}")
  config = lm_extrapolation.get_config()
  config.data.update(max_len=L, max_factor=8, sliding=False)
  config.data.passkey.train_fraction = PASSKEY_FRACTION  # passkey rows in training, at L
  config.model.position = "rotary"
  if arg == "finetune":  # at 2L, from the rotary run of the same seed
    config.data.update(max_len=2 * L, max_factor=4)  # evaluated at 2L, 4L, 8L
    config.train.update(batch_size=16, num_steps=100, schedule="constant", learning_rate=1e-3,
                        warmup_steps=10, checkpoint_every=100, init_from=SOURCES)
  return config


def get_sweep(arg: str = ""):
  return product(FINETUNES if arg else VARIANTS, axis("seed", SEEDS))
