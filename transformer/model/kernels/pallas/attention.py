"""Flash attention as Pallas kernels, with the positional bias computed inside them.

Besides softmax, the kernels compute softmax with a sink logit per head (the running sum
starts at the sink; its gradient, −Σ_rows p_sink·(dO·O), comes from the saved statistics
here) and sigmoid weights σ(x + b) with no normaliser (FlashSigmoid), and add a data bias
u_i − w_j from two vectors per row and head (FoX's c_i − c_j), read per block like the
positions, whose gradients are the row and column sums of the logits' gradient
(bodies.py: Normalizer, read_vectors).

softmax(q·kᵀ + bias)·V over the visible keys (the same non-pad segment, optionally causal and
within a local window, read from segment ids and positions as transformer/model/masks.py does), in
blocks: the forward kernel runs an online softmax over key blocks and saves each query's
logsumexp; the backward kernels recompute each block's probabilities from it (one kernel per
query block for dq and the bias parameters' gradient, one per key block for dk and dv).
Each kernel visits only the blocks its visit list names, decided in XLA from the segments
and positions before the kernels (transformer/model/kernels/pallas/sparsity.py): the partial
ones masked, the full ones not. The
bias comes from the encoding's BiasSpec (transformer/model/positions/base.py), evaluated on each
[block_q, block_k] block of positions from the head's parameters, so no [L, L] array exists
in memory, forward or backward; the gradient of the bias parameters is the vjp of the
block's bias function at the logits' gradient (or the BiasSpec's closed form of it),
summed over blocks, or, where a layout reads the bias from a table (over k − q: tables.py;
of an MLP's linear pieces: piecewise.py), the logits' gradient summed per table entry,
then the vjp of the table's construction. The kernel bodies are
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
from transformer.model.kernels.pallas import layouts, piecewise, sparsity, tables
from transformer.model.kernels.pallas.bodies import (LN2, LOG2E, Normalizer, Static,
                                                     dkv_kernel, dq_kernel, forward_kernel,
                                                     grad_by_table)
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
  count: bool = False  # the kernels also count the blocks they visit (visited_blocks)
  dense: object = None  # the BiasSpec's dense form, or None
  saturates_at: int | None = None  # the BiasSpec's: a table over k − q where a layout reads one
  grad: object = None  # the BiasSpec's closed-form vjp of its fn, or None
  mlp_input: object = None  # the BiasSpec's: its MLP read as pieces where a layout reads tables
  normalizer: Normalizer | None = None  # how logits become weights (None: softmax)
  vectors: bool = False  # a data bias u_i − w_j from two vectors per row and head


def _table_width(cfg: _Config, layout, packing) -> int:
  """A head's row of the bias table the layout reads (0: none): 2·M + 1 entries over k − q,
  or the pieces of an MLP (piecewise.row_width), as the layout pads it."""
  if not layout.tables:
    return 0
  if cfg.saturates_at:
    return layout.dim(2 * cfg.saturates_at + 1)
  return layout.dim(piecewise.row_width(packing)) if cfg.mlp_input else 0


def _static(cfg: _Config, layout, bq, bk, packing, width, inner, inner_block, visits,
            reverse=False, interpret=True):
  return Static(fn=cfg.fn, learned=cfg.learned, causal=cfg.causal, window=cfg.window,
                block_q=bq, block_k=bk, params=packing, width=width, lanes=layout.lanes,
                grid_inner=layout.grid_inner, inner=inner, inner_block=inner_block,
                axes=layout.axes, visits=visits, count=cfg.count, dq_atomic=layout.dq_atomic,
                reverse=reverse and cfg.causal and layout.heaviest_first,
                table=cfg.saturates_at if layout.tables else None,
                table_width=_table_width(cfg, layout, packing), atomic_table=not interpret,
                grad=cfg.grad, mlp_input=(cfg.mlp_input if layout.tables and not
                                          cfg.saturates_at else None),
                normalizer=cfg.normalizer, vectors=cfg.vectors)


def _bias_operands(cfg: _Config, st: Static, flat, params):
  """The kernels' bias inputs: the flat parameters, and the table where the layout reads
  one: over k − q (tables.py) or an MLP's pieces (piecewise.py)."""
  if cfg.fn is None:
    return []
  ops = [Operand(flat, "params")]
  if st.table is not None:
    spec = BiasSpec(cfg.fn, params, dense=cfg.dense, saturates_at=cfg.saturates_at)
    ops.append(Operand(tables.relative_table(spec, st.table_width), "table"))
  elif st.mlp_input is not None:
    ops.append(Operand(piecewise.piece_table(params, st.table_width), "table"))
  return ops


