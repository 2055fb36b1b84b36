"""Data-dependent logit biases: a bias computed from the tokens themselves, added beside the
positional encoding's (`model.attention.data_bias`).

`forget` is the Forgetting Transformer's forget gate (Lin et al., ICLR 2025; their code,
zhixuan-lin/forgetting-transformer, `fgate_type="full"`): per head, f_t = σ(w_hᵀx_t + b_h)
from the layer's input, and the logit of query i and key j ≤ i gains
Σ_{l=j+1..i} log f_l = c_i − c_j, c the cumulative sums of log f along the sequence: a
learned, content-dependent ALiBi. The bias is two vectors per row and head (c at the
queries, c at the keys), which the `pallas` kernel reads per block like positions
(bias_vectors(); its gradient, the row and column sums of the logits', flows back through
the cumulative sum in XLA); a kernel adding a bias array computes it whole (`data_bias`:
transformer/model/kernels/capabilities.py).

DATA_BIASES: an entry is made with `(d_model, num_heads, *, dtype, rngs)`; `sums(x, offset)`
gives the cumulative sums [b, t, h] of x's tokens continuing `offset` [b, h] (None: from 0;
the cache's last sum when decoding), None when it adds nothing; `view(encoding, q_sums,
k_sums)` the encoding a kernel is handed, its bias seam adding c_i − c_j. Each declares
`vectors` (it adds a bias: the kernel must declare `data_bias`) and `causal_only` (defined
for causal self-attention, where keys j ≤ i precede the query).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.registry import lookup
from transformer.model.layers import Dense
from transformer.model.normalizers import causal_only_error
from transformer.model.positions import EncodingView


class NoDataBias(nnx.Module):
  """No data-dependent bias: the encoding as it is."""

  vectors = False
  causal_only = False

  def __init__(self, d_model: int, num_heads: int, *, dtype=jnp.float32, rngs=None):
    del d_model, num_heads, dtype, rngs

  def sums(self, x: jax.Array, offset: jax.Array | None) -> jax.Array | None:
    del x, offset
    return None

  def view(self, encoding, q_sums, k_sums):
    del q_sums, k_sums
    return encoding


class ForgetGate(NoDataBias):
  """FoX's forget gate: log f = log σ(x W + b), W [d_model, h] and b [h] (their
  `fgate_proj`, a Linear with a bias), computed in float32; c its cumulative sums."""

  vectors = True
  causal_only = True

  def __init__(self, d_model, num_heads, *, dtype=jnp.float32, rngs):
    self.proj = Dense(d_model, num_heads, use_bias=True, kernel_axes=("fsdp", "tensor"),
                      dtype=dtype, rngs=rngs)

  def sums(self, x, offset):
    log_f = jax.nn.log_sigmoid(self.proj(x).astype(jnp.float32))  # [b, t, h]
    c = jnp.cumsum(log_f, axis=1)
    return c if offset is None else c + offset[:, None, :]

  def view(self, encoding, q_sums, k_sums):
    return ForgetBiased(encoding, q_sums, k_sums)


class ForgetBiased(EncodingView):
  """`encoding` with c_i − c_j added to its bias: q_sums [b, tq, h] at the queries, k_sums
  [b, tk, h] at the keys (whole rows: only kernels offering `data_bias` are handed it: the
  whole-array ones add bias(), `pallas` reads bias_vectors() per block beside the
  encoding's BiasSpec). Made per call by the layer; its other seams are the encoding's."""

  def __init__(self, encoding, q_sums: jax.Array, k_sums: jax.Array):
    super().__init__(encoding, biases=True)
    self.q_sums, self.k_sums = q_sums, k_sums

  def bias_spec(self):
    """The encoding's positional bias alone: a kernel computing in blocks (`pallas`) adds
    bias_vectors() beside it."""
    return self.encoding.bias_spec()

  def bias_vectors(self):
    """(c at the queries [b, tq, h], c at the keys [b, tk, h]): the bias c_i − c_j."""
    return self.q_sums, self.k_sums

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """The encoding's bias plus c_i − c_j: [b, h, tq, tk] float32."""
    data = (jnp.transpose(self.q_sums, (0, 2, 1))[:, :, :, None]
            - jnp.transpose(self.k_sums, (0, 2, 1))[:, :, None, :])
    return self.encoding.bias(q_positions, k_positions) + data


DATA_BIASES: dict[str, type[NoDataBias]] = {"none": NoDataBias, "forget": ForgetGate}


def make_data_bias(name: str, d_model: int, num_heads: int, *, causal: bool, dtype=jnp.float32,
                   rngs: nnx.Rngs) -> NoDataBias:
  """The data bias `name` for a layer of num_heads heads: a ConfigError if it is causal-only
  and the layer is not causal self-attention."""
  cls = lookup(DATA_BIASES, name, "attention data_bias")
  if cls.causal_only and not causal:
    raise causal_only_error("data_bias", name, "a decay over the keys before the query")
  return cls(d_model, num_heads, dtype=dtype, rngs=rngs)
