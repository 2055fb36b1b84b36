"""A ReLU MLP of one scalar per pair (a BiasSpec declaring `mlp_input`: FIRE's) as the
piecewise-linear function it is, built in XLA once per call for the kernels to read in
place of the MLP's units per element (bodies._logits), and its gradient.

f(x) = b2 + Σ_u w2[u]·relu(w1[u]·x + b1[u]) has a kink at t_u = −b1[u]/w1[u] per unit
(none where w1[u] = 0). With L = #{kinks < x} and E = #{kinks ≤ x}, unit u is on (its
w1[u]·x + b1[u] > 0) exactly when L ≥ e_u (w1[u] > 0) or E ≤ r_u (w1[u] < 0), r_u and
e_u the numbers of kinks below and at most t_u; so f is A_p·x + C_p on each piece
p = L + E, 2·width + 1 of them: the open intervals between kinks (p even) and the kinks
themselves (a tie x = t_u: unit u off, relu′(0) = 0). Distinct reachable (L, E) give
distinct p (a run of m equal kinks leaves the pieces between its ends empty), so one row
per head holds it all:

  [ kinks (width) | A (2·width + 1) | C (2·width + 1) | slots ]

and a kernel reads x (the BiasSpec's mlp_input), counts p against the kinks, and gathers
A_p, C_p. Its gradient: per pair, the logits' gradient dS·x is added at A_p's entry and
dS at C_p's (tables.add), and the input's parameters' (the BiasSpec's other parameters:
FIRE's c and threshold) block sums, the vjp of mlp_input at dS·A_p, at the row's slots
(in the packing's order); params_gradient turns the A and C entries into the MLP's
parameters' gradient by the vjp of the pieces' construction (the on-states held fixed,
as the units' relu′ holds them).

Exact in real arithmetic. In floating point A_p·x + C_p sums the units in another order
than b2 + Σ_u w2[u]·relu(·) does (the last bits of the bias differ), and a unit's side is
decided by comparing x with t_u computed in XLA, not by the sign of w1[u]·x + b1[u]: the
two can disagree where x is within rounding of a kink (the bias there differs by the
unit's rounding-sized hidden value, its parameters' gradient by that unit's share)."""

import jax
import jax.numpy as jnp

MLP = ("b1", "b2", "w1", "w2")  # the MLP's parameters; a BiasSpec's others are its input's


def units(packing) -> int:
  """The MLP's width, from a layout's packing ((name, offset, size), ...)."""
  return dict((name, size) for name, _, size in packing)["w1"]


def inputs(packing):
  """The input's parameters, (name, slot, size) in packing's order, slot counted from the
  row's slots."""
  found, slot = [], 0
  for name, _, size in packing:
    if name not in MLP:
      found.append((name, slot, size))
      slot += size
  return tuple(found)


def row_width(packing) -> int:
  """Entries of a head's row: kinks, A, C, slots."""
  k = units(packing)
  return k + 2 * (2 * k + 1) + sum(size for _, _, size in inputs(packing))


def _on_states(w1, b1):
  """One head's units' states on each piece, bool [2K + 1, K] (K = len(w1)), and the
  sorted kinks [K] (+inf for a unit with w1 = 0, whose state is b1 > 0 on every piece)."""
  k = w1.shape[0]
  t = jnp.where(w1 != 0, -b1 / jnp.where(w1 != 0, w1, 1.0), jnp.inf)
  s = jnp.sort(t)
  below = jnp.sum(s[None, :] < t[:, None], -1)  # r_u
  at_most = jnp.sum(s[None, :] <= t[:, None], -1)  # e_u
  # the reachable (L, E): open intervals (s_k, s_k+1) where not empty, then each kink
  n = jnp.arange(k + 1)
  lo = jnp.concatenate([jnp.array([-jnp.inf]), s])
  hi = jnp.concatenate([s, jnp.array([jnp.inf])])
  count_l = jnp.concatenate([n, jnp.sum(s[None, :] < s[:, None], -1)])
  count_e = jnp.concatenate([n, jnp.sum(s[None, :] <= s[:, None], -1)])
  valid = jnp.concatenate([lo < hi, jnp.isfinite(s)])
  on = (((w1 > 0) & (count_l[:, None] >= at_most)) | ((w1 < 0) & (count_e[:, None] <= below))
        | ((w1 == 0) & (b1 > 0)))  # [candidates, K]
  pieces = jnp.where(valid, count_l + count_e, 2 * k + 1)  # unreachable: dropped
  # equal rows where p repeats (a run's kinks): the set is the same whichever lands
  states = jnp.zeros((2 * k + 1, k), bool).at[pieces].set(on, mode="drop")
  return states, s


