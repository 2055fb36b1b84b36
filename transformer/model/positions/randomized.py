"""Randomized positions (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
Generalization of Transformers"): each sequence's positions are a sorted random sample of
its length from [0, max_position) instead of 0..length-1, so a model trained on short
sequences has seen every position an encoding can take up to max_position.

The sample replaces the consecutive positions wherever a stack reads them (the encoding's
seams and its masks, whose causal order a sorted sample keeps); it is drawn once per stack
call (transformer/model/blocks.py, Stack).
"""

import jax
import jax.numpy as jnp


def sample_positions(key: jax.Array, positions: jax.Array, segments: jax.Array,
                     max_position: int) -> jax.Array:
  """Each segment's positions replaced by a sorted sample without replacement of its length
  from [0, max_position), uniform over the subsets of that size.

  Each row draws one uniform random permutation of [0, max_position); the segment whose
  tokens occupy columns a..a+n-1 takes the permutation's entries a..a+n-1 (any n distinct
  entries of a uniform permutation are a uniform n-subset), sorted. Segments of one row so
  get disjoint samples, and every segment the distribution of a lone sequence.

  Args:
    key: a PRNG key; the same key gives the same positions.
    positions: int [b, t], 0..n-1 over each segment's n contiguous tokens (packing's layout).
    segments: int [b, t], 0 on padding.
    max_position: ≥ t (else a ValueError): positions are drawn from [0, max_position).
  Returns:
    int32 [b, t]: strictly increasing within each segment; 0 on padding.
  """
  b, t = positions.shape
  if t > max_position:
    raise ValueError(f"max_position ({max_position}) must be ≥ the row length ({t})")
  permutations = jax.vmap(lambda k: jax.random.permutation(k, max_position))(
      jax.random.split(key, b))
  drawn = permutations[:, :t].astype(jnp.int32)  # [b, t]
  column = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  real = segments > 0
  # Sorting each row by (the segment's first column, drawn value) sorts within segments and
  # keeps each segment on its columns; a padding token keeps its column (a block of its own
  # that sorts after any value drawn).
  start = jnp.where(real, column - positions.astype(jnp.int32), column)
  value = jnp.where(real, drawn, max_position)
  _, ordered = jax.lax.sort((start, value), dimension=1, num_keys=2)
  return jnp.where(real, ordered, 0)
