"""The [b, h, L, L] temporaries a kernel holds for a layer, against the device's memory:
where they would not fit, `auto` passes the kernel over for one in O(L) (choice.py).

Bytes per (row, head, query, key), by kernel, as the compute dtype's itemsize i makes
them; a kernel not listed holds no L×L array (blockwise, pallas). Fitted to what XLA
allocated on an H100 at batch 4, 16 heads, L 8192, bf16 (benchmarks/attention_scaling.py,
2026-11-28): `xla` forward + backward 40 GiB (10 bytes a pair: 4 + 3i), `cudnn` with
ALiBi's bias 24 GiB (6: 3i); forwards, unmeasured, as the f32 logits and the weights
(4 + i) and the bias alone (i).
"""

import jax
import jax.numpy as jnp

# kernel -> (bytes per pair forward, forward + backward, given the itemsize; with a bias)
BYTES_PER_PAIR = {
    "reference": lambda i, bias: (4 + i, 4 + 3 * i),
    "xla": lambda i, bias: (4 + i, 4 + 3 * i),
    "cudnn": lambda i, bias: (i, 3 * i) if bias else (0, 0),
}
SHARE = 0.5  # of the device's memory that one layer's temporaries may take


def device_memory() -> int | None:
  """Bytes of memory of this process's first device, if it says (GPUs and TPUs do). Its own
  device: another process's, first in jax.devices() on a multi-process job, has no stats
  here."""
  stats = jax.local_devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def too_big(kernel: str, dtype: str, bias: bool, heads: int, rows: int | None,
            length: int | None, memory: int | None, training: bool) -> str:
  """Why `kernel`'s L×L temporaries for a layer of `heads` heads over `rows` rows of
  `length` would not fit in SHARE of `memory` bytes ('' if they would, or if any of these
  is not known)."""
  if kernel not in BYTES_PER_PAIR or not (heads and rows and length and memory):
    return ""
  per_pair = BYTES_PER_PAIR[kernel](jnp.dtype(dtype).itemsize, bias)[1 if training else 0]
  need = per_pair * rows * heads * length ** 2
  if need <= SHARE * memory:
    return ""
  return (f"its [b, h, L, L] temporaries (about {need / 2**30:.1f} GiB at {rows} rows x "
          f"{heads} heads x L {length}) would not fit in half of this device's "
          f"{memory / 2**30:.0f} GiB")
