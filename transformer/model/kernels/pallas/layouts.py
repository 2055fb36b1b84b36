"""How the Pallas flash-attention kernels (transformer/model/kernels/pallas/bodies.py) lay out their
arrays and blocks for each lowering, and the pallas_call that runs them.

A Layout meets one lowering's rules:
- `generic`: interpret mode (the kernel bodies as ordinary JAX ops, on the CPU); blocks of
  multiples of 8, ids and statistics [t, 1], an inner-block loop in the kernel; as Triton's,
  one backward kernel adding dq atomically, and a bias table read by a gather.
- `triton`: Pallas' Triton lowering (GPU). Every array a kernel loads or computes has a
  power-of-two size, and tl.dot wants each matrix dimension ≥ 16: blocks are powers of two
  ≥ 16, head dims are zero-padded to one, and the parameter row to a power of two. Blocks
  are capped per head dim (TRITON_TUNING: 128 forward and 64 backward up to 128, half that
  above, as JAX's own Triton attention keeps register use bounded); the inner loop runs in the kernel over whole rows left in global memory, over
  the blocks of the outer block's visit list (a power-of-two row). The grid's first axis
  (the fastest-varying program id) is the outer block, a causal forward's query blocks
  from the last; one backward kernel per key block adds dq atomically into a float32
  array; a bias table over k − q (tables.py) or of an MLP's pieces (piecewise.py) is read
  by a gather, and its gradient added per entry by atomics.
- `mosaic_tpu`: Mosaic (TPU). A block's last two dimensions are multiples of (8, 128) or
  the array's own: query and key blocks of multiples of 128 (the query side's 8 would do
  for the blocks, but the backward pass transposes [block_q, block_k] probabilities, and
  JAX's own TPU kernels keep such transposes 128-aligned); as JAX's
  splash attention does, the query side's segment ids and positions are broadcast along
  the 128 lanes [t, 128], the key side's along 8 sublanes [8, t], and the row statistics
  (logsumexp, delta) are [t, 128]; the bias parameters live in SMEM (scalar memory) and
  their gradient leaves as a [1, width] block. The inner blocks are the grid's last
  ("arbitrary") axis, so VMEM holds blocks, never whole rows: the visit lists are a scalar
  prefetch (flat, in SMEM) that the index maps read, so only listed blocks are copied, and
  steps past a list's end repeat its last block (no copy). No atomics: dq has its own
  kernel; no gather from memory: the bias is evaluated per element.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from transformer.model.kernels.pallas.bodies import Static, lowering, outer_block


def _ceil_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _floor_pow2(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def round_up(n: int, multiple: int) -> int:
  """n rounded up to a multiple of `multiple`."""
  return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Layout:
  """One lowering's block sizes, padding and array layout."""

  name: str
  lanes: int  # the query side's ids, positions and row statistics: [t, lanes]
  sublanes: int  # the key side's ids and positions: [sublanes, t]
  q_multiple: int  # query blocks are multiples of this
  k_multiple: int  # key blocks are multiples of this
  grid_inner: bool  # the inner blocks are the grid's last axis (else a loop in the kernel)
  power_of_two: bool = False  # blocks, head dims and the parameter row are powers of two
  min_size: int = 1  # blocks and head dims are at least this
  tuned: bool = False  # the largest blocks per head dim from TRITON_TUNING
  smem_params: bool = False  # the bias parameters in scalar memory
  # the grid's axes in order: on a GPU the first is the fastest-varying program id, so the
  # query (outer) block comes first, as in JAX's and FlashAttention-2's Triton kernels
  axes: tuple[str, ...] = ("outer", "batch", "head")
  heaviest_first: bool = False  # a causal mask's query blocks from the last (the heaviest)
  # the dk/dv kernel adds dq atomically (one backward kernel; else a dq kernel besides)
  dq_atomic: bool = False
  # the kernels gather a bias from a table in memory (tables.py, piecewise.py)
  tables: bool = False

  def blocks(self, block_q: int, block_k: int, tq: int, tk: int, backward: bool,
             head_dim: int = 64):
    """(query block, key block) for lengths tq, tk from the asked sizes (and the padded
    head dim, which sets a tuned layout's largest blocks)."""
    def size(block, length, multiple):
      if self.tuned:
        block = min(block, triton_tuning(head_dim)[1 + backward])
      if self.power_of_two:
        return max(self.min_size, min(_floor_pow2(block), _ceil_pow2(length)))
      return max(multiple, min(block // multiple * multiple, round_up(length, multiple)))
    return size(block_q, tq, self.q_multiple), size(block_k, tk, self.k_multiple)

  def dim(self, n: int) -> int:
    """A head dim or parameter row of n entries as laid out."""
    return max(self.min_size, _ceil_pow2(n)) if self.power_of_two else n

  def compiler_params(self, head_dim: int, axes: tuple[str, ...]):
    if self.name == "triton":
      warps, stages = triton_tuning(head_dim)[2:]
      return lowering("triton").CompilerParams(num_warps=warps, num_stages=stages)
    if self.name == "mosaic_tpu":
      return lowering("tpu").CompilerParams(dimension_semantics=tuple(
          "arbitrary" if axis == "inner" else "parallel" for axis in axes))
    return None


# Triton's largest blocks (forward, backward), num_warps and num_stages per padded head dim
# (≤ 64, ≤ 128, larger): FlashAttention-2's and JAX's Triton attention's choices (blocks of
# 128 forward and 64 backward, halved above 128 where q, k, v blocks fill registers and
# shared memory; 4 warps up to 64, 8 above; fewer stages for larger blocks).
# NOT measured on a GPU: none was at hand.
TRITON_TUNING = ((64, 128, 64, 4, 3), (128, 128, 64, 8, 2), (None, 64, 32, 8, 1))


def triton_tuning(head_dim: int) -> tuple[int, int, int, int]:
  """(forward block, backward block, num_warps, num_stages) for a padded head dim, from
  TRITON_TUNING."""
  return next(row[1:] for row in TRITON_TUNING if row[0] is None or head_dim <= row[0])


LAYOUTS = {
    "generic": Layout("generic", 1, 1, 8, 8, grid_inner=False, dq_atomic=True,
                      tables=True),
    "triton": Layout("triton", 1, 1, 16, 16, grid_inner=False, power_of_two=True,
                     min_size=16, tuned=True, heaviest_first=True, dq_atomic=True,
                     tables=True),
    "mosaic_tpu": Layout("mosaic_tpu", 128, 8, 128, 128, grid_inner=True, smem_params=True,
                         axes=("batch", "head", "outer", "inner")),
}


def heads(x, length: int, width: int):
  """[b, t, h, d] -> [b, h, length, width], zero-padded."""
  x = jnp.swapaxes(x, 1, 2)
  return jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2]), (0, width - x.shape[3])])


