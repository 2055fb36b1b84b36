"""Which attention kernel each layer runs: decided here, and nowhere else.

A layer states what it asks of a kernel as one record, Needs, built once when the layer is
made (transformer/model/attention.py); the run states where the model will execute as a
Target: the JAX backend, the mesh, training or evaluating. The run sets the target around
the model's construction (`with choosing_for(target):`, in make_model), and each layer's
choice reads it there: the target is where the model executes, a context like JAX's mesh,
not a part of any layer, so no constructor between the run and the layers carries it,
while each choice is still made where the layer's parts are known and a refusal is raised
as the model is built. Outside such a scope: this process's backend, one device, training.

choose() compares the two with what each kernel offers (KERNELS,
transformer/model/kernels/registry.py; the capabilities, each declared once:
transformer/model/kernels/capabilities.py):

  * a kernel named by hand must run on the backend, be partitioned over the mesh when it
    has several devices, and accept the layer's needs (check); otherwise a ConfigError. One
    that runs only emulated here (Pallas' interpret mode on the CPU) is kept, with a
    warning;
  * `auto` takes the first kernel that it offers the layer, passes the same check, is not
    emulated here and whose L×L temporaries fit the device (kernels/memory.py), of the
    kernels measured for such a layer, fastest first (kernels/measured.py), then the
    backend's order (AUTO_ORDER); each kernel it passes over comes with its reason, the
    error choosing it by hand would give or its memory. A kernel declaring
    `auto_only_with_bias` (pallas) is offered only to a layer whose encoding adds a
    positional bias, once a kernel was passed over for its memory, or once every native
    kernel before it refused the layer; to others it is not a candidate (nor in the log);
  * evaluating (a run trained elsewhere), the kernel of its training is an execution choice
    that need not hold here: one that is refused or emulated here is replaced by its
    stand-in, which computes the same function, or else by `auto`'s choice.

The run logs a model's choices (kernel_choices: one line per distinct choice, with the
layers it holds for and its reasons) and the warnings of kernels emulated here
(kernel_warnings) when it builds the model.
"""

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator

import jax
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.kernels.capabilities import CAPABILITIES, Needs
from transformer.model.kernels.measured import ranked
from transformer.model.kernels.memory import device_memory, too_big
from transformer.model.kernels.registry import KERNELS, able

AUTO = "auto"

# Per backend, the order where no measurement ranks the kernels (kernels/measured.py ranks
# those it measured first): cuDNN where it applies, XLA, Pallas (measured faster nowhere
# but where measured.py says; first where XLA's [b, h, L, L] temporaries would not fit:
# kernels/memory.py), the formula, which runs every layer (on the CPU as fast as xla at
# small sizes). A name missing from KERNELS is passed over.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("cudnn", "xla", "pallas", "reference"),
    "tpu": ("xla", "pallas", "reference"),
    "cpu": ("reference",),  # runs every layer
}
OTHER_BACKENDS = ("xla", "reference")


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a model will execute: the JAX backend (cpu, gpu, tpu), its mesh (None: one
  device) and whether it is evaluated (a run trained elsewhere) rather than trained; and,
  where known, each device's memory in bytes, the rows it holds at once and the longest
  sequence (what a kernel's L×L temporaries are weighed with: kernels/memory.py)."""

  backend: str
  mesh: jax.sharding.AbstractMesh | None = None
  evaluating: bool = False
  memory: int | None = None
  rows: int | None = None
  length: int | None = None

  @classmethod
  def here(cls, mesh: jax.sharding.AbstractMesh | None = None, evaluating: bool = False,
           **known) -> "Target":
    """This process's default backend and its first device's memory."""
    return cls(jax.default_backend(), mesh, evaluating, device_memory(), **known)

  @property
  def devices(self) -> int:
    return 1 if self.mesh is None else self.mesh.size


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("target", default=None)


@contextlib.contextmanager
def choosing_for(target: Target | None) -> Iterator[None]:
  """The kernels of the layers made inside are chosen for `target` (None: Target.here())."""
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
  """The kernel a layer runs: `asked` in the config, `name` run; the kernels preferred to it
  that could not run the layer, each with its reason (auto's candidates, or the kernel
  asked for that an evaluation replaced); a warning to say once (a kernel emulated here)."""

  asked: str
  name: str
  passed_over: tuple[tuple[str, str], ...] = ()
  warning: str = ""
  basis: str = ""  # the measurement that ordered auto's candidates

  def describe(self, where: str = "") -> str:
    """One log line: "kernel auto -> xla{where} (cudnn: <why not>) [<basis>]"."""
    line = f"kernel {self.asked} -> {self.name}{where}"
    reasons = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
    line = f"{line} ({reasons})" if reasons else line
    return f"{line} [fastest {self.basis}]" if self.basis else line


def check_kernel_name(name: str) -> None:
  """An UnknownName (a ConfigError) unless `name` is `auto` or a key of KERNELS."""
  lookup({AUTO: None, **KERNELS}, name, "attention kernel")


def check(name: str, needs: Needs, target: Target | None = None) -> None:
  """A ConfigError naming what kernel `name` cannot do for a layer with these needs: where it
  runs (given a target: its backends, a mesh of several devices), then what it computes
  (the capabilities it offers against those the layer needs), then in what dtype."""
  kernel = lookup(KERNELS, name, "attention kernel")
  if target is not None and kernel.backends is not None and target.backend not in kernel.backends:
    raise ConfigError(f"model.attention.kernel={name!r} runs on {' or '.join(kernel.backends)} "
                      f"only; this machine's JAX backend is {target.backend}: use "
                      f"{kernel.stand_in!r} (the same computation) or 'reference'")
  if target is not None and target.devices > 1 and not kernel.multi_device:
    raise ConfigError(f"model.attention.kernel={name!r} runs on one device (its kernel is not "
                      f"partitioned over a mesh) and this run's mesh has {target.devices}; use "
                      f"kernel 'auto' or {able(lambda k: k.multi_device)}")
  for capability in CAPABILITIES:  # in their order: the first refusal is said
    if capability in needs.capabilities and capability not in kernel.offers:
      # the kernels to use instead offer everything the layer needs, not this one alone
      instead = able(lambda k: needs.capabilities <= k.offers)
      raise ConfigError(f"attention.kernel '{name}' {needs.refusal(capability, instead)}")
  if kernel.dtypes is not None and needs.dtype not in kernel.dtypes:
    raise ConfigError(
        f"attention.kernel '{name}' computes in {' or '.join(kernel.dtypes)} only, and "
        f"model.dtype is {needs.dtype}; set model.dtype={kernel.dtypes[0]} or use kernel "
        f"{able(lambda k: k.dtypes is None or needs.dtype in k.dtypes)}")


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
  """The first kernel offered to the layer that runs it natively and whose L×L temporaries
  fit, of the kernels measured for such a layer (fastest first) and then the backend's
  AUTO_ORDER. A kernel declaring auto_only_with_bias is offered to a layer without a bias
  too once a kernel was passed over for its memory, or every native kernel before it
  refused the layer (a normaliser or data bias only it fuses: the rest is the formula)."""
  passed_over = list(passed_over)
  training = not target.evaluating
  measured, basis = ranked(target.backend, needs.dtype, needs.position if needs.bias else "none",
                           target.length, training)
  order = AUTO_ORDER.get(target.backend, OTHER_BACKENDS)
  memory_bound, all_refused = False, True
  for candidate in dict.fromkeys([*measured, *order]):
    if candidate not in KERNELS or not (offered(candidate, needs) or memory_bound
                                        or all_refused and passed_over):
      continue  # not registered (yet), or not offered
    why = _emulated(candidate, target)
    try:
      check(candidate, needs, target)
    except ConfigError as e:
      why = str(e)
    else:
      all_refused = all_refused and bool(why)
    if not why:
      why = too_big(candidate, needs.dtype, needs.bias, needs.heads, target.rows,
                    target.length, target.memory, training)
      memory_bound = memory_bound or bool(why)
    if why:
      passed_over.append((candidate, why))
      continue
    return KernelChoice(AUTO, candidate, tuple(passed_over),
                        basis=basis if candidate in measured else "")
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
  """(the choice, the kernel function) for a layer with these needs, on `target` (None: the
  one choosing_for set, else this process's backend, one device, training); the rules are
  the module docstring's."""
  target = target or _TARGET.get() or Target.here()
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
                             mesh=target.mesh, backend=target.backend)


