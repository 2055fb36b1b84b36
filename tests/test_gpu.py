"""Checks only an NVIDIA GPU can run (skipped elsewhere): cuDNN fused attention (and a Pallas
kernel, when one is registered) against the reference formula, values and gradients, under
packing, padding and causal masks, with every bias encoding and the Gaussian scorer; the
Mosaic GPU kernel (Hopper or later); and `auto`'s choice on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.kernels.registry import KERNELS
from transformer.model.kernels.reference import reference_kernel
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, PositionalEncoding, make_positional_encoding
from transformer.model.scores import Gaussian, ScaledDot

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


# --- every bias encoding, and the Gaussian, through the GPU's fused kernels --------------
# Written without a GPU at hand (the session that wrote them had none): unverified until a
# GPU runs them.

GPU_KERNELS = [name for name in ("cudnn", "pallas") if name in KERNELS]
BIASED = ["none", *sorted(name for name, cls in POSITIONS.items() if cls.biases)]


def _packed_batch(b=2, t=64):
  seg = jnp.concatenate([jnp.ones((b, 40), jnp.int32), 2 * jnp.ones((b, 16), jnp.int32),
                         jnp.zeros((b, 8), jnp.int32)], axis=1)  # two segments, then padding
  pos = jnp.concatenate([jnp.arange(40), jnp.arange(16), jnp.zeros(8, jnp.int32)])[None]
  pos = jnp.broadcast_to(pos, (b, t))
  return seg, Mask(seg, seg, pos, pos, causal=True)


def _bf16_against_f32_reference(kernel_name, score, encoding, *, param_grads):
  """(relative errors of the output and of the gradients wrt q, k, v and, with
  `param_grads`, the scorer's and the encoding's parameters) of kernel_name in bf16
  against the reference formula in f32."""
  b, t, h, d = 2, 64, 4, 64
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, g = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys)
  seg, mask = _packed_batch(b, t)
  real = (seg > 0)[:, :, None, None]
  (score_def, score_state), (enc_def, enc_state) = nnx.split(score), nnx.split(encoding)
  kernel = KERNELS[kernel_name].make(block_size=512)

  def loss(run, states, q, k, v):
    s, e = nnx.merge(score_def, states[0]), nnx.merge(enc_def, states[1])
    out = run(q, k, v, mask, e, s, nnx.Dropout(0.0), None)
    return jnp.sum(jnp.where(real, out, 0).astype(jnp.float32) * g.astype(jnp.float32)), out

  states = (score_state, enc_state)
  fused = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a), (0, 1, 2, 3), has_aux=True))
  if kernel_name == "cudnn":
    hlo = fused.lower(states, q, k, v).compile().as_text()
    assert "cudnn" in hlo and "fmha" in hlo  # the fused cuDNN call, not an XLA fallback
  (_, out), grads = fused(states, q, k, v)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, ref), ref_grads = jax.value_and_grad(
      lambda st, *x: loss(reference_kernel, st, *map(f32, x)), (0, 1, 2, 3), has_aux=True)(
          states, q, k, v)
  assert np.isfinite(np.asarray(out, np.float32)).all()  # padding rows too
  keep = np.asarray(seg) > 0
  errors = {"out": _relative_error(np.asarray(out, np.float32)[keep], np.asarray(ref)[keep])}
  for name, got, want in zip("qkv", grads[1:], ref_grads[1:]):
    errors[f"d{name}"] = _relative_error(f32(got), want)
  if param_grads:  # each parameter's error against the norm of all their gradients: some
    # are 0 by symmetry (FIRE's output bias shifts a whole row), where a ratio means nothing
    flat, ref_flat = jax.tree.leaves(grads[0]), jax.tree.leaves(ref_grads[0])
    scale = np.sqrt(sum(np.sum(np.asarray(w, np.float64) ** 2) for w in ref_flat))
    for i, (got, want) in enumerate(zip(flat, ref_flat)):
      diff = np.asarray(got, np.float64) - np.asarray(want, np.float64)
      errors[f"param{i}"] = np.linalg.norm(diff) / scale
  return errors


@pytest.mark.parametrize("kernel_name", [*GPU_KERNELS, "mosaic_gpu"])
@pytest.mark.parametrize("position", BIASED)
def test_every_bias_encoding_through_the_fused_gpu_kernels_in_bfloat16(kernel_name, position):
  """Values and gradients (q, k, v, and a learned bias's parameters where the kernel
  offers them) of each bias encoding through cuDNN, Pallas' Triton kernel and the Mosaic
  GPU one (Hopper or later), bf16, against the f32 reference. A learned bias through a kernel not
  offering learned_bias is what `auto` avoids and check_kernel refuses by hand:
  there the values and the q, k, v gradients are checked, not the bias's."""
  encoding = make_positional_encoding(position, 256, 4, 64, causal=True, rngs=nnx.Rngs(2))
  learned = encoding.learned_bias and "learned_bias" in KERNELS[kernel_name].offers
  errors = _bf16_against_f32_reference(kernel_name, ScaledDot(4, 64), encoding,
                                       param_grads=learned)
  assert errors["out"] < 1e-2, errors
  assert all(err < 3e-2 for key, err in errors.items() if key != "out"), errors
  if learned:
    assert any(key.startswith("param") for key in errors)  # the bias's gradient was compared


