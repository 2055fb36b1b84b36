"""The positional-encoding interface (transformer/model/positions/__init__.py): the identity at
every seam."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import NoSettings


@dataclasses.dataclass(frozen=True)
class BiasSpec:
  """A positional logit bias as a function a kernel evaluates on any block of (query, key)
  positions, one head at a time, without the whole [tq, tk] array.

  fn(params, q_positions [m, 1] or [m, n], k_positions [1, n] or [m, n]) -> float32 [m, n],
  `params` one head's slice of `params` ({name: float32 [num_heads, size]}, read as
  params[name][u] with static u). fn uses elementwise operations and static loops only (no
  gather, matmul, slicing or custom_jvp), so that it and its vjp lower inside a Pallas
  kernel on every backend. dense(params, q_positions, k_positions) -> [b, h, tq, tk], if
  given, is the same bias over whole arrays (gathers and matmuls allowed; tests check that
  the two agree); None: fn mapped over heads and rows. learned: the params carry gradients
  a kernel must compute. `saturates_at`:
  the bias is a function of k − q alone, constant for k − q ≤ −saturates_at and for
  k − q ≥ saturates_at (T5's buckets beyond max_distance), so a kernel may read it from a
  table of 2·saturates_at + 1 entries per head; None: no such promise. `grad`:
  grad(params, q_positions, k_positions, dbias [m, n]) -> {name: tuple of scalars}, the vjp
  of fn at dbias in closed form (sums over the block), for a kernel to take in place of
  jax.vjp of fn; under the same rules as fn; None: the vjp. `mlp_input`: fn is
  b2 + Σ_u w2[u]·relu(w1[u]·x + b1[u]) (relu′(0) = 0) of one scalar per pair,
  x = mlp_input(params, q_positions, k_positions) [m, n], the MLP's parameters params
  "w1", "b1", "w2" (width each) and "b2" (1), the input's the others, so a kernel may read
  fn as a piecewise-linear function of x (kernels/pallas/piecewise.py); None: no such
  promise."""

  fn: Callable[[dict, jax.Array, jax.Array], jax.Array]
  params: dict[str, Any]
  learned: bool = True
  dense: Callable[[dict, jax.Array, jax.Array], jax.Array] | None = None
  saturates_at: int | None = None
  grad: Callable[[dict, jax.Array, jax.Array, jax.Array], dict] | None = None
  mlp_input: Callable[[dict, jax.Array, jax.Array], jax.Array] | None = None


def spec_bias(spec: BiasSpec, q_positions: jax.Array, k_positions: jax.Array, *,
              blockwise: bool = False) -> jax.Array:
  """The bias of `spec` over whole arrays: q [b, tq], k [b, tk] positions -> [b, h, tq, tk];
  by spec.dense where given, unless `blockwise`: then always by spec.fn (the kernels' form)."""
  return pair_bias(spec, q_positions[:, :, None], k_positions[:, None, :], blockwise=blockwise)


def pair_bias(spec: BiasSpec, q_positions: jax.Array, k_positions: jax.Array, *,
              blockwise: bool = False) -> jax.Array:
  """spec_bias for positions given pair by pair: q, k broadcastable to [b, tq, tk] (e.g. a
  query position 0 and each pair's sampled offset as the key's) -> [b, h, tq, tk]."""
  if spec.dense is not None and not blockwise:
    return spec.dense(spec.params, q_positions, k_positions)
  per_head = jax.vmap(spec.fn, in_axes=(0, None, None))
  return jax.vmap(per_head, in_axes=(None, 0, 0))(spec.params, q_positions, k_positions)


class PositionalEncoding(nnx.Module):
  """No positional information: the identity at every seam."""

  Settings = NoSettings
  name = "none"  # its config name (make_positional_encoding sets it), for error lines
  biases = False  # bias() is not zero: the attention kernel must add it
  learned_bias = False  # bias() has parameters: the kernel must give their gradient
  content_biases = False  # content_bias() is not zero: only a kernel declaring content_bias adds it
  causal_only = False  # defined only for causal self-attention: no encoder stack may use it
  takes_positions = True  # its seams read the positions (model.random_positions may sample them)
  # embed() is not the identity: it adds to the embeddings, once per stack, before the
  # layers, so it cannot vary per layer (no layer-wise pattern may name it)
  embeds = False
  # bias() is a function of the offset k − q alone (and no other seam reads positions):
  # randomized positions drawn per batch feed it sampled offsets (positions/randomized.py)
  relative = False
  # bias() reads a table at each pair (sampled offsets): a kernel evaluating bias_spec()
  # in-kernel has no gather
  gathered_bias = False

  def for_layer(self, layer: int) -> "PositionalEncoding":
    """The encoding whose seams layer `layer` of the stack calls: this one, in every layer
    (a layer-wise pattern, positions.PositionPattern, gives each layer its entry's)."""
    del layer
    return self

  def embed(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [b, t, d_model], positions: [b, t] -> [b, t, d_model]."""
    del positions
    return x

  def rotate_queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def rotate_keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Keys x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def rotated_dims(self, head_dim: int) -> int | None:
    """How many leading dimensions of a head of head_dim rotate_queries and rotate_keys
    turn among themselves, passing the rest through: 0 where they are the identity; None
    where what they turn is not such a block (multi-head latent attention needs it)."""
    del head_dim
    return 0 if type(self).rotate_keys is PositionalEncoding.rotate_keys else None

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""

  def bias_spec(self) -> BiasSpec | None:
    """The logit bias as a BiasSpec (an encoding that biases defines it), or None: no bias."""
    return None

  def bias_vectors(self) -> tuple[jax.Array, jax.Array] | None:
    """A data-dependent logit bias u_i − w_j beside bias_spec()'s, as its two vectors
    (u [b, tq, h] at the queries, w [b, tk, h] at the keys), or None: none. Only views of
    transformer/model/data_biases.py give one, to kernels offering `data_bias`."""
    return None

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """-> a logit bias broadcastable to [b, h, tq, tk]: bias_spec() over the whole arrays."""
    spec = self.bias_spec()
    if spec is None:
      return jnp.zeros((), jnp.float32)
    return spec_bias(spec, q_positions, k_positions)

  def content_bias(self, q: jax.Array, logits: jax.Array) -> jax.Array:
    """A logit bias that depends on content, added after bias().

    Args:
      q: the per-head queries as the scorer saw them (rotated), [b, tq, h, d].
      logits: the scorer's logits plus bias(), float32 [b, h, tq, tk], −inf at masked keys.
    Returns:
      a logit bias broadcastable to [b, h, tq, tk].
    """
    del q, logits
    return jnp.zeros((), jnp.float32)


class NoPosition(PositionalEncoding):
  """`none`: the identity encoding, built like every registry entry."""

  takes_positions = False

  def __init__(self, d_model: int, num_heads: int, max_len: int, *, causal: bool = False,
               settings=None, rngs: nnx.Rngs | None = None):
    del d_model, num_heads, max_len, causal, settings, rngs


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"none": NoPosition}


class EncodingView:
  """An encoding seen with another bias seam: its declarations and every other seam are
  the wrapped encoding's, except those given as `changed` (e.g. gathered_bias=True). Not a
  module: made per layer or call. A subclass defines bias(); a view's bias is computed
  whole, so it has no BiasSpec."""

  DECLARED = ("name", "biases", "learned_bias", "content_biases", "causal_only",
              "takes_positions", "relative", "gathered_bias", "embeds")

  def __init__(self, encoding, **changed):
    self.encoding = encoding
    for name in self.DECLARED:
      setattr(self, name, changed.get(name, getattr(encoding, name)))

  def bias_spec(self):
    return None

  def bias_vectors(self):
    return self.encoding.bias_vectors()

  def embed(self, x, positions):
    return self.encoding.embed(x, positions)

  def rotate_queries(self, x, positions):
    return self.encoding.rotate_queries(x, positions)

  def rotate_keys(self, x, positions):
    return self.encoding.rotate_keys(x, positions)

  def rotated_dims(self, head_dim):
    return self.encoding.rotated_dims(head_dim)

  def content_bias(self, q, logits):
    return self.encoding.content_bias(q, logits)