# --------------------------------------------------------------------------- the log


def _choices(model):
  """(path, choice) of each attention layer of `model` (an NNX module, abstract or not), in
  NNX's graph order (attributes by name, list entries by index)."""
  for path, node in nnx.iter_modules(model):
    choice = getattr(node, "kernel_choice", None)
    if isinstance(choice, KernelChoice):
      yield ".".join(str(p) for p in path), choice


def kernel_choices(model) -> list[str]:
  """A log line for each distinct choice that was made, not merely taken as asked (`auto`'s,
  or a substitution), among `model`'s attention layers: "kernel auto -> reference for 3
  layers: decoder.layers.*.self_attention, ... (reasons)", layer indices written as * where
  the choice holds for every layer at that place, else listed (a layer-wise pattern's layers
  may need different kernels: "decoder.layers.{0,2}.self_attention")."""
  choices = list(_choices(model))
  everywhere: dict[str, set[str]] = {}  # each place (indices as *): its layers' paths
  for path, _ in choices:
    everywhere.setdefault(_place(path), set()).add(path)
  layers: dict[KernelChoice, list[str]] = {}
  for path, choice in choices:
    if choice.asked == AUTO or choice.asked != choice.name:
      layers.setdefault(choice, []).append(path)
  lines = []
  for choice, paths in layers.items():
    places: dict[str, set[str]] = {}
    for path in paths:
      places.setdefault(_place(path), set()).add(path)
    where = sorted(place if chosen == everywhere[place] else _listed(place, chosen)
                   for place, chosen in places.items())
    count = f"{len(paths)} layer{'s' if len(paths) > 1 else ''}"
    lines.append(choice.describe(f" for {count}: {', '.join(where)}"))
  return lines


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _place(path: str) -> str:
  return _INDEX.sub("*", path)


def _listed(place: str, paths: set[str]) -> str:
  """Some of the layers at `place`: by their indices where the place has one index, else
  by their paths."""
  if place.count("*") != 1:
    return ", ".join(sorted(paths))
  indices = sorted(int(_INDEX.search(path).group()) for path in paths)
  shown = str(indices[0]) if len(indices) == 1 else "{" + ",".join(map(str, indices)) + "}"
  return place.replace("*", shown)


def kernel_warnings(model) -> list[str]:
  """The distinct warnings of `model`'s kernel choices (a kernel emulated here)."""
  return list(dict.fromkeys(choice.warning for _, choice in _choices(model) if choice.warning))
