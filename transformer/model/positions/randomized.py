"""Randomized positions (Ruoss et al. 2023, "Randomized Positional Encodings Boost Length
Generalization of Transformers"): a sequence's positions are a sorted random sample of its
length from [0, max_position) instead of 0..length-1, so a model trained on short sequences
has seen every position an encoding can take up to max_position. Two ways of drawing them
(model.random_positions_draw, DRAWS), applied by the stack (transformer/model/stack.py):

  per_batch  as Ruoss et al.'s code does (models/transformer.py and positional_encodings.py of
             google-deepmind/randomized_positional_encodings): one draw per batch, shared by
             its rows; a fresh draw for the embedding (sinusoidal, learned) and for each
             attention layer (rotary, xPos, FIRE rotate or bias in every layer; theirs draws
             per layer for rotary, ALiBi and relative encodings); an encoding whose bias is a
             function of the offset k − q alone (`relative`: ALiBi, T5, KERPLE) is fed
             sampled offsets: a sorted sample d_1 < ... < d_{n-1} of [1, max_position) with
             d_0 = 0, the pair (i, j) at offset sign(j − i)·d_|j−i| (their noisy relative
             encodings: the bias stays a function of j − i). Rows of different lengths read
             the same permutation: a sequence of n tokens takes its first n entries, sorted,
             so each row's sample is uniform over the subsets of its length and rows of one
             length share it. A packed segment shorter than its row's longest reads the
             longest's offsets (theirs packs nothing).
  per_row    each row its own sample of positions, shared by the embedding and every
             layer; relative encodings read |p_i − p_j| of the drawn positions, which is not
             a function of j − i (the draw of runs saved without the setting).

Training draws from the step's key (resumes exactly); an evaluation call from the key its
caller sets (RandomPositions.draw_from: the evaluator's batch_key, fresh per batch) or key 0.

This module owns randomized positions: the config's check (check_random_positions), a
stack's draws (RandomPositions, which transformer/model/stack.py calls), the evaluator's
keys (batch_key) and the view of a relative encoding at sampled offsets that the kernels are
handed (AtSampledOffsets, declaring `gathered_bias`: transformer/model/kernels/capabilities.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.fields import check
from transformer.core.registry import lookup
from transformer.model import layer_pattern
from transformer.model.masks import WINDOWS, Mask
from transformer.model.positions.base import EncodingView, pair_bias


def _check(t: int, max_position: int) -> None:
  if t > max_position:
    raise ValueError(f"max_position ({max_position}) must be ≥ the row length ({t})")


def _sort_within_segments(value, positions, segments):
  """Each segment's values sorted in place (a segment: contiguous columns, positions 0..n-1
  over them); padding keeps its column. int32 [b, t], 0 on padding."""
  b, t = positions.shape
  column = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  real = segments > 0
  # Sorting each row by (the segment's first column, value) sorts within segments and keeps
  # each segment on its columns; a padding token keeps its column (a block of its own that
  # sorts after any value drawn).
  start = jnp.where(real, column - positions.astype(jnp.int32), column)
  _, ordered = jax.lax.sort((start, jnp.where(real, value, jnp.iinfo(jnp.int32).max)),
                            dimension=1, num_keys=2)
  return jnp.where(real, ordered, 0)


def sample_positions(key: jax.Array, positions: jax.Array, segments: jax.Array,
                     max_position: int) -> jax.Array:
  """per_row: each segment's positions replaced by a sorted sample without replacement of
  its length from [0, max_position), uniform over the subsets of that size.

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
  _check(t, max_position)
  permutations = jax.vmap(lambda k: jax.random.permutation(k, max_position))(
      jax.random.split(key, b))
  return _sort_within_segments(permutations[:, :t].astype(jnp.int32), positions, segments)


def batch_positions(key: jax.Array, positions: jax.Array, segments: jax.Array,
                    max_position: int) -> jax.Array:
  """per_batch: one uniform permutation π of [0, max_position) for the batch; a segment of n
  tokens takes sorted(π[:n]), its token at position p the p-th smallest. Uniform over the
  n-subsets, as Ruoss et al.'s jrandom.choice(key, arange(max_position), (n,),
  replace=False) sorted; segments of one length, in any row, get the same positions.
  Arguments and result as sample_positions'."""
  _check(positions.shape[1], max_position)
  drawn = jax.random.permutation(key, max_position)[:positions.shape[1]].astype(jnp.int32)
  return _sort_within_segments(drawn[jnp.clip(positions, 0, positions.shape[1] - 1)],
                               positions, segments)


