"""What the train-step benchmarks share: the model dimensions by name, the matmul peak of
this device and the matmul FLOPs of an encoder-decoder step, whose ratio to the step time
is the MFU (benchmarks/train_step.py, benchmarks/flax_wmt_step.py)."""

import time

import jax

DIMS = {
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3),
    "tiny": dict(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6, num_decoder_layers=6),
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6,
                num_decoder_layers=6),
}
LENGTHS = {"small": 64, "tiny": 8, "base": 64, "big": 512}  # tokens per side, by default


def matmul_peak(n: int, dtype, repeats: int = 10) -> float:
  """Best n×n matmul throughput of the default device in `dtype`, FLOP/s."""
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def model_flops(m, vocab: int, batch: int, src: int, tgt: int) -> float:
  """Matmul FLOPs of one training step (3 × forward) of the encoder-decoder with the
  dimensions of `m` (d_model, d_ff, num_encoder_layers, num_decoder_layers)."""
  d, ff = m.d_model, m.d_ff
  encoder = m.num_encoder_layers * src * (8 * d * d + 4 * d * ff + 4 * src * d)
  decoder = m.num_decoder_layers * (tgt * (8 * d * d + 4 * tgt * d + 4 * d * d + 4 * src * d
                                           + 4 * d * ff) + src * 4 * d * d)
  return 3.0 * batch * (encoder + decoder + tgt * 2 * d * vocab)
