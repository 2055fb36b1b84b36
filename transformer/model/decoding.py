"""Autoregressive decoding with a KV cache: greedy or sampled (transformer/model/sampling.py),
and beam search.

The encoder runs once; cross-attention K/V are projected once per source sentence; each
step feeds one token through the decoder against the self-attention caches. The loops are
lax.while_loops over (cache, outputs) carried as pure state, so they jit as one program.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.vocab import BOS_ID, EOS_ID, PAD_ID
from transformer.model.families import ModelFamily
from transformer.model.sampling import GREEDY, Sampling, next_tokens

NEG_INF = -1.0e9


def _start(model: ModelFamily, batch: dict[str, jax.Array], max_len: int, repeat: int = 1):
  """Prepares the caches for `repeat` hypotheses per row of batch (init_decoding) and returns
  (step_fn, cache) with step_fn(cache, tokens [b], t) -> (logits [b, vocab], cache)."""
  model = nnx.clone(model)  # the caches go on a copy, never on the caller's model
  model.init_decoding(batch, max_len, repeat)
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)

  def step_fn(cache, tokens, t):
    m = nnx.merge(graphdef, cache, rest)
    logits = m.decode_step(tokens[:, None], t)[:, 0]
    return logits, nnx.state(m, nnx.Cache)

  return step_fn, cache


def greedy_decode(model: ModelFamily, batch: dict[str, jax.Array], max_len: int,
                  sampling: Sampling = GREEDY, key: jax.Array | None = None) -> jax.Array:
  """Greedy decoding, or each token drawn as `sampling` says.

  Args:
    model: the Transformer (run deterministically).
    batch: `inputs` [b, s] and optionally `inputs_positions`, `inputs_segmentation`.
    max_len: number of output slots, EOS included.
    sampling: how each token is chosen (static under jit); the default is the argmax.
    key: the draws' PRNG key, folded with each step (default: key 0).
  Returns:
    tokens [b, max_len]: each row ends at its first EOS, followed by PAD.
  """
  b = batch["inputs"].shape[0]
  key = jax.random.key(0) if key is None else key
  step_fn, cache = _start(model, batch, max_len)

  def not_finished(state):
    t, _, _, done, _ = state
    return (t < max_len) & ~jnp.all(done)

  def step(state):
    t, last, out, done, cache = state
    logits, cache = step_fn(cache, last, t)
    token = jnp.where(done, PAD_ID, next_tokens(logits, jax.random.fold_in(key, t), sampling))
    return t + 1, token, out.at[:, t].set(token), done | (token == EOS_ID), cache

  state = (jnp.zeros((), jnp.int32), jnp.full((b,), BOS_ID, jnp.int32),
           jnp.zeros((b, max_len), jnp.int32), jnp.zeros((b,), bool), cache)
  return jax.lax.while_loop(not_finished, step, state)[2]


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  """GNMT (Wu et al. 2016): ((5 + |Y|) / 6)^α."""
  return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def _gather_beams(x: jax.Array, indices: jax.Array) -> jax.Array:
  """x [b, n, ...] re-indexed along its beam axis by indices [b, m] -> [b, m, ...]."""
  idx = indices.reshape(*indices.shape, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, idx, axis=1)


def _gather_cache(cache, indices: jax.Array):
  """Cache leaves [b*k, ...] re-indexed per sentence by indices [b, k]; scalars (the step
  index) pass through."""
  b, k = indices.shape

  def gather(x):
    if x.ndim == 0:
      return x
    return _gather_beams(x.reshape(b, k, *x.shape[1:]), indices).reshape(x.shape)

  return jax.tree.map(gather, cache)


def beam_search(model: ModelFamily, batch: dict[str, jax.Array], max_len: int,
                beam_size: int = 4, alpha: float = 0.6) -> tuple[jax.Array, jax.Array]:
  """Beam search ranking finished hypotheses by log P(Y|X) / length_penalty(|Y|, α).

  Args:
    model, batch, max_len: as for greedy_decode.
    beam_size: hypotheses kept per sentence (the paper: 4).
    alpha: length-penalty exponent (the paper: 0.6; 0 ranks by log-probability).
  Returns:
    tokens [b, max_len] of the best hypothesis (ending at EOS, then PAD) and its score [b].
  """
  b, k = batch["inputs"].shape[0], beam_size
  step_fn, cache = _start(model, batch, max_len, repeat=k)
  # Only the first copy of each sentence starts alive, so the k beams do not duplicate.
  alive_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1)), (b, 1))
  state = {
      "t": jnp.zeros((), jnp.int32),
      "last": jnp.full((b, k), BOS_ID, jnp.int32),
      "alive_seqs": jnp.zeros((b, k, max_len), jnp.int32),
      "alive_logp": alive_logp,
      "finished_seqs": jnp.zeros((b, k, max_len), jnp.int32),
      "finished_scores": jnp.full((b, k), NEG_INF),
      "cache": cache,
  }

  def not_finished(s):
    # Stop when no alive hypothesis, even at the longest length, can beat the worst finished.
    best_alive = s["alive_logp"][:, 0] / length_penalty(jnp.asarray(max_len), alpha)
    worst_finished = jnp.min(s["finished_scores"], axis=1)
    return (s["t"] < max_len) & ~jnp.all(worst_finished > best_alive)

  def step(s):
    t = s["t"]
    logits, cache = step_fn(s["cache"], s["last"].reshape(b * k), t)
    vocab = logits.shape[-1]
    logp = jax.nn.log_softmax(logits).reshape(b, k, vocab) + s["alive_logp"][..., None]
    top_logp, top_idx = jax.lax.top_k(logp.reshape(b, k * vocab), 2 * k)  # [b, 2k]
    origin, token = top_idx // vocab, (top_idx % vocab).astype(jnp.int32)
    seqs = _gather_beams(s["alive_seqs"], origin).at[:, :, t].set(token)
    ended = token == EOS_ID

    # Alive: the best k candidates that did not just end.
    alive_logp, alive_pick = jax.lax.top_k(jnp.where(ended, NEG_INF, top_logp), k)
    alive_origin = jnp.take_along_axis(origin, alive_pick, axis=1)

    # Finished: an EOS candidate counts only if it ranks among the best k (as in fairseq),
    # so beam 1 with α = 0 is greedy decoding. Merge with the old finished, keep the best k.
    ended_in_beam = ended & (jnp.arange(2 * k) < k)[None, :]
    new_scores = jnp.where(ended_in_beam, top_logp / length_penalty(t + 1, alpha), NEG_INF)
    scores = jnp.concatenate([s["finished_scores"], new_scores], axis=1)
    pool = jnp.concatenate([s["finished_seqs"], seqs], axis=1)
    finished_scores, finished_pick = jax.lax.top_k(scores, k)
    return {
        "t": t + 1,
        "last": jnp.take_along_axis(token, alive_pick, axis=1),
        "alive_seqs": _gather_beams(seqs, alive_pick),
        "alive_logp": alive_logp,
        "finished_seqs": _gather_beams(pool, finished_pick),
        "finished_scores": finished_scores,
        "cache": _gather_cache(cache, alive_origin),
    }

  s = jax.lax.while_loop(not_finished, step, state)
  # A sentence with no finished hypothesis (max_len reached) returns its best alive one.
  has_finished = s["finished_scores"][:, 0] > NEG_INF / 2
  alive_scores = s["alive_logp"][:, 0] / length_penalty(jnp.asarray(max_len), alpha)
  tokens = jnp.where(has_finished[:, None], s["finished_seqs"][:, 0], s["alive_seqs"][:, 0])
  return tokens, jnp.where(has_finished, s["finished_scores"][:, 0], alive_scores)


def generate(model, prompts: jax.Array, lengths: jax.Array, max_len: int,
             sampling: Sampling = GREEDY, key: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
  """KV-cached continuation of prompts by a family that generates (DecoderOnly): greedy,
  or each token drawn as `sampling` says.

  Args:
    model: the language model (run deterministically).
    prompts: [b, p] token ids; row i's prompt is its first lengths[i] ≥ 1 tokens.
    lengths: [b] prompt lengths.
    max_len: tokens in each output row, prompt included (the cache size).
    sampling: how each token is chosen (static under jit); the default is the argmax.
    key: the draws' PRNG key, folded with each step (default: key 0).
  Returns:
    tokens [b, max_len]: the prompt, then the continuation (never PAD, which is no
    language model's target); and the logits
    [b, max_len - 1, vocab] with which each position's successor was predicted.
  """
  b = prompts.shape[0]
  key = jax.random.key(0) if key is None else key
  model = nnx.clone(model)  # the caches go on a copy
  model.init_decoding({"inputs": prompts}, max_len)
  graphdef, cache, rest = nnx.split(model, nnx.Cache, ...)
  prompts = jnp.pad(prompts, ((0, 0), (0, max_len - prompts.shape[1])))
  tokens = jnp.where(jnp.arange(max_len)[None] < lengths[:, None], prompts, PAD_ID)

  def step(t, state):
    tokens, all_logits, cache = state
    m = nnx.merge(graphdef, cache, rest)
    token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
    logits = m.decode_step(token, t)[:, 0]
    chosen = next_tokens(logits.at[:, PAD_ID].set(NEG_INF), jax.random.fold_in(key, t),
                         sampling)
    forced = jax.lax.dynamic_index_in_dim(prompts, t + 1, axis=1, keepdims=False)
    nxt = jnp.where(t + 1 < lengths, forced, chosen)
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], t + 1, axis=1)
    all_logits = jax.lax.dynamic_update_slice_in_dim(all_logits, logits[:, None], t, axis=1)
    return tokens, all_logits, nnx.state(m, nnx.Cache)

  vocab = model.cfg.vocab_size
  state = (tokens, jnp.zeros((b, max_len - 1, vocab), jnp.float32), cache)
  tokens, logits, _ = jax.lax.fori_loop(0, max_len - 1, step, state)
  return tokens, logits
