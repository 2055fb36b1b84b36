"""Which attention kernel each layer runs: decided here, and nowhere else.

A layer states what it asks of a kernel as one record, Needs, built once when the layer is
made (transformer/model/attention.py); the run states where the model will execute as a
Target: the JAX backend, the mesh, training or evaluating (transformer/run/experiment.py
builds it; the model wing never reads the run's config). choose() compares the two with
the kernels' declared capabilities (KERNELS, transformer/model/kernels/registry.py):

  * a kernel named by hand must run on the backend, be partitioned over the mesh when it
    has several devices, and accept the layer's needs (check); otherwise a ConfigError. One
    that runs only emulated here (Pallas' interpret mode on the CPU) is kept, with a
    warning;
  * `auto` takes the first kernel of the backend's order of preference (AUTO_ORDER) that
    it offers the layer, passes the same check and is not emulated here; each kernel it
    passes over comes with its reason, the error choosing it by hand would give. A kernel
    declaring `auto_only_with_bias` (pallas) is offered only to a layer whose encoding adds
    a positional bias; to others it is not a candidate (nor in the log);
  * evaluating (a run trained elsewhere), the kernel of its training is an execution choice
    that need not hold here: one that is refused or emulated here is replaced by its
    stand-in, which computes the same function, or else by `auto`'s choice.

The log lines of a model's choices, one per distinct choice: transformer/model/kernels/log.py.
"""

import dataclasses
from collections.abc import Callable

import jax

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.kernels.registry import KERNELS, Kernel, able
from transformer.model.normalizers import NORMALIZERS, SOFTMAX, Normalizer
from transformer.model.positions import PositionalEncoding
from transformer.model.scores import Scorer

AUTO = "auto"

# Fastest first. GPU: cuDNN's flash attention (bf16/fp16, no learned bias, no attention
# dropout); then, offered only to a layer with a positional bias (ALiBi, T5, KERPLE, FIRE:
# Kernel.auto_only_with_bias), Pallas' flash attention, which computes that bias in-kernel
# instead of holding a [b, h, L, L] array (lowered for Triton and Mosaic by
# tests/test_lowering.py, never run on a GPU or TPU); then XLA's fused attention, then the
# formula. TPU: the same without cuDNN. CPU: the reference kernel runs everything, and the
# default config ran it before `auto` (at small sizes it is as fast as `xla`; `blockwise`
# trades speed for memory, which auto does not judge: choose it by hand for long
# sequences). A name missing from KERNELS is passed over, so an order may name a kernel
# that is not registered everywhere.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("cudnn", "pallas", "xla", "reference"),
    "tpu": ("pallas", "xla", "reference"),
    "cpu": ("reference",),  # runs every layer
}
OTHER_BACKENDS = ("xla", "reference")


