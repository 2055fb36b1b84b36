"""Which blocks of (query, key) pairs the flash kernels visit, decided in XLA before them.

For each row and query block, the key blocks in which every pair is visible ("full": the
kernel adds them unmasked) and those in which some but not all are ("partial": masked);
the rest are never visited. The transposed lists (for each key block, its query blocks)
drive the dk/dv pass. As FlexAttention's BlockMask (kv_num_blocks, kv_indices and their
"full" counterparts) and splash attention's mask info, but computed per batch from the
mask's ingredients (segment ids, positions, causal, window), never from an [L, L] array.

Exact, not conservative, wherever a row's keys are sorted by (segment, position) with the
padding (segment 0) last, as packed, padded, randomized-position and causal rows are: each
query's visible keys are then one interval [lo, hi) of array indices, found by a binary
search on (segment, position), and a block is visited iff some query's interval meets it,
full iff every query's interval covers it. A row whose keys are not so sorted falls back
to visiting every block of it masked (the kernels' masks keep the result exact either way).
Cost: O(b · t · (log t + blocks)) integer operations, against the kernels' O(b · h · t² · d).
"""

import jax
import jax.numpy as jnp

EMPTY, PARTIAL, FULL = 0, 1, 2
_PAD_SEGMENT = jnp.iinfo(jnp.int32).max  # padding keys sort after every segment
_LOWEST, _HIGHEST = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max


def _search(k_seg, k_pos, seg, pos, upper: bool):
  """The number of keys before (seg, pos) in each row's sorted keys: keys < (seg, pos), or
  ≤ when `upper`. k_seg, k_pos [b, tk] sorted; seg, pos [b, tq] -> int32 [b, tq]."""
  b, tk = k_seg.shape
  lo = jnp.zeros(seg.shape, jnp.int32)
  hi = jnp.full(seg.shape, tk, jnp.int32)
  for _ in range(max(tk, 1).bit_length()):
    mid = (lo + hi) // 2
    at = jnp.minimum(mid, tk - 1)
    ks, kp = (jnp.take_along_axis(x, at, axis=1) for x in (k_seg, k_pos))
    before = (ks < seg) | ((ks == seg) & ((kp <= pos) if upper else (kp < pos)))
    before &= mid < hi
    lo, hi = jnp.where(before, mid + 1, lo), jnp.where(before, hi, mid)
  return lo


def key_intervals(q_segments, k_segments, q_positions, k_positions, *, causal: bool,
                  window: int | None):
  """Each query's visible keys as array indices [lo, hi), exact where its row's keys are
  sorted by (segment, position), padding last; and which rows are. q_* [b, tq], k_* [b, tk]
  int -> (lo, hi) int32 [b, tq] (empty for padding queries), sorted bool [b]."""
  k_seg = jnp.where(k_segments == 0, _PAD_SEGMENT, k_segments).astype(jnp.int32)
  k_pos = jnp.where(k_segments == 0, 0, k_positions).astype(jnp.int32)
  steps = (k_seg[:, 1:] > k_seg[:, :-1]) | (
      (k_seg[:, 1:] == k_seg[:, :-1]) & (k_pos[:, 1:] >= k_pos[:, :-1]))
  sorted_rows = jnp.all(steps, axis=1)
  seg, pos = q_segments.astype(jnp.int32), q_positions.astype(jnp.int32)
  first = pos - window if window is not None else jnp.full_like(pos, _LOWEST)
  last = pos if causal else (pos + window if window is not None else jnp.full_like(pos, _HIGHEST))
  lo = _search(k_seg, k_pos, seg, first, upper=False)
  hi = _search(k_seg, k_pos, seg, last, upper=True)
  hi = jnp.where(seg == 0, lo, jnp.maximum(hi, lo))
  return lo, hi, sorted_rows


def classify(q_segments, k_segments, q_positions, k_positions, *, causal: bool,
             window: int | None, block_q: int, block_k: int, lq: int, lk: int):
  """Each (row, query block, key block): EMPTY, PARTIAL or FULL, int32 [b, lq/block_q,
  lk/block_k], for lengths zero-padded to lq, lk (padding is segment 0)."""
  pad = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1])])  # noqa: E731
  lo, hi, sorted_rows = key_intervals(
      pad(q_segments, lq), pad(k_segments, lk), pad(q_positions, lq), pad(k_positions, lk),
      causal=causal, window=window)
  starts = jnp.arange(0, lk, block_k, dtype=jnp.int32)
  ends = starts + block_k
  lo, hi = lo[..., None], hi[..., None]  # [b, lq, 1] against the key blocks [nk]
  meets = (lo < ends) & (hi > starts) & (lo < hi)
  covers = (lo <= starts) & (hi >= ends)
  b, nq, nk = lo.shape[0], lq // block_q, lk // block_k
  meets = meets.reshape(b, nq, block_q, nk).any(2)
  covers = covers.reshape(b, nq, block_q, nk).all(2)
  kind = jnp.where(covers, FULL, jnp.where(meets, PARTIAL, EMPTY))
  return jnp.where(sorted_rows[:, None, None], kind, PARTIAL).astype(jnp.int32)


def visit_lists(kind, width: int):
  """Per (row, outer block), the inner blocks to visit: int32 [b, n, width] holding
  [number partial, number visited, the partial blocks' indices, then the full ones'], the
  rest repeating the last visited index (0 if none), so that a pipeline asked for them
  copies nothing new. kind [b, n, m] (classify's, or its transpose); width ≥ m + 2."""
  m = kind.shape[-1]
  rank = jnp.where(kind == PARTIAL, 0, jnp.where(kind == FULL, 1, 2)) * m + jnp.arange(m)
  order = jnp.argsort(rank, axis=-1).astype(jnp.int32)
  partial = jnp.sum(kind == PARTIAL, -1, dtype=jnp.int32)
  visited = partial + jnp.sum(kind == FULL, -1, dtype=jnp.int32)
  last = jnp.take_along_axis(order, jnp.maximum(visited - 1, 0)[..., None], axis=-1)
  order = jnp.where(jnp.arange(m) < visited[..., None], order, last)
  fill = jnp.broadcast_to(last, (*order.shape[:-1], width - m - 2))
  return jnp.concatenate([partial[..., None], visited[..., None], order, fill], -1)