def batch_offsets(key: jax.Array, lengths: jax.Array, size: int,
                  max_position: int) -> jax.Array:
  """per_batch's sampled distances: [b, size] int32 tables d, d[:, 0] = 0 and, in a row whose
  longest segment has n = lengths[row] tokens, d[1..n-1] = sorted(π'[:n-1]) with π' one
  uniform permutation of [1, max_position) for the batch: Ruoss et al.'s
  jrandom.choice(key, arange(1, max_position), (n - 1,), replace=False) sorted (their noisy
  relative encodings and noisy ALiBi). Entries from n on (no pair of the row reads them)
  are max_position + k."""
  _check(size, max_position)
  drawn = jax.random.permutation(key, max_position - 1)[:size - 1].astype(jnp.int32) + 1
  k = jnp.arange(1, size, dtype=jnp.int32)
  values = jnp.where(k[None] < lengths[:, None], drawn[None], max_position + k[None])
  zero = jnp.zeros((lengths.shape[0], 1), jnp.int32)
  return jnp.concatenate([zero, jnp.sort(values, axis=1)], axis=1)


def segment_lengths(positions: jax.Array, segments: jax.Array) -> jax.Array:
  """Tokens of each row's longest segment: [b] int32 (1 for a row of padding)."""
  return jnp.max(jnp.where(segments > 0, positions + 1, 1), axis=1).astype(jnp.int32)


