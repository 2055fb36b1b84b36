"""How an attention layer forms its keys and values, and what its KV cache holds.

KV_FORMS: `model.attention.kv`.
  * `heads`: K and V projected per head from the input (num_kv_heads heads: multi-head,
    grouped-query or multi-query attention); the cache holds them.
  * `latent`: multi-head latent attention (DeepSeek-V2, Liu et al. 2024; its code:
    `DeepseekV2Attention` in deepseek-ai/DeepSeek-V2's modeling_deepseek.py). The input is
    compressed to a latent c = RMSNorm(x W_DKV) of `rank` features, from which each head's
    key part k_C and value are projected up (W_UK, W_UV, one matrix `up` here, as their
    kv_b_proj); the rotary part of the key, k_R = RoPE(x W_KR), is one vector shared by all
    heads (the "decoupled" rotary key, their k_pe from kv_a_proj_with_mqa), and each head's
    query is [RoPE(q_R), q_C], projected by W_Q from x or, with `query_rank`, from a
    compressed query RMSNorm(x W_DQ) (their q_a_proj, q_a_layernorm; W_Q their q_b_proj:
    compress_query). The cache holds c and the rotated k_R — rank + r floats per
    token against 2·heads·head_dim — and the keys and values are projected up from it at
    each step (the non-absorbed form: the paper's inference folds W_UK into W_Q, which
    changes the cost, not the result).

A form maps a self-attention input to its cacheable state, `state(x, positions, encoding)`
-> (a [b, t, ...], b [b, t, ...]), and a state to the kernel's keys and values,
`keys_values(state)` -> k [b, t, kv_heads, qk_dim], v [b, t, kv_heads, head_dim].
`heads`' state is (k, v), qk_dim = head_dim.

The rotary part is r dimensions: what the rotary encoding turns of a head of head_dim
(rotated_fraction·head_dim, its "neox" layout; their qk_rope_head_dim 64 of 128 is 0.5);
`rotary_place` puts it beside the head's head_dim content dimensions (`concat`, theirs:
qk_dim = head_dim + r, softmax scale 1/√qk_dim) or within them (`within`: qk_dim =
head_dim, r below it). An encoding that rotates nothing (none, ALiBi, T5, ...) gives
r = 0: no rotary key, and its bias applies as to any layer. Every difference from their
code: docs/axes.md.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_0, check, check_ranges
from transformer.core.registry import lookup, one_of, settings_sections
from transformer.model.layers import NORMS, Dense
from transformer.model.positions import PositionalEncoding

EPSILON = 1e-6  # the latent's RMSNorm (DeepSeek-V2's rms_norm_eps)
ROTARY_PLACES = ("concat", "within")  # LatentKV.Settings.rotary_place


class HeadKV:
  """Keys and values per head: the layer's own K and V projections (attention.py)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    pass


