"""Length generalisation in a decoder-only model (Kazemnejad et al. 2023, "The Impact of
Positional Encoding on Length Generalization in Transformers"): the algorithmic tasks in the
decoder cast (data.cast=decoder: the input, a separator, then the answer generated
greedily; the loss on the answer only), trained on input lengths 1..20 and tested on
21..40, their protocol's doubling. No positions (NoPE), rotary, ALiBi and FIRE, each plain
and with randomized positions (Ruoss et al. 2023; NoPE has no positions to randomize), on
reverse_string, bucket_sort and parity_check, 3 seeds: 63 runs. Their finding to test:
NoPE ≈ T5's bias > ALiBi > rotary ≈ absolute on the longer inputs.

  python sweep.py --config configs/decoder_cast.py --sweep_dir sweeps/decoder_cast \\
      --baseline model.position=none
  python sweep.py --config configs/decoder_cast.py --sweep_dir sweeps/decoder_cast \\
      --report_only --baseline model.random_positions=False

The model and training are configs/chomsky.py:cpu's (d 64, 8 heads, feed-forward 256, Adam
at a constant 1e-3, batch 16, 1500 steps) with 3 decoder layers; the test split has 10
instances per length (200), scored by exact match and mean per-length accuracy over the
answer symbols. Kazemnejad et al. train a ~107M-parameter decoder for far longer; this is a
CPU-sized check of the direction, not a replication.
"""

from configs import chomsky
from transformer.api import axis, product

TASKS = ["reverse_string", "bucket_sort", "parity_check"]
ENCODINGS = ["none", "rotary", "alibi", "fire"]
SEEDS = [0, 1, 2]


def get_config():
  config = chomsky.get_config("cpu")
  config.data.cast = "decoder"
  config.task.update(min_len=1, max_len=20, test_max_len=40)
  config.model.update(arch="decoder", num_decoder_layers=3, position="none",
                      max_len=128)  # the longest row: bucket_sort at 40, 82 tokens
  config.eval.update(num_examples=200, batch_size=100)  # 10 per test length
  return config


def get_sweep():
  return product(axis("task.name", TASKS), chomsky.encodings(ENCODINGS), axis("seed", SEEDS))
