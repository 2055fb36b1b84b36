"""The Pallas flash-attention kernel (transformer/model/kernels/pallas/attention.py; Pallas' interpret mode
on the CPU) against the reference kernel: outputs and gradients (of q, k, v, the scorers'
parameters and the bias encodings' parameters) for every dot-product scorer × every
bias-declaring encoding (and rotary, which biases nothing) × {causal, bidirectional, local
window}, each batch holding a packed row (two segments, restarting positions) and a padded
row (sorted positions with gaps, as randomized positions give), 19 tokens in blocks of 8.

The compiled lowerings' layouts (Triton's, Mosaic TPU's: pallas_layouts.LAYOUTS) run in
interpret mode against the reference too, every encoding per layout with grouped-query heads
in every other case; tests/test_lowering.py lowers them for cuda and tpu. A one-query row (a
KV-cached decoding step) takes the reference formula: it is checked against the reference
kernel for every encoding. The fused normalisers (a sink, a sigmoid) and FoX's data bias
(two vectors per row and head) run in the compiled layouts and over many Mosaic grid steps
against the reference kernel with the model's normaliser, and in one-query rows.

Tolerances: float32 outputs within atol = rtol = 1e-5; float32 gradients within rtol 1e-4
and atol max(1e-4 × the largest |entry| of that gradient, 2e-5) (the blocks sum in another
order; the floor covers gradients that are 0 in exact arithmetic, e.g. of FIRE's output bias,
a constant per row that the softmax ignores); bfloat16 inputs: outputs within 2e-2 and
gradients within 5e-2 × their largest |entry| of the float32 reference on the same
(bf16-rounded) inputs.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.data_biases import ForgetBiased
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.kernels.registry import KERNELS
from transformer.model.kernels.reference import reference_kernel
from transformer.model.layers import Dropout
from transformer.model.masks import Mask
from transformer.model.normalizers import make_normalizer
from transformer.model.kernels.pallas import layouts, piecewise, sparsity, tables
from transformer.model.kernels.pallas.attention import flash_attention, visited_blocks
from transformer.model.kernels.pallas.layouts import LAYOUTS
from transformer.model.positions import POSITIONS, Fire, T5Bias
from transformer.model.positions.base import spec_bias
from transformer.model.scores import SCORES, Dot, make_score

H, D, T, BLOCK = 2, 8, 19, 8
DOT_SCORES = sorted(name for name in SCORES
                    if make_score(name, H, D, rngs=nnx.Rngs(0)).dot_product is not None)
# Every encoding declaring a bias, and rotary (no bias; it rotates q and k before the kernel).
KERNEL_POSITIONS = sorted(name for name, cls in POSITIONS.items() if cls.biases) + ["rotary"]
# Small tables and MLPs, so the bias is cheap to trace; the T5 buckets reach their log range.
SETTINGS = {"t5": T5Bias.Settings(num_buckets=8, max_distance=12),
            "fire": Fire.Settings(width=2, init_threshold=6.0)}
# The interpret-mode kernels' compilation is most of this file's time: XLA's backend at
# optimisation level 0 compiles them in about 60% of the time (both kernels alike).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
DOT = Dot(H, D)  # scale 1, identity transforms: the kernels score the stacked q, k as given
MASKS = {"causal": (True, None), "bidirectional": (False, None), "window": (False, 3)}


def _rows():
  """Segments and positions [2, T]: a packed row, and a padded row of sorted positions."""
  gapped = np.cumsum(np.random.default_rng(0).integers(1, 4, 13)) - 1
  seg = jnp.array([[1] * 9 + [2] * 7 + [0] * 3, [1] * 13 + [0] * 6])
  pos = jnp.array([list(range(9)) + list(range(7)) + [0] * 3, list(gapped) + [0] * 6])
  return seg, pos


def _encoding(name, causal):
  """The encoding `name`; FIRE's hidden biases set apart from their initial zeros: its
  MLP's kinks at 0.35 (w1 > 0) and 0 (w1 < 0: off at the diagonal's input 0, a tie)."""
  cls = POSITIONS[name]
  enc = cls(16, H, 64, causal=causal, settings=SETTINGS.get(name), rngs=nnx.Rngs(1))
  if name == "fire":
    enc.hidden.bias[...] = jnp.array([-0.2, 0.0])
  return enc


def _run(kernel, enc, scorers, mask, q, k, v, w, layout=None):
  """Σ_scorers Σ out·w, and the outputs [n_scorers, b, tq, h, d], from `kernel` (pallas or
  reference) run once for all scorers: their transformed queries and keys stacked along the
  batch, scored as plain q·k (what a dot-product scorer is defined as, scores.py). The
  scorers' own formulas are tested in test_attention."""
  q = enc.rotate_queries(q, mask.q_positions)
  k = enc.rotate_keys(k, mask.k_positions)
  products = [s.dot_product for s in scorers]
  tile = lambda x: jnp.concatenate([x] * len(scorers))  # noqa: E731
  qs = [p.queries(q) * jnp.asarray(p.scale, q.dtype) for p in products]
  ks = [p.keys(k) for p in products]
  # zero columns change no dot product: transforms that add dimensions stack with the rest
  width = max(x.shape[-1] for x in qs)
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])  # noqa: E731
  q, k = jnp.concatenate([pad(x) for x in qs]), jnp.concatenate([pad(x) for x in ks])
  mask = jax.tree.map(tile, mask)
  if kernel == "pallas":
    out = flash_attention(q, k, tile(v), q_segments=mask.q_segments, k_segments=mask.k_segments,
                          q_positions=mask.q_positions, k_positions=mask.k_positions,
                          causal=mask.causal, window=mask.window, bias_spec=enc.bias_spec(),
                          block_q=BLOCK, block_k=BLOCK, layout=layout)
  else:
    out = reference_kernel(q, k, tile(v), mask, enc, DOT, Dropout(0.0), None)
  out = out.reshape(len(scorers), -1, *out.shape[1:])
  return jnp.sum(out.astype(jnp.float32) * w), out


