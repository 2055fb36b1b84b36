"""Attention kernels: ways to compute softmax(score(q, k) + bias)·V, and what each supports.

A kernel computes the heads' outputs [b, tq, h, d] from q [b, tq, h, d], k, v
[b, tk, kv_heads, d] (kv_heads divides h: query head i reads kv head i // (h / kv_heads),
grouped-query attention; kv_heads = h is multi-head attention), a Mask, the positional
encoding, and the layer's scorer, dropout and normaliser (transformer/model/normalizers.py;
None: softmax): `kernel(q, k, v, mask, encoding, score, dropout, rngs, normalizer=None)`.
Of the encoding it calls the logit seams it supports: every kernel adds `encoding.bias(q_positions, k_positions)` (`pallas`
evaluates it block by block from `encoding.bias_spec()`, inside its kernels); a kernel
offering `content_bias` also adds `encoding.content_bias(q, logits)`, a function of each
query's whole row of logits. The functions: the formula computed whole
(kernels/reference.py) or in blocks (kernels/blockwise.py), and here XLA's or cuDNN's
fused attention, Pallas' flash attention (kernels/pallas/attention.py) and Pallas' Mosaic GPU
kernels (kernels/pallas/mosaic_gpu.py, mosaic_gpu_backward.py), wrapped.

KERNELS maps a name to a Kernel: how to make the function, and the capabilities it offers
(transformer/model/kernels/capabilities.py), which transformer/model/kernels/choice.py
compares once, when a layer is made, with what the layer needs; a new kernel is one function
and its line in KERNELS, and tests/test_kernel_conformance.py runs it against the reference
kernel over everything it offers.

A kernel offering `softcap` is made with `softcap=c` when the layer caps its logits
(model.attention.logit_softcap = c > 0): the scorer's logits become c·tanh(score / c), and
the positional biases are added after the cap, so distance biases (ALiBi, T5) are not
bounded by c.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.kernels.blockwise import blockwise_kernel
from transformer.model.kernels.capabilities import CAPABILITIES
from transformer.model.kernels.cudnn_mask import bias_positions, cudnn_mask, dense_mask
from transformer.model.kernels.fallbacks import log_once
from transformer.model.kernels.pallas import flash_attention, mosaic_gpu_attention
from transformer.model.kernels.reference import reference_kernel, repeat_heads
from transformer.model.normalizers import SOFTMAX


def fused_kernel(implementation: str):
  """jax.nn.dot_product_attention (XLA's fused attention, or cuDNN's flash attention on
  NVIDIA GPUs) for the scorers declaring a dot product, whose transforms and scale it
  applies: softmax(scale · queries(q) · keys(k)ᵀ + bias)·V, the bias computed beforehand
  from positions alone; no dropout on the weights, no content bias, and not the declared
  row_term (softmax ignores it). XLA takes the mask whole, a query row with no visible key
  (padding) attending to every key instead of none, so it stays finite (no NaN to leak into
  later layers); the loss never reads it. cuDNN takes it as its own arguments where the
  mask declares a structure they express (kernels/cudnn_mask.py: sequence lengths, a causal
  flag, a left window), otherwise whole, logged once; a padded mask's bias is evaluated on
  one row of positions, [1, h, tq, tk]. Fewer key/value heads than query heads are attended
  natively (grouped-query attention), without repeating them, unless the key transform is
  per query head (DotProduct.keys_per_head)."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs, normalizer=None):
    del dropout, rngs, normalizer  # softmax (kernel_choice refuses another)
    product = score.dot_product
    impl = implementation
    if q.shape[1] == 1 and implementation == "cudnn":  # cuDNN has no 1-query decode step
      impl = "xla"
      log_once("kernel cudnn: one query per row (a decoding step) runs XLA's attention "
               f"over the row [b, h, 1, {k.shape[1]}], not cuDNN's")
    if impl == "cudnn":
      masking, why = cudnn_mask(mask)
      if why:
        log_once(f"kernel cudnn: {why}")
      bias = encoding.bias(*bias_positions(mask, not encoding.gathered_bias))
    else:
      masking = dense_mask(mask)
      bias = encoding.bias(mask.q_positions, mask.k_positions)
    bias = None if jnp.ndim(bias) == 0 else bias.astype(q.dtype)
    if product.keys_per_head:  # each query head's own key transform: one key head each
      k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])
    qt, kt, vt = equal_head_dims(product.queries(q).astype(v.dtype),
                                 product.keys(k).astype(v.dtype), v)
    out = jax.nn.dot_product_attention(qt, kt, vt, bias=bias, scale=product.scale,
                                       implementation=impl, **masking)
    return out[..., :v.shape[-1]]

  return kernel