@pytest.mark.parametrize("kernel_name", GPU_KERNELS)
def test_the_gaussian_through_the_fused_gpu_kernels_in_bfloat16(kernel_name):
  """The Gaussian's augmented product (head dim 64 + 2, padded to 72 for cuDNN), values and
  gradients including σ's, bf16 against the f32 reference formula."""
  errors = _bf16_against_f32_reference(kernel_name, Gaussian(4, 64), PositionalEncoding(),
                                       param_grads=True)
  assert errors["out"] < 1e-2, errors
  assert "param0" in errors and all(err < 3e-2 for err in errors.values()), errors


def test_mosaic_gpu_with_the_gaussian_in_bfloat16():
  """Kernel mosaic_gpu compiled by Mosaic GPU (Hopper or later): the Gaussian's augmented
  product (head dim 66, padded to 128) with σ's gradient, bf16 against the f32 reference
  formula."""
  errors = _bf16_against_f32_reference("mosaic_gpu", Gaussian(4, 64), PositionalEncoding(),
                                       param_grads=True)
  assert errors["out"] < 1e-2 and all(err < 3e-2 for err in errors.values()), errors


def test_auto_on_the_gpu_avoids_cudnn_for_a_learned_bias_and_refuses_it_by_hand():
  """In bf16, auto gives T5's self-attention a kernel that differentiates its bias and
  ALiBi's cuDNN; cudnn named by hand with T5 is one ConfigError citing JAX #23701."""
  cfg = AttentionConfig()
  made = {}
  for position in ("t5", "alibi"):
    encoding = make_positional_encoding(position, 256, 4, 64, causal=True, rngs=nnx.Rngs(2))
    made[position] = MultiHeadAttention(256, 4, cfg, dtype=jnp.bfloat16, encoding=encoding,
                                        rngs=nnx.Rngs(0)).kernel_choice.name
  assert "learned_bias" in KERNELS[made["t5"]].offers and made["t5"] != "cudnn"
  assert made["alibi"] in GPU_KERNELS
  t5 = make_positional_encoding("t5", 256, 4, 64, causal=True, rngs=nnx.Rngs(2))
  with pytest.raises(ConfigError, match="JAX issue #23701"):
    MultiHeadAttention(256, 4, AttentionConfig(kernel="cudnn"), dtype=jnp.bfloat16,
                       encoding=t5, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind, position", [
    (kind, position) for kind in ("causal", "padding", "causal_window", "cross")
    for position in ("none", "alibi") if kind != "cross" or position == "none"])
def test_padded_masks_through_cudnn_own_arguments_in_bfloat16(kind, position):
  """A padded mask reaches cuDNN as sequence lengths, a causal flag and a left window
  (kernels/cudnn_mask.py; tests/test_cudnn_mask.py checks the arguments on any machine):
  values and q, k, v gradients on the real rows, bf16 against the f32 reference."""
  b, t, s, h, d = 3, 128, 96, 4, 64
  rows = lambda lengths, n: (  # noqa: E731
      jnp.asarray(np.arange(n)[None] < np.array(lengths)[:, None], jnp.int32),
      jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
  seg, pos = rows([128, 77, 1], t)
  k_seg, k_pos = rows([96, 40, 60], s) if kind == "cross" else (seg, pos)
  causal, window = {"causal": (True, None), "padding": (False, None),
                    "causal_window": (True, 16), "cross": (False, None)}[kind]
  mask = Mask(seg, k_seg, pos, k_pos, causal=causal, window=window, padded=True)
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
  k, v = (jax.random.normal(key, (b, k_seg.shape[1], h, d), jnp.bfloat16) for key in keys[1:3])
  g = jax.random.normal(keys[3], (b, t, h, d), jnp.float32) * seg[:, :, None, None]
  encoding = make_positional_encoding(position, h * d, h, 256, causal=causal, rngs=nnx.Rngs(2))
  score, dropout = ScaledDot(h, d), nnx.Dropout(0.0)
  cudnn = KERNELS["cudnn"].make(block_size=64)

  def loss(kernel, q, k, v):
    out = kernel(q, k, v, mask, encoding, score, dropout, None)
    return jnp.sum(out.astype(jnp.float32) * g), out

  fused = jax.jit(jax.value_and_grad(lambda *x: loss(cudnn, *x), (0, 1, 2), has_aux=True))
  (_, out), grads = fused(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  (_, ref), ref_grads = jax.value_and_grad(
      lambda *x: loss(reference_kernel, *map(f32, x)), (0, 1, 2), has_aux=True)(q, k, v)
  keep = np.asarray(seg) > 0
  assert np.isfinite(np.asarray(out, np.float32)[keep]).all()
  assert _relative_error(np.asarray(out, np.float32)[keep], np.asarray(ref)[keep]) < 1e-2
  for name, got, want in zip("qkv", grads, ref_grads):
    assert _relative_error(f32(got), want) < 3e-2, name
