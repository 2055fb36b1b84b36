"""Pooling an encoder's outputs per packed segment (`model.pooling`): none (a label per
token), cls (the segment's first token), mean (over its real tokens)."""


import jax
import jax.numpy as jnp


def pool_segments(x: jax.Array, segments: jax.Array, positions: jax.Array,
                  pooling: str) -> jax.Array:
  """Each token's vector replaced by its segment's pooled vector: x [b, t, d] ->
  [b, t, d]. "cls": the segment's first token (position 0); "mean": the mean over its real
  tokens; "none": x itself. Pooling per segment keeps packed rows apart."""
  if pooling == "none":
    return x
  b, t, d = x.shape
  take = (segments > 0) & ((positions == 0) if pooling == "cls" else True)
  ids = (jnp.arange(b)[:, None] * (t + 1) + segments).reshape(-1)  # segment ids are ≤ t
  w = take.reshape(-1).astype(jnp.float32)
  flat = x.reshape(-1, d).astype(jnp.float32) * w[:, None]
  sums = jax.ops.segment_sum(flat, ids, num_segments=b * (t + 1))
  counts = jax.ops.segment_sum(w, ids, num_segments=b * (t + 1))
  return (sums / jnp.maximum(counts, 1)[:, None])[ids].reshape(b, t, d).astype(x.dtype)

POOLINGS = {"none": "none", "cls": "cls", "mean": "mean"}
