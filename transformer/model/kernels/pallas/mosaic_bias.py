"""The positional bias inside the Mosaic GPU kernels (mosaic_gpu.py): one head's BiasSpec
parameters as a row copied to shared memory and read as scalars, the bias of a 64×64 block
of logits from the query block's and key block's position rows, and a block's share of
the parameters' gradient from the logits' gradient dS.

Mosaic GPU has no gather from registers, nor from shared memory at an index array, so
the tables over k − q (tables.py) and an MLP's linear pieces (piecewise.py), which the
Triton kernels read by a gather, cannot be read here: the bias is the BiasSpec's fn per
element (ALiBi: a multiply of |Δ|; KERPLE: one log1p; T5: its bucket, one log, and a
select per bucket; FIRE: its input's two log1p and divide, and a multiply-add, compare,
select and multiply-add per hidden unit), equal to the dense formula in real arithmetic,
the transcendental functions being the device's. A bias saturating at M (T5) takes its
constant on a block whose pairs all lie beyond ±M. Primitives Mosaic GPU does not lower
(log1p, a sum over two axes) are replaced inside fn and its vjp (lowerable).

The gradient per block: the BiasSpec's `grad` in closed form where it declares one
(KERPLE: two sums); for an MLP of one scalar per pair (`mlp_input`, FIRE) two sums per
hidden unit, Σ dS and Σ dS·x over the pairs where the unit is on, from which the unit's
three parameters' gradients follow as scalars, and the vjp of the input at dS·A(x), A(x)
the MLP's slope at x (its input's parameters); else the vjp of fn (T5: one sum per bucket).
Each sum is a reduction of the tile to a scalar."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend import core
from jax.extend.core import primitives

from transformer.model.kernels.pallas import piecewise
from transformer.model.kernels.pallas.bodies import LOG2E
from transformer.model.kernels.pallas.layouts import round_up
from transformer.model.positions import BiasSpec, spec_bias

ROW = 32  # float32 per 128 bytes: a Mosaic GPU copy moves a multiple of 128 bytes
SATURATED = " saturated"  # pack's name of a saturating bias's two constants (no BiasSpec's)


def _log1p(x):
  """log(1 + x) from log alone (Mosaic GPU lowers no log1p): Kahan's x·log(u)/(u − 1),
  u = 1 + x rounded, exact to a few ulps; x where u rounds to 1."""
  u = 1.0 + x
  safe = jnp.where(u == 1.0, 2.0, u)
  return jnp.where(u == 1.0, x, jnp.log(safe) * (x / (safe - 1.0)))


def _log1p_rule(x, **params):
  del params
  return _log1p(x)


def _reduce_sum_rule(x, *, axes, **params):
  """A sum over several axes as one sum per axis, the last first (Mosaic GPU reduces a
  tile along one axis at a time)."""
  del params
  for axis in sorted(axes, reverse=True):
    x = lax.reduce_sum_p.bind(x, axes=(axis,), out_sharding=None)
  return x


def _integer_pow_rule(x, *, y):
  """x**y for y < −1 (a quotient's derivative) as 1 / x**−y, as XLA computes it."""
  if y >= -1:
    return lax.integer_pow(x, y)
  return 1.0 / lax.integer_pow(x, -y)


# Primitives (and forms) Mosaic GPU does not lower, by functions of those it does:
# primitive -> rule(*operands, **the equation's params).
SUBSTITUTES = {primitives.log1p_p: _log1p_rule, lax.reduce_sum_p: _reduce_sum_rule,
               lax.integer_pow_p: _integer_pow_rule,
               primitives.add_jaxvals_p: lambda x, y: x + y}  # a vjp's sum of cotangents


def _evaluate(jaxpr, consts, args):
  """Evaluates a jaxpr with SUBSTITUTES in place of their primitives (also inside jit)."""
  env = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]  # noqa: E731
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive in SUBSTITUTES:
      outs = [SUBSTITUTES[eqn.primitive](*ins, **eqn.params)]
    elif eqn.primitive is primitives.jit_p:
      inner = eqn.params["jaxpr"]
      outs = _evaluate(inner.jaxpr, inner.consts, ins)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def lowerable(f):
  """f with SUBSTITUTES in place of their primitives, for a Mosaic GPU kernel (a BiasSpec's
  fn, or its vjp: differentiated first, so the derivatives stay the primitives' own)."""
  def run(*args):
    closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
    out = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shape), out)
  return run


