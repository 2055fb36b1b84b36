"""WMT14 English→German with the paper's big Transformer (Table 3): d 1024, 16 heads, d_ff 4096,
dropout 0.3, 300k steps; everything else as configs/wmt14_base.py.

  python train.py --config configs/wmt14_big.py --workdir workdirs/wmt14_big
"""

from configs import wmt14_base


def get_config():
  config = wmt14_base.get_config()
  config.model.update(d_model=1024, num_heads=16, d_ff=4096, dropout=0.3)
  config.train.num_steps = 300_000
  return config
