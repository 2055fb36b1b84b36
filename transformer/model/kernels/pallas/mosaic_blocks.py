"""The 64-row blocks the Mosaic GPU (Hopper) kernels share (mosaic_gpu.py's forward,
mosaic_gpu_backward.py's dk/dv and dq kernels): the block size, the transforms of a wgmma
tile in shared memory, the visit lists as their copies take them, copies from global to
shared memory on barriers, shared-memory rows loaded in a wgmma row or column layout, and
the visibility tile of a block from its queries' and keys' segment and position rows.
Mosaic GPU's interpret mode has no register layouts: there a row is read plainly."""

from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from transformer.model.kernels.pallas import sparsity
from transformer.model.kernels.pallas.layouts import round_up

BLOCK = 64  # queries or keys per block: a warpgroup's wgmma rows
# A wgmma operand read from shared memory: tiled by (8, 64) and swizzled by 128 bytes (the
# lowering refuses one without; the interpreter does not check)
TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def visit_lists(kind):
  """sparsity.visit_lists of a block classification [b, n, m], each list of m + 2 entries
  padded to a multiple of BLOCK (a copy moves a multiple of 128 bytes): int32
  [b, n, width]."""
  return sparsity.visit_lists(kind, round_up(kind.shape[-1] + 2, BLOCK))


def interpret_params():
  """The parameters of Mosaic GPU's interpret mode (its defaults)."""
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def load(ref, layout, interpret):
  """A 1-D shared-memory vector in a wgmma row/column layout."""
  return ref[...] if interpret else plgpu.load(ref, (), layout=layout)


def cast(interpret, x, layout):
  """x in a register layout (interpret mode has none)."""
  return x if interpret else plgpu.layout_cast(x, layout)


def copy_in(pairs, barriers, first):
  """Copies each (GMEM ref, SMEM ref) pair on its own barrier from barriers[first] on and
  waits for all of them."""
  for i, (src, dst) in enumerate(pairs):
    plgpu.copy_gmem_to_smem(src, dst, barriers.at[first + i])
  for i in range(len(pairs)):
    plgpu.barrier_wait(barriers.at[first + i])


def visible(q_seg, q_pos, k_seg, k_pos, *, causal, window, query_axis):
  """Which (query, key) pairs of a tile are visible, bool [64, 64]: the rows of 64 queries'
  and keys' segment ids and positions laid along their axes (the queries along query_axis):
  the same non-padding segment, the key not after the query (causal), and within window
  positions of it on each side."""
  shape, key_axis = (BLOCK, BLOCK), 1 - query_axis
  qs, qp = (lax.broadcast_in_dim(a, shape, [query_axis]) for a in (q_seg, q_pos))
  ks, kp = (lax.broadcast_in_dim(a, shape, [key_axis]) for a in (k_seg, k_pos))
  keep = (qs == ks) & (ks != 0)
  if causal:
    keep &= kp <= qp
  if window is not None:
    keep &= (qp - kp <= window) & (kp - qp <= window)
  return keep
