"""`model.attention.kernel=auto`: each attention layer takes the fastest kernel that can run
it, by the kernels' declared capabilities (transformer/model/kernels.py) against what its
scorer, dropout, positional encoding, compute dtype and the JAX backend ask.

The order of preference per backend is data (AUTO_ORDER); a name missing from KERNELS is
passed over, so an order may name a kernel that is not registered everywhere.
Each candidate is asked through check_kernel, the same check a kernel chosen by hand meets,
so the reason auto passes one over is the error that choosing it by hand would give.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.kernels import KERNELS, check_kernel
from transformer.model.positions import PositionalEncoding
from transformer.model.scores import Scorer

AUTO = "auto"

# Fastest first. GPU: cuDNN's flash attention (bf16/fp16, no
# learned bias, no attention dropout), then XLA's fused attention, then the formula. CPU:
# the reference kernel runs everything, and the default config ran it before `auto` (at
# small sizes it is as fast as `xla`; `blockwise` trades speed for memory, which auto does
# not judge: choose it by hand for long sequences).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    # `pallas` joins the GPU and TPU orders (first) once its lowerings have run and been
    # measured there; until then auto prefers the kernels known to run.
    "gpu": ("cudnn", "xla", "reference"),
    "tpu": ("xla", "reference"),
    "cpu": ("reference",),  # runs every layer
}
OTHER_BACKENDS = ("xla", "reference")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The kernel a layer runs: `asked` in the config, `name` run, and for `auto` the kernels
  preferred to it that could not run the layer, each with its reason."""

  asked: str
  name: str
  passed_over: tuple[tuple[str, str], ...] = ()

  def describe(self) -> str:
    """One log line: "kernel auto -> xla (cudnn: <why not>)"."""
    line = f"kernel {self.asked} -> {self.name}"
    reasons = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
    return f"{line} ({reasons})" if reasons else line


def check_kernel_name(name: str) -> None:
  """An UnknownName (a ConfigError) unless `name` is `auto` or a key of KERNELS."""
  lookup({AUTO: None, **KERNELS}, name, "attention kernel")


def choose_kernel(name: str, *, score_name: str, score: Scorer, dropout: float,
                  block_size: int, softcap: float = 0.0,
                  encoding: PositionalEncoding | None = None,
                  position: str = "none", dtype=jnp.float32,
                  backend: str | None = None) -> tuple[KernelChoice, Callable]:
  """(the choice, the kernel function) for a layer. A kernel named by hand: check_kernel's,
  a ConfigError if it cannot run the layer. `auto`: the first kernel of AUTO_ORDER for
  `backend` (None: JAX's default) that runs on it and passes check_kernel."""
  check = dict(score_name=score_name, score=score, dropout=dropout, block_size=block_size,
               softcap=softcap, encoding=encoding, position=position, dtype=dtype)
  if name != AUTO:
    return KernelChoice(name, name), check_kernel(name, **check)
  backend = backend or jax.default_backend()
  passed_over = []
  for candidate in AUTO_ORDER.get(backend, OTHER_BACKENDS):
    kernel = KERNELS.get(candidate)
    if kernel is None:  # not registered (yet)
      continue
    if kernel.backends is not None and backend not in kernel.backends:
      passed_over.append((candidate, f"runs on {' or '.join(kernel.backends)} only"))
      continue
    try:
      function = check_kernel(candidate, **check)
    except ConfigError as e:
      passed_over.append((candidate, str(e)))
      continue
    return KernelChoice(AUTO, candidate, tuple(passed_over)), function
  raise ConfigError(f"attention.kernel 'auto' found no kernel for this layer on {backend}: "
                    + "; ".join(f"{name}: {why}" for name, why in passed_over))


def kernel_choices(model) -> list[str]:
  """'path: kernel auto -> name (reasons)' for each attention layer of `model` (an NNX
  module, abstract or not) whose kernel `auto` chose, in NNX's graph order (attributes by
  name, list entries by index)."""
  return [f"{'.'.join(str(p) for p in path)}: {node.kernel_choice.describe()}"
          for path, node in nnx.iter_modules(model)
          if isinstance(getattr(node, "kernel_choice", None), KernelChoice)
          and node.kernel_choice.asked == AUTO]
