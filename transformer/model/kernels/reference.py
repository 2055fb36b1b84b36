"""The attention formula computed whole: normalise(cap(score(q, k)) + bias + content bias)·V
over the unmasked keys, normalise the layer's normaliser (softmax unless it has another:
transformer/model/normalizers.py) (the reference kernel, which every other kernel of KERNELS is tested
against: transformer/model/kernels/registry.py), its weights (what the attention pictures draw), and
what every kernel shares: key/value heads repeated for grouped-query attention, the logit
soft-cap."""

import jax
import jax.numpy as jnp

from transformer.model.masks import Mask
from transformer.model.normalizers import SOFTMAX


def repeat_heads(x: jax.Array, heads: int) -> jax.Array:
  """x [b, t, kv_heads, d] with each kv head repeated for its heads / kv_heads query heads:
  [b, t, heads, d] (head i is kv head i // (heads / kv_heads)); x itself when kv_heads = heads."""
  return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap · tanh(logits / cap) in float32; the logits themselves when cap is 0 (off)."""
  return cap * jnp.tanh(logits.astype(jnp.float32) / cap) if cap else logits


def attention_weights(q, k, mask: Mask, encoding, score, softcap: float = 0.0,
                      normalizer=None) -> jax.Array:
  """normalizer(cap(score(q, k)) + bias + content bias) over the unmasked keys (None:
  softmax): [b, h, tq, tk] float32, cap = soft_cap(·, softcap). k may have fewer heads than
  q (repeat_heads). The content bias sees the logits before it, −inf at the masked keys."""
  visible = mask.dense()
  k = repeat_heads(k, q.shape[2])
  logits = soft_cap(score(q, k), softcap) + encoding.bias(mask.q_positions, mask.k_positions)
  if encoding.content_biases:  # otherwise no pass over the logits for a zero
    logits = jnp.where(visible, logits.astype(jnp.float32), -jnp.inf)
    logits = logits + encoding.content_bias(q, logits)
  return (normalizer or SOFTMAX)(logits, visible, mask)


def reference_kernel(q, k, v, mask: Mask, encoding, score, dropout, rngs, normalizer=None, *,
                     softcap: float = 0.0):
  """The formula, any scorer, normaliser and seam: normalizer(cap(score(q, k)) + bias +
  content bias) over unmasked keys, dropout, ·V."""
  weights = attention_weights(q, k, mask, encoding, score, softcap,
                              normalizer).astype(v.dtype)
  weights = dropout(weights, deterministic=rngs is None, rngs=rngs)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, repeat_heads(v, q.shape[2]))
