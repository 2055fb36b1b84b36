"""transformer/model/layers.py against the Flax layers they replace and the dropout formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.model.layers import Dense, Dropout, LayerNorm, project


def _x(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape) * 2.0 + 0.5


def test_dense_is_nnx_linear_on_3d_inputs():
  dense = Dense(8, 6, rngs=nnx.Rngs(0))
  linear = nnx.Linear(8, 6, rngs=nnx.Rngs(0))
  assert jax.tree.structure(nnx.state(dense)) == jax.tree.structure(nnx.state(linear))
  x = _x(3, 5, 8)
  np.testing.assert_allclose(dense(x), linear(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_project_is_the_layers_one_by_one_values_and_gradients(groups):
  layers = [Dense(8, 8, use_bias=False, rngs=nnx.Rngs(i)) for i in range(3)]
  graphdef, params = nnx.split(nnx.List(layers))
  x = _x(2, 7, 8)
  weights = [_x(2, 7, 8, seed=i + 1) for i in range(3)]

  def loss(params, x, fused):
    layers = nnx.merge(graphdef, params)
    ys = project(x, *layers, groups=groups) if fused else [layer(x) for layer in layers]
    return sum(jnp.sum(y * w) for y, w in zip(ys, weights))

  for a, b in zip(project(x, *layers, groups=groups), [layer(x) for layer in layers]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  fused, plain = (jax.grad(loss, argnums=(0, 1))(params, x, f) for f in (True, False))
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_matches_nnx_values_and_gradients(dtype):
  ours = LayerNorm(16, epsilon=1e-6, dtype=dtype, rngs=nnx.Rngs(0))
  flax_ln = nnx.LayerNorm(16, epsilon=1e-6, dtype=dtype, rngs=nnx.Rngs(0))
  for ln in (ours, flax_ln):  # non-trivial scale and bias
    ln.scale[...] = _x(16, seed=1)
    ln.bias[...] = _x(16, seed=2)
  x, dy = _x(4, 5, 16) * 3.0, _x(4, 5, 16, seed=3)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert ours(x).dtype == dtype
  np.testing.assert_allclose(ours(x).astype(jnp.float32), flax_ln(x).astype(jnp.float32),
                             rtol=tol, atol=tol)

  def grads(ln):
    graphdef, params = nnx.split(ln)
    loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x).astype(jnp.float32) * dy)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(params, x)

  for a, b in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(grads(flax_ln))):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a.astype(jnp.float32) / scale, b.astype(jnp.float32) / scale,
                               atol=tol)


def _dropout(x, rate, seed=0):
  return Dropout(rate)(x, deterministic=False, rngs=nnx.Rngs(dropout=seed))


def test_dropout_rate_scale_and_expectation():
  rate, n = 0.1, 64
  x = jnp.ones((256, 64, n))
  y = np.asarray(_dropout(x, rate))
  threshold = round(rate * 2 ** 16)
  kept = y != 0
  # kept elements are scaled by the exact inverse keep probability
  np.testing.assert_array_equal(np.unique(y[kept]), [np.float32(2 ** 16 / (2 ** 16 - threshold))])
  # the drop rate, overall and in each quarter of the row (each takes different bits of the
  # same threefry words), within 6 standard deviations
  def check(fraction, count):
    assert abs(fraction - rate) < 6 * np.sqrt(rate * (1 - rate) / count), fraction
  check(1 - kept.mean(), kept.size)
  for quarter in np.split(kept, 4, axis=-1):
    check(1 - quarter.mean(), quarter.size)
  # neighbouring elements are not correlated
  a, b = kept[..., :-1].ravel().astype(float), kept[..., 1:].ravel().astype(float)
  assert abs(np.corrcoef(a, b)[0, 1]) < 0.01
  assert abs(y.mean() - 1.0) < 6 * np.sqrt(rate / (1 - rate) / y.size)


def test_dropout_keys_shapes_and_the_identity_cases():
  x = _x(3, 7, 5)  # a last axis that is not a multiple of 4
  y = _dropout(x, 0.5)
  assert y.shape == x.shape and 0 < int(jnp.sum(y == 0)) < x.size
  np.testing.assert_array_equal(_dropout(x, 0.5), y)  # same key, same mask
  assert not np.array_equal(_dropout(x, 0.5, seed=1) == 0, y == 0)
  np.testing.assert_array_equal(Dropout(0.5)(x, deterministic=True), x)
  np.testing.assert_array_equal(_dropout(x, 0.0), x)
  np.testing.assert_array_equal(_dropout(x, 1.0), jnp.zeros_like(x))


def test_dropout_gradient_is_the_mask_times_the_scale():
  x = _x(16, 32)
  rate = 0.3
  y = _dropout(x, rate)
  grad = jax.grad(lambda x: jnp.sum(_dropout(x, rate)))(x)
  expected = np.where(np.asarray(y) != 0, 2 ** 16 / (2 ** 16 - round(rate * 2 ** 16)), 0.0)
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
