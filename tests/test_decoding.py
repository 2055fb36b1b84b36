"""Cached decoding equals full decoding; beam search against greedy and its own scores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import DECODE_BATCH, DECODE_LEN, TINY_MODEL, cached_logits, full_logits
from transformer.core.errors import ConfigError
from transformer.core.vocab import EOS_ID, PAD_ID
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.decoding import beam_search, greedy_decode, length_penalty
from transformer.model.families import EncoderDecoder
from transformer.model.positions import POSITIONS, PositionSettings
from transformer.model.scores import SCORES

# 13 tokens: EOS is 1 in 13, likely within DECODE_LEN steps of a random model, so that rows of
# the greedy and beam answers below end early; max_len 16: the table 17 steps overrun.
TINY = {**TINY_MODEL, "vocab_size": 13, "num_decoder_layers": 2, "max_len": 16}
# An encoder-decoder's encoder stack is bidirectional: no encoding declaring causal_only
# (cached generation with those is tested in the decoder-only family, tests/test_families.py).
ENCODER_POSITIONS = sorted(name for name, cls in POSITIONS.items() if not cls.causal_only)


def _model(position="sinusoidal", score="scaled_dot", window="full", seed=0, kv="heads",
           **model):
  cfg = ModelConfig(**TINY, position=position, **model,
                    attention=AttentionConfig(score=score, window=window, window_size=2, kv=kv))
  return EncoderDecoder(cfg, rngs=nnx.Rngs(seed))


def _reference_greedy(model, batch, max_len):
  """Greedy by re-running the full decoder on the whole prefix at every step."""
  out = np.zeros((batch["inputs"].shape[0], max_len), np.int32)
  done = np.zeros(len(out), bool)
  for t in range(max_len):
    token = np.asarray(jnp.argmax(full_logits(model, batch, jnp.asarray(out))[:, t], -1))
    token = np.where(done, PAD_ID, token)
    out[:, t] = token
    done |= token == EOS_ID
  return out


@pytest.mark.parametrize("position,score,window", [
    *[(p, "scaled_dot", "full") for p in ENCODER_POSITIONS],
    *[("rotary", s, "full") for s in sorted(SCORES) if s != "scaled_dot"],
    ("rotary", "scaled_dot", "local"), ("learned", "additive", "local"),
    ("rotary+none", "scaled_dot", "local+full"), ("t5+alibi", "scaled_dot", "full")])
def test_cached_step_logits_equal_full_decoding(position, score, window):
  model = _model(position, score, window)
  targets = jnp.asarray(np.random.default_rng(0).integers(3, 13, (2, DECODE_LEN)), jnp.int32)
  np.testing.assert_allclose(cached_logits(model, DECODE_BATCH, targets),
                             full_logits(model, DECODE_BATCH, targets), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("position", ["sinusoidal", "rotary"])
def test_cached_greedy_equals_full_redecoding(position):
  for seed in range(3):  # several random models: tokens vary, EOS lands at different steps
    model = _model(position, seed=seed)
    cached = nnx.jit(greedy_decode, static_argnums=2)(model, DECODE_BATCH, DECODE_LEN)
    np.testing.assert_array_equal(cached, _reference_greedy(model, DECODE_BATCH, DECODE_LEN))


def test_beam_one_without_length_penalty_is_greedy():
  for seed in range(3):
    model = _model(seed=seed)
    greedy = nnx.jit(greedy_decode, static_argnums=2)(model, DECODE_BATCH, DECODE_LEN)
    beam, _ = nnx.jit(beam_search, static_argnums=(2, 3, 4))(model, DECODE_BATCH, DECODE_LEN, 1, 0.0)
    np.testing.assert_array_equal(beam, greedy)


@pytest.mark.parametrize("alpha,kv", [(0.0, "heads"), (0.6, "heads"), (0.6, "latent")])
def test_beam_scores_are_length_normalised_log_probabilities(alpha, kv):
  """Beam search reorders the cache between steps: with kv=latent the latent and the
  decoupled rotary key (rotary over half of each head) are what it reorders."""
  half = PositionSettings(rotary=POSITIONS["rotary"].Settings(rotated_fraction=0.5))
  model = _model(seed=1) if kv == "heads" else _model("rotary", seed=1, kv=kv,
                                                      position_settings=half)
  tokens, scores = nnx.jit(beam_search, static_argnums=(2, 3, 4))(model, DECODE_BATCH, DECODE_LEN, 4, alpha)
  logp = jax.nn.log_softmax(full_logits(model, DECODE_BATCH, tokens))
  for row in range(2):
    seq = np.asarray(tokens[row])
    ends = np.flatnonzero(seq == EOS_ID)
    length = ends[0] + 1 if len(ends) else DECODE_LEN
    assert np.all(seq[length:] == PAD_ID)
    total = sum(float(logp[row, t, seq[t]]) for t in range(length))
    np.testing.assert_allclose(scores[row], total / length_penalty(jnp.asarray(length), alpha),
                               rtol=1e-4)


def test_learned_positions_refuse_decoding_past_their_table():
  model = _model("learned")
  with pytest.raises(ConfigError, match="exceeds the learned position table"):
    greedy_decode(model, DECODE_BATCH, 17)
