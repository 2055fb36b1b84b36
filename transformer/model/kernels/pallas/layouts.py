"""How the Pallas flash-attention kernels (transformer/model/kernels/pallas/bodies.py) lay out their
arrays and blocks for each lowering, and the pallas_call that runs them.

A Layout meets one lowering's rules:
- `generic`: interpret mode (the kernel bodies as ordinary JAX ops, on the CPU); blocks of
  multiples of 8, ids and statistics [t, 1], an inner-block loop in the kernel.
- `triton`: Pallas' Triton lowering (GPU). Every array a kernel loads or computes has a
  power-of-two size, and tl.dot wants each matrix dimension ≥ 16: blocks are powers of two
  ≥ 16, head dims are zero-padded to one, and the parameter row to a power of two. Blocks
  are capped (128 forward, 64 backward, as JAX's own Triton attention keeps register use
  bounded); the inner loop runs in the kernel over whole rows left in global memory.
- `mosaic_tpu`: Mosaic (TPU). A block's last two dimensions are multiples of (8, 128) or
  the array's own: query and key blocks of multiples of 128 (the query side's 8 would do
  for the blocks, but the backward pass transposes [block_q, block_k] probabilities, and
  JAX's own TPU kernels keep such transposes 128-aligned); as JAX's
  splash attention does, the query side's segment ids and positions are broadcast along
  the 128 lanes [t, 128], the key side's along 8 sublanes [8, t], and the row statistics
  (logsumexp, delta) are [t, 128]; the bias parameters live in SMEM (scalar memory) and
  their gradient leaves as a [1, width] block. The inner blocks are the grid's last
  ("arbitrary") axis, so VMEM holds blocks, never whole rows.
"""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from transformer.model.kernels.pallas.bodies import Static


def _ceil_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _floor_pow2(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def _round_up(n: int, multiple: int) -> int:
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
  caps: tuple[int, int] | None = None  # (forward, backward) largest block
  smem_params: bool = False  # the bias parameters in scalar memory

  def blocks(self, block_q: int, block_k: int, tq: int, tk: int, backward: bool):
    """(query block, key block) for lengths tq, tk from the asked sizes."""
    def size(block, length, multiple):
      if self.caps:
        block = min(block, self.caps[backward])
      if self.power_of_two:
        return max(self.min_size, min(_floor_pow2(block), _ceil_pow2(length)))
      return max(multiple, min(block // multiple * multiple, _round_up(length, multiple)))
    return size(block_q, tq, self.q_multiple), size(block_k, tk, self.k_multiple)

  def dim(self, n: int) -> int:
    """A head dim or parameter row of n entries as laid out."""
    return max(self.min_size, _ceil_pow2(n)) if self.power_of_two else n

  def compiler_params(self, head_dim: int):
    if self.name == "triton":
      return _lowering("triton").CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    if self.name == "mosaic_tpu":
      return _lowering("tpu").CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",))
    return None


def _lowering(name: str):
  """jax.experimental.pallas.tpu or .triton, imported when a layout of theirs is used: they
  take 0.4 s of imports that a run on the CPU never needs."""
  return importlib.import_module(f"jax.experimental.pallas.{name}")


LAYOUTS = {
    "generic": Layout("generic", 1, 1, 8, 8, grid_inner=False),
    "triton": Layout("triton", 1, 1, 16, 16, grid_inner=False, power_of_two=True,
                     min_size=16, caps=(128, 64)),
    "mosaic_tpu": Layout("mosaic_tpu", 128, 8, 128, 128, grid_inner=True, smem_params=True),
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
  "keys" [b, sublanes, t], "stats" [b, h, t, lanes], "params" (whole), "drow" [b, h, n, 1,
  width]; role "outer" (the grid's block n) or "inner" (block m, or the whole row when the
  kernel loops); groups: query heads per head of this array (grouped-query K and V)."""

  array: object
  kind: str
  role: str = "outer"
  groups: int = 1


def _spec(layout: Layout, st: Static, op: Operand, block: int):
  if op.kind == "params":
    if layout.smem_params:
      return pl.BlockSpec(memory_space=_lowering("tpu").SMEM)
    return pl.BlockSpec(op.array.shape, lambda *grid: (0,))
  shape = op.array.shape
  whole = op.role == "inner" and not layout.grid_inner
  t = {"heads": 2, "query": 1, "keys": 2, "stats": 2, "drow": 2}[op.kind]
  size = shape[t] if whole else block

  def at(n, m):  # the block index along t
    return 0 if whole else (n if op.role == "outer" else m[0])

  def head(j):  # lax.div: jnp's // lowers through sign, which Mosaic asks a TPU about
    return j if op.groups == 1 else jax.lax.div(j, op.groups)

  if op.kind == "heads":
    return pl.BlockSpec((None, None, size, shape[3]),
                        lambda i, j, n, *m: (i, head(j), at(n, m), 0))
  if op.kind == "query":
    return pl.BlockSpec((None, size, shape[2]), lambda i, j, n, *m: (i, at(n, m), 0))
  if op.kind == "keys":
    return pl.BlockSpec((None, shape[1], size), lambda i, j, n, *m: (i, 0, at(n, m)))
  if op.kind == "stats":
    return pl.BlockSpec((None, None, size, shape[3]), lambda i, j, n, *m: (i, j, at(n, m), 0))
  return pl.BlockSpec((None, None, None, 1, shape[4]), lambda i, j, n, *m: (i, j, n, 0, 0))


def call(layout: Layout, kernel, st: Static, *, name: str, outer: int, inputs, outputs,
         scratch, interpret: bool, head_dim: int):
  """pallas_call of kernel(*inputs, *outputs, *scratch, st=st) over the grid (batch, head,
  outer block[, inner block]). inputs, outputs: Operands (an output's array a
  ShapeDtypeStruct); scratch: the carry's shapes, float32 (the grid driver's only)."""
  b, h = outputs[0].array.shape[:2]
  grid = (b, h, outer) + ((st.inner,) if layout.grid_inner else ())
  outer_block = st.block_k if name == "flash_dkv" else st.block_q
  block = lambda op: outer_block if op.role == "outer" else st.inner_block  # noqa: E731
  scratch_shapes = [_lowering("tpu").VMEM(shape, jnp.float32) for shape in scratch] \
      if layout.grid_inner else []
  return pl.pallas_call(
      functools.partial(kernel, st=st), grid=grid, name=name,
      in_specs=[_spec(layout, st, op, block(op)) for op in inputs],
      out_specs=[_spec(layout, st, op, block(op)) for op in outputs],
      out_shape=[op.array for op in outputs], scratch_shapes=scratch_shapes,
      compiler_params=layout.compiler_params(head_dim), interpret=interpret,
  )(*(op.array for op in inputs))
