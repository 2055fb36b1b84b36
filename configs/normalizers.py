"""How the logits become weights, and what gates and data-dependent biases do to length
generalisation, retrieval and the attention sink: softmax, sigmoid (Ramapuram et al. 2025),
softmax with a learned per-head sink (Xiao et al. 2024; gpt-oss), an element-wise output
gate (Qiu et al. 2025, their recommended G1), stick-breaking (Tan et al. 2025) and FoX's
forget gate (Lin et al. 2025), each with no positions (NoPE) and with rotary, 3 seeds.

`cast`: bucket_sort in the decoder cast (configs/decoder_cast.py: trained on input
lengths 1..20, tested on 21..40), its model and training; `cast_reverse`: the same on
reverse_string. `lm`: the context-extension LM
of configs/lm_context.py (L = 64, a quarter of the training rows passkey rows at L,
perplexity and passkey at L, 2L, 4L, 8L) made CPU-sized for this grid: d 64, 4 heads, 2
layers, 400 steps of 32 windows; sigmoid's b = −log n with n = L, its paper's choice (the
cast keeps the default n = model.max_len). `mqar`: MQAR (configs/mqar.py: L = 64, 4
key-value pairs, accuracy by length × pairs) with 1000 steps of its 2000, rotary only.

  python sweep.py --config configs/normalizers.py:cast --sweep_dir sweeps/normalizers_cast
  python sweep.py --config configs/normalizers.py:cast_reverse \\
      --sweep_dir sweeps/normalizers_reverse
  python sweep.py --config configs/normalizers.py:lm --sweep_dir sweeps/normalizers_lm
  python sweep.py --config configs/normalizers.py:mqar --sweep_dir sweeps/normalizers_mqar

Each variant against softmax with the same positions (compare.py, paired by seed), and the
first-token attention mass per layer (transformer/study/attention_sinks.py):

  python compare.py sweeps/normalizers_lm/model.position=rotary,* \\
      --output sweeps/normalizers_lm/rotary --ignore model.attention.normalizer_settings \\
      --baseline model.attention.normalizer=softmax,model.attention.gate=none,model.attention.data_bias=none
  python -m transformer.study.attention_sinks 'sweeps/normalizers_lm/*seed=*' \\
      --split len64 --split len512 \\
      --baseline model.attention.normalizer=softmax,model.attention.gate=none,model.attention.data_bias=none

The results, commands and wall time: docs/results.md.
"""

from configs import decoder_cast, lm_context, mqar
from transformer.api import axis, lookup, product

# Every variant names all three fields, so that each differs from softmax in one only.
PLAIN = {"model.attention.normalizer": "softmax", "model.attention.gate": "none",
         "model.attention.data_bias": "none"}
VARIANTS = [PLAIN,  # the baseline first
            {**PLAIN, "model.attention.normalizer": "sigmoid"},
            {**PLAIN, "model.attention.normalizer": "sink"},
            {**PLAIN, "model.attention.gate": "elementwise"},
            {**PLAIN, "model.attention.normalizer": "stick_breaking"},
            {**PLAIN, "model.attention.data_bias": "forget"}]
POSITIONS = ["none", "rotary"]
SEEDS = [0, 1, 2]
TASKS = {"cast": "bucket_sort",  # the cast's task that every encoding learns in distribution
         "cast_reverse": "reverse_string"}  # the one where rotary beat NoPE past L


def _cast(task: str):
  config = decoder_cast.get_config()
  config.task.name = task
  return config


def _lm():
  config = lm_context.get_config()
  config.model.update(d_model=64, num_heads=4, d_ff=256)
  # sigmoid's b = −log n with n the training length, as its paper (not model.max_len = 8L)
  config.model.attention.normalizer_settings.sigmoid.length = lm_context.L
  config.train.update(num_steps=400, warmup_steps=100)
  return config


def _mqar():
  config = mqar.get_config()
  config.model.attention.normalizer_settings.sigmoid.length = config.data.max_len
  config.train.update(num_steps=1000)
  return config


CONFIGS = {**{arg: lambda task=task: _cast(task) for arg, task in TASKS.items()}, "lm": _lm,
           "mqar": _mqar}
ARGS = tuple(CONFIGS)  # get_config's arguments


def get_config(arg: str = "cast"):
  return lookup(CONFIGS, arg, "configs/normalizers.py argument")()


def get_sweep(arg: str = "cast"):
  # MQAR with rotary only: its runs are the grid's longest
  positions = ["rotary"] if arg == "mqar" else POSITIONS
  return product(axis("model.position", positions), VARIANTS, axis("seed", SEEDS))