def _outputs_and_grads(enc, scorers, mask, q, k, v, w, reference_inputs=None, layout=None):
  """((gradients, outputs) of the Pallas kernel, the same of the reference), compiled as
  one program; gradients of (encoding, scorers, q, k, v). reference_inputs: other q, k, v
  for the reference (e.g. float32 copies of bfloat16 ones)."""
  (enc_def, enc_state), score_parts = nnx.split(enc), [nnx.split(s) for s in scorers]

  def loss(enc_state, score_states, q, k, v, kernel):
    merged = [nnx.merge(g, s) for (g, _), s in zip(score_parts, score_states)]
    return _run(kernel, nnx.merge(enc_def, enc_state), merged, mask, q, k, v, w, layout)

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
  states = [s for _, s in score_parts]
  both = lambda *x: (grad(enc_state, states, *x[:3], "pallas"),  # noqa: E731
                     grad(enc_state, states, *x[3:], "reference"))
  return jax.jit(both, compiler_options=FAST_COMPILE)(q, k, v, *(reference_inputs or (q, k, v)))


def _inputs(tq=T, tk=T, dtype=jnp.float32, seed=5, kv_heads=H):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(2, tq, H, D)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(2, tk, kv_heads, D)), dtype) for _ in range(2))
  w = jnp.asarray(rng.normal(size=(len(DOT_SCORES), 2, tq, H, D)), jnp.float32)
  return q, k, v, w


def _close_grads(got, want, rtol, scale, floor=2e-5):
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, rtol=rtol, atol=max(scale * np.abs(r).max(), floor))


@pytest.mark.parametrize("position", sorted(n for n, cls in POSITIONS.items() if cls.biases))
def test_bias_spec_block_function_is_the_encodings_bias(position):
  """The per-head block function the kernel evaluates, mapped over heads and rows, gives the
  encoding's bias() (its dense form where it has one) and the same parameter gradients, at
  positions far apart (T5's last bucket, FIRE beyond its threshold), in both directions."""
  pos = jnp.array([[0, 1, 3, 7, 12, 40], [2, 3, 4, 5, 30, 31]])
  for causal in (True, False):
    enc = _encoding(position, causal)
    graphdef, state = nnx.split(enc)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(2, H, 6, 6)), jnp.float32)

    def total(state, blockwise):
      spec = nnx.merge(graphdef, state).bias_spec()
      bias = spec_bias(spec, pos, pos, blockwise=blockwise)
      return jnp.sum(bias * weights), bias

    (block, grads), (dense, want_grads) = jax.jit(
        lambda state: [jax.grad(total, has_aux=True)(state, b)[::-1] for b in (True, False)],
        compiler_options=FAST_COMPILE)(state)
    np.testing.assert_allclose(dense, enc.bias(pos, pos), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(block, dense, rtol=1e-5, atol=1e-6)
    _close_grads(grads, want_grads, 1e-4, 1e-5, 1e-7)


@pytest.mark.parametrize("position", sorted(
    n for n, cls in POSITIONS.items() if cls.biases and _encoding(n, True).bias_spec().grad))
def test_bias_spec_grad_is_the_vjp_of_its_fn(position):
  """A BiasSpec's closed-form grad (KERPLE's two block sums), which the kernels take in
  place of the vjp of fn, equals that vjp for each head, keys on both sides of the query."""
  spec = _encoding(position, False).bias_spec()
  qp, kp = jnp.array([[0], [3], [9], [40]]), jnp.array([[0, 1, 5, 9, 41, 200]])
  dbias = jnp.asarray(np.random.default_rng(6).normal(size=(4, 6)), jnp.float32)
  for head in range(H):
    params = {name: tuple(x[head]) for name, x in spec.params.items()}
    want = jax.vjp(lambda p: spec.fn(p, qp, kp), params)[1](dbias)[0]
    got = spec.grad(params, qp, kp, dbias)
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize("position", KERNEL_POSITIONS)
def test_pallas_equals_reference(position, mask_kind):
  causal, window = MASKS[mask_kind]
  seg, pos = _rows()
  mask = Mask(seg, seg, pos, pos, causal=causal, window=window)
  enc = _encoding(position, causal)
  scorers = [make_score(name, H, D, rngs=nnx.Rngs(2)) for name in DOT_SCORES]
  q, k, v, w = _inputs()
  (grads, out), (want_grads, want) = _outputs_and_grads(enc, scorers, mask, q, k, v, w)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out)[:, 0, 16:] == 0) and np.all(np.asarray(out)[:, 1, 13:] == 0)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)
  spec = enc.bias_spec()
  if spec is not None and spec.learned:  # the encoding's parameters do learn through it
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(want_grads[0]))