def pack(spec: BiasSpec):
  """A BiasSpec's params {name: [h, size]} as rows float32 [h, width] (width a multiple of
  ROW) and their packing ((name, offset, size), ...); where it declares `saturates_at` M,
  also its two constants (SATURATED: the bias at k − q ≤ −M and ≥ M, by its dense
  formula)."""
  params = dict(spec.params)
  if spec.saturates_at is not None:
    far = jnp.asarray([[-spec.saturates_at, spec.saturates_at]], jnp.int32)
    params[SATURATED] = spec_bias(spec, jnp.zeros((1, 1), jnp.int32), far)[0, :, 0]
  names = sorted(params)
  sizes = [params[name].shape[-1] for name in names]
  offsets = [sum(sizes[:n]) for n in range(len(names))]
  width = max(ROW, round_up(sum(sizes), ROW))
  rows = jnp.concatenate([params[name].astype(jnp.float32) for name in names], -1)
  return jnp.pad(rows, [(0, 0), (0, width - sum(sizes))]), tuple(zip(names, offsets, sizes))


def operand(spec: BiasSpec | None, heads: int):
  """A kernel's parameter rows and packing: pack(spec), or without a spec one row of
  zeros per head (copied nowhere, read never) and no packing."""
  if spec is None:
    return jnp.zeros((heads, ROW), jnp.float32), ()
  return pack(spec)


def unpack(packing, rows):
  """pack's inverse for rows [..., width] -> {name: [..., size]}."""
  return {name: rows[..., offset:offset + size] for name, offset, size in packing}


def theta(ref, packing):
  """One head's parameters from its row in shared memory: name -> tuple of scalars."""
  return {name: tuple(ref[offset + u] for u in range(size)) for name, offset, size in packing}


def zero_gradient(packing):
  """block_gradient's structure of zeros, to sum blocks into: name -> tuple of scalars."""
  return {name: (jnp.zeros((), jnp.float32),) * size for name, _, size in packing}


def params_gradient(spec: BiasSpec, packing, rows):
  """The BiasSpec's params' gradient {name: [h, size]} (params' dtypes) from rows of
  gradients [h, width] (store's, summed over programs): the SATURATED entries (Σ dS over
  the blocks beyond ±M) through the vjp of pack's constants."""
  grads = unpack(packing, rows)
  if spec.saturates_at is not None:
    _, vjp = jax.vjp(lambda p: unpack(packing, pack(dataclasses.replace(spec, params=p))[0])
                     [SATURATED], spec.params)
    grads = jax.tree.map(jnp.add, {name: grads[name] for name in spec.params},
                         vjp(grads[SATURATED])[0])
  return {name: grads[name].astype(value.dtype) for name, value in spec.params.items()}


def store(ref, packing, grads):
  """Writes gradients (name -> tuple of scalars: block_gradient's, or their sums) into a row
  ref [width] in shared memory at their packing's offsets, as scalars."""
  for name, offset, size in packing:
    for u in range(size if name in grads else 0):
      ref[offset + u] = grads[name][u]


def _pairs(q_positions, k_positions, query_axis=0):
  """The query block's positions [bq] and the key block's [bk] widened to the block, the
  queries along query_axis (0: [bq, bk], the queries in a row layout and the keys in a
  column layout; 1: [bk, bq], the transpose): int32 each."""
  n = (q_positions.shape[0], k_positions.shape[0])
  shape = n if query_axis == 0 else n[::-1]
  return (lax.broadcast_in_dim(q_positions, shape, [query_axis]),
          lax.broadcast_in_dim(k_positions, shape, [1 - query_axis]))


