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

`selective` is selective attention (Leviathan, Kalman, Matias, ICLR 2025; the sketch of
their Figure 2): one head's logits (head 0's) choose which earlier tokens later queries stop
seeing. S_kj = ReLU(logit⁰_kj) where query k sees key j, 0 at each sequence's first token
and at query k's own key; F_ij = Σ_{k<i} S_kj, the selections by the queries before i; every
head's logit of query i and key j loses F_ij. No parameters; the bias is a whole [b, tq, tk]
array, computed from the logits before the kernel runs (logit_view()), which the kernels
adding a bias array take (`data_bias_array`: transformer/model/kernels/capabilities.py).

DATA_BIASES: an entry is made with `(d_model, num_heads, *, dtype, rngs)`; `sums(x, offset)`
gives the cumulative sums [b, t, h] of x's tokens continuing `offset` [b, h] (None: from 0;
the cache's last sum when decoding), None when it adds nothing; `view(encoding, q_sums,
k_sums)` the encoding a kernel is handed, its bias seam adding c_i − c_j; `logit_view(encoding,
q, k, mask, score, softcap)` the encoding with a bias read from the logits (after view());
`init_cache(batch, max_len)` makes what cached decoding carries beyond the layer's KVCache.
Each declares `vectors` (it adds u_i − w_j: the kernel must declare `data_bias`), `array` (it
adds a whole array: `data_bias` and `data_bias_array`) and `causal_only` (defined for causal
self-attention, where keys j ≤ i precede the query, `causal_reason` saying why: an
encoder-decoder's encoder and cross-attention take none, outside_causal(); an encoder-only
model refuses it).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.registry import lookup
from transformer.model.kernels import repeat_heads, soft_cap
from transformer.model.layers import Dense
from transformer.model.masks import Mask
from transformer.model.positions import EncodingView


class NoDataBias(nnx.Module):
  """No data-dependent bias: the encoding as it is."""

  vectors = False
  array = False
  causal_only = False
  causal_reason = ""  # why a causal-only entry is (the refusal's words)

  def __init__(self, d_model: int, num_heads: int, *, dtype=jnp.float32, rngs=None):
    del d_model, num_heads, dtype, rngs

  def init_cache(self, batch: int, max_len: int) -> None:
    """Makes what cached decoding of `batch` rows of max_len slots carries for it beyond the
    layer's KVCache (which keeps `vectors` entries' sums): nothing here."""
    del batch, max_len

  def sums(self, x: jax.Array, offset: jax.Array | None) -> jax.Array | None:
    del x, offset
    return None

  def view(self, encoding, q_sums, k_sums):
    del q_sums, k_sums
    return encoding

  def logit_view(self, encoding, q, k, mask: Mask, score, softcap: float):
    """The encoding with a bias read from the logits of q [b, tq, h, d] and k [b, tk,
    kv_heads, d] (rotated; with a cache, all its slots) under `mask`, by the layer's scorer
    and soft-cap: `encoding` itself here."""
    del q, k, mask, score, softcap
    return encoding


class ForgetGate(NoDataBias):
  """FoX's forget gate: log f = log σ(x W + b), W [d_model, h] and b [h] (their
  `fgate_proj`, a Linear with a bias), computed in float32; c its cumulative sums."""

  vectors = True
  causal_only = True
  causal_reason = "a decay over the keys before the query"

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


class Selective(NoDataBias):
  """Selective attention: every head's logits lose F_ij = Σ_{k<i} S_kj (head_logits,
  selections). Cached decoding carries Σ_k S_kj per key slot over the queries decoded so
  far (`carried` [b, max_len] float32): a step's queries read it, then add their own S."""

  array = True
  causal_only = True
  causal_reason = "later queries mask the keys that earlier queries chose"
  HEAD = 0  # the head whose logits select (theirs: the first)

  def __init__(self, d_model, num_heads, *, dtype=jnp.float32, rngs=None):
    del d_model, num_heads, dtype, rngs
    self.carried: nnx.Cache | None = nnx.data(None)  # set by init_cache

  def init_cache(self, batch, max_len):
    self.carried = nnx.Cache(jnp.zeros((batch, max_len), jnp.float32))

  def logit_view(self, encoding, q, k, mask, score, softcap):
    chosen = selections(head_logits(q, k, mask, encoding, score, softcap, self.HEAD), mask)
    # F_ij: the selections of the queries before i (an exclusive cumulative sum)
    before = jnp.cumsum(jnp.pad(chosen, ((0, 0), (1, 0), (0, 0)))[:, :-1], axis=1)
    if self.carried is not None:
      before = before + self.carried[...][:, None, :]
      self.carried[...] = self.carried[...] + jnp.sum(chosen, axis=1)
    return Selected(encoding, before)


def head_logits(q, k, mask: Mask, encoding, score, softcap: float, head: int) -> jax.Array:
  """One head's logits as the reference kernel forms them before normalising, in float32:
  cap(score(q, k)) + the encoding's positional bias (not its content bias), [b, tq, tk]. q
  [b, tq, h, d], k [b, tk, kv_heads, d]; a dot-product scorer's transforms apply to every
  head (they may hold per-head parameters), its product to `head` alone."""
  heads = q.shape[2]
  k = repeat_heads(k, heads)
  product = score.dot_product
  if product is None:
    logits = score(q, k)[:, head].astype(jnp.float32)
  else:
    qt = product.queries(q)[:, :, head].astype(jnp.float32)
    kt = product.keys(k)[:, :, head].astype(jnp.float32)
    logits = jnp.einsum("bqd,bkd->bqk", qt * product.scale, kt)
    if product.row_term is not None:
      logits = logits + product.row_term(q)[:, head].astype(jnp.float32)
  bias = encoding.bias(mask.q_positions, mask.k_positions)
  return soft_cap(logits, softcap) + (bias[:, head] if jnp.ndim(bias) == 4 else bias)


def selections(logits: jax.Array, mask: Mask) -> jax.Array:
  """S [b, tq, tk] float32: ReLU(logits) where the query sees the key, except at each
  sequence's first token (the key of its segment at the earliest position: their <BOS>)
  and at the query's own key (the same position); 0 elsewhere."""
  k_seg, k_pos = mask.k_segments, mask.k_positions
  same = k_seg[:, :, None] == k_seg[:, None, :]
  earliest = jnp.min(jnp.where(same, k_pos[:, None, :], jnp.iinfo(k_pos.dtype).max), axis=2)
  own = mask.q_positions[:, :, None] == k_pos[:, None, :]
  keep = mask.dense()[:, 0] & ~own & (k_pos != earliest)[:, None, :]
  return jnp.where(keep, jax.nn.relu(logits), 0.0)


class Selected(EncodingView):
  """`encoding` with F [b, tq, tk] (selective attention's) subtracted from its bias in every
  head, a whole array (only kernels offering `data_bias_array` are handed it). Made per
  call by the layer; its other seams are the encoding's."""

  def __init__(self, encoding, masked: jax.Array):
    super().__init__(encoding, biases=True)
    self.masked = masked

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """The encoding's bias minus F: [b, h, tq, tk] float32."""
    return self.encoding.bias(q_positions, k_positions) - self.masked[:, None]


DATA_BIASES: dict[str, type[NoDataBias]] = {"none": NoDataBias, "forget": ForgetGate,
                                            "selective": Selective}


def make_data_bias(name: str, d_model: int, num_heads: int, *, causal: bool, dtype=jnp.float32,
                   rngs: nnx.Rngs) -> NoDataBias:
  """The data bias `name` for a layer of num_heads heads: a ConfigError if it is causal-only
  and the layer is not causal self-attention."""
  cls = lookup(DATA_BIASES, name, "attention data_bias")
  if cls.causal_only and not causal:
    raise ConfigError(
        f"model.attention.data_bias={name!r} is defined for causal self-attention only "
        f"({cls.causal_reason}), and this layer is bidirectional or cross-attention (an "
        "encoder-only model has no causal self-attention): use model.arch=decoder, or "
        "encoder_decoder (where it acts in the decoder's self-attention), or another data_bias")
  return cls(d_model, num_heads, dtype=dtype, rngs=rngs)


def outside_causal(attention):
  """`attention` (an AttentionConfig) for the bidirectional and cross-attention layers of a
  model that also has causal self-attention (an encoder-decoder's encoder stack and its
  decoder's cross-attention): a causal-only data bias acts in the causal self-attention
  alone, so these layers take none."""
  if lookup(DATA_BIASES, attention.data_bias, "attention data_bias").causal_only:
    return dataclasses.replace(attention, data_bias="none")
  return attention