# The compiled lowerings' layouts (pallas_layouts.LAYOUTS), run in interpret mode: Triton's
# power-of-two blocks ≥ 16 and padded head dims, Mosaic TPU's lane- and sublane-broadcast
# ids, [t, 128] statistics, SMEM parameters and inner blocks on the grid (their scratch
# carried between grid steps). Every encoding per layout, the masks in turn, every other
# case with grouped-query heads (one K/V head for both query heads).
LAYOUT_CASES = [(layout, position, sorted(MASKS)[n % 3], 1 if n % 2 else H)
                for layout in ("triton", "mosaic_tpu")
                for n, position in enumerate(KERNEL_POSITIONS)]


@pytest.mark.parametrize("layout,position,mask_kind,kv_heads", LAYOUT_CASES, ids=[
    f"{layout}-{position}-{mask}-kv{kv}" for layout, position, mask, kv in LAYOUT_CASES])
def test_compiled_layouts_equal_reference(layout, position, mask_kind, kv_heads):
  causal, window = MASKS[mask_kind]
  seg, pos = _rows()
  mask = Mask(seg, seg, pos, pos, causal=causal, window=window)
  enc, scorers = _encoding(position, causal), [make_score("scaled_dot", H, D, rngs=nnx.Rngs(2))]
  q, k, v, w = _inputs(kv_heads=kv_heads)
  (grads, out), (want_grads, want) = _outputs_and_grads(enc, scorers, mask, q, k, v, w[:1],
                                                        layout=layout)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)


# The normalisers of a flash form and FoX's data bias, in the compiled layouts (the
# generic one: test_kernel_conformance): a sink (learned,
# its logits apart from 0) with ALiBi, causal, one K/V head; a sigmoid with T5, a window.
FUSED_CASES = [(layout, normalizer) for layout in ("triton", "mosaic_tpu")
               for normalizer in ("sink", "sigmoid")]


@pytest.mark.parametrize("layout,normalizer", FUSED_CASES,
                         ids=[f"{layout}-{n}" for layout, n in FUSED_CASES])