class LatentKV(nnx.Module):
  """Multi-head latent attention's keys and values (module docstring), for num_heads heads
  of head_dim, from inputs of d_model features."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    # the latent's width (their kv_lora_rank); 0: 4·head_dim, DeepSeek-V2's 512 for its
    # heads of 128
    rank: int = 0
    # the query's compressed width (their q_lora_rank): W_Q reads RMSNorm(x W_DQ) of this
    # many features; 0: W_Q reads x (DeepSeek-V2-Lite's; DeepSeek-V2's is 1536, 12·head_dim)
    query_rank: int = 0
    # a key of ROTARY_PLACES: where the decoupled rotary part (the r dimensions the rotary
    # encoding turns of a head) sits: `concat`, beside each head's head_dim (DeepSeek-V2's:
    # queries and keys of head_dim + r, values of head_dim) | `within`, the leading r of
    # head_dim (queries, keys and values of head_dim)
    rotary_place: str = "concat"

    def __post_init__(self):
      check_ranges(self, rank=AT_LEAST_0, query_rank=AT_LEAST_0)
      check(self.rotary_place in ROTARY_PLACES, "rotary_place", self.rotary_place,
            one_of(ROTARY_PLACES))

  def __init__(self, d_model: int, num_heads: int, head_dim: int, settings: Settings, *,
               encoding: PositionalEncoding | None, dtype=jnp.float32, rngs: nnx.Rngs):
    self.num_heads, self.head_dim = num_heads, head_dim
    self.rank = settings.rank or 4 * head_dim
    beside = settings.rotary_place == "concat"
    self.rotary = rotary_dims(encoding or PositionalEncoding(), head_dim, whole=beside)
    self.content = head_dim if beside else head_dim - self.rotary  # k_C's, q_C's width
    self.qk_dim = self.content + self.rotary  # of a head's query and key
    self.down = Dense(d_model, self.rank, use_bias=False, kernel_axes=("fsdp", None),
                      dtype=dtype, rngs=rngs)
    self.norm = NORMS["rmsnorm"](self.rank, epsilon=EPSILON, dtype=dtype, rngs=rngs)
    self.up = Dense(self.rank, num_heads * (self.content + head_dim), use_bias=False,
                    kernel_axes=(None, "tensor"), dtype=dtype, rngs=rngs)
    self.rotary_key = Dense(d_model, self.rotary, use_bias=False, kernel_axes=("fsdp", None),
                            dtype=dtype, rngs=rngs) if self.rotary else None
    self.query_features = settings.query_rank or d_model  # what W_Q reads
    self.query_down = Dense(d_model, settings.query_rank, use_bias=False,
                            kernel_axes=("fsdp", None), dtype=dtype,
                            rngs=rngs) if settings.query_rank else None
    self.query_norm = NORMS["rmsnorm"](settings.query_rank, epsilon=EPSILON, dtype=dtype,
                                       rngs=rngs) if settings.query_rank else None

  def compress_query(self, x: jax.Array) -> jax.Array:
    """What W_Q reads of x [b, t, d_model]: RMSNorm(x W_DQ) [b, t, query_rank] (their q_a_proj,
    q_a_layernorm), or x itself without query compression."""
    if self.query_down is None:
      return x
    return self.query_norm(self.query_down(x))

  def state(self, x: jax.Array, positions: jax.Array, encoding: PositionalEncoding):
    """(the latent c [b, t, rank], the rotated shared key k_R [b, t, r]) of x [b, t, d_model]
    at positions [b, t]."""
    latent = self.norm(self.down(x))
    if not self.rotary:
      return latent, jnp.zeros((*x.shape[:2], 0), latent.dtype)
    key = self.rotary_key(x)[:, :, None, :]  # one head
    return latent, rotate_prefix(encoding.rotate_keys, key, positions, self.head_dim)[:, :, 0]

  def keys_values(self, state) -> tuple[jax.Array, jax.Array]:
    """The kernel's keys [b, t, heads, qk_dim] and values [b, t, heads, head_dim] of a state
    (the cached one)."""
    latent, rotated = state
    b, t = latent.shape[:2]
    up = self.up(latent).reshape(b, t, self.num_heads, -1)
    content, v = up[..., :self.content], up[..., self.content:]
    shared = jnp.broadcast_to(rotated[:, :, None, :].astype(content.dtype),
                              (b, t, self.num_heads, self.rotary))
    return jnp.concatenate([shared, content], axis=-1), v

  def rotate_queries(self, q: jax.Array, positions: jax.Array,
                     encoding: PositionalEncoding) -> jax.Array:
    """q [b, t, heads, qk_dim] with its first r dimensions (q_R) rotated, the rest (q_C)
    as they are."""
    if not self.rotary:
      return q
    turned = rotate_prefix(encoding.rotate_queries, q[..., :self.rotary], positions,
                           self.head_dim)
    return jnp.concatenate([turned, q[..., self.rotary:]], axis=-1)

  def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], ...]:
    return (batch, max_len, self.rank), (batch, max_len, self.rotary)


def rotary_dims(encoding: PositionalEncoding, head_dim: int, *, whole: bool) -> int:
  """r: how many leading dimensions of a head `encoding` rotates, for the latent form; a
  ConfigError where it rotates not a leading block, or the whole head unless `whole` (the
  rotary part beside the head: within it, no content part would remain)."""
  r = encoding.rotated_dims(head_dim)
  if r is None:
    raise ConfigError(
        f"model.attention.kv='latent' decouples the rotary part of the keys, and "
        f"model.position={encoding.name!r} does not rotate a leading block of each head: "
        "use rotary with partial='neox', or an encoding that does not rotate")
  if r >= head_dim and not whole:
    raise ConfigError(
        f"model.attention.kv='latent' decouples the rotary part of the keys, and "
        f"model.position={encoding.name!r} rotates all {head_dim} dimensions of each head, "
        "and model.attention.kv_settings.latent.rotary_place='within' puts them in the head: "
        "set rotary_place=concat or model.position_settings.rotary.rotated_fraction below 1")
  return r


def rotate_prefix(rotate, x: jax.Array, positions: jax.Array, head_dim: int) -> jax.Array:
  """rotate (an encoding's rotate_queries or rotate_keys, defined on whole heads) applied to
  x [b, t, h, r], the leading r dimensions of heads of head_dim: x zero-padded to the head,
  rotated, cut back. Exact: the encoding turns its leading r dimensions among themselves."""
  pad = jnp.zeros((*x.shape[:-1], head_dim - x.shape[-1]), x.dtype)
  return rotate(jnp.concatenate([x, pad], axis=-1), positions)[..., :x.shape[-1]]


KV_FORMS: dict[str, type] = {"heads": HeadKV, "latent": LatentKV}

KVSettings = settings_sections(KV_FORMS, "KVSettings")


def make_kv_form(name: str, d_model: int, num_heads: int, head_dim: int, settings, *,
                 encoding: PositionalEncoding | None, dtype=jnp.float32,
                 rngs: nnx.Rngs) -> LatentKV | None:
  """The form `name` of KV_FORMS: None for `heads` (the layer's own projections), else
  its module."""
  form = lookup(KV_FORMS, name, "attention kv")
  if form is HeadKV:
    return None
  return form(d_model, num_heads, head_dim, getattr(settings, name), encoding=encoding,
              dtype=dtype, rngs=rngs)
