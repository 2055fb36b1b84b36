"""The log lines of a model's attention kernel choices (transformer/model/kernels/choice.py makes them, one per
layer): one line per distinct choice, with the layers it holds for and its reasons, and the
warnings of kernels emulated here. transformer/run/experiment.py logs them when a run's
model is built."""

import re

from flax import nnx

from transformer.model.kernels.choice import AUTO, KernelChoice


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