def test_normalizers_and_data_bias_in_every_layout(layout, normalizer):
  """Outputs and gradients of q, k, v, the normaliser's sink, the encoding's parameters and
  the data bias's two vectors (u at the queries, w at the keys: c_i − c_j) against the
  reference kernel with the model's normaliser (transformer/model/normalizers.py) and
  FoX's view (data_biases.ForgetBiased)."""
  position, mask_kind, kv_heads = (("alibi", "causal", 1) if normalizer == "sink"
                                   else ("t5", "window", H))
  causal, window = MASKS[mask_kind]
  seg, pos = _rows()
  mask = Mask(seg, seg, pos, pos, causal=causal, window=window)
  enc = _encoding(position, causal)
  norm = make_normalizer(normalizer, H, max_len=16, causal=True, rngs=nnx.Rngs(0))
  if normalizer == "sink":
    norm.sink[...] = jnp.array([0.5, -1.5])
  (enc_def, enc_state), (norm_def, norm_state) = nnx.split(enc), nnx.split(norm)
  q, k, v, w = _inputs(kv_heads=kv_heads)
  rng = np.random.default_rng(9)
  vectors = tuple(jnp.cumsum(jax.nn.log_sigmoid(jnp.asarray(2 + rng.normal(size=(2, T, H)),
                                                            jnp.float32)), 1) for _ in range(2))

  def loss(q, k, v, enc_state, norm_state, vectors, kernel):
    enc, norm = nnx.merge(enc_def, enc_state), nnx.merge(norm_def, norm_state)
    if kernel == "pallas":
      form = norm.flash_form()
      out = flash_attention(q, k, v, q_segments=seg, k_segments=seg, q_positions=pos,
                            k_positions=pos, causal=causal, window=window,
                            bias_spec=enc.bias_spec(), block_q=BLOCK, block_k=BLOCK,
                            layout=layout, sigmoid_bias=form.sigmoid_bias, sink=form.sink,
                            bias_vectors=vectors)
    else:
      out = reference_kernel(q, k, v, mask, ForgetBiased(enc, *vectors), DOT, Dropout(0.0),
                             None, normalizer=norm)
    return jnp.sum(out * w[0]), out

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)
  (grads, out), (want_grads, want) = jax.jit(lambda *x: [
      grad(*x, kernel) for kernel in ("pallas", "reference")],
      compiler_options=FAST_COMPILE)(q, k, v, enc_state, norm_state, vectors)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)
  assert np.abs(np.asarray(want_grads[5][1])).max() > 1e-3  # the keys' vector does learn
  if normalizer == "sink":
    assert np.abs(np.asarray(want_grads[4]["sink"][...])).min() > 1e-3


@pytest.mark.parametrize("layout,fused", [("triton", False), ("mosaic_tpu", False),
                                          ("mosaic_tpu", True)])
def test_compiled_layouts_over_many_blocks(layout, fused):
  """Rows of 300 tokens in the layouts' default blocks: Mosaic TPU's inner blocks are grid
  steps (3 of 128 keys), its running sums carried in scratch between them; Triton's
  forward and backward blocks differ (128 and 64). Packed and padded rows, causal, T5's
  bias, one K/V head for both query heads; `fused`: softmax with a sink and FoX's data
  bias besides (its sums' gradients carried between grid steps too)."""
  t = 300
  seg = jnp.array([[1] * 150 + [2] * 100 + [0] * 50, [1] * 280 + [0] * 20])
  pos = jnp.array([list(range(150)) + list(range(100)) + [0] * 50,
                   list(range(280)) + [0] * 20])
  mask = Mask(seg, seg, pos, pos, causal=True)
  enc = _encoding("t5", True)
  q, k, v, _ = _inputs(tq=t, tk=t, kv_heads=1)
  rng = np.random.default_rng(6)
  w = jnp.asarray(rng.normal(size=(2, t, H, D)), jnp.float32)
  c = jnp.cumsum(jax.nn.log_sigmoid(jnp.asarray(3 + rng.normal(size=(2, t, H)), jnp.float32)), 1)
  norm = make_normalizer("sink" if fused else "softmax", H, max_len=t, causal=True,
                         rngs=nnx.Rngs(0))
  pallas = lambda q, k, v, c: flash_attention(  # noqa: E731
      q, k, v, q_segments=seg, k_segments=seg, q_positions=pos, k_positions=pos,
      causal=True, bias_spec=enc.bias_spec(), layout=layout, sink=norm.flash_form().sink,
      bias_vectors=(c, c) if fused else None)
  reference = lambda q, k, v, c: reference_kernel(  # noqa: E731
      q, k, v, mask, ForgetBiased(enc, c, c) if fused else enc, DOT, Dropout(0.0), None,
      normalizer=norm)
  (out, grads), (want, want_grads) = jax.jit(lambda *x: [
      (f(*x), jax.grad(lambda *y, f=f: jnp.sum(f(*y) * w), (0, 1, 2, 3))(*x))
      for f in (pallas, reference)], compiler_options=FAST_COMPILE)(q, k, v, c)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_blocks_meet_their_lowerings_rules(name):
  """Mosaic TPU: blocks of a [t, ·] array are multiples of 8 rows, of a key side's [8, t]
  multiples of 128 lanes; Triton: powers of two ≥ 16 (tl.dot's least), ≤ 128 forward and
  ≤ 64 backward (half that for head dims above 128), head dims padded to one; every layout: blocks within the asked size (or
  the least allowed) and never twice a length or more (or the least allowed)."""
  layout = LAYOUTS[name]
  least = max(layout.q_multiple, layout.k_multiple, layout.min_size)
  for asked, length, backward in itertools.product((8, 100, 128, 512), (1, 19, 128, 300),
                                                   (False, True)):
    for head_dim in (16, 64, 128, 256):
      for block in layout.blocks(asked, asked, length, length, backward, head_dim):
        assert block <= max(asked, least) and block < max(2 * length, least + 1)
        if name == "mosaic_tpu":
          assert block % 128 == 0
        if name == "triton":
          cap = (64 if backward else 128) // (2 if head_dim > 128 else 1)
          assert block & (block - 1) == 0 and 16 <= block <= cap
  for dim in (1, 8, 11, 64, 66):
    padded = layout.dim(dim)
    assert padded == (max(16, 1 << (dim - 1).bit_length()) if name == "triton" else dim)