def _pieces(mlp):
  """A and C [h, 2K + 1] of the MLP {w1, b1, w2: [h, K], b2: [h, 1]} per head, and the
  sorted kinks [h, K]; differentiable in the MLP's parameters with the states held."""
  states, kinks = jax.vmap(_on_states)(*(jax.lax.stop_gradient(mlp[n]) for n in ("w1", "b1")))
  on = states.astype(jnp.float32)
  a = jnp.einsum("hpu,hu->hp", on, mlp["w2"] * mlp["w1"])
  c = mlp["b2"] + jnp.einsum("hpu,hu->hp", on, mlp["w2"] * mlp["b1"])
  return a, c, kinks


def piece_table(params, width: int):
  """The heads' rows [h, width] (width ≥ row_width): kinks, A, C, zeros for the slots."""
  a, c, kinks = _pieces({n: params[n].astype(jnp.float32) for n in MLP})
  row = jnp.concatenate([kinks, a, c], -1)
  return jnp.pad(row, [(0, 0), (0, width - row.shape[-1])])


def params_gradient(params, packing, dtable):
  """The gradient of the BiasSpec's params {name: [h, size]} from the rows' gradient
  dtable float32 [h, width]: the MLP's by the vjp of _pieces at the A and C entries, the
  input's read from the slots."""
  k = units(packing)
  p = 2 * k + 1
  mlp = {n: params[n].astype(jnp.float32) for n in MLP}
  _, vjp = jax.vjp(lambda m: _pieces(m)[:2], mlp)
  grads = vjp((dtable[:, k:k + p], dtable[:, k + p:k + 2 * p]))[0]
  for name, slot, size in inputs(packing):
    grads[name] = dtable[:, k + 2 * p + slot:k + 2 * p + slot + size]
  return {name: grads[name].astype(params[name].dtype) for name in params}


def read(mlp_input, packing, params, table_ref, qp, kp):
  """A block's bias [bq, bk] from a head's row table_ref [width], and (x, the piece p
  int32, A_p) for its gradient: x = mlp_input(params, qp, kp), p counted against the
  kinks (read as scalars), A_p and C_p gathered."""
  k = units(packing)
  x = mlp_input(params, qp, kp)
  piece = jnp.zeros(x.shape, jnp.int32)
  for u in range(k):
    kink = table_ref[u]
    piece = piece + jnp.where(x > kink, 1, 0) + jnp.where(x >= kink, 1, 0)
  a = table_ref[k + piece]
  return a * x + table_ref[k + 2 * k + 1 + piece], (x, piece, a)


def add_gradient(mlp_input, packing, params, ref, read_out, qp, kp, dlogits, add):
  """Adds a block's share of a head's row gradient ref [width] by add(ref, at, values)
  (tables.add): dS·x at each pair's A_p, dS at its C_p, and the input's parameters' block
  sums (the vjp of mlp_input at dS·A_p) at the slots; read_out: read's (x, p, A_p) of the
  block."""
  k = units(packing)
  p = 2 * k + 1
  x, piece, a = read_out
  add(ref, k + piece, dlogits * x)
  add(ref, k + p + piece, dlogits)
  names = [name for name, _, _ in inputs(packing)]
  if not names:
    return
  _, vjp = jax.vjp(lambda own: mlp_input({**params, **own}, qp, kp),
                   {name: params[name] for name in names})
  grads = vjp(dlogits * a)[0]
  for name, slot, size in inputs(packing):
    for u in range(size):
      at = jnp.full((1, 1), k + 2 * p + slot + u, jnp.int32)
      add(ref, at, jnp.reshape(grads[name][u], (1, 1)))