def _table_params_gradient(cfg: _Config, st: Static, params, dtable):
  """The bias parameters' gradient {name: [h, size]} from the table's, dtable float32
  [h, table_width]: the vjp of the table's construction."""
  if st.mlp_input is not None:
    return piecewise.params_gradient(params, st.params, dtable)
  spec = BiasSpec(cfg.fn, params, dense=cfg.dense, saturates_at=cfg.saturates_at)
  return tables.table_gradient(spec, st.table_width, dtable)


def _term_operands(cfg: _Config, layout, terms, lq: int, lk: int, query_outer: bool = True):
  """The kernels' inputs for the normaliser and the data bias (bodies.take_terms): the
  sink's logits in base 2, flat [h]; the vectors u [b, h, lq, lanes] at the queries and
  w [b, h, sublanes, lk] at the keys, inner on the side the kernel loops over."""
  sink, u, w = terms
  ops = [] if sink is None else [Operand(sink.astype(jnp.float32) * LOG2E, "params")]
  if cfg.vectors:
    ops += [Operand(layouts.statistics(layout, u, lq), "stats",
                    "outer" if query_outer else "inner"),
            Operand(layouts.head_keys(layout, w, lk), "head_keys",
                    "inner" if query_outer else "outer")]
  return ops


def _lists(layout, kind):
  """The visit lists of a block classification [b, n, m] (sparsity.visit_lists), each
  [2 + m] entries wide (a power of two for Triton)."""
  m = kind.shape[-1]
  width = layout.dim(m + 2)
  return sparsity.visit_lists(kind, width), width