@pytest.mark.parametrize("position", KERNEL_POSITIONS)
def test_one_query_rows_equal_reference(position):
  """A KV-cached decoding step (one query per row against a cache with empty slots) takes
  the reference formula (flash_attention._one_query), grouped-query heads included."""
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(2, 1, H, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, T, 1, D)), jnp.float32) for _ in range(2))
  slots = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = Mask(jnp.ones((2, 1), jnp.int32), (slots < jnp.array([[12], [5]])).astype(jnp.int32),
              jnp.array([[11], [4]]), slots, causal=True, window=6)
  enc = _encoding(position, True)
  out = flash_attention(enc.rotate_queries(q, mask.q_positions),
                        enc.rotate_keys(k, mask.k_positions), v, q_segments=mask.q_segments,
                        k_segments=mask.k_segments, q_positions=mask.q_positions,
                        k_positions=mask.k_positions, causal=True, window=6,
                        bias_spec=enc.bias_spec())
  want = reference_kernel(enc.rotate_queries(q, mask.q_positions),
                          enc.rotate_keys(k, mask.k_positions), v, mask, enc, DOT,
                          Dropout(0.0), None)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalizer", ["sink", "sigmoid"])
def test_one_query_rows_with_a_normalizer_and_data_bias(normalizer):
  """The one-query rows' formula (_one_query) with a sink or a sigmoid and FoX's vectors
  beside ALiBi: the reference kernel's values."""
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(2, 1, H, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, T, 1, D)), jnp.float32) for _ in range(2))
  u, w = jnp.asarray(rng.normal(size=(2, 1, H)), jnp.float32), jnp.asarray(
      rng.normal(size=(2, T, H)), jnp.float32)
  slots = jnp.broadcast_to(jnp.arange(T), (2, T))
  mask = Mask(jnp.ones((2, 1), jnp.int32), (slots < jnp.array([[12], [5]])).astype(jnp.int32),
              jnp.array([[11], [4]]), slots, causal=True)
  enc = _encoding("alibi", True)
  norm = make_normalizer(normalizer, H, max_len=16, causal=True, rngs=nnx.Rngs(0))
  if normalizer == "sink":
    norm.sink[...] = jnp.array([0.5, -1.5])
  form = norm.flash_form()
  out = flash_attention(q, k, v, q_segments=mask.q_segments, k_segments=mask.k_segments,
                        q_positions=mask.q_positions, k_positions=mask.k_positions,
                        causal=True, bias_spec=enc.bias_spec(), sink=form.sink,
                        sigmoid_bias=form.sigmoid_bias, bias_vectors=(u, w))
  want = reference_kernel(q, k, v, mask, ForgetBiased(enc, u, w), DOT, Dropout(0.0), None,
                          normalizer=norm)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_pallas_cross_attention_with_other_lengths():
  """Queries and keys of different lengths (5 and 19, neither a whole number of blocks),
  segments and positions of their own, a bidirectional T5 bias."""
  seg, pos = _rows()
  q_seg, q_pos = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]]), jnp.array([[0, 1, 0, 1, 0],
                                                                            [0, 2, 5, 0, 0]])
  mask = Mask(q_seg, seg, q_pos, pos)
  enc, scorers = _encoding("t5", False), [make_score("scaled_dot", H, D, rngs=nnx.Rngs(2))]
  q, k, v, w = _inputs(tq=5)
  (grads, out), (want_grads, want) = _outputs_and_grads(enc, scorers, mask, q, k, v, w[:1])
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)


def test_pallas_bfloat16_is_within_bfloat16_error():
  seg, pos = _rows()
  mask = Mask(seg, seg, pos, pos, causal=True)
  enc, scorers = _encoding("kerple", True), [make_score("scaled_dot", H, D, rngs=nnx.Rngs(2))]
  q, k, v, w = _inputs(dtype=jnp.bfloat16)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (grads, out), (want_grads, want) = _outputs_and_grads(enc, scorers, mask, q, k, v, w[:1], f32)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2)
  _close_grads(grads, want_grads, rtol=0, scale=5e-2)


