"""Autoregressive decoding."""

import jax
import jax.numpy as jnp

from transformer.model import Transformer, shift_right
from transformer.vocab import EOS_ID, PAD_ID


def greedy_decode(model: Transformer, batch: dict[str, jax.Array], max_len: int) -> jax.Array:
  """Greedy decoding by full re-decoding of the prefix at each step.

  Args:
    model: the Transformer (deterministic mode).
    batch: `inputs` [b, s] and optionally `inputs_positions`, `inputs_segmentation`.
    max_len: number of output slots, EOS included.
  Returns:
    tokens [b, max_len]: each row ends at its first EOS, followed by PAD.
  """
  inputs = batch["inputs"]
  in_seg = batch.get("inputs_segmentation", (inputs != PAD_ID).astype(jnp.int32))
  in_pos = batch.get("inputs_positions")
  encoded = model.encode(inputs, in_pos, in_seg)
  b = inputs.shape[0]
  positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
  segments = jnp.ones((b, max_len), jnp.int32)  # the causal mask hides the empty future

  def not_finished(state):
    t, _, done = state
    return (t < max_len) & ~jnp.all(done)

  def step(state):
    t, out, done = state
    logits = model.decode(encoded, in_seg, shift_right(out, positions), positions, segments,
                          inputs_positions=in_pos)
    token = jnp.where(done, PAD_ID, jnp.argmax(logits[:, t], axis=-1).astype(jnp.int32))
    return t + 1, out.at[:, t].set(token), done | (token == EOS_ID)

  out = jnp.zeros((b, max_len), jnp.int32)
  _, out, _ = jax.lax.while_loop(not_finished, step, (0, out, jnp.zeros((b,), bool)))
  return out
