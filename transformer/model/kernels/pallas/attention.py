"""Flash attention as Pallas kernels, with the positional bias computed inside them.

softmax(q·kᵀ + bias)·V over the visible keys (the same non-pad segment, optionally causal and
within a local window, read from segment ids and positions as transformer/model/masks.py does), in
blocks: the forward kernel runs an online softmax over key blocks and saves each query's
logsumexp; the backward kernels recompute each block's probabilities from it (one kernel per
query block for dq and the bias parameters' gradient, one per key block for dk and dv). The
bias comes from the encoding's BiasSpec (transformer/model/positions/base.py), evaluated on each
[block_q, block_k] block of positions from the head's parameters, so no [L, L] array exists
in memory, forward or backward; the gradient of the bias parameters is the vjp of the
block's bias function at the logits' gradient, summed over blocks. The kernel bodies are
transformer/model/kernels/pallas/bodies.py; each lowering's blocks and array layout,
transformer/model/kernels/pallas/layouts.py.

Which lowering runs follows the platform the program is lowered for, not the process's
default backend (jax.lax.platform_dependent): on `cpu` the kernels run in Pallas' interpret
mode, on `tpu` they are compiled by Mosaic TPU (a `tpu_custom_call`), on `cuda` and `rocm`
by Pallas' Triton lowering (`__gpu$xla.gpu.triton`). So one jitted function runs
interpreted on the CPU and lowers to compiled kernels for a GPU or a TPU from the same
CPU (tests/test_lowering.py). A single jax.export for several platforms at once is not
possible: JAX lowers the ops inside each platform's branch for every exported platform, and
a Triton call cannot be lowered for a TPU (nor Mosaic's for a GPU); export per platform.

GPU: Triton, on purpose, not Mosaic GPU (this JAX's default Pallas GPU backend). Triton
runs on every CUDA GPU JAX supports (Ampere and later) and on ROCm, and lowers ordinary
array code (2-D loads of any power-of-two block, masks, loops, conditionals, scalar
reads), which these kernels are; Mosaic GPU targets Hopper and Blackwell only, and wants
kernels written for its warpgroup layouts and aligned copies (the 1-D segment rows and
parameter rows these kernels read are refused there). JAX's own Pallas GPU attention
(jax/experimental/pallas/ops/gpu/attention.py) is written for Triton too.

Only lowered, never run on an accelerator (none where this was written): the lowering
proves the Pallas-to-Mosaic and Pallas-to-Triton steps, which run in Python; the device
compilers (Mosaic's layout passes, Triton's PTX) run only on the device. The layouts'
numerics are tested in interpret mode (tests/test_pallas_attention.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from transformer.model.kernels.fallbacks import log_once
from transformer.model.kernels.pallas import layouts
from transformer.model.kernels.pallas.bodies import Static, dkv_kernel, dq_kernel, forward_kernel
from transformer.model.kernels.pallas.layouts import LAYOUTS, Operand
from transformer.model.masks import Mask, masked_softmax
from transformer.model.positions import BiasSpec, spec_bias

# Each platform's layout, and whether Pallas interprets it there (None: every other one).
PLATFORMS = {"cpu": ("generic", True), "cuda": ("triton", False), "rocm": ("triton", False),
             "tpu": ("mosaic_tpu", False), None: ("generic", True)}


@dataclasses.dataclass(frozen=True)
class _Config:
  """What flash_attention is specialised on, but for the platform."""

  fn: object  # the BiasSpec's fn, or None
  learned: bool
  causal: bool
  window: int | None
  block_q: int
  block_k: int
  variants: tuple  # ((platform or None: the default, layout name, interpret), ...)


def _static(cfg: _Config, layout, bq, bk, packing, width, inner, inner_block):
  return Static(fn=cfg.fn, learned=cfg.learned, causal=cfg.causal, window=cfg.window,
                block_q=bq, block_k=bk, params=packing, width=width, lanes=layout.lanes,
                grid_inner=layout.grid_inner, inner=inner, inner_block=inner_block)


def _forward(cfg, name, interpret, q, k, v, qs, ks, qp, kp, params):
  """One layout's forward: out [b, tq, h, d_v] and logsumexp float32 [b, h, tq]."""
  layout = LAYOUTS[name]
  (b, tq, h, d), tk, dv = q.shape, k.shape[1], v.shape[-1]
  bq, bk = layout.blocks(cfg.block_q, cfg.block_k, tq, tk, backward=False)
  lq, lk = -(-tq // bq) * bq, -(-tk // bk) * bk
  dp, dvp = layout.dim(d), layout.dim(dv)
  flat, packing, width = layouts.pack(layout, params)
  st = _static(cfg, layout, bq, bk, packing, width, lk // bk, bk)
  groups = h // k.shape[2]
  inputs = [Operand(layouts.heads(q, lq, dp), "heads"),
            Operand(layouts.query_side(layout, qs, lq), "query"),
            Operand(layouts.query_side(layout, qp, lq), "query"),
            Operand(layouts.heads(k, lk, dp), "heads", "inner", groups),
            Operand(layouts.heads(v, lk, dvp), "heads", "inner", groups),
            Operand(layouts.key_side(layout, ks, lk), "keys", "inner"),
            Operand(layouts.key_side(layout, kp, lk), "keys", "inner")]
  inputs += [Operand(flat, "params")] if cfg.fn else []
  outputs = [Operand(jax.ShapeDtypeStruct((b, h, lq, dvp), v.dtype), "heads"),
             Operand(jax.ShapeDtypeStruct((b, h, lq, layout.lanes), jnp.float32), "stats")]
  out, lse = layouts.call(
      layout, forward_kernel, st, name="flash_forward", outer=lq // bq, inputs=inputs,
      outputs=outputs, scratch=[(bq, layout.lanes)] * 2 + [(bq, dvp)], interpret=interpret,
      head_dim=dp)
  return layouts.unheads(out, tq, dv), lse[:, :, :tq, 0]


def _backward(cfg, name, interpret, q, k, v, qs, ks, qp, kp, params, out, lse, do):
  """One layout's gradients of q, k, v and of the bias parameters ([h, size] each)."""
  layout = LAYOUTS[name]
  (b, tq, h, d), tk, dv = q.shape, k.shape[1], v.shape[-1]
  bq, bk = layout.blocks(cfg.block_q, cfg.block_k, tq, tk, backward=True)
  lq, lk, nq, nk = -(-tq // bq) * bq, -(-tk // bk) * bk, -(-tq // bq), -(-tk // bk)
  dp, dvp = layout.dim(d), layout.dim(dv)
  flat, packing, width = layouts.pack(layout, params)
  groups = h // k.shape[2]
  delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
  query = [Operand(layouts.heads(q, lq, dp), "heads"),
           Operand(layouts.query_side(layout, qs, lq), "query"),
           Operand(layouts.query_side(layout, qp, lq), "query"),
           Operand(layouts.heads(do, lq, dvp), "heads"),
           Operand(layouts.statistics(layout, lse, lq), "stats"),
           Operand(layouts.statistics(layout, delta, lq), "stats")]
  keys = [Operand(layouts.heads(k, lk, dp), "heads", groups=groups),
          Operand(layouts.heads(v, lk, dvp), "heads", groups=groups),
          Operand(layouts.key_side(layout, ks, lk), "keys"),
          Operand(layouts.key_side(layout, kp, lk), "keys")]
  par = [Operand(flat, "params")] if cfg.fn else []
  inner = lambda ops: [dataclasses.replace(op, role="inner") for op in ops]  # noqa: E731

  st = _static(cfg, layout, bq, bk, packing, width, nk, bk)
  outputs = [Operand(jax.ShapeDtypeStruct((b, h, lq, dp), q.dtype), "heads")]
  if cfg.learned:
    outputs.append(Operand(jax.ShapeDtypeStruct((b, h, nq, 1, width), jnp.float32), "drow"))
  dq, *drow = layouts.call(
      layout, dq_kernel, st, name="flash_dq", outer=nq, inputs=query + inner(keys) + par,
      outputs=outputs, scratch=[(bq, dp)] + [(1, width)] * cfg.learned, interpret=interpret,
      head_dim=dp)

  st = _static(cfg, layout, bq, bk, packing, width, nq, bq)
  outputs = [Operand(jax.ShapeDtypeStruct((b, h, lk, dp), k.dtype), "heads"),
             Operand(jax.ShapeDtypeStruct((b, h, lk, dvp), v.dtype), "heads")]
  dk, dv_ = layouts.call(
      layout, dkv_kernel, st, name="flash_dkv", outer=nk, inputs=keys + inner(query) + par,
      outputs=outputs, scratch=[(bk, dp), (bk, dvp)], interpret=interpret, head_dim=dp)
  if groups > 1:  # each query head's share, summed into its key/value head
    dk, dv_ = (x.reshape(b, h // groups, groups, *x.shape[2:]).sum(2) for x in (dk, dv_))
  if cfg.learned:
    dparams = layouts.unpack(st, drow[0].sum((0, 2))[:, 0])
  else:
    dparams = jax.tree.map(jnp.zeros_like, params)
  return (layouts.unheads(dq, tq, d), layouts.unheads(dk, tk, d).astype(k.dtype),
          layouts.unheads(dv_, tk, dv).astype(v.dtype), dparams)


def _per_platform(cfg: _Config, what, *args):
  """what(cfg, layout name, interpret, *args) for the platform being lowered for."""
  made = {}  # one callable per (layout, interpret): platform_dependent joins their branches
  branches = {platform: made.setdefault((name, interpret),
                                        functools.partial(what, cfg, name, interpret))
              for platform, name, interpret in cfg.variants}
  if list(branches) == [None]:
    return branches[None](*args)
  default = branches.pop(None, None)
  branches = {p: branch for p, branch in branches.items() if branch is not default}
  return jax.lax.platform_dependent(*args, default=default, **branches)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, qs, ks, qp, kp, params):
  return _per_platform(cfg, _forward, q, k, v, qs, ks, qp, kp, params)[0]


def _flash_fwd(cfg, q, k, v, qs, ks, qp, kp, params):
  out, lse = _per_platform(cfg, _forward, q, k, v, qs, ks, qp, kp, params)
  return out, (q, k, v, qs, ks, qp, kp, params, out, lse)


def _flash_bwd(cfg, residuals, do):
  dq, dk, dv, dparams = _per_platform(cfg, _backward, *residuals, do)
  return dq, dk, dv, None, None, None, None, dparams


_flash.defvjp(_flash_fwd, _flash_bwd)


def _one_query(q, k, v, mask: Mask, bias_spec: BiasSpec | None):
  """The reference formula for rows of one query (q [b, 1, h, d], scaled): its logits
  [b, h, 1, tk] are a row, as small as a kernel's block, and a Pallas call would pad the
  query to a whole block (16 rows for Triton, 128 for Mosaic TPU)."""
  b, _, h, d = q.shape
  grouped = q.reshape(b, 1, k.shape[2], h // k.shape[2], d)  # query heads by their kv head
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k, preferred_element_type=jnp.float32)
  logits = logits.reshape(b, h, 1, k.shape[1])
  if bias_spec is not None:
    logits = logits + spec_bias(bias_spec, mask.q_positions, mask.k_positions)
  weights = masked_softmax(logits, mask.dense()).astype(v.dtype)
  weights = weights.reshape(b, k.shape[2], h // k.shape[2], 1, k.shape[1])
  return jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(b, 1, h, v.shape[-1])


def flash_attention(q, k, v, *, q_segments, k_segments, q_positions, k_positions,
                    causal: bool = False, window: int | None = None,
                    bias_spec: BiasSpec | None = None, scale: float = 1.0, block_q: int = 128,
                    block_k: int = 128, interpret: bool | None = None,
                    layout: str | None = None) -> jax.Array:
  """softmax(scale·q·kᵀ + bias)·V over the visible keys, as Pallas kernels.

  Args:
    q: [b, tq, h, d]; k: [b, tk, kv_heads, d]; v: [b, tk, kv_heads, d_v] (d_v may differ
      from d; kv_heads divides h: query head i reads key/value head i // (h / kv_heads)).
    q_segments, k_segments: int [b, tq], [b, tk]; a query sees keys of its own segment, and
      segment 0 (padding) sees and is seen by none.
    q_positions, k_positions: int [b, tq], [b, tk], the tokens' positions (which the causal
      mask, the window and the bias read; never the array indices).
    causal: keys at positions ≤ the query's only; window: within ±window positions.
    bias_spec: the positional bias, evaluated on blocks inside the kernels; its learned
      parameters get gradients.
    block_q, block_k: the largest blocks of queries and keys; each lowering takes the
      nearest it allows (pallas_layouts.LAYOUTS), capped at the lengths; lengths are
      zero-padded to whole blocks inside.
    interpret: run the kernels in Pallas' interpret mode; None: on the CPU (and platforms
      without a Pallas lowering) only, decided for the platform being lowered for; False:
      never (compiled on cuda, rocm and tpu; lowering for the CPU then fails).
    layout: a key of pallas_layouts.LAYOUTS run in interpret mode on every platform (a
      compiled lowering's layout checked on the CPU, as tests do); None: each platform's
      own (PLATFORMS).
  Returns:
    [b, tq, h, d_v] in v's dtype; 0 for a query that sees no key. Rows of one query (a
    KV-cached decoding step) are computed by the reference formula instead (_one_query),
    which is logged.
  """
  q = q * jnp.asarray(scale, q.dtype)
  if q.shape[1] == 1:  # a KV-cached decoding step
    log_once("flash_attention: one query per row (a decoding step) runs the reference "
             f"formula over the row [b, h, 1, {k.shape[1]}], not the Pallas kernels")
    mask = Mask(q_segments, k_segments, q_positions, k_positions, causal=causal, window=window)
    return _one_query(q, k, v, mask, bias_spec)
  if layout is not None:
    if interpret is False:
      raise ValueError(f"flash_attention: layout {layout!r} runs in interpret mode only "
                       "(its own platform compiles it when layout is None)")
    variants = ((None, layout, True),)
  else:  # interpret=False: the compiled platforms only, no branch for the CPU
    variants = tuple((platform, name, interpreted if interpret is None else interpret)
                     for platform, (name, interpreted) in PLATFORMS.items()
                     if interpret is not False or not interpreted)
  cfg = _Config(fn=None if bias_spec is None else bias_spec.fn,
                learned=bias_spec is not None and bias_spec.learned, causal=causal,
                window=window, block_q=block_q, block_k=block_k, variants=variants)
  params = {} if bias_spec is None else dict(bias_spec.params)
  return _flash(cfg, q, k, v, q_segments, k_segments, q_positions, k_positions, params)