def unheads(x, length: int, width: int):
  """heads' inverse: [b, h, ≥length, ≥width] -> [b, length, h, width]."""
  return jnp.swapaxes(x[:, :, :length, :width], 1, 2)


def query_side(layout: Layout, x, length: int):
  """[b, t] ids or positions -> int32 [b, length, lanes] (padding: 0, segment 0 masked)."""
  x = jnp.pad(x.astype(jnp.int32), [(0, 0), (0, length - x.shape[1])])
  return jax.lax.broadcast_in_dim(x, (*x.shape, layout.lanes), (0, 1))


def key_side(layout: Layout, x, length: int):
  """[b, t] ids or positions -> int32 [b, sublanes, length]."""
  x = jnp.pad(x.astype(jnp.int32), [(0, 0), (0, length - x.shape[1])])
  return jax.lax.broadcast_in_dim(x, (x.shape[0], layout.sublanes, length), (0, 2))


def statistics(layout: Layout, x, length: int):
  """[b, h, t] float32 row statistics -> [b, h, length, lanes]."""
  x = jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2])])
  return jax.lax.broadcast_in_dim(x, (*x.shape, layout.lanes), (0, 1, 2))


def head_keys(layout: Layout, x, length: int):
  """[b, h, t] float32 per-head key-side values -> [b, h, sublanes, length]."""
  x = jnp.pad(x, [(0, 0), (0, 0), (0, length - x.shape[2])])
  return jax.lax.broadcast_in_dim(x, (*x.shape[:2], layout.sublanes, length), (0, 1, 3))


def pack(layout: Layout, params: dict):
  """The bias parameters {name: [h, size]} as one flat float32 array [h · width], and
  their (name, offset, size) and width."""
  names = sorted(params)
  sizes = [params[name].shape[-1] for name in names]
  offsets = [sum(sizes[:n]) for n in range(len(names))]
  width = layout.dim(sum(sizes)) if names else 1
  rows = [params[name].astype(jnp.float32) for name in names]
  h = rows[0].shape[0] if rows else 1
  flat = jnp.concatenate(rows + [jnp.zeros((h, width - sum(sizes)), jnp.float32)], -1)
  return flat.reshape(-1), tuple(zip(names, offsets, sizes)), width


def unpack(st: Static, rows):
  """pack's inverse for gradient rows [h, width] -> {name: [h, size]}."""
  return {name: rows[:, offset:offset + size] for name, offset, size in st.params}


@dataclasses.dataclass(frozen=True)
class Operand:
  """An array and how a kernel sees it: kind "heads" [b, H, t, d], "query" [b, t, lanes],
  "keys" [b, sublanes, t], "stats" [b, h, t, lanes], "params" (whole), "table" [h, width]
  (the head's row), "drow" [b, h, n, 1, width], "head_keys" [b, h, sublanes, t], "lists" [b, n, width] (the visit lists); role "outer" (the grid's block n) or
  "inner" (the listed block, or the whole row when the kernel loops); groups: query heads
  per head of this array (grouped-query K and V)."""

  array: object
  kind: str
  role: str = "outer"
  groups: int = 1