def _forward(cfg, name, interpret, q, k, v, qs, ks, qp, kp, params, terms=(None,) * 3):
  """One layout's forward: out [b, tq, h, d_v], base-2 logsumexp float32 [b, h, tq] and
  (cfg.count) the blocks visited and masked per query block [b, h, nq] each. terms: (the
  sink's logits [h] or None, the data bias's vectors u [b, h, tq], w [b, h, tk] or None)."""
  layout = LAYOUTS[name]
  (b, tq, h, d), tk, dv = q.shape, k.shape[1], v.shape[-1]
  bq, bk = layout.blocks(cfg.block_q, cfg.block_k, tq, tk, backward=False,
                         head_dim=layout.dim(d))
  lq, lk = -(-tq // bq) * bq, -(-tk // bk) * bk
  dp, dvp = layout.dim(d), layout.dim(dv)
  flat, packing, width = layouts.pack(layout, params)
  kind = sparsity.classify(qs, ks, qp, kp, causal=cfg.causal, window=cfg.window,
                           block_q=bq, block_k=bk, lq=lq, lk=lk)
  lists, visits = _lists(layout, kind)
  st = _static(cfg, layout, bq, bk, packing, width, lk // bk, bk, visits, reverse=True)
  groups = h // k.shape[2]
  inputs = [Operand(layouts.heads(q, lq, dp), "heads"),
            Operand(layouts.query_side(layout, qs, lq), "query"),
            Operand(layouts.query_side(layout, qp, lq), "query"),
            Operand(layouts.heads(k, lk, dp), "heads", "inner", groups),
            Operand(layouts.heads(v, lk, dvp), "heads", "inner", groups),
            Operand(layouts.key_side(layout, ks, lk), "keys", "inner"),
            Operand(layouts.key_side(layout, kp, lk), "keys", "inner")]
  inputs += _term_operands(cfg, layout, terms, lq, lk)
  inputs += _bias_operands(cfg, st, flat, params)
  outputs = [Operand(jax.ShapeDtypeStruct((b, h, lq, dvp), v.dtype), "heads"),
             Operand(jax.ShapeDtypeStruct((b, h, lq, layout.lanes), jnp.float32), "stats")]
  out, lse, *counts = layouts.call(
      layout, forward_kernel, st, name="flash_forward", outer=lq // bq, lists=lists,
      inputs=inputs, outputs=outputs, scratch=[(bq, layout.lanes)] * 2 + [(bq, dvp)],
      interpret=interpret, head_dim=dp)
  return (layouts.unheads(out, tq, dv), lse[:, :, :tq, 0],
          *(c[:, :, ::bq, 0] for c in counts))


def _backward(cfg, name, interpret, q, k, v, qs, ks, qp, kp, params, out, lse, do,
              terms=(None,) * 3):
  """One layout's gradients of q, k, v, of the bias parameters ([h, size] each) and of
  the terms (the sink's logits [h], the data bias's vectors u [b, h, tq], w [b, h, tk]:
  None where absent), and {kernel name: (blocks visited, blocks masked) per outer block
  [b, h, n]} (cfg.count).

  Where the layout adds dq atomically (layout.dq_atomic: Triton, interpret mode) one kernel
  per key block computes dk, dv, the bias parameters' gradient and adds its share of dq into
  a float32 array (5 matmuls per block pair); elsewhere (Mosaic TPU: no atomics) a dq kernel
  per query block (with the parameters' gradient) and a dk/dv kernel per key block."""
  layout = LAYOUTS[name]
  (b, tq, h, d), tk, dv = q.shape, k.shape[1], v.shape[-1]
  bq, bk = layout.blocks(cfg.block_q, cfg.block_k, tq, tk, backward=True,
                         head_dim=layout.dim(d))
  lq, lk, nq, nk = -(-tq // bq) * bq, -(-tk // bk) * bk, -(-tq // bq), -(-tk // bk)
  dp, dvp = layout.dim(d), layout.dim(dv)
  flat, packing, width = layouts.pack(layout, params)
  groups = h // k.shape[2]
  kind = sparsity.classify(qs, ks, qp, kp, causal=cfg.causal, window=cfg.window,
                           block_q=bq, block_k=bk, lq=lq, lk=lk)
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
  par = _bias_operands(cfg, _static(cfg, layout, bq, bk, packing, width, nk, bk, 0),
                       flat, params)
  vectors = [jax.ShapeDtypeStruct((b, h, lq, layout.lanes), jnp.float32)] * cfg.vectors
  inner = lambda ops: [dataclasses.replace(op, role="inner") for op in ops]  # noqa: E731
  drow = lambda n: [Operand(jax.ShapeDtypeStruct(  # noqa: E731
      (b, h, n, 1, width), jnp.float32), "drow")] * cfg.learned
  counts = {}

  if not layout.dq_atomic:
    lists, visits = _lists(layout, kind)
    st = _static(cfg, layout, bq, bk, packing, width, nk, bk, visits, reverse=True)
    outputs = [Operand(jax.ShapeDtypeStruct((b, h, lq, dp), q.dtype), "heads")] + drow(nq)
    outputs += [Operand(x, "stats") for x in vectors]
    dq, *rest = layouts.call(
        layout, dq_kernel, st, name="flash_dq", outer=nq, lists=lists,
        inputs=query + inner(keys) + _term_operands(cfg, layout, terms, lq, lk) + par,
        outputs=outputs, scratch=[(bq, dp)] + [(1, width)] * cfg.learned
        + [(bq, layout.lanes)] * cfg.vectors, interpret=interpret, head_dim=dp)
    rows, du, rest = rest[:cfg.learned], rest[cfg.learned:][:cfg.vectors], rest[
        cfg.learned + cfg.vectors:]
    counts["dq"] = tuple(c[:, :, ::bq, 0] for c in rest)

  lists, visits = _lists(layout, jnp.swapaxes(kind, 1, 2))
  st = _static(cfg, layout, bq, bk, packing, width, nq, bq, visits, interpret=interpret)
  outputs = [Operand(jax.ShapeDtypeStruct((b, h, lk, dp), k.dtype), "heads"),
             Operand(jax.ShapeDtypeStruct((b, h, lk, dvp), v.dtype), "heads")]
  outputs += [Operand(jax.ShapeDtypeStruct((b, h, layout.sublanes, lk), jnp.float32),
                      "head_keys")] * cfg.vectors
  by_table = grad_by_table(st)
  if layout.dq_atomic:  # dq's float32 sums, zeros aliased to the output the kernel adds to
    outputs += [Operand(jnp.zeros((b, h, lq, dp), jnp.float32), "heads", "inner")]
    outputs += ([Operand(jnp.zeros((h, st.table_width), jnp.float32), "table")] if by_table
                else drow(nk))
    outputs += [Operand(jnp.zeros(x.shape, x.dtype), "stats", "inner") for x in vectors]
  dk, dv_, *rest = layouts.call(
      layout, dkv_kernel, st, name="flash_backward" if layout.dq_atomic else "flash_dkv",
      outer=nk, lists=lists, inputs=keys + inner(query)
      + _term_operands(cfg, layout, terms, lq, lk, query_outer=False) + par,
      outputs=outputs, scratch=[(bk, dp), (bk, dvp)] + [(1, bk)] * cfg.vectors,
      interpret=interpret, head_dim=dp)
  dw, rest = rest[:cfg.vectors], rest[cfg.vectors:]
  if layout.dq_atomic:
    dq, rows, rest = rest[0], rest[1:1 + cfg.learned], rest[1 + cfg.learned:]
    du, rest = rest[:cfg.vectors], rest[cfg.vectors:]
  counts["dkv"] = tuple(c[:, :, ::bk, 0] for c in rest)
  if groups > 1:  # each query head's share, summed into its key/value head
    dk, dv_ = (x.reshape(b, h // groups, groups, *x.shape[2:]).sum(2) for x in (dk, dv_))
  if by_table:
    dparams = _table_params_gradient(cfg, st, params, rows[0])
  elif cfg.learned:
    dparams = layouts.unpack(st, rows[0].sum((0, 2))[:, 0])
  else:
    dparams = jax.tree.map(jnp.zeros_like, params)
  if layout.dq_atomic:
    dq = (dq * LN2).astype(q.dtype)
  dterms = _term_gradients(terms, lse, delta[:, :, :tq], du, dw, tq, tk)
  return (layouts.unheads(dq, tq, d), layouts.unheads(dk, tk, d).astype(k.dtype),
          layouts.unheads(dv_, tk, dv).astype(v.dtype), dparams, dterms, counts)


def _term_gradients(terms, lse, delta, du, dw, tq: int, tk: int):
  """The gradients of the terms (sink [h], u [b, h, tq], w [b, h, tk]; None where absent):
  a sink's, d s_h = −Σ_rows p_sink·(dO·O) with p_sink = 2^(s_h·log2 e − lse) the weight of
  the sink (its share of each row's normaliser: ∂lse/∂s); the vectors', the row and column
  sums of the logits' gradient that the kernels gave ([..., lanes] and [..., sublanes, ·]
  layouts: entry 0)."""
  sink, u, w = terms
  dsink = None if sink is None else -jnp.sum(
      jnp.exp2(sink[None, :, None].astype(jnp.float32) * LOG2E - lse) * delta, (0, 2))
  if u is None:
    return dsink, None, None
  return dsink, du[0][:, :, :tq, 0], dw[0][:, :, 0, :tk]


def _gradients(cfg, name, interpret, *args):
  """_backward's gradients alone (its counts differ between layouts)."""
  return _backward(cfg, name, interpret, *args)[:5]


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
def _flash(cfg, q, k, v, qs, ks, qp, kp, params, terms):
  return _per_platform(cfg, _forward, q, k, v, qs, ks, qp, kp, params, terms)[0]


def _flash_fwd(cfg, q, k, v, qs, ks, qp, kp, params, terms):
  out, lse = _per_platform(cfg, _forward, q, k, v, qs, ks, qp, kp, params, terms)
  return out, (q, k, v, qs, ks, qp, kp, params, out, lse, terms)


def _flash_bwd(cfg, residuals, do):
  *residuals, terms = residuals
  dq, dk, dv, dparams, dterms = _per_platform(cfg, _gradients, *residuals, do, terms)
  return dq, dk, dv, None, None, None, None, dparams, dterms


_flash.defvjp(_flash_fwd, _flash_bwd)


def visited_blocks(q, k, v, *, q_segments, k_segments, q_positions, k_positions,
                   causal: bool = False, window: int | None = None, block_q: int = 128,
                   block_k: int = 128, layout: str = "generic") -> dict:
  """The blocks each kernel visits, counted by the kernels themselves (in interpret mode,
  with `layout`'s blocks and driver): {"forward", "dq": per query block, "dkv": per key
  block: (visited, masked) int [b, h, blocks]}, "dq" only where the layout has a dq kernel
  (not layout.dq_atomic). Arguments as flash_attention's (no bias, q unscaled); for tests."""
  cfg = _Config(fn=None, learned=False, causal=causal, window=window, block_q=block_q,
                block_k=block_k, variants=((None, layout, True),), count=True)
  ids = (q_segments, k_segments, q_positions, k_positions)
  out, lse, *forward = _forward(cfg, layout, True, q, k, v, *ids, {})
  *_, backward = _backward(cfg, layout, True, q, k, v, *ids, {}, out, lse, jnp.ones_like(out))
  return {name: tuple(c.astype(jnp.int32) for c in pair)
          for name, pair in [("forward", forward), *backward.items()]}


def _row_weights(logits, visible, sigmoid_bias: float | None, sink):
  """The normaliser over whole rows of logits [b, h, tq, tk] (visible: their mask): σ(x + b)
  (sigmoid_bias b), or softmax with the sink's logits [h] as one more column (sink), or
  softmax; 0 at hidden keys."""
  if sigmoid_bias is not None:
    return jnp.where(visible, jax.nn.sigmoid(logits + sigmoid_bias), 0.0)
  if sink is None:
    return masked_softmax(logits, visible)
  column = jnp.broadcast_to(sink.astype(jnp.float32)[:, None, None], (*logits.shape[:3], 1))
  visible = jnp.broadcast_to(visible, logits.shape)
  return masked_softmax(jnp.concatenate([logits, column], -1),
                        jnp.concatenate([visible, jnp.ones_like(visible[..., :1])], -1))[..., :-1]


def _one_query(q, k, v, mask: Mask, bias_spec: BiasSpec | None, sigmoid_bias=None, sink=None,
               bias_vectors=None):
  """The reference formula for rows of one query (q [b, 1, h, d], scaled): its logits
  [b, h, 1, tk] are a row, as small as a kernel's block, and a Pallas call would pad the
  query to a whole block (16 rows for Triton, 128 for Mosaic TPU)."""
  b, _, h, d = q.shape
  grouped = q.reshape(b, 1, k.shape[2], h // k.shape[2], d)  # query heads by their kv head
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k, preferred_element_type=jnp.float32)
  logits = logits.reshape(b, h, 1, k.shape[1])
  if bias_spec is not None:
    logits = logits + spec_bias(bias_spec, mask.q_positions, mask.k_positions)
  if bias_vectors is not None:
    u, w = (jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in bias_vectors)
    logits = logits + u[..., :, None] - w[..., None, :]
  weights = _row_weights(logits, mask.dense(), sigmoid_bias, sink).astype(v.dtype)
  weights = weights.reshape(b, k.shape[2], h // k.shape[2], 1, k.shape[1])
  return jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(b, 1, h, v.shape[-1])


def flash_attention(q, k, v, *, q_segments, k_segments, q_positions, k_positions,
                    causal: bool = False, window: int | None = None,
                    bias_spec: BiasSpec | None = None, scale: float = 1.0, block_q: int = 128,
                    block_k: int = 128, interpret: bool | None = None,
                    layout: str | None = None, sigmoid_bias: float | None = None,
                    sink: jax.Array | None = None,
                    bias_vectors: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """normalise(scale·q·kᵀ + bias)·V over the visible keys, as Pallas kernels; normalise is
  softmax, softmax with a sink, or a sigmoid.

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
      nearest it allows (layouts.LAYOUTS), capped at the lengths; lengths are
      zero-padded to whole blocks inside.
    interpret: run the kernels in Pallas' interpret mode; None: on the CPU (and platforms
      without a Pallas lowering) only, decided for the platform being lowered for; False:
      never (compiled on cuda, rocm and tpu; lowering for the CPU then fails).
    layout: a key of layouts.LAYOUTS run in interpret mode on every platform (a
      compiled lowering's layout checked on the CPU, as tests do); None: each platform's
      own (PLATFORMS).
    sigmoid_bias: b of sigmoid attention, weights σ(x + b) at the visible keys and no
      normaliser (FlashSigmoid); None: softmax.
    sink: [h] float32, softmax with one more logit per head in its normaliser and no value
      (a learned sink gets its gradient); softmax only.
    bias_vectors: (u [b, tq, h], w [b, tk, h]) float32: a data-dependent bias u_i − w_j
      added to the logits (FoX's c_i − c_j), read per block like positions; both get
      gradients (the row and column sums of the logits' gradient).
  Returns:
    [b, tq, h, d_v] in v's dtype; 0 for a query that sees no key. Rows of one query (a
    KV-cached decoding step) are computed by the reference formula instead (_one_query),
    which is logged.
  """
  if q.shape[1] == 1:  # a KV-cached decoding step
    log_once("flash_attention: one query per row (a decoding step) runs the reference "
             f"formula over the row [b, h, 1, {k.shape[1]}], not the Pallas kernels")
    mask = Mask(q_segments, k_segments, q_positions, k_positions, causal=causal, window=window)
    return _one_query(q * jnp.asarray(scale, q.dtype), k, v, mask, bias_spec, sigmoid_bias,
                      sink, bias_vectors)
  if sink is not None and sigmoid_bias is not None:
    raise ValueError("flash_attention: a sink is a term of softmax's normaliser; sigmoid "
                     "attention has none")
  q = q * jnp.asarray(scale * LOG2E, q.dtype)  # the kernels' logits are in base 2
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
                window=window, block_q=block_q, block_k=block_k, variants=variants,
                dense=None if bias_spec is None else bias_spec.dense,
                saturates_at=None if bias_spec is None else bias_spec.saturates_at,
                grad=None if bias_spec is None else bias_spec.grad,
                mlp_input=None if bias_spec is None else bias_spec.mlp_input,
                normalizer=Normalizer(sigmoid=sigmoid_bias is not None,
                                      bias=(sigmoid_bias or 0.0) * LOG2E, sink=sink is not None),
                vectors=bias_vectors is not None)
  params = {} if bias_spec is None else dict(bias_spec.params)
  u, w = (None, None) if bias_vectors is None else (
      jnp.swapaxes(x, 1, 2).astype(jnp.float32) for x in bias_vectors)  # [b, h, t]
  return _flash(cfg, q, k, v, q_segments, k_segments, q_positions, k_positions, params,
                (sink, u, w))
