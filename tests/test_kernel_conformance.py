"""Every kernel of KERNELS against the reference kernel (the formula: its own tests check it
against NumPy), over everything the kernel declares it supports: each axis varied from a
base case — every scorer, every encoding that biases the logits (and none; the relative
ones also at sampled offsets, a table's), the masks (causal, bidirectional, a local window,
causal within a window, cross-attention of other lengths, a one-query decoding step; every
batch holds a packed row and a padded row of gapped positions), grouped- and multi-query
heads, each dtype, a logit soft-cap — kept where
kernel_choice.check accepts the case's Needs. Values and gradients (of q, k, v and of the
scorer's and the encoding's parameters) on the queries that see a key (the fused kernels
let a padding query attend to every key instead of none; no loss reads it). Attention
dropout is compared off: random masks differ between kernels, and the reference is the one
kernel declaring it.

A kernel registered in KERNELS is tested here the moment it is registered. A kernel that
does not run on this backend (cuDNN on a CPU) is reported as skipped, with the reason; the
GPU list (tests/test_gpu.py) runs it there. Pallas runs in interpret mode on the CPU: the
dimensions are tiny (4 heads of 4, 11 tokens, blocks of 4).

Tolerances: float32 outputs within 1e-5; float32 gradients within rtol 1e-4 and atol 1e-4 ×
the largest |entry| of that gradient (at least 2e-5: blocks sum in another order, and some
gradients are 0 in exact arithmetic); bfloat16 inputs: outputs within 2e-2 and gradients
within 5e-2 × their largest |entry| of the float32 reference on the same bf16-rounded inputs.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model.kernel_choice import Needs, check
from transformer.model.kernels import KERNELS, reference_kernel
from transformer.model.layers import Dropout
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, PositionSettings, make_positional_encoding
from transformer.model.positions.randomized import AtSampledOffsets, batch_offsets
from transformer.model.positions.relative import Fire, T5Bias
from transformer.model.scores import SCORES, make_score

H, D, T, BLOCK = 4, 4, 11, 4
DTYPES = ("float32", "bfloat16")
# Small tables and MLPs: the Pallas kernels unroll a loop per T5 bucket and per FIRE unit
# (the T5 buckets still reach their log range within 11 positions).
SETTINGS = PositionSettings(t5=T5Bias.Settings(num_buckets=8, max_distance=12),
                            fire=Fire.Settings(width=4))
# Every encoding that biases the logits (the kernels' concern; rotations and embeddings act
# before them), and none; each relative one also at sampled offsets ("NAME@sampled": its
# bias read from a table, as randomized positions drawn per batch give it).
POSITIONS_SEEN = sorted(n for n, cls in POSITIONS.items() if cls.biases or cls.content_biases)
SAMPLED = "@sampled"
POSITIONS_SEEN += [n + SAMPLED for n in POSITIONS_SEEN if POSITIONS[n].relative]


def _rows(length=T):
  """Segments and positions [2, length]: a packed row (6 + 3 tokens, then 2 of padding) and
  a row of sorted positions with gaps (as randomized positions give), then padding."""
  gapped = list(np.cumsum(np.random.default_rng(0).integers(1, 4, length - 2)) - 1)
  seg = jnp.array([[1] * 6 + [2] * 3 + [0] * (length - 9), [1] * (length - 2) + [0] * 2])
  pos = jnp.array([list(range(6)) + list(range(3)) + [0] * (length - 9), gapped + [0] * 2])
  return seg, pos


def _mask(kind: str) -> Mask:
  seg, pos = _rows()
  if kind == "cross":  # 5 queries of their own segments and positions against the 11 keys
    q_seg = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 0, 0]])
    return Mask(q_seg, seg, jnp.array([[0, 1, 0, 1, 0], [0, 2, 5, 0, 0]]), pos)
  if kind == "decode":  # one query per row, at its row's positions 4 and 7 (cached decoding)
    return Mask(jnp.ones((2, 1), jnp.int32), jnp.ones((2, T), jnp.int32),
                jnp.array([[4], [7]]), jnp.broadcast_to(jnp.arange(T), (2, T)), causal=True)
  causal, window = {"causal": (True, None), "bidirectional": (False, None),
                    "window": (False, 2), "causal_window": (True, 3)}[kind]
  return Mask(seg, seg, pos, pos, causal=causal, window=window)


MASKS = ("causal", "bidirectional", "window", "causal_window", "cross", "decode")


@dataclasses.dataclass(frozen=True)
class Case:
  score: str = "scaled_dot"
  position: str = "none"
  mask: str = "causal"
  kv_heads: int = H
  dtype: str = "float32"
  softcap: float = 0.0

  def parts(self):
    """(scorer, encoding, mask, its Needs); view(encoding) is what the kernel is handed."""
    scorer = make_score(self.score, H, D, rngs=nnx.Rngs(2))
    mask = _mask(self.mask)
    name = self.position.removesuffix(SAMPLED)
    encoding = make_positional_encoding(name, H * D, H, 64, causal=mask.causal,
                                        settings=SETTINGS, rngs=nnx.Rngs(1))
    needs = Needs.of(scorer, self.view(encoding), score=self.score, position=name,
                     softcap=self.softcap, window=mask.window is not None,
                     grouped=self.kv_heads < H, dtype=self.dtype, block_size=BLOCK)
    return scorer, encoding, mask, needs

  def view(self, encoding):
    """The encoding at sampled offsets (a fixed draw of 2 rows' distances) for NAME@sampled."""
    if not self.position.endswith(SAMPLED):
      return encoding
    table = batch_offsets(jax.random.key(4), jnp.array([T, 5]), T, 16)  # distances < 16
    return AtSampledOffsets(encoding, table)

  def __str__(self):
    base = Case(dtype=self.dtype)
    changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
               if getattr(self, f.name) != getattr(base, f.name)]
    return "-".join([self.dtype, *changed])


