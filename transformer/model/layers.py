"""Building blocks shared by the attention and the model."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.random import threefry2x32_p


def mesh_axes(*axes: str | None) -> dict:
  """NNX metadata declaring a parameter's sharding: the mesh axis that splits each of its
  dimensions (None: not split; no declaration: replicated), read by
  sharding.param_specs. Only declared: not applied at creation, so no mesh is needed then
  and the values are the same as without it."""
  return {"out_sharding": axes, "eager_sharding": False}


class Dense(nnx.Linear):
  """nnx.Linear over the last axis, computed as one 2-D matmul of the flattened leading
  axes. Same parameters (`kernel`, `bias`) and result; XLA:CPU runs [b·t, d] matmuls and
  their weight-gradient dots without the copies it inserts for [b, t, d] (README, Benchmarks).

  kernel_axes, bias_axes: the mesh axes of the kernel [in, out] and bias [out] (mesh_axes);
  None: replicated."""

  def __init__(self, in_features: int, out_features: int, *,
               kernel_axes: tuple[str | None, str | None] | None = None,
               bias_axes: tuple[str | None] | None = None, **kwargs):
    super().__init__(in_features, out_features,
                     kernel_metadata=mesh_axes(*kernel_axes) if kernel_axes else {},
                     bias_metadata=mesh_axes(*bias_axes) if bias_axes else {}, **kwargs)

  def __call__(self, x: jax.Array) -> jax.Array:
    lead = x.shape[:-1]
    return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)


def project(x: jax.Array, *layers: Dense, groups: int = 1) -> list[jax.Array]:
  """[layer(x) for layer in layers] for bias-free Dense layers of one input size and dtype,
  as a single matmul against their kernels side by side: Q, K and V as one [b·t, d] × [d, 3e]
  product, which XLA:CPU runs faster than three narrow ones (README, Benchmarks). The
  parameters stay separate. The columns are interleaved in `groups` blocks (the attention
  heads: head 0 of Q, K, V, then head 1, ...; with grouped-query attention a kv head's group:
  its queries' columns, then its key's and its value's), so a kernel split over its output
  features (tensor parallelism) stays aligned with its devices. Each layer's output width
  must be a multiple of `groups`."""
  if len(layers) == 1:
    return [layers[0](x)]
  d = layers[0].in_features
  widths = [layer.out_features // groups for layer in layers]  # per group
  if len(set(widths)) == 1:  # multi-head Q, K, V; a gated FFN's W, V: stacked, as measured
    w = widths[0]
    kernel = jnp.stack([layer.kernel[...].reshape(d, groups, w) for layer in layers],
                       axis=2).reshape(d, -1)  # [d, groups, n, w]
    flat, kernel = layers[0].promote_dtype((x.reshape(-1, d), kernel), dtype=layers[0].dtype)
    y = (flat @ kernel).reshape(-1, groups, len(layers), w)
    return [y[:, :, i].reshape(*x.shape[:-1], groups * w) for i in range(len(layers))]
  kernel = jnp.concatenate([layer.kernel[...].reshape(d, groups, w)
                            for layer, w in zip(layers, widths)], axis=2).reshape(d, -1)
  flat, kernel = layers[0].promote_dtype((x.reshape(-1, d), kernel), dtype=layers[0].dtype)
  y = (flat @ kernel).reshape(-1, groups, sum(widths))  # [b·t, groups, Σ widths]
  starts = [sum(widths[:i]) for i in range(len(widths))]
  return [y[:, :, s:s + w].reshape(*x.shape[:-1], groups * w) for s, w in zip(starts, widths)]


@jax.custom_vjp
def _masked_scale(x, keep, scale):
  return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


def _masked_scale_fwd(x, keep, scale):
  return _masked_scale(x, keep, scale), (keep, scale)


def _masked_scale_bwd(residuals, g):
  keep, scale = residuals
  return _masked_scale(g, keep, scale), None, None


_masked_scale.defvjp(_masked_scale_fwd, _masked_scale_bwd)


class Dropout(nnx.Dropout):
  """Inverted dropout that draws 16 random bits per element where nnx.Dropout draws a
  32-bit uniform float: an element is kept where its bits are ≥ round(rate · 2¹⁶), so the
  drop probability is `rate` to within 2⁻¹⁷, and kept elements are scaled by the exact
  inverse of that keep probability, so the expectation is unchanged. One threefry-2x32
  call (counter = the index of a group of four elements) gives 64 bits, the bits of four
  elements, where jax.random.bernoulli spends one call per element; and the backward pass
  reuses the boolean mask instead of recomputing it from saved random words (nnx.Dropout
  is slower: README, Benchmarks)."""

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    if deterministic or self.rate == 0.0:
      return inputs
    threshold = round(self.rate * 2 ** 16)
    *lead, n = inputs.shape
    groups = (*lead, (n + 3) // 4)  # fewer than 2³² groups: the counter's high word is 0
    counter = jax.lax.iota(jnp.uint32, math.prod(groups)).reshape(groups)
    key = jax.random.key_data(rngs[self.rng_collection]())
    high, low = threefry2x32_p.bind(key[0], key[1], jnp.zeros_like(counter), counter)
    bits = jnp.stack([high & 0xFFFF, high >> 16, low & 0xFFFF, low >> 16], axis=-2)
    keep = bits.reshape(*lead, -1)[..., :n] >= threshold
    scale = 2 ** 16 / (2 ** 16 - threshold) if threshold < 2 ** 16 else 0.0
    return _masked_scale(inputs, keep, jnp.asarray(scale, inputs.dtype))


class LayerNorm(nnx.LayerNorm):
  """nnx.LayerNorm (same `scale` and `bias` parameters, statistics in float32) with a
  hand-written backward pass whose row sums Σ_j dy_j·γ_j and Σ_j dy_j·γ_j·x̂_j are
  matrix-vector products with γ, where XLA:CPU would otherwise materialise γ broadcast to
  the activations' shape for every reduction (README, Benchmarks)."""

  def __call__(self, x: jax.Array) -> jax.Array:
    y = _layer_norm(x.astype(jnp.float32), self.scale[...].astype(jnp.float32),
                    self.bias[...].astype(jnp.float32), self.epsilon)
    return y.astype(self.dtype or x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, epsilon):
  return _layer_norm_fwd(x, scale, bias, epsilon)[0]


def _layer_norm_fwd(x, scale, bias, epsilon):
  centred = x - jnp.mean(x, axis=-1, keepdims=True)
  inv_std = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
  normed = centred * inv_std
  return normed * scale + bias, (normed, inv_std, scale)


def _layer_norm_bwd(epsilon, residuals, dy):
  """dx = (γ·dy − mean(γ·dy) − x̂·mean(γ·dy·x̂)) / σ, dγ = Σ dy·x̂, dβ = Σ dy."""
  del epsilon
  normed, inv_std, scale = residuals
  d = normed.shape[-1]
  dy_rows, dy_normed = dy.reshape(-1, d), (dy * normed).reshape(-1, d)
  mean_g = (dy_rows @ scale).reshape(*dy.shape[:-1], 1) / d
  mean_gx = (dy_normed @ scale).reshape(*dy.shape[:-1], 1) / d
  dx = inv_std * (dy * scale - mean_g - normed * mean_gx)
  return dx, jnp.sum(dy_normed, axis=0), jnp.sum(dy_rows, axis=0)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class RMSNorm(nnx.RMSNorm):
  """x / √(mean(x²) + ε) · g (Zhang & Sennrich 2019): LayerNorm without the centring and the
  bias; one `scale` parameter, statistics in float32 as LayerNorm's. Plain jnp: a
  hand-written backward like LayerNorm's measured no faster on XLA:CPU."""

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    y = x32 * inv_rms * self.scale[...].astype(jnp.float32)
    return y.astype(self.dtype or x.dtype)


# config.model.norm_type: the normalisation of every residual block and pre-LN final norm.
# Each is built as NORMS[name](num_features, epsilon=..., dtype=..., rngs=...).
NORMS: dict[str, type[nnx.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
