"""Checks only an NVIDIA GPU can run (skipped elsewhere): cuDNN fused attention against the
reference formula, values and gradients, under packing, padding and causal masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.kernels import KERNELS, reference_kernel
from transformer.masks import Mask
from transformer.positions import PositionalEncoding
from transformer.scores import ScaledDot

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def _relative_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_cudnn_attention_matches_reference_in_bfloat16(kv_heads):
  b, t, h, d = 2, 64, 4, 64
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, g = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys)
  k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]  # query head i reads kv head i // (h / kv)
  seg = jnp.concatenate([jnp.ones((b, 40), jnp.int32), 2 * jnp.ones((b, 16), jnp.int32),
                         jnp.zeros((b, 8), jnp.int32)], axis=1)  # two segments, then padding
  pos = jnp.concatenate([jnp.arange(40), jnp.arange(16), jnp.zeros(8, jnp.int32)])[None]
  pos = jnp.broadcast_to(pos, (b, t))
  mask = Mask(seg, seg, pos, pos, causal=True)
  no_position = PositionalEncoding()
  score = ScaledDot(h, d)
  dropout = nnx.Dropout(0.0)

  def loss(kernel, q, k, v):
    out = kernel(q, k, v, mask, no_position, score, dropout, None)
    return jnp.sum(jnp.where((seg > 0)[:, :, None, None], out, 0).astype(jnp.float32) * g), out

  def f32_reference(q, k, v):
    return loss(reference_kernel, *(x.astype(jnp.float32) for x in (q, k, v)))

  kernel = KERNELS["cudnn"].make(block_size=512)
  cudnn = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a), (0, 1, 2), has_aux=True))
  hlo = cudnn.lower(q, k, v).compile().as_text()
  assert "cudnn" in hlo and "fmha" in hlo  # the fused cuDNN call, not an XLA fallback
  (_, out), grads = cudnn(q, k, v)
  (_, ref), ref_grads = jax.value_and_grad(f32_reference, (0, 1, 2), has_aux=True)(q, k, v)
  assert np.isfinite(np.asarray(out, np.float32)).all()  # padding rows too
  real = np.asarray(seg) > 0
  assert _relative_error(np.asarray(out, np.float32)[real], np.asarray(ref)[real]) < 1e-2
  for grad, ref_grad in zip(grads, ref_grads):
    assert _relative_error(grad.astype(jnp.float32), ref_grad) < 2e-2