def tile(spec: BiasSpec, params, q_positions, k_positions, *, interpret: bool = False,
         query_axis: int = 0):
  """log2(e)·bias of a block, float32 [bq, bk] in the logits' layout (the logits are in
  base 2: q arrives multiplied by scale·log2 e; query_axis 1: its transpose [bk, bq], the
  query positions in a column layout and the keys' in a row layout): spec.fn of one head's
  params (theta) per element, or, where spec saturates at M and every pair of the block has
  k − q ≥ M (or every pair ≤ −M, from the blocks' position extremes), its constant there.
  interpret: Mosaic GPU's interpret mode (no register layouts)."""
  qp, kp = _pairs(q_positions, k_positions, query_axis)

  def exact():
    return LOG2E * lowerable(spec.fn)(params, qp, kp)
  if spec.saturates_at is None:
    return exact()
  far, above = _beyond(spec.saturates_at, q_positions, k_positions)

  def constant():
    below_above = params[SATURATED]
    value = jnp.full(qp.shape, LOG2E * jnp.where(above, below_above[1], below_above[0]),
                     jnp.float32)
    return value if interpret else plgpu.layout_cast(value, plgpu.Layout.WGMMA)
  return lax.cond(far, constant, exact)


def _beyond(m: int, q_positions, k_positions):
  """(every pair of the block has k − q ≥ m or every pair ≤ −m, the former), from the
  blocks' position extremes: bool scalars."""
  low = jnp.min(k_positions) - jnp.max(q_positions)  # the block's least k − q
  high = jnp.max(k_positions) - jnp.min(q_positions)
  return (low >= m) | (high <= -m), low >= m


def _mlp_gradient(spec: BiasSpec, params, qp, kp, ds):
  """The vjp of an MLP of one scalar per pair (spec.mlp_input) at ds [bq, bk]: per unit u,
  S0 = Σ_on dS and S1 = Σ_on dS·x over the pairs where w1·x + b1 > 0, so d w1 = w2·S1,
  d b1 = w2·S0, d w2 = w1·S1 + b1·S0; d b2 = Σ dS; the input's parameters by the vjp of
  mlp_input at dS·A(x), A(x) = Σ_on w2·w1."""
  x = spec.mlp_input(params, qp, kp)
  dx = ds * x
  slope = jnp.zeros(x.shape, jnp.float32)
  grads = {"w1": [], "b1": [], "w2": [], "b2": (jnp.sum(ds),)}
  for w1, b1, w2 in zip(params["w1"], params["b1"], params["w2"]):
    on = x * w1 + b1 > 0
    s0, s1 = jnp.sum(jnp.where(on, ds, 0.0)), jnp.sum(jnp.where(on, dx, 0.0))
    slope = slope + jnp.where(on, w2 * w1, 0.0)
    grads["w1"].append(w2 * s1)
    grads["b1"].append(w2 * s0)
    grads["w2"].append(w1 * s1 + b1 * s0)
  own = {name: params[name] for name in params if name not in piecewise.MLP}
  if own:
    _, vjp = jax.vjp(lambda p: spec.mlp_input({**params, **p}, qp, kp), own)
    grads.update(vjp(ds * slope)[0])
  return {name: tuple(value) for name, value in grads.items()}


def block_gradient(spec: BiasSpec, params, q_positions, k_positions, ds):
  """A block's share of one head's parameters' gradient, name -> tuple of scalars, from
  the logits' gradient ds float32 [bq, bk] (of the bias in natural units: the caller
  multiplies a base-2 dS by log2 e) and the blocks' positions [bq], [bk]. Where spec
  saturates (T5), a block beyond ±M gives Σ dS at its constant's SATURATED entry (one sum,
  not one per parameter: params_gradient maps it) and the others' gradient 0."""
  own = {name: value for name, value in params.items() if name != SATURATED}
  if spec.grad is not None:
    grad = spec.grad
  elif spec.mlp_input is not None:
    grad = functools.partial(_mlp_gradient, spec)
  else:
    def grad(params, qp, kp, ds):
      return jax.vjp(lambda p: spec.fn(p, qp, kp), params)[1](ds)[0]

  def exact():
    return lowerable(grad)(own, *_pairs(q_positions, k_positions), ds)
  if spec.saturates_at is None:
    return exact()
  far, above = _beyond(spec.saturates_at, q_positions, k_positions)
  zero = jnp.zeros((), jnp.float32)

  def constant():
    total = jnp.sum(jnp.sum(ds, axis=1), axis=0)
    grads = {name: (zero,) * len(value) for name, value in own.items()}
    return {**grads, SATURATED: (jnp.where(above, zero, total), jnp.where(above, total, zero))}
  return lax.cond(far, constant, lambda: {**exact(), SATURATED: (zero, zero)})