def _runs_here(name: str) -> str:
  """'' if kernel `name` runs on this backend, else why not."""
  backends = KERNELS[name].backends
  if backends is None or jax.default_backend() in backends:
    return ""
  return f"{name} runs on {' or '.join(backends)} only; this backend is {jax.default_backend()}"


def _axes(name: str) -> dict[str, list]:
  """The values of each axis of a case (the base value first)."""
  dtypes = KERNELS[name].dtypes or DTYPES
  return {"score": ["scaled_dot", *sorted(set(SCORES) - {"scaled_dot"})],
          "position": ["none", *POSITIONS_SEEN],
          "mask": list(MASKS), "kv_heads": [H, 1, 2],
          "dtype": ["float32", *(d for d in dtypes if d != "float32")] if "float32" in dtypes
          else list(dtypes), "softcap": [0.0, 2.0]}


def _accepts(name: str, case: Case) -> bool:
  """Kernel `name` declares it supports the case (kernel_choice.check), and the case is one
  this test compares: cross-attention has no positional bias (the model's relates two
  sequences' positions), and other dtypes than float32 are checked with the scaled dot
  product (a learned temperature's or width's bf16 logits are test_gaussian_dot's)."""
  if case.mask == "cross" and case.position != "none":
    return False
  if case.dtype != "float32" and case.score != "scaled_dot":
    return False
  try:
    check(name, case.parts()[3])
  except ConfigError:
    return False
  return True


