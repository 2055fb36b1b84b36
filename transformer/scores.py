"""Attention scorers: per-head queries and keys to logits, keyed by config string.

Every scorer has one signature, `score(q [b, tq, h, d], k [b, tk, h, d]) -> [b, h, tq, tk]`,
one constructor, `(num_heads, head_dim, settings, *, rngs)` with its own `Settings`, and
declares what it is: `dot_product` is None for an arbitrary function of q and k, or a
DotProduct (scale, query transform, key transform) that the fused kernels compute
themselves instead of calling the scorer. A dot-product scorer is defined by that
declaration alone (its __call__ is the declared product and cannot be overridden), so a
kernel that reads the declaration and one that calls the scorer compute the same function.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.fields import AT_LEAST_0, POSITIVE, check_ranges
from transformer.registry import NoSettings, lookup, settings_of, settings_sections


@dataclasses.dataclass(frozen=True)
class DotProduct:
  """What a dot-product scorer is: logits = scale · queries(q) · keys(k)ᵀ per head, where
  the transforms map [b, t, h, d] to [b, t, h, d]."""

  scale: float
  queries: Callable[[jax.Array], jax.Array]
  keys: Callable[[jax.Array], jax.Array]


class Scorer(nnx.Module):
  """The scorer interface. `dot_product` None: the scorer is an arbitrary function of q and
  k, which only the kernels that call it (any_score) can compute."""

  Settings = NoSettings
  dot_product: DotProduct | None = None

  def __call__(self, q: jax.Array, k: jax.Array) -> jax.Array:
    raise NotImplementedError


class DotProductScore(Scorer):
  """scale · queries(q) · keys(k)ᵀ; the identity transforms and scale 1 unless a subclass
  changes them. Subclasses change `queries`, `keys` or `scale`, never __call__: the fused
  kernels compute the declared product without calling the scorer, so a __call__ of its
  own would make them compute another function than the other kernels, silently."""

  scale = 1.0

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
    return DotProduct(self.scale, self.queries, self.keys)

  def __call__(self, q, k):
    product = self.dot_product
    q, k = product.queries(q), product.keys(k)
    return jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(product.scale, q.dtype), k)


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


class Gaussian(Scorer):
  """−‖q − k‖² / (2σ²) per head: Nadaraya-Watson kernel regression as attention."""

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

  def __call__(self, q, k):
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    q2 = jnp.einsum("bqhd,bqhd->bhq", q, q)[..., :, None]
    k2 = jnp.einsum("bkhd,bkhd->bhk", k, k)[..., None, :]
    sq_dist = jnp.maximum(q2 + k2 - 2.0 * jnp.einsum("bqhd,bkhd->bhqk", q, k), 0.0)
    log_sigma = self.log_sigma[...]
    if not self.learn_sigma:  # fixed width: the parameter exists but never moves
      log_sigma = jax.lax.stop_gradient(log_sigma)
    inv_two_var = 0.5 * jnp.exp(-2.0 * log_sigma)[None, :, None, None]
    return -sq_dist * inv_two_var


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
