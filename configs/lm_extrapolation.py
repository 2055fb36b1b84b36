"""Ablation: "train short, test long" (Press et al. 2022, ALiBi) on a decoder-only language
model: every positional encoding, 2 seeds, trained on windows of L = 64 tokens of the
Python standard library's source and evaluated at L, 2L, 4L and 8L, in non-overlapping
windows and with a sliding window of stride L.

  python train.py --config configs/lm_extrapolation.py --workdir workdirs/lm      # one run
  python eval.py --workdir workdirs/lm                 # perplexity by length, per position
  python sweep.py --config configs/lm_extrapolation.py --sweep_dir sweeps/lm_extrapolation

The corpus is pinned: the top-level .py modules of Python 3.11's standard library
(data.python_version; another version is another corpus: override it knowingly), 1 in 10
files (by CRC32 of the file name) held out; a 2048-piece BPE vocabulary is trained on the
training files into each workdir.
"""

import ml_collections

from configs import default
from transformer import fields
from transformer.data.lm import LMData
from transformer.sweep import axis, product

POSITIONS = ["none", "sinusoidal", "learned", "rotary", "alibi", "t5", "xpos", "kerple", "fire"]


def get_config():
  config = default.get_config()
  # Every field of the lm source's section (so each can be overridden), from its dataclass.
  config.data = ml_collections.ConfigDict(fields.to_dict(LMData(
      corpus="stdlib", python_version="3.11", stdlib_scope="top", heldout_modulus=10,
      vocab_size=2048, tokenizer_type="bpe", max_len=64, max_factor=8, sliding=True)))
  del config.task
  config.model.update(arch="decoder", d_model=128, num_heads=4, d_ff=512,
                      num_decoder_layers=2, max_len=512, dropout=0.0, norm="pre",
                      position="alibi")
  config.train.update(batch_size=32, num_steps=800, learning_rate=1.0, warmup_steps=200,
                      label_smoothing=0.0, eval_every=0, log_every=100, loss_chunks=4)
  config.eval.update(num_examples=16, batch_size=32)
  return config


def get_sweep():
  return product(axis("model.position", POSITIONS), axis("seed", [0, 1]))