def _bias_spec(kernel: str, encoding):
  """The encoding's BiasSpec for a kernel evaluating it in-kernel (None: none), or a
  ConfigError where the encoding adds a bias that is neither a BiasSpec nor a data bias's
  vectors."""
  spec = encoding.bias_spec()
  if spec is None and encoding.bias_vectors() is None and encoding.biases:
    raise ConfigError(f"attention.kernel '{kernel}' needs a BiasSpec of the positional "
                      f"encoding {type(encoding).__name__}, which declares none; use kernel "
                      "'reference' or 'blockwise'")
  return spec


def pallas_kernel(block_size: int, mesh: jax.sharding.AbstractMesh | None = None):
  """flash_attention (transformer/model/kernels/pallas/attention.py) for a scorer declaring a dot product
  (its transforms applied before, its scale passed in), the encoding's BiasSpec and its
  data bias's vectors (bias_vectors(): FoX's c_i − c_j), computed in-kernel, and a
  normaliser of a flash form (softmax, a sink, a sigmoid: Normalizer.flash_form); blocks of
  block_size queries and keys. Fewer key/value heads than query heads are read by their
  query heads in-kernel (grouped-query attention), unless the key transform is per query
  head (DotProduct.keys_per_head). On a mesh of several devices it runs on each device's
  shard (per_device): XLA does not partition a pallas_call."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs, normalizer=None):
    del dropout, rngs  # none (kernel_choice refuses it)
    spec, vectors = _bias_spec("pallas", encoding), encoding.bias_vectors()
    form = (normalizer or SOFTMAX).flash_form()
    product = score.dot_product
    if product.keys_per_head:  # each query head's own key transform: one key head each
      k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])

    def attend(q, k, v, ids, params, sink, vectors):
      return flash_attention(
          q, k, v, q_segments=ids[0], k_segments=ids[1], q_positions=ids[2],
          k_positions=ids[3], causal=mask.causal, window=mask.window,
          bias_spec=None if spec is None else dataclasses.replace(spec, params=params),
          scale=product.scale, block_q=block_size, block_k=block_size,
          sigmoid_bias=form.sigmoid_bias, sink=sink, bias_vectors=vectors)

    ids = (mask.q_segments, mask.k_segments, mask.q_positions, mask.k_positions)
    params = {} if spec is None else dict(spec.params)
    return per_device(attend, mesh)(product.queries(q), product.keys(k), v, ids, params,
                                    form.sink, vectors)

  return kernel


def mosaic_gpu_kernel(interpret: bool = False):
  """mosaic_gpu_attention (transformer/model/kernels/pallas/mosaic_gpu_backward.py: Pallas'
  Mosaic GPU lowering, Hopper and later) for a scorer declaring a dot product (its transforms
  applied before, its scale passed in): softmax over the masks' visible keys plus the
  encoding's BiasSpec evaluated per block in-kernel (kernels/pallas/mosaic_bias.py), its
  parameters' gradient given; bf16/fp16; compiled, or in Mosaic GPU's interpret mode
  (`interpret`: made for a backend other than a GPU). Head dims and lengths are padded to
  multiples of 64 inside; fewer key/value heads than query heads are read by their query
  heads in-kernel, unless the key transform is per query head. One device only (Kernel.multi_device False): its emulation
  cannot be checked on a mesh here (Mosaic GPU's interpreter, on 8 CPU devices: inside a
  shard_map "AssertionError: Barrier remains allocated at key HostAllocationKey(...,
  device_id=7, ...)"; partitioned by XLA, a deadlock in the all-reduce of 8)."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs, normalizer=None):
    del dropout, rngs, normalizer  # no dropout, no other normaliser (check)
    spec = _bias_spec("mosaic_gpu", encoding)
    product = score.dot_product
    if product.keys_per_head:  # each query head's own key transform: one key head each
      k, v = repeat_heads(k, q.shape[2]), repeat_heads(v, q.shape[2])

    return mosaic_gpu_attention(
        product.queries(q).astype(v.dtype), product.keys(k).astype(v.dtype), v,
        q_segments=mask.q_segments, k_segments=mask.k_segments,
        q_positions=mask.q_positions, k_positions=mask.k_positions, causal=mask.causal,
        window=mask.window, scale=product.scale, bias_spec=spec, interpret=interpret)

  return kernel


