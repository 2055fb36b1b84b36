"""MQAR, multi-query associative recall (Arora et al. 2024, "Zoology"): a small causal decoder
trained on sequences of L = 64 tokens with 4 key-value pairs, evaluated by sequence length
(L, 2L, 4L, 8L) × number of pairs (4, 8, ... while 4·pairs ≤ length); the sweep compares
positional encodings, 2 seeds.

  python train.py --config configs/mqar.py --workdir workdirs/mqar
  python eval.py --workdir workdirs/mqar        # accuracy by length and by number of pairs
  python sweep.py --config configs/mqar.py --sweep_dir sweeps/mqar

Zoology's vocabulary is 8192 symbols; here 256 (keys the first half, values the second)
keep the output layer small on a CPU. The sweep's report (report.md) tabulates and draws
accuracy by length × pairs (accuracy_by_length_pairs.png) and by length at the training
number of pairs (extrapolation.png).
"""

from configs import default
from transformer.api import axis, product, with_source

POSITIONS = ["none", "rotary", "alibi", "fire"]


def get_config():
  config = with_source(default.get_config(), "mqar")  # L = 64, 4 pairs, 256 symbols
  config.model.update(arch="decoder", d_model=64, num_heads=2, d_ff=256,
                      num_decoder_layers=2, max_len=512, dropout=0.0, norm="pre",
                      position="rotary")
  config.train.update(batch_size=64, num_steps=2000, learning_rate=1.0, warmup_steps=200,
                      label_smoothing=0.0, eval_every=0, log_every=100)
  config.eval.update(num_examples=64, batch_size=64)
  return config


def get_sweep():
  return product(axis("model.position", POSITIONS), axis("seed", [0, 1]))
