"""What an attention kernel may offer a layer, each capability declared once.

A capability is one entry of CAPABILITIES: which layers need it (read from the layer's parts:
its scorer's and encoding's declarations, its settings), and the words of the refusal of a
kernel that does not offer it. A kernel declares the set it offers (`Kernel.offers`,
transformer/model/kernels/registry.py); transformer/model/kernels/choice.py compares the two.
A new capability is one entry here and its name in the `offers` of the kernels that have it;
tests/test_kernel_conformance.py then runs those kernels with it.
"""

import dataclasses
from collections.abc import Callable

from transformer.model.normalizers import SOFTMAX, Normalizer
from transformer.model.positions import PositionalEncoding
from transformer.model.scores import Scorer


@dataclasses.dataclass(frozen=True)
class Layer:
  """An attention layer's parts, as its needs are read from them."""

  scorer: Scorer
  encoding: PositionalEncoding  # as its kernel is handed it
  dropout: float = 0.0  # on the attention weights
  softcap: float = 0.0  # c > 0: logits capped to c·tanh(score / c)
  window: bool = False  # its masks carry a local window (self-attention, window=local)
  grouped: bool = False  # fewer key/value heads than query heads
  normalizer: Normalizer = SOFTMAX  # how its rows of logits become weights
  data_bias: bool = False  # a data-dependent logit bias (data_biases.py: FoX's c_i − c_j)
  data_bias_array: bool = False  # ... that is a whole array (data_biases.py: selective's F)


@dataclasses.dataclass(frozen=True)
class Capability:
  """needed(layer): whether a layer needs it; refusal: the words after "attention.kernel
  'NAME' " of a kernel not offering it, formatted with the fields of the layer's Needs and
  `able`, the kernels offering it."""

  needed: Callable[[Layer], bool]
  refusal: str


CAPABILITIES: dict[str, Capability] = {
    "any_score": Capability(
        lambda layer: layer.scorer.dot_product is None,
        "computes dot-product scores only, and score '{score}' declares no dot product; use "
        "kernel {able}"),
    "flash_normalizer": Capability(
        lambda layer: not layer.normalizer.plain_softmax,
        "computes softmax only, and normalizer '{normalizer}' is not softmax; use kernel "
        "{able} or model.attention.normalizer=softmax"),
    "online_normalizer": Capability(  # an online form, but none a flash kernel computes
        lambda layer: layer.normalizer.online and not layer.normalizer.flash,
        "computes the normalisers of a flash-attention form only (softmax, sink, sigmoid), "
        "and normalizer '{normalizer}' has none; use kernel {able}"),
    "row_normalizer": Capability(
        lambda layer: not layer.normalizer.online,
        "computes its normaliser block by block, and normalizer '{normalizer}' needs each "
        "query's whole row of logits; use kernel {able}"),
    "data_bias": Capability(
        lambda layer: layer.data_bias,
        "cannot add a data-dependent logit bias (model.attention.data_bias); use kernel "
        "{able}"),
    "data_bias_array": Capability(
        lambda layer: layer.data_bias_array,
        "takes a data-dependent logit bias as two vectors per head only, and this layer's "
        "(model.attention.data_bias) is a whole [tq, tk] array read from one head's logits; "
        "use kernel {able}"),
    "dropout": Capability(
        lambda layer: layer.dropout > 0,
        "has no attention dropout; set model.attention.dropout=0 (got {dropout}) or kernel "
        "{able}"),
    "softcap": Capability(
        lambda layer: layer.softcap > 0,
        "cannot soft-cap the attention logits; set model.attention.logit_softcap=0 (got "
        "{softcap}) or use kernel {able}"),
    "content_bias": Capability(
        lambda layer: layer.encoding.content_biases,
        "cannot add the content-dependent logit bias of position '{position}' (it needs each "
        "query's whole row of logits); use kernel {able} or another position"),
    "gathered_bias": Capability(
        lambda layer: layer.encoding.gathered_bias,
        "evaluates positional biases in-kernel from positions, and position '{position}' with "
        "model.random_positions_draw=per_batch reads its bias at sampled offsets from a "
        "table; use kernel {able}"),
    "learned_bias": Capability(  # a data bias (FoX's gate) has parameters too
        lambda layer: layer.encoding.learned_bias or layer.data_bias,
        "gives no reliable gradient for the learned logit bias of position '{position}' "
        "(cuDNN's bias gradient, JAX issue #23701); use kernel {able} or 'auto'"),
    "local_window": Capability(
        lambda layer: layer.window,
        "takes no local attention window; set model.attention.window=full or use kernel "
        "{able}"),
    "grouped_query": Capability(
        lambda layer: layer.grouped,
        "has no grouped-query attention; set model.num_kv_heads=0 (= num_heads) or use "
        "kernel {able}"),
}


@dataclasses.dataclass(frozen=True)
class Needs:
  """What one attention layer asks of its kernel: the capabilities it needs (keys of
  CAPABILITIES), whether its encoding adds a positional bias (what `auto` offers a kernel
  declaring auto_only_with_bias for), its compute dtype, and what the refusals name and
  the kernel is made with. Every kernel takes padding, packing and causal masks."""

  capabilities: frozenset[str] = frozenset()
  score: str = "scaled_dot"  # the scorer's config name
  position: str = "none"  # the positional encoding's config name
  normalizer: str = "softmax"  # the normaliser's config name
  bias: bool = False
  dropout: float = 0.0
  softcap: float = 0.0
  dtype: str = "float32"
  block_size: int = 512  # queries and keys per block, for the kernels working in blocks
  heads: int = 0  # query heads (0: not known): what a kernel's L×L temporaries scale with

  def __post_init__(self):
    unknown = set(self.capabilities) - set(CAPABILITIES)
    if unknown:
      raise ValueError(f"unknown capabilities {sorted(unknown)}; known: {list(CAPABILITIES)}")
    object.__setattr__(self, "capabilities", frozenset(self.capabilities))

  @classmethod
  def of(cls, scorer: Scorer, encoding: PositionalEncoding, /, *, window: bool = False,
         grouped: bool = False, normalizer: Normalizer = SOFTMAX, data_bias: bool = False,
         data_bias_array: bool = False, **fields) -> "Needs":
    """The needs of a layer of these parts (the encoding as its kernel is handed it; its
    name unless `position` is given; the normaliser's name) and the other `fields`."""
    layer = Layer(scorer, encoding, fields.get("dropout", 0.0), fields.get("softcap", 0.0),
                  window, grouped, normalizer, data_bias, data_bias_array)
    needed = frozenset(name for name, c in CAPABILITIES.items() if c.needed(layer))
    return cls(needed, bias=encoding.biases,
               **{"position": encoding.name, "normalizer": normalizer.name, **fields})

  def refusal(self, capability: str, able: str) -> str:
    """The words of a kernel's refusal of `capability`, the kernels offering it being
    `able`."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return CAPABILITIES[capability].refusal.format(able=able, **fields)
