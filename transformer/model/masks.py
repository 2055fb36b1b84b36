"""Which keys each query may see, and the softmax over them.

Masks are booleans [b, 1, tq, tk] (True = may attend) built from explicit segment ids and
positions, so padding, packing, causality and windows compose by `&`.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
  """[b, tq], [b, tk] segment ids (0 = padding) -> [b, 1, tq, tk]: same non-pad segment."""
  same = q_segments[:, :, None] == k_segments[:, None, :]
  real = (q_segments[:, :, None] != 0) & (k_segments[:, None, :] != 0)
  return (same & real)[:, None]


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """Keys at positions ≤ the query's: [b, 1, tq, tk]."""
  return (k_positions[:, None, :] <= q_positions[:, :, None])[:, None]


WINDOWS: dict[str, Callable[[int], int | None]] = {
    "full": lambda size: None,  # every key of the sequence (within the segment)
    "local": lambda size: size,  # keys within ±size positions
}


def local_window(q_positions, k_positions, size: int) -> jax.Array:
  """Truncated attention: keys within ±size positions of the query, [b, 1, tq, tk]."""
  offset = q_positions[:, :, None] - k_positions[:, None, :]
  return (jnp.abs(offset) <= size)[:, None]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_segments", "k_segments", "q_positions", "k_positions"],
                   meta_fields=["causal", "window", "padded"])
@dataclasses.dataclass(frozen=True)
class Mask:
  """Which keys each query may see, kept as its ingredients ([b, tq] / [b, tk] segment ids
  and positions) so a kernel can build the whole [b, 1, tq, tk] boolean or any block of it
  without the rest: the same non-pad segment, and optionally causal (key position ≤ the
  query's) and a local window (|query − key position| ≤ window).

  `padded` is declared by whoever builds the mask, never inferred from the arrays: each
  row of queries and of keys holds one sequence from slot 0 at positions 0, 1, …, followed
  by padding (segment ids 1…1 0…0), the layout of a batch that carries no segment ids
  (transformer/model/embeddings.py). cuDNN then takes the mask as sequence lengths and a
  causal flag instead of an array (kernels/cudnn_mask.py)."""

  q_segments: jax.Array
  k_segments: jax.Array
  q_positions: jax.Array
  k_positions: jax.Array
  causal: bool = False
  window: int | None = None
  padded: bool = False

  def dense(self) -> jax.Array:
    mask = segment_mask(self.q_segments, self.k_segments)
    if self.causal:
      mask &= causal_mask(self.q_positions, self.k_positions)
    if self.window is not None:
      mask &= local_window(self.q_positions, self.k_positions, self.window)
    return mask

  def block(self, q_start, q_size: int, k_start, k_size: int) -> "Mask":
    """The mask of queries q_start.. (q_size of them) against keys k_start.. (k_size)."""
    q = lambda x: jax.lax.dynamic_slice_in_dim(x, q_start, q_size, axis=1)  # noqa: E731
    k = lambda x: jax.lax.dynamic_slice_in_dim(x, k_start, k_size, axis=1)  # noqa: E731
    return dataclasses.replace(self, q_segments=q(self.q_segments), q_positions=q(self.q_positions),
                               k_segments=k(self.k_segments), k_positions=k(self.k_positions),
                               padded=False)


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis where masked entries get exactly 0 and all-masked rows are 0
  (float32). Its backward pass is the softmax's, p·(g − Σ p·g), which is already 0 where p
  is: no selects on the way back (README, Benchmarks)."""
  return _masked_softmax(logits.astype(jnp.float32), mask)


@jax.custom_vjp
def _masked_softmax(logits, mask):
  logits = jnp.where(mask, logits, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0))  # masked: exp(-inf) = 0
  total = jnp.sum(exp, axis=-1, keepdims=True)
  return exp / jnp.where(total > 0, total, 1.0)


def _masked_softmax_fwd(logits, mask):
  weights = _masked_softmax(logits, mask)
  return weights, weights


def _masked_softmax_bwd(weights, g):
  return weights * (g - jnp.sum(weights * g, axis=-1, keepdims=True)), None


_masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)
