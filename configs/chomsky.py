"""The length-generalisation protocol of Delétang et al. 2023 ("Neural Networks and the
Chomsky Hierarchy") and Ruoss et al. 2023 ("Randomized Positional Encodings Boost Length
Generalization of Transformers"): train an encoder on input lengths 1..40, test it on
longer ones, score the accuracy per test length averaged over the lengths.

  python train.py --config configs/chomsky.py --workdir workdirs/reverse_string
  python train.py --config configs/chomsky.py --workdir workdirs/sort \\
      --config.task.name=bucket_sort --config.model.position=rotary \\
      --config.model.random_positions=True
  python sweep.py --config configs/chomsky.py:cpu --sweep_dir sweeps/chomsky_cpu   # hours, CPU
  python sweep.py --config configs/chomsky.py --sweep_dir sweeps/chomsky          # accelerators

The model is the papers' (DeepMind's code): an encoder of 5 post-LN layers, d_model 64,
8 heads, feed-forward 256, dropout 0.1, reading the input followed by one answer slot per
output symbol (data/tasks/algorithmic.py); Adam at a constant rate; one training length per
batch (task.train_lengths). Randomized positions are drawn as Ruoss et al.'s code draws them
(model.random_positions_draw=per_batch: per batch, per layer, relative encodings at sampled
offsets, evaluation afresh per batch) from [0, 2048) (their noise_max_length); ALiBi has
their 0.5 offset for keys before the query. `get_config()` is the papers' protocol for an
accelerator: test lengths 41..500, batch 128, rates 1e-4, 3e-4, 5e-4, 100k steps (their
example script trains 10k; the papers train far longer). `cpu` is a laptop-sized variant
(about an hour on 2 cores): 3 layers, batch 16, 1500 steps at one rate, test lengths
41..100; its sweep is 5 tasks × 4 encodings × {plain, randomized} (none: plain only) × 3
seeds. The remaining differences from the papers' protocol are listed in docs/tasks.md
(#differences-from-the-papers-protocol).
"""

from configs import default
from transformer.api import CHOMSKY_PROBLEMS, axis, product, with_source

# The encodings the papers compare (sinusoidal, learned, rotary, ALiBi, T5's relative bias,
# and none), in this codebase's names.
ENCODINGS = ["none", "sinusoidal", "learned", "rotary", "alibi", "t5"]
CPU_TASKS = ["reverse_string", "duplicate_string", "odds_first", "bucket_sort",
             "missing_duplicate_string"]
CPU_ENCODINGS = ["none", "sinusoidal", "rotary", "alibi"]
ARGS = ("", "cpu")  # get_config's arguments


def get_config(arg: str = ""):
  if arg not in ARGS:
    raise ValueError(f"configs/chomsky.py takes '' or 'cpu', not {arg!r}")
  config = with_source(default.get_config(), "algorithmic")  # data.cast: slots, as the papers
  # Only the fields every task has; the others stay unset (each task's own defaults), also
  # in a sweep over task.name.
  config.task.update(name="reverse_string", min_len=1, max_len=40, test_max_len=500,
                     train_lengths="per_batch")
  config.model.update(arch="encoder", pooling="none", d_model=64, num_heads=8, d_ff=256,
                      num_encoder_layers=5, dropout=0.1, position="sinusoidal",
                      max_len=1536, max_position=2048, random_positions_draw="per_batch",
                      norm="post")
  config.train.update(batch_size=128, num_steps=100_000, schedule="constant",
                      learning_rate=3e-4, warmup_steps=1, label_smoothing=0.0,
                      eval_every=10_000, checkpoint_every=10_000, loss_chunks=1)
  config.eval.update(num_examples=4600, batch_size=128)  # 10 per test length
  if arg == "cpu":
    config.task.test_max_len = 100
    config.model.update(num_encoder_layers=3,
                        max_len=320)  # the longest CPU row: duplicate_string at 100, 300 tokens
    config.train.update(batch_size=16, num_steps=1500, learning_rate=1e-3, warmup_steps=100,
                        eval_every=0, checkpoint_every=500)
    config.eval.update(num_examples=300, batch_size=100)  # 5 per test length
  return config


def encodings(names: list[str]) -> list[dict]:
  """Each encoding plain and with randomized positions; `none` (no positions) plain only."""
  return [{"model.position": name, "model.random_positions": randomized}
          for name in names for randomized in ([False] if name == "none" else [False, True])]


def get_sweep(arg: str = ""):
  if arg == "cpu":
    return product(axis("task.name", CPU_TASKS), encodings(CPU_ENCODINGS), axis("seed", [0, 1, 2]))
  return product(axis("task.name", sorted(CHOMSKY_PROBLEMS)), encodings(ENCODINGS),
                 axis("train.learning_rate", [1e-4, 3e-4, 5e-4]), axis("seed", [0, 1, 2]))
