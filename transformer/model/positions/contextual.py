"""Positions that depend on content (the `content_bias` seam): CoPE."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.fields import Range, check_ranges
from transformer.model.positions.base import PositionalEncoding


class CoPE(PositionalEncoding):
  """CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's
  Important"): positions that count what the query attends to, not tokens. Query i gates
  each key t by g_it = σ(logit_it), its attention logit (0 at masked keys, whose logit is
  −inf), and measures the position of key j as the gates from j to i,
  p_ij = Σ_{t=j..i} g_it, capped at max_positions − 1. The logit of (i, j) gains q_i·e[p_ij],
  with e learned for the integer positions 0..max_positions−1 and interpolated linearly
  between e[⌊p⌋] and e[⌈p⌉]; as in the paper, q_i·e[n] is computed once per integer n and
  the interpolation mixes those dot products (the same value, far less work).

  Per head, from one table E [head_dim, max_positions] that the heads share, as in the
  paper, and that the layers of the stack share, as those of T5, KERPLE and FIRE do (the
  paper has a table per layer: the seams do not say which layer calls them). E starts at
  zero, the paper's initialisation, so a new model attends as with no positions and learns
  what to count. The gates use the layer's scorer's logits (q·k/√d for scaled_dot), and
  q·e is added unscaled, as in the paper's listing (the authors' released code scales the
  sum q·k + q·e by 1/√d instead).

  Causal only: the paper defines p_ij for keys at or before the query (a decoder's); a
  bidirectional stack's keys after the query would get no position. The bias needs each
  query's whole row of logits, which only the kernels declaring content_bias have.
  Positions are capped, so no sequence is too long for it."""

  content_biases = True
  causal_only = True
  takes_positions = False  # it counts gated keys; the token positions only order them

  @dataclasses.dataclass(frozen=True)
  class Settings:
    # Positions told apart: counts 0..63 of whatever the gates count (tokens, words,
    # sentences), beyond which all share E's last row. Small, as the paper's cap is in its
    # experiments: a query rarely needs to count far, and the cap bounds the product q·E
    # [b, h, t, max_positions] every layer computes.
    max_positions: int = 64

    def __post_init__(self):
      check_ranges(self, max_positions=Range(2))

  def __init__(self, d_model, num_heads, max_len, *, causal=True, settings=None, rngs=None):
    del max_len, causal, rngs  # make_positional_encoding refuses causal=False (causal_only)
    self.max_positions = (settings or self.Settings()).max_positions
    self.table = nnx.Param(jnp.zeros((d_model // num_heads, self.max_positions), jnp.float32))

  def positions(self, logits: jax.Array) -> jax.Array:
    """p_ij = min(Σ_{t ≥ j} σ(logit_it), max_positions − 1): [b, h, tq, tk] float32. The
    sum runs over every key from j on; those after the query are masked (gate 0)."""
    gates = jax.nn.sigmoid(logits)
    return jnp.minimum(jax.lax.cumsum(gates, axis=3, reverse=True), self.max_positions - 1)

  def content_bias(self, q, logits):
    p = self.positions(logits)
    per_position = jnp.einsum("bqhd,dn->bhqn", q.astype(jnp.float32), self.table[...])
    at = lambda n: jnp.take_along_axis(per_position, n.astype(jnp.int32), axis=3)  # noqa: E731
    below = jnp.floor(p)
    above_weight = p - below  # the gradient reaches p (and the gates) through this weight
    return above_weight * at(jnp.ceil(p)) + (1.0 - above_weight) * at(below)


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"cope": CoPE}
