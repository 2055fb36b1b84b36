"""Every kernel of KERNELS against the reference kernel (the formula: its own tests check it
against NumPy), over everything the kernel declares it supports: each axis varied from a
base case — every scorer, every encoding that biases the logits (and none; the relative
ones also at sampled offsets, a table's), the masks (causal, bidirectional, a local window,
causal within a window, cross-attention of other lengths, a one-query decoding step; every
batch holds a packed row and a padded row of gapped positions), grouped- and multi-query
heads, each dtype, a logit soft-cap, each normaliser, FoX's data bias (c_i − c_j from two
vectors) and selective attention's (an array F) — kept where kernels.choice.check accepts
the case's Needs. Values and gradients (of q, k, v, of the scorer's, the encoding's and the
normaliser's parameters, and of the data bias's vectors or array) on the queries that see
a key (the fused kernels let a padding query attend to every key instead of none; no loss reads
it). Attention
dropout is compared off: random masks differ between kernels, and the reference is the one
kernel declaring it.

A kernel registered in KERNELS is tested here the moment it is registered. A kernel that
does not run on this backend (cuDNN on a CPU) is reported as skipped, with the reason; the
GPU list (tests/test_gpu.py) runs it there. The cases and their inputs are
tests/kernel_cases.py's. Pallas runs in interpret mode on the CPU: the dimensions are tiny
(4 heads of 4, 11 tokens, blocks of 4).

Tolerances: float32 outputs within 1e-5; float32 gradients within rtol 1e-4 and atol 1e-4 ×
the largest |entry| of that gradient (at least 2e-5: blocks sum in another order, and some
gradients are 0 in exact arithmetic); bfloat16 inputs: outputs within 2e-2 and gradients
within 5e-2 × their largest |entry| of the float32 reference on the same bf16-rounded inputs;
a bf16 gradient that is 0 in exact arithmetic (FIRE's output bias: a constant added to a
whole row of logits, which softmax ignores) within 5e-2 × the largest |entry| of its
parameter tree's gradients: it is a sum of the logits' gradients like its siblings, whose
rounding (the row sums dO·O of a bf16 output, as FlashAttention-2 takes them) it carries
in full, about 2e-2 here in both the Pallas and the Mosaic GPU kernels.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.kernel_cases import BLOCK, DTYPES, H, MASKS, SAMPLED, Case, case_inputs, cases
from tests.kernel_cases import runs_here
from tests.support import ROOT, eight_devices
from transformer.model.kernels.registry import KERNELS
from transformer.model.kernels.reference import reference_kernel
from transformer.model.layers import Dropout
from transformer.model.normalizers import NORMALIZERS
from transformer.model.scores import SCORES

PARAMS = [pytest.param(name, case, id=f"{name}-{case}")
          for name in KERNELS if name != "reference" and not runs_here(name)
          for case in cases(name)]
ELSEWHERE = [name for name in KERNELS if runs_here(name)]


def _outputs_and_grads(name: str, case: Case):
  """((output, gradients) of kernel `name`, the same of the reference), one compiled program;
  gradients of (q, k, v, the scorer's, the encoding's and the normaliser's states, the data
  bias's vectors)."""
  scorer, encoding, mask, _ = case.parts()
  (score_def, score_state), (enc_def, enc_state) = nnx.split(scorer), nnx.split(encoding)
  norm_def, norm_state = nnx.split(case.make_normalizer())
  kernel = KERNELS[name].make(block_size=BLOCK, softcap=case.softcap, mesh=None)
  seen = (np.asarray(mask.q_segments) > 0)[:, :, None, None]
  qkv, qkv_f32, weights = case_inputs(case)

  def loss(q, k, v, score_state, enc_state, norm_state, vectors, run):
    out = run(q, k, v, mask, case.view(nnx.merge(enc_def, enc_state), vectors),
              nnx.merge(score_def, score_state), Dropout(0.0), None,
              normalizer=nnx.merge(norm_def, norm_state))
    return jnp.sum(jnp.where(seen, out.astype(jnp.float32) * weights, 0.0)), out

  def both(qkv, qkv_f32):
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5, 6), has_aux=True)
    reference = lambda *x, **kw: reference_kernel(*x, softcap=case.softcap, **kw)  # noqa: E731
    return [grad(*args, score_state, enc_state, norm_state, case.vectors(), run)[::-1]
            for args, run in ((qkv, kernel), (qkv_f32, reference))]

  # At XLA:CPU's optimisation level 0 (which compiles Pallas' interpret mode faster) the
  # blockwise kernel's KERPLE gradients came out inf: compiled as the model is, at the default.
  return jax.jit(both)(qkv, qkv_f32), seen[..., 0, 0]


