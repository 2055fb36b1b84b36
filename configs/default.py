"""Default: reverse random strings with a small Transformer; the offline quick start.

  python train.py --config configs/default.py --workdir workdirs/default
  python eval.py --workdir workdirs/default

Every field can be overridden on the command line, e.g.
  --config.model.position=rotary --config.model.attention.score=additive
"""

import ml_collections

from transformer.core.registry import settings_config
from transformer.model.positions import PositionSettings
from transformer.model.scores import ScoreSettings


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Where batches come from (transformer/data/sources.py): synthetic | text | tfds | labelled
  # | lm, each with its own config.data fields (and config.task for synthetic and labelled).
  config.data = ml_collections.ConfigDict()
  config.data.source = "synthetic"

  # The synthetic seq2seq task (transformer/data/synthetic.py).
  config.task = ml_collections.ConfigDict()
  config.task.name = "reverse"  # reverse | copy | sort
  config.task.num_symbols = 16
  config.task.min_len = 1
  config.task.max_len = 16
  config.task.heldout_modulus = 10  # 1/10 of string space is held out for evaluation
  config.task.longer_max_len = 24  # the `longer` split: lengths max_len+1 .. this

  # Model (transformer/model/blocks.py: ModelConfig; transformer/model/attention.py: AttentionConfig).
  config.model = ml_collections.ConfigDict()
  # encoder_decoder (seq2seq) | encoder (classification, labelling) | decoder (causal LM);
  # the data source says which it needs.
  config.model.arch = "encoder_decoder"
  config.model.pooling = "none"  # encoder: none (a label per token) | cls | mean (per sequence)
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.num_kv_heads = 0  # 0: = num_heads (multi-head); 1: multi-query; else a divisor
  config.model.d_ff = 256
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.dropout = 0.0
  # none | sinusoidal | learned | rotary | alibi | t5 | xpos | kerple | fire
  config.model.position = "sinusoidal"
  config.model.max_len = 64  # rows of the `learned` position table
  # Randomized positions (Ruoss et al. 2023): each sequence's positions a sorted random
  # sample of [0, max_position), in training and evaluation; the learned table gets
  # max_position rows. Not for position none or cope, nor with window=local.
  config.model.random_positions = False
  config.model.max_position = 2048
  config.model.norm = "post"  # post | pre
  config.model.norm_type = "layernorm"  # layernorm | rmsnorm: every norm of the model
  # relu | gelu (exact) | swiglu | geglu (gated, no biases: 1.5x the weights at one d_ff;
  # d_ff = floor(2/3 d_ff) matches the parameters)
  config.model.ffn = "relu"
  config.model.share_embeddings = True
  config.model.dtype = "float32"  # float32 | bfloat16 (computation; parameters stay float32)
  config.model.remat = False  # recompute layer activations in the backward pass: less memory
  config.model.scan_layers = False  # each stack's layers as one lax.scan: faster compiles
  config.model.attention = ml_collections.ConfigDict()
  config.model.attention.score = "scaled_dot"  # scaled_dot | dot | additive | gaussian | cosine
  config.model.attention.window = "full"  # full | local
  config.model.attention.window_size = 16
  config.model.attention.dropout = 0.0
  # auto (per layer, the fastest kernel that can run it; logged) | reference (any score,
  # attention dropout) | xla | cudnn (jax.nn.dot_product_attention: dot-product scores, no
  # attention dropout; cudnn = flash attention on NVIDIA GPUs, bf16/fp16, no learned bias)
  # blockwise (any score, no attention dropout): online softmax over blocks of block_size,
  # memory O(L·block) and, with window=local, O(L·(block + 2·window_size)) work.
  # pallas (dot-product scores, no attention dropout): Pallas flash attention, blocks of
  # block_size, the positional bias computed in-kernel; interpret mode (slow) on the CPU.
  config.model.attention.kernel = "auto"
  config.model.attention.block_size = 512
  # Each head's queries and keys normalised over head_dim before the rotation and the scorer:
  # none | rmsnorm | layernorm (learned scale; layernorm: and bias; ε = 1e-6).
  config.model.attention.qk_norm = "none"
  # c > 0: logits c·tanh(score / c), positional biases added after the cap; 0: off. Kernels
  # reference and blockwise only.
  config.model.attention.logit_softcap = 0.0
  # Each scorer's and encoding's own knobs, one section per registry entry with any, from
  # its Settings (defaults: its paper's values; transformer/model/scores.py, positions.py), e.g.
  #   --config.model.attention.score_settings.additive.dim=32  (0: head_dim)
  #   --config.model.attention.score_settings.gaussian.sigma=2.0  (0: head_dim ** 0.25)
  #   --config.model.position_settings.alibi.max_bias=4
  #   --config.model.position_settings.t5.num_buckets=64
  config.model.attention.score_settings = settings_config(ScoreSettings)
  config.model.position_settings = settings_config(PositionSettings)

  # Optimization: AdamW(0.9, 0.98, 1e-9), lr = learning_rate · d^-0.5 · min(n^-0.5, n·warmup^-1.5).
  config.train = ml_collections.ConfigDict()
  config.train.batch_size = 64
  config.train.num_steps = 2000
  config.train.schedule = "rsqrt"  # rsqrt (the paper's warmup then 1/sqrt) | constant
  config.train.learning_rate = 0.25
  config.train.warmup_steps = 200
  config.train.label_smoothing = 0.1  # also damps the late Adam spikes of this converged task
  config.train.weight_decay = 0.0
  config.train.grad_clip_norm = 0.0  # 0: off
  config.train.accumulation_steps = 1  # micro-batches per step (gradients summed): same update
  config.train.loss_chunks = 4  # logits of 1/loss_chunks of the target tokens at a time
  config.train.z_loss = 0.0  # adds z_loss * log(Z)^2 per target token (PaLM: 1e-4); 0: off
  config.train.log_every = 100
  config.train.eval_every = 500  # 0: only at the end
  config.train.eval_examples = 0  # per held-out split during training; 0: eval.num_examples
  config.train.checkpoint_every = 1000
  config.train.keep_checkpoints = 3  # the latest ones, and besides them the lowest-loss one
  # A step whose loss, gradient or update is NaN/inf is never applied; this many in a row
  # are skipped (the data moves on), one more stops the run with an error. 0: stop at once.
  config.train.skip_nonfinite = 0
  config.train.profile_steps = 0  # trace this many steps (jax.profiler) into WORKDIR/profile
  # Weights & Biases (pip install -e '.[wandb]'): the project ("": off), entity ("": the
  # login's default), group ("": none; a sweep groups its runs under its directory's name).
  config.train.wandb_project = ""
  config.train.wandb_entity = ""
  config.train.wandb_group = ""

  # Device mesh (transformer/run/sharding.py): batch split over data x fsdp, parameters and
  # optimizer state split over fsdp and tensor. -1: the devices left over.
  config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})

  config.eval = ml_collections.ConfigDict()
  config.eval.num_examples = 512  # per held-out split
  config.eval.batch_size = 256
  # Decoding (and an LM's eval.py --generate): greedy at temperature 0; T > 0 draws each
  # token from softmax(logits / T) after top_k (0: off), top_p (1: off), min_p (0: off).
  # eval.py's --temperature/--top_k/--top_p/--min_p/--sample_seed override these.
  config.eval.sampling = ml_collections.ConfigDict(
      {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0})
  config.eval.sample_seed = 0
  return config