def _spec(layout: Layout, st: Static, op: Operand, block: int, outers: int):
  if op.kind == "params":
    if layout.smem_params:
      return pl.BlockSpec(memory_space=lowering("tpu").SMEM)
    return pl.BlockSpec(op.array.shape, lambda *grid: (0,))
  shape = op.array.shape
  if op.kind == "table":
    return pl.BlockSpec((None, shape[1]), lambda *grid: (grid[st.axes.index("head")], 0))
  whole = op.role == "inner" and not layout.grid_inner
  t = {"heads": 2, "query": 1, "keys": 2, "stats": 2, "drow": 2, "lists": 1,
       "head_keys": 3}[op.kind]
  size = shape[t] if whole else block

  def index(build):
    """An index map from the grid's indices (and the lists in scalar memory, on the grid
    driver) to build(batch, head, outer block, this operand's block along t)."""
    def index_map(*args):
      grid = dict(zip(st.axes, args))
      i, j, n = grid["batch"], grid["head"], outer_block(st, grid["outer"], outers)
      if whole:
        at = 0
      elif op.role == "outer":
        at = n
      else:  # the grid driver's inner step m: the m-th block of (i, n)'s visit list
        lists = args[len(st.axes)]
        at = lists[(i * outers + n) * st.visits + 2 + grid["inner"]]
      return build(i, j, n, at)
    return index_map

  def head(j):  # lax.div: jnp's // lowers through sign, which Mosaic asks a TPU about
    return j if op.groups == 1 else jax.lax.div(j, op.groups)

  if op.kind == "heads":
    return pl.BlockSpec((None, None, size, shape[3]),
                        index(lambda i, j, n, at: (i, head(j), at, 0)))
  if op.kind == "query":
    return pl.BlockSpec((None, size, shape[2]), index(lambda i, j, n, at: (i, at, 0)))
  if op.kind == "keys":
    return pl.BlockSpec((None, shape[1], size), index(lambda i, j, n, at: (i, 0, at)))
  if op.kind == "stats":
    return pl.BlockSpec((None, None, size, shape[3]), index(lambda i, j, n, at: (i, j, at, 0)))
  if op.kind == "head_keys":
    return pl.BlockSpec((None, None, shape[2], size), index(lambda i, j, n, at: (i, j, 0, at)))
  if op.kind == "lists":
    return pl.BlockSpec((None, None, shape[2]), index(lambda i, j, n, at: (i, n, 0)))
  return pl.BlockSpec((None, None, None, 1, shape[4]), index(lambda i, j, n, at: (i, j, n, 0, 0)))


def call(layout: Layout, kernel, st: Static, *, name: str, outer: int, lists, inputs, outputs,
         scratch, interpret: bool, head_dim: int):
  """pallas_call of kernel(lists, *inputs, *outputs, [counts,] *scratch, st=st) over the
  grid st.axes (batch, head, outer block[, inner step]). lists: the visit lists int32
  [b, outer, st.visits] (sparsity.visit_lists); inputs, outputs: Operands (an output's
  array a ShapeDtypeStruct); scratch: the carry's shapes, float32 (the grid driver's only).
  With st.count, two more outputs [b, h, outer·block, lanes]: the blocks visited and those
  masked per outer block (each row of its block)."""
  b, h = outputs[0].array.shape[:2]
  # an output given as an array (not a ShapeDtypeStruct) starts from it: an aliased input
  aliased = [n for n, op in enumerate(outputs) if not isinstance(op.array, jax.ShapeDtypeStruct)]
  inputs = inputs + [outputs[n] for n in aliased]
  outer_size = st.block_k if name == "flash_dkv" else st.block_q
  sizes = {"batch": b, "head": h, "outer": outer, "inner": st.inner}
  grid = tuple(sizes[axis] for axis in st.axes)
  block = lambda op: outer_size if op.role == "outer" else st.inner_block  # noqa: E731
  if st.count:
    outputs = outputs + [Operand(jax.ShapeDtypeStruct((b, h, outer * outer_size, st.lanes),
                                                      jnp.float32), "stats")] * 2
    scratch = scratch + [(1, 1)] * 2
  spec = lambda op: _spec(layout, st, op, block(op), outer)  # noqa: E731
  in_specs = [spec(op) for op in inputs]
  out_specs = [spec(op) for op in outputs]
  if layout.grid_inner:
    tpu = lowering("tpu")
    grid_spec = tpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[tpu.VMEM(shape, jnp.float32) for shape in scratch])
    arrays = [lists.reshape(-1)]
  else:
    grid_spec = pl.GridSpec(grid=grid, in_specs=[spec(Operand(lists, "lists"))] + in_specs,
                            out_specs=out_specs)
    arrays = [lists]
  return pl.pallas_call(
      functools.partial(kernel, st=st), grid_spec=grid_spec, name=name,
      out_shape=[jax.ShapeDtypeStruct(op.array.shape, op.array.dtype) for op in outputs],
      input_output_aliases={len(arrays) + len(inputs) - len(aliased) + a: n
                            for a, n in enumerate(aliased)},
      compiler_params=layout.compiler_params(head_dim, st.axes), interpret=interpret,
  )(*arrays, *(op.array for op in inputs))
