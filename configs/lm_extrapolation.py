"""Ablation: "train short, test long" (Press et al. 2022, ALiBi) on a decoder-only language
model: every positional encoding, 2 seeds, trained on windows of L = 64 tokens of the
Python standard library's source and evaluated at L, 2L, 4L and 8L, in non-overlapping
windows and with a sliding window of stride L, and by passkey retrieval (a key hidden at
depths 0, 1/4, ..., 1 of filler text, Mohtashami & Jaggi 2023) at each of those lengths.

  python train.py --config configs/lm_extrapolation.py --workdir workdirs/lm      # one run
  python eval.py --workdir workdirs/lm         # perplexity, passkey retrieval by length
  python sweep.py --config configs/lm_extrapolation.py --sweep_dir sweeps/lm_extrapolation
  python sweep.py --config configs/lm_extrapolation.py:t5_distance --sweep_dir sweeps/t5

`:t5_distance` is the controlled experiment on T5's bias: max_distance 128 (T5's), 64 and
32, all else equal. With L = 64, under 128 the causal buckets of distances 67 and more are
never trained (64–66 share a bucket with 59–63; the last bucket, shared from distance 113
on, is among them); under 64 and 32 every bucket is trained at L (the last begins at
distance 59 and 31).

The corpus is pinned: the top-level .py modules of Python 3.11's standard library
(data.python_version; another version is another corpus: override it knowingly), 1 in 10
files (by CRC32 of the file name) held out; a 2048-piece BPE vocabulary is trained on the
training files into each workdir.
"""

from configs import default
from transformer.api import POSITIONS, axis, product, with_source

ARGS = ("", "t5_distance")  # get_config's arguments


def get_config(arg: str = ""):
  if arg not in ARGS:
    raise ValueError(f"configs/lm_extrapolation.py takes '' or 't5_distance', not {arg!r}")
  config = with_source(default.get_config(), "lm")  # its defaults: the corpus described above
  config.data.python_version = "3.11"  # pinned: another version is another corpus
  config.model.update(arch="decoder", d_model=128, num_heads=4, d_ff=512,
                      num_decoder_layers=2, max_len=512, dropout=0.0, norm="pre",
                      position="alibi")
  config.train.update(batch_size=32, num_steps=800, learning_rate=1.0, warmup_steps=200,
                      label_smoothing=0.0, eval_every=0, log_every=100, loss_chunks=4)
  config.eval.update(num_examples=16, batch_size=32)
  # passkey retrieval at each length: 10 keys × 5 depths (transformer/data/lm/passkey.py)
  config.data.passkey.examples = 10
  return config


def get_sweep(arg: str = ""):
  if arg == "t5_distance":
    return product(axis("model.position", ["t5"]),
                   axis("model.position_settings.t5.max_distance", [128, 64, 32]),
                   axis("seed", [0, 1]))
  return product(axis("model.position", sorted(POSITIONS)), axis("seed", [0, 1]))