@dataclasses.dataclass(frozen=True)
class Needs:
  """What one attention layer asks of its kernel: one field per capability a kernel
  declares (kernels.Kernel). Every kernel takes padding, packing and causal masks; the
  conformance test (tests/test_kernel_conformance.py) holds each one to every need it
  declares it meets."""

  score: str = "scaled_dot"  # the scorer's config name (for error lines)
  dot_product: bool = True  # the scorer declares a dot product (scores.DotProduct)
  normalizer: str = "softmax"  # the normaliser's config name (for error lines)
  plain_softmax: bool = True  # the normaliser is softmax itself (normalizers.Normalizer)
  online_normalizer: bool = True  # the normaliser declares an online (blockwise) form
  dropout: float = 0.0  # on the attention weights
  softcap: float = 0.0  # c > 0: logits capped to c·tanh(score / c)
  position: str = "none"  # the positional encoding's config name (for error lines)
  bias: bool = False  # the encoding adds a positional logit bias (what auto offers pallas)
  learned_bias: bool = False  # the encoding's logit bias has parameters (their gradient)
  content_bias: bool = False  # the encoding adds a content bias (a whole row of logits)
  # a data-dependent bias (data_biases.py: FoX's c_i − c_j) is added to the positional one
  data_bias: bool = False
  # the encoding's bias reads a table at each pair (randomized offsets drawn per batch)
  gathered_bias: bool = False
  window: bool = False  # its masks carry a local window (self-attention, window=local)
  grouped: bool = False  # fewer key/value heads than query heads
  dtype: str = "float32"  # the compute dtype's name
  block_size: int = 512  # queries and keys per block, for the kernels working in blocks

  @classmethod
  def of(cls, scorer: Scorer, encoding: PositionalEncoding, normalizer: Normalizer = SOFTMAX,
         /, **fields) -> "Needs":
    """The needs of a layer with this scorer, positional encoding and normaliser (what they
    declare), and the other `fields`."""
    return cls(dot_product=scorer.dot_product is not None,
               plain_softmax=normalizer.plain_softmax, online_normalizer=normalizer.online,
               bias=encoding.biases,
               # a data bias (FoX's gate) has parameters: its gradient is a learned bias's
               learned_bias=encoding.learned_bias or fields.get("data_bias", False),
               content_bias=encoding.content_biases,
               gathered_bias=encoding.gathered_bias,
               **fields)


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a model will execute: the JAX backend (cpu, gpu, tpu), its mesh (None: one
  device) and whether it is evaluated (a run trained elsewhere) rather than trained."""

  backend: str
  mesh: jax.sharding.AbstractMesh | None = None
  evaluating: bool = False

  @classmethod
  def here(cls, mesh: jax.sharding.AbstractMesh | None = None,
           evaluating: bool = False) -> "Target":
    """This process's default backend."""
    return cls(jax.default_backend(), mesh, evaluating)

  @property
  def devices(self) -> int:
    return 1 if self.mesh is None else self.mesh.size


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The kernel a layer runs: `asked` in the config, `name` run; the kernels preferred to it
  that could not run the layer, each with its reason (auto's candidates, or the kernel
  asked for that an evaluation replaced); a warning to say once (a kernel emulated here)."""

  asked: str
  name: str
  passed_over: tuple[tuple[str, str], ...] = ()
  warning: str = ""

  def describe(self, where: str = "") -> str:
    """One log line: "kernel auto -> xla{where} (cudnn: <why not>)"."""
    line = f"kernel {self.asked} -> {self.name}{where}"
    reasons = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
    return f"{line} ({reasons})" if reasons else line


def check_kernel_name(name: str) -> None:
  """An UnknownName (a ConfigError) unless `name` is `auto` or a key of KERNELS."""
  lookup({AUTO: None, **KERNELS}, name, "attention kernel")


def check(name: str, needs: Needs, target: Target | None = None) -> None:
  """A ConfigError naming what kernel `name` cannot do for a layer with these needs: where it
  runs (given a target: its backends, a mesh of several devices), then what it computes
  (its declared capabilities against the needs)."""
  kernel = lookup(KERNELS, name, "attention kernel")
  if target is not None and kernel.backends is not None and target.backend not in kernel.backends:
    raise ConfigError(f"model.attention.kernel={name!r} runs on {' or '.join(kernel.backends)} "
                      f"only; this machine's JAX backend is {target.backend}: use "
                      f"{kernel.stand_in!r} (the same computation) or 'reference'")
  if target is not None and target.devices > 1 and not kernel.multi_device:
    raise ConfigError(f"model.attention.kernel={name!r} runs on one device (its kernel is not "
                      f"partitioned over a mesh) and this run's mesh has {target.devices}; use "
                      f"kernel 'auto' or {able(lambda k: k.multi_device)}")
  for meets, refusal in _rules(needs):
    if not meets(kernel):
      raise ConfigError(f"attention.kernel '{name}' {refusal(kernel, able(meets))}")


def _rules(n: Needs) -> list[tuple[Callable[[Kernel], bool], Callable[[Kernel, str], str]]]:
  """What a kernel must declare to meet the needs `n`: (meets(kernel), the refusal of a
  kernel that does not, given the kernels that do)."""
  return [
      (lambda k: k.any_score or n.dot_product, lambda k, able: (
          f"computes dot-product scores only, and score '{n.score}' declares no dot product; "
          f"use kernel {able}")),
      (lambda k: k.any_normalizer or n.plain_softmax or (
          k.online_normalizers and n.online_normalizer), lambda k, able: (
          f"computes normalizer {_normalizers_of(k)} only, not '{n.normalizer}'; use kernel "
          f"{able} or model.attention.normalizer=softmax")),
      (lambda k: k.dropout or not n.dropout, lambda k, able: (
          f"has no attention dropout; set model.attention.dropout=0 (got {n.dropout}) or "
          f"kernel {able}")),
      (lambda k: k.softcap or not n.softcap, lambda k, able: (
          f"cannot soft-cap the attention logits; set model.attention.logit_softcap=0 (got "
          f"{n.softcap}) or use kernel {able}")),
      (lambda k: k.content_bias or not n.content_bias, lambda k, able: (
          f"cannot add the content-dependent logit bias of position '{n.position}' (it needs "
          f"each query's whole row of logits); use kernel {able} or another position")),
      (lambda k: k.data_bias or not n.data_bias, lambda k, able: (
          f"cannot add a data-dependent logit bias (model.attention.data_bias); use kernel "
          f"{able}")),
      (lambda k: k.gathered_bias or not n.gathered_bias, lambda k, able: (
          f"evaluates positional biases in-kernel from positions, and position "
          f"'{n.position}' with model.random_positions_draw=per_batch reads its bias at "
          f"sampled offsets from a table; use kernel {able}")),
      (lambda k: k.learned_bias or not n.learned_bias, lambda k, able: (
          f"gives no reliable gradient for the learned logit bias of position '{n.position}' "
          f"(cuDNN's bias gradient, JAX issue #23701); use kernel {able} or 'auto'")),
      (lambda k: k.local_window or not n.window, lambda k, able: (
          f"takes no local attention window; set model.attention.window=full or use kernel "
          f"{able}")),
      (lambda k: k.grouped_query or not n.grouped, lambda k, able: (
          f"has no grouped-query attention; set model.num_kv_heads=0 (= num_heads) or use "
          f"kernel {able}")),
      (lambda k: k.dtypes is None or n.dtype in k.dtypes, lambda k, able: (
          f"computes in {' or '.join(k.dtypes)} only, and model.dtype is {n.dtype}; set "
          f"model.dtype={k.dtypes[0]} or use kernel {able}")),
  ]


def _normalizers_of(kernel: Kernel) -> str:
  """The normalisers a kernel declaring no any_normalizer computes: "'sigmoid' or ..."."""
  names = [name for name, cls in NORMALIZERS.items()
           if cls.plain_softmax or (kernel.online_normalizers and cls.online)]
  return " or ".join(repr(name) for name in names)


def _emulated(name: str, target: Target) -> str:
  """Why kernel `name` is not worth running on the target's backend ('' if it is)."""
  if target.backend in KERNELS[name].slow_on:
    return f"runs emulated on {target.backend} (Pallas' interpret mode)"
  return ""


