"""A positional bias as a table over the offset Δ = k − q, built in XLA once per call, for
the kernels to read instead of evaluating the BiasSpec per element (bodies._logits).

For a BiasSpec that declares `saturates_at` = M (its bias a function of Δ alone, constant
beyond ±M: T5's buckets past max_distance), the table holds, per head, the bias at
Δ = −M, …, M (2M + 1 entries, then zeros up to the layout's width), computed by the
encoding's own formula (its dense form where it has one) at query position 0 and key
position Δ; a kernel reads entry clip(Δ, −M, M) + M. On integer positions the value read is
the dense bias's, bit for bit (the same formula at the same Δ). Where the kernels read the
table they also give its gradient, the logits' gradient summed per entry (add),
and table_gradient turns it into the parameters' by the vjp of the table's construction.

A BiasSpec declaring `mlp_input` (FIRE's) is read from a table of its MLP's linear pieces
instead (piecewise.py); reads, read and add_gradient serve the kernels both tables."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

from transformer.model.kernels.pallas import piecewise
from transformer.model.positions import BiasSpec, spec_bias


def relative_table(spec: BiasSpec, width: int):
  """The bias over Δ = −M..M (M = spec.saturates_at), zero-padded to `width` ≥ 2M + 1:
  float32 [heads, width]."""
  m = spec.saturates_at
  offsets = jnp.arange(-m, m + 1, dtype=jnp.int32)[None, :]  # [1, 2M + 1]
  table = spec_bias(spec, jnp.zeros((1, 1), jnp.int32), offsets)[0, :, 0]  # [h, 2M + 1]
  return jnp.pad(table.astype(jnp.float32), [(0, 0), (0, width - 2 * m - 1)])


def table_gradient(spec: BiasSpec, width: int, dtable):
  """The gradient of spec.params from the table's, dtable float32 [heads, width] (the
  logits' gradient summed per entry of relative_table): the vjp of relative_table."""
  def build(params):
    return relative_table(dataclasses.replace(spec, params=params), width)
  return jax.vjp(build, spec.params)[1](dtable)[0]


def entry(m: int, q_positions, k_positions):
  """The table entry of each pair of a block: clip(k − q, ±m) + m, int [bq, bk]."""
  return jnp.clip(k_positions - q_positions, -m, m) + m


def add(ref, at, dlogits, atomic: bool):
  """Adds a block's logits' gradient dlogits [bq, bk] to a head's row of the table's
  gradient, ref [width], at each pair's entry `at` [bq, bk]. atomic (compiled Triton): one
  atomic add per pair at a gathered address, the device summing repeated entries (the one
  scatter Triton's lowering has; adds to one entry are serialised). Else (interpret mode,
  whose atomic_add keeps one of repeated indices: its discharge is a set) a scatter-add,
  then one add of the row."""
  if atomic:
    importlib.import_module("jax.experimental.pallas.triton").atomic_add(ref, (at,), dlogits)
  else:
    ref[...] += jnp.zeros(ref.shape, jnp.float32).at[at].add(dlogits)


def reads(st) -> bool:
  """A kernel of Static st reads the bias from a head's row of a table: over k − q, or an
  MLP's pieces (piecewise.py)."""
  return st.table is not None or st.mlp_input is not None


def read(st, params, table_ref, qp, kp):
  """A block's bias [bq, bk] from a head's row table_ref: the entry of each pair's k − q,
  or the MLP's piece at each pair's input."""
  if st.mlp_input is None:
    return table_ref[entry(st.table, qp, kp)]
  return piecewise.read(st.mlp_input, st.params, params, table_ref, qp, kp)[0]


def add_gradient(st, params, table_ref, ref, qp, kp, dlogits):
  """Adds a block's logits' gradient dlogits [bq, bk] to a head's row ref of the table's
  gradient: per entry of k − q, or per piece of the MLP with its input's parameters' block
  sums (piecewise.add_gradient)."""
  if st.mlp_input is None:
    add(ref, entry(st.table, qp, kp), dlogits, st.atomic_table)
    return
  pieces = piecewise.read(st.mlp_input, st.params, params, table_ref, qp, kp)[1]
  piecewise.add_gradient(st.mlp_input, st.params, params, ref, pieces, qp, kp, dlogits,
                         functools.partial(add, atomic=st.atomic_table))