def cases(name: str) -> list[Case]:
  """Few cases that together hold every value of every axis that kernel `name` declares it
  supports (a value is declared when the base case with that value alone is accepted):
  each case starts from the base and takes, greedily, the next value not yet covered of
  each axis it has not changed, while the kernel still accepts it."""
  axes = _axes(name)
  base = Case(**{axis: values[0] for axis, values in axes.items()})
  wanted = [(axis, value) for axis, values in axes.items() for value in values
            if _accepts(name, dataclasses.replace(base, **{axis: value}))]
  covered, out = set(), []
  while not set(wanted) <= covered:
    case = base
    for axis, value in wanted:
      if (axis, value) in covered or getattr(case, axis) != getattr(base, axis):
        continue
      trial = dataclasses.replace(case, **{axis: value})
      if _accepts(name, trial):
        case = trial
    out.append(case)
    covered |= {(axis, getattr(case, axis)) for axis in axes}
  return out


PARAMS = [pytest.param(name, case, id=f"{name}-{case}")
          for name in KERNELS if name != "reference" and not _runs_here(name)
          for case in cases(name)]
ELSEWHERE = [name for name in KERNELS if _runs_here(name)]


def _inputs(case: Case):
  """q [2, tq, H, D], k, v [2, T, kv_heads, D] in the case's dtype (entries of ~2, so that
  the soft-cap bites), and float32 copies of the same rounded values; the loss weights."""
  rng = np.random.default_rng(5)
  tq = _mask(case.mask).q_segments.shape[1]
  shapes = [(2, tq, H, D), (2, T, case.kv_heads, D), (2, T, case.kv_heads, D)]
  qkv = [jnp.asarray(2 * rng.normal(size=s), case.dtype) for s in shapes]
  weights = jnp.asarray(rng.normal(size=(2, tq, H, D)), jnp.float32)
  return qkv, [x.astype(jnp.float32) for x in qkv], weights


def _outputs_and_grads(name: str, case: Case):
  """((output, gradients) of kernel `name`, the same of the reference), one compiled program;
  gradients of (q, k, v, the scorer's state, the encoding's state)."""
  scorer, encoding, mask, _ = case.parts()
  (score_def, score_state), (enc_def, enc_state) = nnx.split(scorer), nnx.split(encoding)
  kernel = KERNELS[name].make(block_size=BLOCK, softcap=case.softcap, mesh=None)
  seen = (np.asarray(mask.q_segments) > 0)[:, :, None, None]
  qkv, qkv_f32, weights = _inputs(case)

  def loss(q, k, v, score_state, enc_state, run):
    out = run(q, k, v, mask, case.view(nnx.merge(enc_def, enc_state)),
              nnx.merge(score_def, score_state), Dropout(0.0), None)
    return jnp.sum(jnp.where(seen, out.astype(jnp.float32) * weights, 0.0)), out

  def both(qkv, qkv_f32):
    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    reference = lambda *x: reference_kernel(*x, softcap=case.softcap)  # noqa: E731
    return [grad(*args, score_state, enc_state, run)[::-1]
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
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0 if bf16 else 1e-4,
                               atol=5e-2 * scale if bf16 else max(1e-4 * scale, 2e-5))


# The custom call a compiled Pallas kernel lowers to, per platform; the platform's backend.
COMPILED_PALLAS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
BACKEND = {"cuda": "gpu", "tpu": "tpu"}


def _pallas_calls(jaxpr, inside: bool = False) -> tuple[int, int]:
  """(the pallas_calls of `jaxpr` and of the jaxprs in its equations, those of them outside
  a shard_map)."""
  total = bare = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    total, bare = total + (name == "pallas_call"), bare + (name == "pallas_call" and not inside)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub
        if isinstance(sub, jax.extend.core.Jaxpr):
          counts = _pallas_calls(sub, inside or name == "shard_map")
          total, bare = total + counts[0], bare + counts[1]
  return total, bare