def test_model_with_pallas_equals_reference():
  """A whole decoder (kernel=pallas via the KERNELS entry: scorer transforms, FIRE's bias)
  gives the reference kernel's logits and parameter gradients on packed rows."""
  def loss_and_grads(kernel):
    cfg = ModelConfig(**{**TINY_MODEL, "arch": "decoder"}, position="fire",
                      attention=AttentionConfig(score="cosine", kernel=kernel, block_size=8))
    graphdef, params = nnx.split(make_model(cfg, rngs=nnx.Rngs(0)))
    batch = {"inputs": jnp.asarray(np.random.default_rng(1).integers(3, 11, (2, 13))),
             "inputs_segmentation": jnp.array([[1] * 6 + [2] * 7, [1] * 10 + [0] * 3]),
             "inputs_positions": jnp.array([list(range(6)) + list(range(7)),
                                            list(range(10)) + [0] * 3])}
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(batch)[:, :10] ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST_COMPILE)(params)

  (loss, grads), (want_loss, want_grads) = loss_and_grads("pallas"), loss_and_grads("reference")
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)


def test_pallas_refuses_what_it_cannot_compute():
  assert not {"any_score", "dropout", "content_bias"} & KERNELS["pallas"].offers
  with pytest.raises(ConfigError, match="kernel 'pallas' computes dot-product scores only"):
    MultiHeadAttention(8, 2, AttentionConfig(score="additive", kernel="pallas"), rngs=nnx.Rngs(0))

  class Unspecified(POSITIONS["alibi"]):  # a bias without its BiasSpec
    def bias_spec(self):
      return None

  layer = MultiHeadAttention(8, 2, AttentionConfig(kernel="pallas"), rngs=nnx.Rngs(0))
  seg, pos = _rows()
  with pytest.raises(ConfigError, match="needs a BiasSpec of the positional encoding Unspecif"):
    layer.self_attend(jnp.ones((2, T, 8)), Mask(seg, seg, pos, pos), Unspecified(8, 2, 16))


def test_pallas_query_key_width_may_differ_from_the_values():
  """q, k with 11 dimensions (as a transform that augments them gives) and v with 8: the
  same outputs and gradients as the reference."""
  seg, pos = _rows()
  rng = np.random.default_rng(8)
  q, k = (jnp.asarray(rng.normal(size=(2, T, H, 11)), jnp.float32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(2, T, H, D)), jnp.float32)
  mask = Mask(seg, seg, pos, pos, causal=True)
  enc = _encoding("alibi", True)
  w = jnp.asarray(rng.normal(size=(2, T, H, D)), jnp.float32)
  pallas = lambda q, k, v: flash_attention(  # noqa: E731
      q, k, v, q_segments=seg, k_segments=seg, q_positions=pos, k_positions=pos, causal=True,
      bias_spec=enc.bias_spec(), block_q=BLOCK, block_k=BLOCK)
  reference = lambda q, k, v: reference_kernel(  # noqa: E731
      q, k, v, mask, enc, DOT, Dropout(0.0), None)
  (out, grads), (want, want_grads) = jax.jit(lambda *x: [
      (f(*x), jax.grad(lambda *y: jnp.sum(f(*y) * w), (0, 1, 2))(*x))
      for f in (pallas, reference)], compiler_options=FAST_COMPILE)(q, k, v)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  _close_grads(grads, want_grads, rtol=1e-4, scale=1e-4)


