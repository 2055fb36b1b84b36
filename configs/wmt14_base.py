"""WMT14 English→German with the paper's base Transformer ("Attention Is All You Need", Table 3).

  python train.py --config configs/wmt14_base.py --workdir workdirs/wmt14_base \
      --config.data.tfds_dir=/data/tensorflow_datasets
  python eval.py --workdir workdirs/wmt14_base --beam_size 4 --alpha 0.6 --average 5

Reads the TFDS dataset through tfds.data_source (array_record, no TensorFlow); prepare it once
(the error message says how). WMT17: --config.data.tfds_name=wmt17_translate/de-en. Reversed
direction: --config.data.source_lang=de --config.data.target_lang=en. On GPUs/TPUs add
--config.model.dtype=bfloat16 (kernel=auto then takes cuDNN's flash attention on NVIDIA GPUs).

configs/wmt14_base.py:hf reads the hub's wmt/wmt14 de-en through Hugging Face datasets instead
(pip install -e '.[hf]'; --config.data.hf_streaming=true streams it rather than preparing it
whole); reversed: --config.data.source_column=translation.de
--config.data.target_column=translation.en.
"""

from configs import default
from transformer.api import lookup, with_source

ARGS = ("tfds", "hf")  # get_config's arguments: the data source


def get_config(source: str = "tfds"):
  """source: tfds (the prepared TFDS dataset wmt14_translate/de-en) | hf (the hub's
  wmt/wmt14 de-en, columns translation.en → translation.de: configs/wmt14_base.py:hf);
  both sources' defaults are this dataset."""
  lookup(dict.fromkeys(ARGS), source, "configs/wmt14_base.py data source")
  config = with_source(default.get_config(), source)
  data = config.data
  data.vocab_size = 32768  # the paper: a shared source-target vocabulary of ~37000 BPE tokens
  data.tokenizer_type = "bpe"
  data.max_len = 128  # pieces per side: longer pairs are dropped; the packed row width
  data.decode_offset = 50  # the paper decodes up to input length + 50

  config.model.update(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6,
                      num_decoder_layers=6, dropout=0.1, max_len=256)
  # The paper's batches hold ~25k source + ~25k target tokens: 224 rows x 128 x ~90% fill.
  config.train.update(batch_size=224, num_steps=100_000, learning_rate=1.0, warmup_steps=4000,
                      label_smoothing=0.1, log_every=200, eval_every=5000, eval_examples=1000,
                      checkpoint_every=2000, keep_checkpoints=5)
  config.eval.update(num_examples=0, batch_size=128)
  return config
