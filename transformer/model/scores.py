"""Attention scorers: per-head queries and keys to logits, keyed by config string.

Every scorer has one signature, `score(q [b, tq, h, d], k [b, tk, h, d]) -> [b, h, tq, tk]`,
one constructor, `(num_heads, head_dim, settings, *, rngs)` with its own `Settings`, and
declares what it is: `dot_product` is None for an arbitrary function of q and k, or a
DotProduct (scale, query transform, key transform, and a per-query term softmax ignores)
that the fused kernels compute themselves instead of calling the scorer. A dot-product
scorer is defined by that declaration alone (its __call__ is the declared product and
cannot be overridden), so a kernel that reads the declaration and one that calls the scorer
compute the same attention weights.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.fields import AT_LEAST_0, POSITIVE, check_ranges
from transformer.core.registry import NoSettings, lookup, settings_of, settings_sections


@dataclasses.dataclass(frozen=True)
class DotProduct:
  """What a dot-product scorer is: logits = scale · queries(q) · keys(k)ᵀ + row_term(q) per
  head. The transforms map [b, t, h, d] to [b, t, h, d'], d' the same for both and not
  necessarily d (the Gaussian's augmented vectors have d + 1). row_term(q) [b, h, tq, 1]
  (None: 0) is constant along each query's row of logits, so the attention weights never
  depend on it: the fused kernels leave it out, and only what reads the logits themselves
  (CoPE's gates, the reference and blockwise kernels calling the scorer) sees it.
  keys_per_head: keys(k) uses each query head's own parameters (the Gaussian's σ_h), so a
  kernel given fewer key heads than query heads (grouped-query attention) repeats them
  before the transform; otherwise the transform applies to the key heads as they are."""

  scale: float
  queries: Callable[[jax.Array], jax.Array]
  keys: Callable[[jax.Array], jax.Array]
  row_term: Callable[[jax.Array], jax.Array] | None = None
  keys_per_head: bool = False


class Scorer(nnx.Module):
  """The scorer interface. `dot_product` None: the scorer is an arbitrary function of q and
  k, which only the kernels that call it (any_score) can compute."""

  Settings = NoSettings
  dot_product: DotProduct | None = None

  def __call__(self, q: jax.Array, k: jax.Array) -> jax.Array:
    raise NotImplementedError


class DotProductScore(Scorer):
  """scale · queries(q) · keys(k)ᵀ; the identity transforms and scale 1 unless a subclass
  changes them. Subclasses change `queries`, `keys`, `scale` or `row_term` (None: no term),
  never __call__: the fused
  kernels compute the declared product without calling the scorer, so a __call__ of its
  own would make them compute another function than the other kernels, silently."""

  scale = 1.0
  row_term = None
  keys_per_head = False  # keys() uses per-head parameters (DotProduct.keys_per_head)

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "__call__" in vars(cls):
      raise TypeError(
          f"{cls.__name__} overrides __call__ of a dot-product scorer, which the fused kernels "
          "never call: change its queries/keys transforms or scale instead, or derive it from "
          "Scorer (dot_product None) if its score is not a dot product")

  def queries(self, q: jax.Array) -> jax.Array:
    return q

  def keys(self, k: jax.Array) -> jax.Array:
    return k

  @property
  def dot_product(self) -> DotProduct:
    return DotProduct(self.scale, self.queries, self.keys, self.row_term, self.keys_per_head)

  def __call__(self, q, k):
    product = self.dot_product
    qt, kt = product.queries(q), product.keys(k)
    logits = jnp.einsum("bqhd,bkhd->bhqk", qt * jnp.asarray(product.scale, qt.dtype), kt)
    return logits if product.row_term is None else logits + product.row_term(q)


class ScaledDot(DotProductScore):
  """q·k / √d_k ("Attention Is All You Need", eq. 1)."""

  def __init__(self, num_heads: int, head_dim: int, settings=None, *, rngs: nnx.Rngs | None = None):
    self.scale = 1.0 / math.sqrt(head_dim)


class Dot(DotProductScore):
  """Unscaled q·k (Luong et al. 2015)."""

  def __init__(self, num_heads, head_dim, settings=None, *, rngs=None):
    self.scale = 1.0


def unit(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / ‖x‖ over the last axis, in float32 (0 stays 0)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


class Cosine(DotProductScore):
  """τ_h · cos(q, k): unit queries and keys and a learned temperature τ_h per head (query-key
  normalisation, Henry et al. 2020; Swin Transformer v2's scaled cosine attention). As a
  dot product: scale 1, queries τ_h · q/‖q‖, keys k/‖k‖. τ is learned as log τ."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    init_temperature: float = 10.0  # τ of every head at initialisation (Swin v2's)

    def __post_init__(self):
      check_ranges(self, init_temperature=POSITIVE)

  def __init__(self, num_heads, head_dim, settings=None, *, rngs=None):
    settings = settings or self.Settings()
    self.log_temperature = nnx.Param(
        jnp.full((num_heads,), math.log(settings.init_temperature), jnp.float32))

  def queries(self, q):
    temperature = jnp.exp(self.log_temperature[...])[:, None]  # [h, 1]
    return (unit(q) * temperature).astype(q.dtype)

  def keys(self, k):
    return unit(k).astype(k.dtype)


class Additive(Scorer):
  """w_vᵀ tanh(W_q q + W_k k) per head (Bahdanau et al. 2015)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    # hidden size a of the scorer per head; 0 = head_dim
    dim: int = dataclasses.field(default=0, metadata={"moved_from": "model.attention.additive_dim"})

    def __post_init__(self):
      check_ranges(self, dim=AT_LEAST_0)

  def __init__(self, num_heads, head_dim, settings=None, *, rngs):
    a = (settings or self.Settings()).dim or head_dim
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.w_q = nnx.Param(init(rngs.params(), (num_heads, head_dim, a)))
    self.w_k = nnx.Param(init(rngs.params(), (num_heads, head_dim, a)))
    self.w_v = nnx.Param(nnx.initializers.normal(a ** -0.5)(rngs.params(), (num_heads, a)))

  def __call__(self, q, k):
    qa = jnp.einsum("bqhd,hda->bhqa", q, self.w_q[...].astype(q.dtype))
    ka = jnp.einsum("bkhd,hda->bhka", k, self.w_k[...].astype(k.dtype))
    hidden = jnp.tanh(qa[:, :, :, None, :] + ka[:, :, None, :, :])  # [b, h, q, k, a]
    return jnp.einsum("bhqka,ha->bhqk", hidden, self.w_v[...].astype(q.dtype))


class Gaussian(DotProductScore):
  """−‖q − k‖² / (2σ_h²) per head: Nadaraya-Watson kernel regression as attention.

  As a dot product of augmented vectors, so that every dot-product kernel runs it:
  −‖q − k‖²/2σ² = [q/σ², 1]·[k, −‖k‖²/2σ²] − ‖q‖²/2σ², and the last term, the same for every
  key of a query's row, is the declared row_term (softmax ignores it; the logits keep it).
  The expanded form subtracts ‖k‖²/2σ² from q·k/σ², so a rounding of ‖k‖²/2σ² errs in
  proportion to ‖k‖², not to the distance: the key's column is split in two, a bfloat16
  part and the float32 rest, [q/σ², 1, 1]·[k, hi, lo], so that a kernel computing in bf16
  rounds it to ~16 bits instead of 8 (in bf16 the fused kernels are then as close to the
  f32 formula as the reference kernel, which rounds only q and k; tests/test_gaussian_dot).
  The transforms work in float32; the fused kernels cast them to the compute dtype."""

  keys_per_head = True  # σ_h in the keys' augmented column

  @dataclasses.dataclass(frozen=True)
  class Settings:
    # initial kernel width; 0 = head_dim ** 0.25 (matches √d scaling)
    sigma: float = dataclasses.field(default=0.0,
                                     metadata={"moved_from": "model.attention.gaussian_sigma"})
    # the width learned per head, or fixed
    learn_sigma: bool = dataclasses.field(default=True,
                                          metadata={"moved_from": "model.attention.learn_sigma"})

    def __post_init__(self):
      check_ranges(self, sigma=AT_LEAST_0)

  def __init__(self, num_heads, head_dim, settings=None, *, rngs=None):
    settings = settings or self.Settings()
    sigma = settings.sigma or head_dim ** 0.25
    self.learn_sigma = settings.learn_sigma
    self.log_sigma = nnx.Param(jnp.full((num_heads,), math.log(sigma), jnp.float32))

  def inverse_variance(self) -> jax.Array:
    """1/σ_h² per head, [h, 1]; a fixed width's parameter exists but never moves."""
    log_sigma = self.log_sigma[...]
    if not self.learn_sigma:
      log_sigma = jax.lax.stop_gradient(log_sigma)
    return jnp.exp(-2.0 * log_sigma)[:, None]

  def queries(self, q):  # [q/σ², 1, 1]: [b, t, h, d + 2] float32
    q = q.astype(jnp.float32)
    return jnp.concatenate([q * self.inverse_variance(), jnp.ones_like(q[..., :2])], axis=-1)

  def keys(self, k):  # [k, hi, lo], hi + lo = −‖k‖²/2σ², hi a bfloat16: [b, t, h, d + 2] float32
    k = k.astype(jnp.float32)
    column = -0.5 * jnp.sum(k * k, axis=-1, keepdims=True) * self.inverse_variance()
    hi = column.astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([k, hi, column - hi], axis=-1)

  def row_term(self, q):  # −‖q‖²/2σ²: [b, h, tq, 1]
    q = q.astype(jnp.float32)
    half_sq = -0.5 * jnp.sum(q * q, axis=-1) * self.inverse_variance()[:, 0]  # [b, t, h]
    return jnp.transpose(half_sq, (0, 2, 1))[..., None]


SCORES: dict[str, type[Scorer]] = {
    "scaled_dot": ScaledDot,
    "dot": Dot,
    "additive": Additive,
    "gaussian": Gaussian,
    "cosine": Cosine,
}

# config.model.attention.score_settings: a section per scorer with settings.
ScoreSettings = settings_sections(SCORES, "ScoreSettings")


def make_score(name: str, num_heads: int, head_dim: int, settings=None, *,
               rngs: nnx.Rngs) -> Scorer:
  """The scorer `name` with its section of `settings` (a ScoreSettings; None: defaults)."""
  cls = lookup(SCORES, name, "attention score")
  return cls(num_heads, head_dim, settings_of(settings, SCORES, name), rngs=rngs)