def per_device(attend: Callable, mesh: jax.sharding.AbstractMesh | None) -> Callable:
  """attend(q, k, v, ids, params, sink, vectors) run by jax.shard_map on each device's
  shard of a mesh of several devices (itself on one): the rows over the mesh's batch axes,
  `data` and `fsdp`, and the heads over `tensor` (the axes of transformer/run/sharding.py),
  each where it divides them (otherwise that dimension is whole on every device). q
  [b, t, h, d], k, v [b, t, kv_heads, d] and the output split by rows and heads (a
  device's query heads read its own key/value heads: both split alike, or neither), the
  ids ([b, t] segments and positions) by rows, the params ({name: [h, size]}, a
  BiasSpec's) and the sink ([h] or None) by heads, the vectors ((u, w) [b, t, h] or None:
  a data bias's) by rows and heads. Each device's rows and heads are independent
  attentions, so no collective is needed; the gradients of the params and the sink, which
  the rows share, are summed over the batch axes by shard_map's transpose."""
  if mesh is None or mesh.size == 1:
    return attend

  def sharded(q, k, v, ids, params, sink, vectors):
    rows = ("data", "fsdp")
    rows = rows if q.shape[0] % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    tensor = mesh.shape["tensor"]
    heads = "tensor" if q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    x, t = P(rows, None, heads, None), P(rows, None)
    in_specs = (x, x, x, (t,) * len(ids), jax.tree.map(lambda _: P(heads, None), params),
                None if sink is None else P(heads),
                None if vectors is None else (P(rows, None, heads),) * 2)
    # check_vma=False: a pallas_call's out_shape (kernels/pallas/attention.py) declares no varying
    # mesh axes, which the check requires; the tests compare values and gradients with one
    # device's (test_sharding: the losses of a 2x2x2 mesh).
    return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=x,
                         check_vma=False)(q, k, v, ids, params, sink, vectors)

  return sharded


