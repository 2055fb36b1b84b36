"""Default: reverse random strings with a small Transformer; the offline quick start.

  python train.py --config configs/default.py --workdir workdirs/default
  python eval.py --workdir workdirs/default
  python train.py --config configs/default.py --show_config  # every field, what it allows

Every field of the schema (the dataclasses' defaults: transformer/run/config.py) is here and
can be overridden on the command line, e.g.
  --config.model.position=rotary --config.model.attention.score=additive
  --config.model.position_settings.alibi.max_bias=4
This file writes only what the quick start changes.
"""

from transformer.api import schema


def get_config():
  config = schema("synthetic")
  config.task.update(name="reverse_string", num_symbols=16, max_len=16)
  # A model far smaller than the paper's base (the schema's defaults), which this task
  # needs: it trains in minutes on a CPU.
  config.model.update(d_model=64, num_heads=4, d_ff=256, num_encoder_layers=2,
                      num_decoder_layers=2, dropout=0.0, max_len=64)
  # train.label_smoothing stays 0.1: it also damps the late Adam spikes of this converged task.
  config.train.update(learning_rate=0.25, warmup_steps=200, eval_every=500)
  config.eval.update(num_examples=512, batch_size=256)
  return config
