"""The measured speeds by which `auto` orders the kernels (choice.py), with the command,
device and date of each measurement: until a kernel has been measured faster on a
platform, it is not `auto`'s first choice there.

SPEEDS holds, per (backend, compute dtype, measured length), the milliseconds of one
attention layer per encoding (by its config name; `none` for every encoding that adds no
logit bias: none, sinusoidal, learned, rotary) and kernel, forward and forward + backward.
A layer of length L is ordered by the measurement of its LENGTH_RANGES entry (the nearest
measured length for its encoding where its own range has none); training orders by
forward + backward, evaluating by forward. A kernel not measured for the layer comes after
the measured ones, in AUTO_ORDER's order.

To measure again (on the device whose figures to add; the JSON rows go into SPEEDS):

  python benchmarks/gpu.py --out gpu_results      # its attention steps: benchmarks.md
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Measurement:
  """Where figures come from: the command, the device and its software, the date."""

  command: str
  device: str
  software: str
  date: str
  layer: str

  def describe(self) -> str:
    return f"measured on {self.device}, {self.date}"


H100 = Measurement(
    command="not kept with the figures (shared/FACTS.md, 'On an H100'); the same grid today: "
            "python benchmarks/attention_scaling.py --kernels cudnn,xla,pallas "
            "--dtype bfloat16 --positions none,alibi,t5,kerple,fire --lengths 2048,8192 "
            "--block 64 --d_model 1024 --heads 16 --batch 4 --causal. Kernels as they were "
            "then: cuDNN with a dense mask; pallas with a branch per block and two backward "
            "kernels, before its visit lists",
    device="NVIDIA H100 80GB HBM3", software="jax 0.11.2, CUDA 13 plugin",
    date="2026-11-28",
    layer="one self-attention layer with its projections, bf16, causal, batch 4, "
          "16 heads x 64, median of 10 after warm-up")

# ms (forward, forward + backward); None: not run (its temporaries did not fit: 40 GiB)
Speeds = dict[str, dict[str, tuple[float | None, float | None]]]
SPEEDS: dict[tuple[str, str, int], tuple[Measurement, Speeds]] = {
    ("gpu", "bfloat16", 2048): (H100, {
        "none": {"cudnn": (0.62, 1.75), "xla": (2.06, 5.47), "pallas": (2.64, 4.45)},
        "alibi": {"cudnn": (0.87, 2.82), "pallas": (3.10, 4.88)},
        "t5": {"xla": (3.41, 30.4), "pallas": (14.2, 22.4)},
        "kerple": {"xla": (2.50, 6.21), "pallas": (4.03, 6.44)},
        "fire": {"xla": (4.37, 14.4), "pallas": (14.2, 110.0)},
    }),
    ("gpu", "bfloat16", 8192): (H100, {
        "none": {"cudnn": (5.15, 16.6), "xla": (27.0, None), "pallas": (33.3, 56.4)},
        "alibi": {"cudnn": (8.23, 34.5), "pallas": (40.9, 64.4)},
    }),
}

# The lengths each measured length stands for: (measured, longest it stands for).
LENGTH_RANGES = ((2048, 4096), (8192, None))


def ranked(backend: str, dtype: str, position: str, length: int | None,
           training: bool) -> tuple[tuple[str, ...], str]:
  """(the kernels measured for such a layer, fastest first, a kernel not run last; what
  measured them, for the log), or ((), '') where nothing was. `position`: the encoding's
  config name, `none` if it adds no logit bias; `length` None: the shortest range."""
  wanted = next((m for m, top in LENGTH_RANGES if length is None or top is None or length <= top))
  measured = sorted((m for (b, d, m) in SPEEDS if (b, d) == (backend, dtype)
                     and position in SPEEDS[b, d, m][1]), key=lambda m: abs(m - wanted))
  if not measured:
    return (), ""
  at = measured[0]
  source, speeds = SPEEDS[backend, dtype, at]
  mode = 1 if training else 0
  times = speeds[position]
  order = sorted(times, key=lambda k: (times[k][mode] is None, times[k][mode] or 0.0))
  return tuple(order), (f"{'forward + backward' if training else 'forward'} at L {at} "
                        f"{source.describe()}")
