"""The cases of the kernel conformance test (tests/test_kernel_conformance.py): each kernel's
cases over everything it declares it supports, their inputs, and the check of the kernels on
a mesh of 8 devices that the test runs in a subprocess (which imports this module; not a test
module: see tests/support.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model.data_biases import ForgetBiased, Selected
from transformer.model.kernels.capabilities import Needs
from transformer.model.kernels.choice import check
from transformer.model.kernels.registry import KERNELS
from transformer.model.layers import Dropout
from transformer.model.masks import Mask
from transformer.model.normalizers import NORMALIZERS, make_normalizer
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
  normalizer: str = "softmax"
  # "forget": FoX's c_i − c_j beside the encoding; "selective": an array F subtracted from
  # it (selective attention's); their inputs are vectors()
  data_bias: str = "none"

  def parts(self):
    """(scorer, encoding, mask, its Needs); view(encoding) is what the kernel is handed."""
    scorer = make_score(self.score, H, D, rngs=nnx.Rngs(2))
    mask = _mask(self.mask)
    normalizer = self.make_normalizer()
    name = self.position.removesuffix(SAMPLED)
    encoding = make_positional_encoding(name, H * D, H, 64, causal=mask.causal,
                                        settings=SETTINGS, rngs=nnx.Rngs(1))
    needs = Needs.of(scorer, self.view(encoding), normalizer=normalizer,
                     data_bias=self.data_bias != "none",
                     data_bias_array=self.data_bias == "selective", score=self.score,
                     position=name, softcap=self.softcap, window=mask.window is not None,
                     grouped=self.kv_heads < H, dtype=self.dtype, block_size=BLOCK)
    return scorer, encoding, mask, needs

  def make_normalizer(self):
    """The case's normaliser, a sink's logits drawn away from 0 (its gradient then counts);
    a causal-only one made for every mask (compared only with the kernels offering it)."""
    normalizer = make_normalizer(self.normalizer, H, max_len=T, causal=True, rngs=nnx.Rngs(3))
    if hasattr(normalizer, "sink"):
      normalizer.sink[...] = jnp.array([0.5, -1.0, 2.0, 0.0])
    return normalizer

  def vectors(self):
    """The data bias's vectors (c at the queries [2, tq, H], at the keys [2, T, H]):
    cumulative sums of log σ of random logits, drawn apart for queries and keys (the
    kernels take any two); selective attention's F [2, tq, T] (cumulative sums down the
    queries of nonnegative draws); or None."""
    if self.data_bias == "none":
      return None
    rng = np.random.default_rng(7)
    tq = _mask(self.mask).q_segments.shape[1]
    if self.data_bias == "selective":
      return (jnp.cumsum(jnp.asarray(np.abs(rng.normal(size=(2, tq, T))), jnp.float32), 1),)
    return tuple(jnp.cumsum(jax.nn.log_sigmoid(jnp.asarray(2 + rng.normal(size=(2, n, H)),
                                                           jnp.float32)), 1) for n in (tq, T))

  def view(self, encoding, vectors=None):
    """The encoding at sampled offsets (a fixed draw of 2 rows' distances) for NAME@sampled;
    with the data bias of `vectors` (vectors()) beside it."""
    if self.position.endswith(SAMPLED):
      table = batch_offsets(jax.random.key(4), jnp.array([T, 5]), T, 16)  # distances < 16
      encoding = AtSampledOffsets(encoding, table)
    vectors = vectors or self.vectors()
    if vectors is None:
      return encoding
    return (Selected if self.data_bias == "selective" else ForgetBiased)(encoding, *vectors)

  def __str__(self):
    base = Case(dtype=self.dtype)
    changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
               if getattr(self, f.name) != getattr(base, f.name)]
    return "-".join([self.dtype, *changed])


def runs_here(name: str) -> str:
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
          else list(dtypes), "softcap": [0.0, 2.0],
          "normalizer": ["softmax", *sorted(set(NORMALIZERS) - {"softmax"})],
          "data_bias": ["none", "forget", "selective"]}


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


def case_inputs(case: Case):
  """q [2, tq, H, D], k, v [2, T, kv_heads, D] in the case's dtype (entries of ~2, so that
  the soft-cap bites), and float32 copies of the same rounded values; the loss weights."""
  rng = np.random.default_rng(5)
  tq = _mask(case.mask).q_segments.shape[1]
  shapes = [(2, tq, H, D), (2, T, case.kv_heads, D), (2, T, case.kv_heads, D)]
  qkv = [jnp.asarray(2 * rng.normal(size=s), case.dtype) for s in shapes]
  weights = jnp.asarray(rng.normal(size=(2, tq, H, D)), jnp.float32)
  return qkv, [x.astype(jnp.float32) for x in qkv], weights


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
    qkv, _, weights = case_inputs(case)
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