def offered(name: str, needs: Needs) -> bool:
  """Whether `auto` offers kernel `name` to a layer with these needs: one declaring
  auto_only_with_bias only to a layer whose encoding adds a positional bias."""
  return needs.bias or not KERNELS[name].auto_only_with_bias


def _auto(needs: Needs, target: Target, passed_over=()) -> KernelChoice:
  """The first kernel of the backend's AUTO_ORDER offered to the layer that runs it
  natively."""
  passed_over = list(passed_over)
  for candidate in AUTO_ORDER.get(target.backend, OTHER_BACKENDS):
    if candidate not in KERNELS or not offered(candidate, needs):  # not registered (yet)
      continue
    why = _emulated(candidate, target)
    try:
      check(candidate, needs, target)
    except ConfigError as e:
      why = str(e)
    if why:
      passed_over.append((candidate, why))
      continue
    return KernelChoice(AUTO, candidate, tuple(passed_over))
  raise ConfigError(f"attention.kernel 'auto' found no kernel for this layer on "
                    f"{target.backend}: " + "; ".join(f"{n}: {why}" for n, why in passed_over))


def _for_evaluation(asked: str, why: str, needs: Needs, target: Target) -> KernelChoice:
  """Evaluating, kernel `asked` refused or emulated here (`why`): its stand-in, the same
  function, if that runs the layer natively here; otherwise auto's choice."""
  stand_in = KERNELS[asked].stand_in
  if stand_in is not None and not _emulated(stand_in, target):
    try:
      check(stand_in, needs, target)
      return KernelChoice(asked, stand_in, ((asked, f"{why}; evaluating with its stand-in "
                                                    f"{stand_in!r}, the same function"),))
    except ConfigError:
      pass
  return dataclasses.replace(_auto(needs, target, [(asked, why)]), asked=asked)


def choose(asked: str, needs: Needs, target: Target | None = None
           ) -> tuple[KernelChoice, Callable]:
  """(the choice, the kernel function) for a layer with these needs, on `target` (None:
  this process's backend, one device, training); the rules are the module docstring's."""
  target = target or Target.here()
  check_kernel_name(asked)
  if asked == AUTO:
    choice = _auto(needs, target)
  else:
    try:
      check(asked, needs, target)
      why = _emulated(asked, target)
    except ConfigError as e:
      if not target.evaluating:
        raise
      why = str(e)
    if why and target.evaluating:
      choice = _for_evaluation(asked, why, needs, target)
    elif why:  # training asked for it: slow, but it is the kernel asked for
      stand_in = KERNELS[asked].stand_in
      choice = KernelChoice(asked, asked, warning=(
          f"model.attention.kernel {asked!r} {why}: slow, for tests"
          + (f"; {stand_in!r} computes the same function here" if stand_in else "")))
    else:
      choice = KernelChoice(asked, asked)
  kernel = KERNELS[choice.name]
  return choice, kernel.make(block_size=needs.block_size, softcap=needs.softcap,
                             mesh=target.mesh)
