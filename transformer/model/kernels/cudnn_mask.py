"""How a Mask reaches cuDNN's flash attention: as cuDNN's own arguments where the mask's
declared structure allows, so that cuDNN skips the blocks the mask hides and no
[b, 1, tq, tk] array exists; otherwise as the dense boolean mask, which JAX hands cuDNN as
an additive bias computed over every block, the hidden ones too.

| the Mask | jax.nn.dot_product_attention's arguments |
| --- | --- |
| `padded` (one sequence per row from slot 0), no window | `query_seq_lengths`, `key_value_seq_lengths` (each row's non-pad count), `is_causal` |
| `padded`, causal, a local window w | the same and `local_window_size=(w, 0)`: keys at positions q − w … q |
| `padded`, bidirectional, a local window | `mask`: cuDNN takes a window only to the left, with a causal mask |
| packed (segment ids, `padded` not declared) | `mask`: this JAX's dot_product_attention takes no sequence offsets |

The structure is what the Mask declares (`Mask.padded`, set by whoever builds it from a
batch without segment ids), never inferred from the arrays' values or shapes.
"""

import jax
import jax.numpy as jnp

from transformer.model.masks import Mask


def dense_mask(mask: Mask) -> dict:
  """{"mask": [b, 1, tq, tk] bool}: the mask whole, a query row with no visible key
  (padding) attending to every key instead of none, so that it stays finite; the loss
  never reads it."""
  dense = mask.dense()
  return {"mask": dense | ~jnp.any(dense, axis=-1, keepdims=True)}


def cudnn_mask(mask: Mask) -> tuple[dict, str]:
  """(the keyword arguments of jax.nn.dot_product_attention that impose `mask` on cuDNN,
  '' or why they are the dense mask). Query rows of padding attend to nothing that the
  loss reads: their lengths' padding rows are cuDNN's to fill; a row of padding alone
  (length 0) counts as length 1, so no row is empty."""
  tq, tk = mask.q_segments.shape[1], mask.k_segments.shape[1]
  if not mask.padded:
    return dense_mask(mask), (
        f"packed rows (segment ids) reach cuDNN as a dense [b, 1, {tq}, {tk}] mask computed "
        "over every block: this JAX's dot_product_attention takes no sequence offsets")
  if mask.window is not None and not mask.causal:
    return dense_mask(mask), (
        f"a bidirectional local window (±{mask.window}) reaches cuDNN as a dense "
        f"[b, 1, {tq}, {tk}] mask: cuDNN takes a window to the left only, with a causal mask")
  if mask.causal and tq != tk:
    return dense_mask(mask), (
        f"a causal mask of {tq} queries against {tk} keys (a cached prefill) reaches cuDNN "
        "as a dense mask: its causal flag aligns query and key slot 0")
  args = {"query_seq_lengths": row_lengths(mask.q_segments),
          "key_value_seq_lengths": row_lengths(mask.k_segments),
          "is_causal": mask.causal}
  if mask.window is not None:
    args["local_window_size"] = (mask.window, 0)
  return args, ""


def row_lengths(segments: jax.Array) -> jax.Array:
  """[b, t] segment ids of padded rows (1…1 0…0) -> [b] int32: each row's length, at
  least 1."""
  return jnp.maximum(jnp.sum(segments != 0, axis=1), 1).astype(jnp.int32)


def bias_positions(mask: Mask, rows_share_positions: bool) -> tuple[jax.Array, jax.Array]:
  """The query and key positions to evaluate a positional bias at: one row [1, t] when
  every row has the same positions (a padded mask: 0, 1, …) and the bias is a function of
  the positions alone (`rows_share_positions`), so the bias is [1, h, tq, tk] instead of
  [b, h, tq, tk]; otherwise the mask's [b, t]."""
  if mask.padded and rows_share_positions:
    return mask.q_positions[:1], mask.k_positions[:1]
  return mask.q_positions, mask.k_positions