class AtSampledOffsets(EncodingView):
  """A `relative` encoding whose bias is read at sampled offsets: the pair (i, j) of
  positions p_i, p_j (0..n-1 within the segment) at sign(p_j − p_i)·d[|p_j − p_i|], d its
  row of `table` [b or 1, size] (batch_offsets). The encoding's other seams are the
  identity (a relative encoding has no other). Not a module: made per layer and call by the
  stack. Its bias is a gather from the table, which a kernel evaluating biases in-kernel
  from positions has not (`gathered_bias`: transformer/model/kernels/capabilities.py)."""

  def __init__(self, encoding, table: jax.Array | None):
    """table None: a declaration only (what a layer asks of its kernel)."""
    super().__init__(encoding, gathered_bias=True)
    self.table = table

  def offsets(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """The sampled offsets [b, tq, tk] of positions [b, tq], [b, tk]."""
    r = k_positions[:, None, :] - q_positions[:, :, None]
    table = jnp.broadcast_to(self.table, (r.shape[0], self.table.shape[1]))
    index = jnp.minimum(jnp.abs(r), table.shape[1] - 1).reshape(r.shape[0], -1)
    d = jnp.take_along_axis(table, index, axis=1).reshape(r.shape)
    return jnp.where(r < 0, -d, d)

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """The encoding's bias at the sampled offsets: [b, h, tq, tk] (a query at 0, its key at
    the offset: the bias of a relative encoding depends on nothing else)."""
    offsets = self.offsets(q_positions, k_positions)
    return pair_bias(self.encoding.bias_spec(), jnp.zeros_like(offsets), offsets)


@dataclasses.dataclass(frozen=True)
class PerRow:
  """model.random_positions_draw=per_row (module docstring)."""

  max_position: int
  per_batch = False  # an evaluation call draws from its caller's key (draw_from)

  def declared(self, encoding):
    """What the layers' kernels will be handed, for their choice."""
    return encoding

  def slot_positions(self, key: jax.Array, positions: jax.Array) -> jax.Array:
    """Cached decoding's slots [b, max_len] (0..max_len-1): drawn as a full pass's."""
    return sample_positions(key, positions, jnp.ones_like(positions), self.max_position)

  def start(self, mask: Mask, key: jax.Array, num_layers: int, cached: bool):
    """(the call's mask, the layers' keys): the positions drawn once (cached: the slots
    were, by slot_positions)."""
    del num_layers
    if not cached:
      drawn = sample_positions(key, mask.q_positions, mask.q_segments, self.max_position)
      mask = dataclasses.replace(mask, q_positions=drawn, k_positions=drawn, padded=False)
    return mask, None

  def embed_positions(self, mask: Mask, keys, cached: bool) -> jax.Array:
    del keys, cached
    return mask.q_positions

  def layer(self, mask: Mask, encoding, key, cached: bool):
    """(the layer's mask, its encoding)."""
    del key, cached
    return mask, encoding


@dataclasses.dataclass(frozen=True)
class PerBatch(PerRow):
  """model.random_positions_draw=per_batch (module docstring)."""

  per_batch = True

  def declared(self, encoding):
    return AtSampledOffsets(encoding, None) if encoding.relative else encoding

  def slot_positions(self, key: jax.Array, positions: jax.Array) -> jax.Array:
    del key  # each layer maps the slots' positions itself (layer)
    return positions

  def start(self, mask: Mask, key: jax.Array, num_layers: int, cached: bool):
    """The mask as given; keys [num_layers + 1]: the embedding's, then each layer's."""
    del cached
    return mask, jax.random.split(key, num_layers + 1)

  def _positions(self, key, mask: Mask, cached: bool):
    """(query, key) positions drawn from `key`: cached decoding's slots (the keys are the
    cache's slots 0..S-1, one sequence of S) as a full pass of S tokens draws them."""
    if not cached:
      drawn = batch_positions(key, mask.q_positions, mask.q_segments, self.max_position)
      return drawn, drawn
    slots = mask.k_positions.shape[1]
    table = batch_positions(key, jnp.arange(slots)[None], jnp.ones((1, slots), jnp.int32),
                            self.max_position)[0]
    return table[mask.q_positions], table[mask.k_positions]

  def embed_positions(self, mask: Mask, keys, cached: bool) -> jax.Array:
    return self._positions(keys[0], mask, cached)[0]

  def layer(self, mask: Mask, encoding, key, cached: bool):
    if encoding.relative:
      if cached:
        size = mask.k_positions.shape[1]
        lengths = jnp.full((1,), size, jnp.int32)
      else:
        size = mask.q_positions.shape[1]
        lengths = segment_lengths(mask.q_positions, mask.q_segments)
      return mask, AtSampledOffsets(encoding, batch_offsets(key, lengths, size,
                                                            self.max_position))
    q, k = self._positions(key, mask, cached)
    return dataclasses.replace(mask, q_positions=q, k_positions=k, padded=False), encoding


# model.random_positions_draw's choices (module docstring).
DRAWS = {"per_batch": PerBatch, "per_row": PerRow}


def check_random_positions(cfg, encodings) -> None:
  """A FieldError unless config.model's randomized positions fit the rest of it (`cfg`, a
  ModelConfig; `encodings`, the classes its position names): some encoding reads positions,
  and no attention window spans ±window_size positions."""
  lookup(DRAWS, cfg.random_positions_draw, "model random_positions_draw")
  if cfg.random_positions:
    check(any(e.takes_positions for e in encodings), "random_positions", True,
          f"false for position {cfg.position!r}, which takes no positions")
    windows = layer_pattern.entries(cfg.attention.window)
    check(all(WINDOWS[w](1) is None for w in windows), "random_positions", True,
          f"false with attention.window={cfg.attention.window!r} (a window of "
          "±window_size positions would span sampled positions)")


def batch_key(number) -> jax.Array:
  """The key of batch `number`'s random positions in an evaluation (the evaluator's)."""
  return jax.random.fold_in(jax.random.key(0), number)


class RandomPositions(nnx.Module):
  """A stack's randomized positions: each call's draw (module docstring), from the key of
  the call's rngs (training), else from evaluation_key()."""

  def __init__(self, draw: str, max_position: int, causal: bool):
    self.draw = lookup(DRAWS, draw, "model random_positions_draw")(max_position)
    self.max_position, self.causal = max_position, causal
    self.key: jax.Array | None = nnx.data(None)  # evaluation_key's base (None: key 0)

  def draw_from(self, key: jax.Array) -> None:
    """Calls without rngs draw per_batch positions from `key` (the evaluator's batch_key)."""
    self.key = key

  def evaluation_key(self) -> jax.Array:
    """The key of deterministic calls' random positions (one per kind of stack): from the
    key set by draw_from under per_batch (key 0 if none is set), from key 0 under per_row."""
    base = self.key if self.key is not None and self.draw.per_batch else None
    return jax.random.fold_in(jax.random.key(0) if base is None else base, int(self.causal))

  def check_length(self, length: int) -> None:
    if length > self.max_position:
      raise ConfigError(
          f"sequence length {length} exceeds model.max_position={self.max_position}, the "
          "range random positions are drawn from; raise model.max_position")

  def declared(self, encoding):
    """A layer's encoding as its kernel will be handed it, for the kernel's choice."""
    return self.draw.declared(encoding)

  def slot_positions(self, positions: jax.Array) -> jax.Array:
    """Cached decoding's slots [b, max_len] (0..max_len-1), as the draw places them."""
    return self.draw.slot_positions(self.evaluation_key(), positions)

  def start(self, mask: Mask, rngs: nnx.Rngs | None, num_layers: int, cached: bool):
    """(the call's mask, its keys or None): the draw's start, from the rngs' dropout
    stream's key, or evaluation_key() without rngs."""
    key = self.evaluation_key() if rngs is None else rngs.dropout()
    return self.draw.start(mask, key, num_layers, cached)

  def embed_positions(self, mask: Mask, keys, cached: bool) -> jax.Array:
    """The positions the embedding is given."""
    return mask.q_positions if keys is None else self.draw.embed_positions(mask, keys, cached)

  def layer(self, mask: Mask, encoding, key, cached: bool):
    """(a layer's mask, its encoding) at its own draw (key: its row of start's keys)."""
    return self.draw.layer(mask, encoding, key, cached)