@pytest.mark.parametrize("name,case", PARAMS)
def test_kernel_equals_the_reference(name, case):
  ((out, grads), (want, want_grads)), seen = _outputs_and_grads(name, case)
  bf16 = case.dtype != "float32"
  assert out.dtype == jnp.dtype(case.dtype)
  out, want = np.asarray(out, np.float32)[seen], np.asarray(want)[seen]
  np.testing.assert_allclose(out, want, rtol=0 if bf16 else 1e-5, atol=2e-2 if bf16 else 1e-5)
  for tree, want_tree in zip(grads, want_grads, strict=True):
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(want_tree)]
    largest = max((np.abs(x).max() for x in leaves if x.size), default=0.0)
    for got, ref in zip(jax.tree.leaves(tree), leaves, strict=True):
      got, scale = np.asarray(got, np.float32), np.abs(ref).max()
      if bf16 and scale < 1e-4 * largest:  # 0 in exact arithmetic (see the docstring)
        scale = largest
      np.testing.assert_allclose(got, ref, rtol=0 if bf16 else 1e-4,
                                 atol=5e-2 * scale if bf16 else max(1e-4 * scale, 2e-5))


def test_every_kernel_declaring_multi_device_computes_the_same_on_a_mesh():
  """In a subprocess of 8 CPU devices (mesh_matches_one_device): a kernel XLA partitions
  passes by construction; one with Pallas calls must run them per device (pallas:
  shard_map), and a new one that does not is refused here."""
  names = [n for n, kernel in KERNELS.items() if kernel.multi_device and not runs_here(n)]
  code = ("import sys; from tests.kernel_cases import mesh_matches_one_device; "
          "mesh_matches_one_device(sys.argv[1:]); print('SAME', *sys.argv[1:])")
  proc = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, env=eight_devices(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["SAME", *names]


@pytest.mark.parametrize("name", ELSEWHERE)
def test_a_kernel_of_another_backend_is_run_there(name):
  pytest.skip(runs_here(name))


def test_every_kernel_but_the_reference_has_cases_on_every_axis_it_declares():
  """The cases follow the declarations: a kernel declaring a capability is tested with it
  (a soft-cap, a content bias, each dtype, every scorer), one not declaring it is not."""
  for name, kernel in KERNELS.items():
    if name == "reference":
      continue
    mine = cases(name)
    offers = kernel.offers
    assert any(c.softcap for c in mine) == ("softcap" in offers), name
    assert any(c.position == "cope" for c in mine) == ("content_bias" in offers), name
    assert any(c.position.endswith(SAMPLED) for c in mine) == ("gathered_bias" in offers), name
    assert {c.dtype for c in mine} == set(kernel.dtypes or DTYPES), name
    assert ({c.score for c in mine} == set(SCORES)) == ("any_score" in offers), name
    assert {c.normalizer for c in mine} == {
        n for n, cls in NORMALIZERS.items()
        if (cls.plain_softmax or "flash_normalizer" in offers)
        and (cls.flash or not cls.online or "online_normalizer" in offers)
        and (cls.online or "row_normalizer" in offers)}, name
    # FoX's gate has parameters: its bias needs a learned bias's gradient too (cuDNN's not)
    assert any(c.data_bias != "none" for c in mine) == (
        {"data_bias", "learned_bias"} <= offers), name
    assert any(c.data_bias == "selective" for c in mine) == (
        {"data_bias", "data_bias_array", "learned_bias"} <= offers), name
    assert {c.mask for c in mine} == set(MASKS) and {c.kv_heads for c in mine} == {1, 2, H}