def equal_head_dims(q, k, v, multiple: int = 8):
  """q, k [b, t, h, d'] and v [b, t, h, d] padded with zeros to one head dim, a multiple of
  `multiple` (cuDNN's), when d' ≠ d: jax.nn.dot_product_attention needs q, k and v of one
  head dim. Zeros change no dot product, and v's zero columns give output columns to drop."""
  dq, dv = q.shape[-1], v.shape[-1]
  if dq == dv:
    return q, k, v
  dim = -max(dq, dv) // multiple * -multiple
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, dim - x.shape[-1])])  # noqa: E731
  return pad(q), pad(k), pad(v)


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A way to compute softmax(score + bias)·V, and what it supports: the capabilities it
  offers (keys of CAPABILITIES, transformer/model/kernels/capabilities.py), the dtypes and
  backends it runs on, which transformer/model/kernels/choice.py compares with a layer's
  needs. Every kernel adds an encoding's positional bias (its `bias` seam) and takes
  padding, packing and causal masks."""

  # make(block_size=, softcap=, mesh=, backend=) -> the kernel function: blocks of
  # block_size queries and keys, logits capped at softcap (offering `softcap`; others get
  # 0), for the mesh the model runs on (jax.sharding.AbstractMesh; None: one device) and
  # its JAX backend (cpu, gpu, tpu; None: this process's)
  make: Callable[..., Callable]
  offers: frozenset[str]
  dtypes: tuple[str, ...] | None = None  # the compute dtypes it takes; None: every one
  backends: tuple[str, ...] | None = None  # the JAX backends it runs on; None: every one
  # a kernel computing the same function on any backend, which evaluation uses where this
  # one does not run (or, slow_on, runs only emulated)
  stand_in: str | None = None
  slow_on: tuple[str, ...] = ()  # backends where it runs emulated (Pallas' interpret mode)
  # runs on a mesh of several devices: XLA partitions it, or its function does (per_device)
  multi_device: bool = True
  # `auto` offers it only to a layer whose encoding adds a positional bias, or that every
  # kernel before it refused (choice.py)
  auto_only_with_bias: bool = False

  def __post_init__(self):
    object.__setattr__(self, "offers", frozenset(self.offers))
    for name in self.offers:
      lookup(CAPABILITIES, name, "kernel capability")


def _reference(block_size, softcap=0.0, mesh=None, backend=None):
  del block_size, mesh, backend
  return functools.partial(reference_kernel, softcap=softcap)


def _blockwise(block_size, softcap=0.0, mesh=None, backend=None):
  del mesh, backend
  return functools.partial(blockwise_kernel, block=block_size, softcap=softcap)


def _fused(implementation: str):
  def make(block_size, softcap=0.0, mesh=None, backend=None):
    del block_size, softcap, mesh, backend
    return fused_kernel(implementation)
  return make


def _pallas(block_size, softcap=0.0, mesh=None, backend=None):
  del softcap, backend  # pallas decides per platform lowered for (platform_dependent)
  return pallas_kernel(block_size, mesh)


def _mosaic_gpu(block_size, softcap=0.0, mesh=None, backend=None):
  del block_size, softcap, mesh  # blocks of 64; one device (multi_device=False)
  return mosaic_gpu_kernel(interpret=(backend or jax.default_backend()) != "gpu")


# What most kernels offer: every layer's masks and heads, and any positional bias.
_MASKS_HEADS_BIASES = {"local_window", "grouped_query", "learned_bias", "gathered_bias"}

KERNELS: dict[str, Kernel] = {
    "reference": Kernel(_reference, offers=set(CAPABILITIES)),  # the formula: everything
    # a data bias (two vectors' or a whole array) added to the positional bias array it builds
    "xla": Kernel(_fused("xla"), offers={"data_bias", "data_bias_array", *_MASKS_HEADS_BIASES}),
    # cuDNN's flash attention takes fp16/bf16 only, and its bias gradient is not to be
    # trusted (JAX #23701: for years refused unless batch 1 and one bias per head; #27184,
    # #32242: none, or NaN): it is refused for a learned bias.
    "cudnn": Kernel(_fused("cudnn"), offers={"data_bias", *_MASKS_HEADS_BIASES} - {"learned_bias"},
                    backends=("gpu",), stand_in="xla", dtypes=("bfloat16", "float16")),
    # the normalisers with an online form, as it computes softmax
    "blockwise": Kernel(_blockwise, offers={"any_score", "softcap", "flash_normalizer",
                                            "online_normalizer", *_MASKS_HEADS_BIASES}),
    # Pallas flash attention, the encoding's BiasSpec and a data bias's vectors evaluated
    # in-kernel, and the normalisers of a flash form (kernels/pallas/attention.py);
    # interpret mode on the CPU; on a mesh, per device (shard_map). auto offers it where
    # its in-kernel bias spares an [L, L] array, or where xla and cudnn refuse the layer
    # (a fused normaliser or data bias); elsewhere they are better known.
    "pallas": Kernel(_pallas, offers={"flash_normalizer", "data_bias", *_MASKS_HEADS_BIASES}
                     - {"gathered_bias"}, stand_in="xla", slow_on=("cpu",),
                     auto_only_with_bias=True),
    # Pallas' Mosaic GPU lowering, Hopper and later (kernels/pallas/mosaic_gpu.py): softmax
    # over the masks and a positional bias from its BiasSpec; compiled when made for a GPU (an older GPU than
    # Hopper fails in Mosaic GPU's compiler), Mosaic GPU's interpret mode on the CPU; one
    # device. Unmeasured: not in AUTO_ORDER, so `auto` never takes it.
    "mosaic_gpu": Kernel(_mosaic_gpu, offers={"learned_bias", "local_window",
                                              "grouped_query"},
                         dtypes=("bfloat16", "float16"), backends=("gpu", "cpu"),
                         stand_in="xla", slow_on=("cpu",), multi_device=False),
}


def able(capable: str | Callable[[Kernel], bool]) -> str:
  """The kernels offering a capability (its name, or a test of the kernel), for an error
  line: "'reference' or 'xla'"."""
  if isinstance(capable, str):
    capable = lambda kernel, name=capable: name in kernel.offers  # noqa: E731
  return " or ".join(repr(key) for key, kernel in KERNELS.items() if capable(kernel))
