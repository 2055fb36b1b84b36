"""Multi30k English→German: a small Transformer on real parallel text (run from the repo root).

  python train.py --config configs/multi30k.py --workdir workdirs/multi30k
  python eval.py --workdir workdirs/multi30k --beam_size 4 --alpha 0.6

The corpus directory is a field: --config.data.dir=/path/to/multi30k. A joint sentencepiece
vocabulary is trained on the training pairs into the workdir on the first run.
"""

from configs import default


def get_config():
  config = default.get_config()
  data = config.data
  data.source = "text"
  data.dir = "../shared/data/multi30k"
  data.train_source, data.train_target = "train.en.gz", "train.de.gz"
  data.valid_source, data.valid_target = "val.en.gz", "val.de.gz"
  data.test_source, data.test_target = "test_2016_flickr.en.gz", "test_2016_flickr.de.gz"
  data.vocab_size = 8000
  data.tokenizer_type = "unigram"  # unigram | bpe | char | word
  data.tokenizer = ""  # an existing sentencepiece model; "": train one into the workdir
  data.max_len = 64  # training pairs longer than this (in pieces) are dropped; packed row width
  data.pack = True
  data.decode_offset = 10  # decode up to source length + this many pieces

  config.model.update(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3,
                      num_decoder_layers=3, dropout=0.1, max_len=256)
  config.model.attention.dropout = 0.1
  config.train.update(batch_size=64, num_steps=20000, learning_rate=1.0, warmup_steps=4000,
                      label_smoothing=0.1, log_every=100, eval_every=2000,
                      checkpoint_every=2000, keep_checkpoints=5)
  config.eval.update(num_examples=0, batch_size=128)  # 0: every held-out sentence
  return config