def _block_structure(mask: Mask, bq: int, bk: int):
  """The exact block structure from the dense mask: per (row, query block, key block),
  whether any pair is visible and whether all are, for lengths padded to whole blocks."""
  dense = np.asarray(mask.dense())[:, 0]  # [b, tq, tk]
  b, tq, tk = dense.shape
  lq, lk = -(-tq // bq) * bq, -(-tk // bk) * bk
  dense = np.pad(dense, [(0, 0), (0, lq - tq), (0, lk - tk)])
  dense = dense.reshape(b, lq // bq, bq, lk // bk, bk)
  return dense.any((2, 4)), dense.all((2, 4))


def _packed_rows(t=40):
  """Three rows of length t: packed (three segments of about t/3, positions restarting),
  padded (gapped sorted positions, then a quarter of padding), one segment throughout."""
  a, c = t // 3, t // 4
  gapped = np.cumsum(np.random.default_rng(2).integers(1, 4, t - c)) - 1
  seg = jnp.array([[1] * a + [2] * a + [3] * (t - 2 * a), [1] * (t - c) + [0] * c, [1] * t])
  pos = jnp.array([list(range(a)) * 2 + list(range(t - 2 * a)), list(gapped) + [0] * c,
                   list(range(t))])
  return seg, pos


BLOCK_CASES = [(layout, mask_kind) for layout in ("generic", "triton", "mosaic_tpu")
               for mask_kind in ("causal", "bidirectional", "window", "causal_window")]


@pytest.mark.parametrize("layout,mask_kind", BLOCK_CASES,
                         ids=[f"{layout}-{mask}" for layout, mask in BLOCK_CASES])
def test_kernels_visit_exactly_the_visible_blocks(layout, mask_kind):
  """Counted by the kernels in interpret mode, with each lowering's blocks and driver: the
  forward and (Mosaic TPU's) dq kernels visit, per query block, exactly the key blocks
  holding a visible pair and mask exactly those not wholly visible; the dk/dv kernel (which
  adds dq atomically on the other layouts) the same per key block (the transposed lists). Packed, padded and single-segment rows; causal, bidirectional, a local
  window and both."""
  t, block = (300, 128) if layout == "mosaic_tpu" else (40, 16 if layout == "triton" else 8)
  causal, window = {"causal": (True, None), "bidirectional": (False, None),  # windows: some
                    "window": (False, 3 * block // 2),  # diagonal blocks full, others partial
                    "causal_window": (True, 2 * block + 1)}[mask_kind]
  seg, pos = _packed_rows(t)
  mask = Mask(seg, seg, pos, pos, causal=causal, window=window)
  q, k, v = (jnp.zeros((3, t, 1, 8), jnp.float32) for _ in range(3))
  counts = jax.jit(lambda q, k, v: visited_blocks(
      q, k, v, q_segments=seg, k_segments=seg, q_positions=pos, k_positions=pos, causal=causal,
      window=window, block_q=block, block_k=block, layout=layout),
      compiler_options=FAST_COMPILE)(q, k, v)
  bq = bk = LAYOUTS[layout].blocks(block, block, t, t, backward=False)[0]
  visible, full = _block_structure(mask, bq, bk)
  assert LAYOUTS[layout].blocks(block, block, t, t, backward=True) == (bq, bk)
  assert set(counts) == ({"forward", "dkv"} if LAYOUTS[layout].dq_atomic
                         else {"forward", "dq", "dkv"})
  for kernel, axis in (("forward", 2), ("dq", 2), ("dkv", 1)):
    if kernel not in counts:  # one backward kernel: dq added atomically by the dk/dv kernel
      continue
    visited, masked = (np.asarray(c)[:, 0] for c in counts[kernel])
    np.testing.assert_array_equal(visited, visible.sum(axis), err_msg=kernel)
    np.testing.assert_array_equal(masked, (visible & ~full).sum(axis), err_msg=kernel)
  assert visible.sum() < visible.size and full.any()  # the cases do skip and unmask blocks


def test_causal_8k_visits_half_the_blocks_and_masks_the_diagonal():
  """Causal at 8192 tokens in blocks of 128: 2080 of the 4096 blocks visited, 64 masked
  (the diagonal), and the visit lists name them in order, partial first."""
  t, n = 8192, 64
  seg, pos = jnp.ones((1, t), jnp.int32), jnp.arange(t)[None]
  kind = sparsity.classify(seg, seg, pos, pos, causal=True, window=None, block_q=128,
                           block_k=128, lq=t, lk=t)
  assert int(jnp.sum(kind > 0)) == 2080 and int(jnp.sum(kind == sparsity.PARTIAL)) == 64
  lists = np.asarray(sparsity.visit_lists(kind, n + 2))[0]
  for i in (0, 5, 63):
    assert lists[i, 0] == 1 and lists[i, 1] == i + 1
    assert list(lists[i, 2:3 + i]) == [i] + list(range(i))  # the diagonal, then 0..i-1


def test_rows_not_sorted_by_segment_and_position_are_visited_whole():
  """Keys not sorted by (segment, position) (here: positions descending) fall back to every
  block, masked: conservative, and the kernels' masks keep the result exact."""
  seg, pos = jnp.ones((2, 24), jnp.int32), jnp.array([list(range(24)), list(range(24))[::-1]])
  kind = np.asarray(sparsity.classify(seg, seg, pos, pos, causal=True, window=None, block_q=8,
                                      block_k=8, lq=24, lk=24))
  assert (kind[1] == sparsity.PARTIAL).all()
  assert (kind[0] == [[1, 0, 0], [2, 1, 0], [2, 2, 1]]).all()


@pytest.mark.parametrize("causal", [True, False])
def test_t5_table_reads_the_dense_bias_bit_for_bit(causal):
  """T5's table over k − q (tables.relative_table, 2·max_distance + 1 entries per head),
  read at clip(k − q, ±max_distance) as the kernels read it, is the dense bias exactly, at
  offsets within and far beyond max_distance, both directions; the layouts that gather
  (interpret mode, Triton) read it, Mosaic TPU evaluates the BiasSpec."""
  spec = _encoding("t5", causal).bias_spec()
  m = spec.saturates_at
  pos = jnp.array([[0, 1, 3, 7, 12, 13, 40, 300]])
  table = tables.relative_table(spec, 32)
  assert table.shape == (H, 32) and 2 * m + 1 <= 32
  at = jnp.clip(pos[0][None, :] - pos[0][:, None], -m, m) + m
  np.testing.assert_array_equal(table[:, at], spec_bias(spec, pos, pos)[0])
  assert LAYOUTS["generic"].tables and LAYOUTS["triton"].tables
  assert not LAYOUTS["mosaic_tpu"].tables


@pytest.mark.parametrize("causal", [True, False])
def test_t5_gradient_through_the_table_is_the_dense_gradient(causal):
  """The logits' gradient summed per entry of the table (as the backward kernel adds it,
  tables.add), then tables.table_gradient, is the gradient of Σ dS·bias through
  the dense bias, at offsets within and beyond max_distance."""
  spec = _encoding("t5", causal).bias_spec()
  m = spec.saturates_at
  pos = jnp.array([[0, 1, 3, 7, 12, 13, 40, 300]])
  ds = jnp.asarray(np.random.default_rng(4).normal(size=(1, H, 8, 8)), jnp.float32)
  at = jnp.clip(pos[0][None, :] - pos[0][:, None], -m, m) + m
  dtable = jax.vmap(lambda d: jnp.zeros(32, jnp.float32).at[at].add(d))(ds[0])
  got = tables.table_gradient(spec, 32, dtable)
  want = jax.grad(lambda p: jnp.sum(ds * spec_bias(
      dataclasses.replace(spec, params=p), pos, pos)))(spec.params)
  np.testing.assert_allclose(got["table"], want["table"], rtol=1e-6, atol=1e-6)


class _Row:
  """A head's row of a table's gradient as the kernels' ref (tables.add: ref[...] += x)."""

  def __init__(self, width):
    self.value = jnp.zeros(width, jnp.float32)
    self.shape = self.value.shape

  def __getitem__(self, at):
    return self.value[at]

  def __setitem__(self, at, x):
    self.value = self.value.at[at].set(x)


def test_mlp_pieces_are_the_mlp_and_its_gradient():
  """An MLP of one scalar read as pieces (piecewise.read: A_p·x + C_p) is the MLP's value,
  and the per-piece sums (piecewise.add_gradient) mapped back (params_gradient) are its
  parameters' gradient with relu′(0) = 0, at inputs exactly at kinks (a pair of kinks at
  0.5 of either slope, a pair at 0, one at −0.5, where the hidden units are exactly 0),
  near them and between, with two units of w1 = 0 (on, off)."""
  w1 = jnp.array([[0.5, -2.0, 0.25, 0.0, 0.0, 1.5, -1.0]])
  b1 = jnp.array([[-0.25, 1.0, 0.125, 0.3, -0.1, 0.0, 0.0]])
  rng = np.random.default_rng(7)
  params = {"w1": w1, "b1": b1, "w2": jnp.asarray(rng.normal(size=(1, 7)), jnp.float32),
            "b2": jnp.array([[0.2]])}
  x = jnp.array([[-1.0, -0.5, -0.499, -0.25, 0.0, 1e-3, 0.25, 0.5, 0.501, 0.75, 1.0]])
  ds = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  _, packing, _ = layouts.pack(LAYOUTS["generic"], params)
  width = piecewise.row_width(packing)
  table = piecewise.piece_table(params, width)[0]
  given = lambda p, qp, kp: x  # noqa: E731

  def mlp(params):
    hidden = x[..., None] * params["w1"][0] + params["b1"][0]
    return params["b2"][0, 0] + jnp.sum(jnp.where(hidden > 0, hidden, 0.0) * params["w2"][0], -1)

  def both(params):
    head = {name: tuple(p[0]) for name, p in params.items()}
    got, pieces = piecewise.read(given, packing, head, table, None, None)
    row = _Row(width)
    piecewise.add_gradient(given, packing, head, row, pieces, None, None, ds,
                           lambda *a: tables.add(*a, atomic=False))
    return ((got, piecewise.params_gradient(params, packing, row.value[None])),
            (mlp(params), jax.grad(lambda p: jnp.sum(ds * mlp(p)))(params)))

  (got, grads), (value, want) = jax.jit(both)(params)
  np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-6)
  for name in params:
    np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