def mesh_matches_one_device(names):
  """Run in a process of 8 devices: each kernel of `names`, made for a 2x2x2 (data, fsdp,
  tensor) mesh, gives the values and gradients it gives made for one device, on inputs
  laid out on the mesh (4 rows, 4 query heads and 2 key/value heads: all split), with T5's
  learned bias where the kernel takes it; its Pallas calls, forward and backward, run
  inside a shard_map (XLA cannot partition a compiled Pallas call; in interpret mode it
  partitions the emulation, so the values alone would not tell); and the program lowers
  for cuda and tpu (those the kernel declares), with compiled Pallas calls where it has
  any."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  for name in names:
    case = next(c for c in (Case(position="t5", kv_heads=2), Case(kv_heads=2), Case())
                if _accepts(name, c))
    scorer, encoding, mask, _ = case.parts()
    (score_def, score_state), (enc_def, enc_state) = nnx.split(scorer), nnx.split(encoding)
    qkv, _, weights = _inputs(case)
    rows = lambda x: jnp.concatenate([x, x])  # noqa: E731
    qkv, weights, mask = [rows(x) for x in qkv], rows(weights), jax.tree.map(rows, mask)

    def grads(kernel):
      def loss(q, k, v, score_state, enc_state):
        out = kernel(q, k, v, mask, nnx.merge(enc_def, enc_state),
                     nnx.merge(score_def, score_state), Dropout(0.0), None)
        return jnp.sum(out.astype(jnp.float32) * weights)
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    inputs = jax.device_put((*qkv, score_state, enc_state),
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    make = lambda m: KERNELS[name].make(block_size=BLOCK, softcap=0.0, mesh=m)  # noqa: E731
    want = grads(make(None))(*inputs)
    on_mesh = grads(make(mesh.abstract_mesh))
    got = on_mesh(*inputs)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"{name} on the mesh")
    pallas_calls, bare = _pallas_calls(jax.make_jaxpr(on_mesh)(*inputs).jaxpr)
    assert bare == 0, f"{name}: {bare} pallas_call(s) outside shard_map"
    for platform, call in COMPILED_PALLAS.items():  # the same program, for the accelerators
      if KERNELS[name].backends is None or BACKEND[platform] in KERNELS[name].backends:
        text = on_mesh.trace(*inputs).lower(lowering_platforms=(platform,)).as_text()
        assert (call in text) == (pallas_calls > 0), f"{name} on the mesh, for {platform}"


def test_every_kernel_declaring_multi_device_computes_the_same_on_a_mesh():
  """In a subprocess of 8 CPU devices (mesh_matches_one_device): a kernel XLA partitions
  passes by construction; one with Pallas calls must run them per device (pallas:
  shard_map), and a new one that does not is refused here."""
  names = [n for n, kernel in KERNELS.items() if kernel.multi_device and not _runs_here(n)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu"}
  code = ("import sys; from tests.test_kernel_conformance import mesh_matches_one_device; "
          "mesh_matches_one_device(sys.argv[1:]); print('SAME', *sys.argv[1:])")
  proc = subprocess.run([sys.executable, "-c", code, *names], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ["SAME", *names]


@pytest.mark.parametrize("name", ELSEWHERE)
def test_a_kernel_of_another_backend_is_run_there(name):
  pytest.skip(_runs_here(name))


def test_every_kernel_but_the_reference_has_cases_on_every_axis_it_declares():
  """The cases follow the declarations: a kernel declaring a capability is tested with it
  (a soft-cap, a content bias, each dtype, every scorer), one not declaring it is not."""
  for name, kernel in KERNELS.items():
    if name == "reference":
      continue
    mine = cases(name)
    assert any(c.softcap for c in mine) == kernel.softcap, name
    assert any(c.position == "cope" for c in mine) == kernel.content_bias, name
    assert any(c.position.endswith(SAMPLED) for c in mine) == kernel.gathered_bias, name
    assert {c.dtype for c in mine} == set(kernel.dtypes or DTYPES), name
    assert ({c.score for c in mine} == set(SCORES)) == kernel.any_score, name
    assert {c.mask for c in mine} == set(MASKS) and {c.kv_heads for c in mine} == {1, 2, H}
