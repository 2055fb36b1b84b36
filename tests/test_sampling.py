"""Sampling the next token (transformer/model/sampling.py): the settings are checked; temperature → 0
and top_k = 1 are greedy, in the pure function and through cached decoding; each filter
keeps exactly its tokens; the draws follow the renormalised filtered distribution (a
chi-square test that rejects the usual wrong ones); a key repeats its tokens."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from tests.support import TINY_MODEL
from transformer.core.fields import FieldError
from transformer.core.vocab import EOS_ID, PAD_ID
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate, greedy_decode
from transformer.model.families import EncoderDecoder, make_model
from transformer.model.sampling import GREEDY, Sampling, next_tokens

VOCAB = 32
LOGITS = jnp.asarray(2.0 * np.random.default_rng(0).standard_normal((8, VOCAB)), jnp.float32)
draw = jax.jit(next_tokens, static_argnums=2)


def _draws(logits, sampling, n, seed=0):
  """n draws [n, b] for each row of logits [b, vocab], from one jitted call."""
  b = logits.shape[0]
  tiled = jnp.broadcast_to(logits, (n, *logits.shape)).reshape(n * b, -1)
  return np.asarray(draw(tiled, jax.random.key(seed), sampling)).reshape(n, b)


def _softmax(logits, temperature: float = 1.0) -> np.ndarray:
  z = np.asarray(logits, np.float64) / temperature
  p = np.exp(z - z.max(-1, keepdims=True))
  return p / p.sum(-1, keepdims=True)


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
  """The ids of the smallest set of most likely tokens whose probability reaches top_p."""
  order = np.argsort(-probs, kind="stable")
  return order[:int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]


def _expected(logits, sampling) -> np.ndarray:
  """The distribution [b, vocab] that sampling should draw from, in float64 from the
  definitions: softmax(logits / T), then in turn the k most likely tokens, the nucleus, the
  tokens with p ≥ min_p · p_max, each renormalised."""
  p = _softmax(logits, sampling.temperature)
  for row in p:
    if sampling.top_k:
      row[np.argsort(-row, kind="stable")[sampling.top_k:]] = 0
      row /= row.sum()
    if sampling.top_p < 1:
      row[np.setdiff1d(np.arange(len(row)), _nucleus(row, sampling.top_p))] = 0
      row /= row.sum()
    if sampling.min_p:
      row[row < sampling.min_p * row.max()] = 0
      row /= row.sum()
  return p


def _chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
  """Pearson's chi-square test of counts against the probabilities `expected` (any
  vector: a token drawn where expected is 0 rejects outright)."""
  n = counts.sum()
  if np.any(counts[expected == 0] > 0):
    return 0.0
  keep = expected > 0
  statistic = np.sum((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep]))
  return float(stats.chi2.sf(statistic, keep.sum() - 1))


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature=-1.0 is not allowed; it must be ≥ 0"),
    ({"temperature": float("inf")}, "temperature=inf"),
    ({"temperature": 1.0, "top_k": -1}, "top_k=-1 is not allowed; it must be ≥ 0"),
    ({"temperature": 1.0, "top_k": 2.5}, "top_k=2.5 is not allowed; it must be an integer"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p=0.0 is not allowed; it must be in (0, 1]"),
    ({"temperature": 1.0, "top_p": 1.5}, "top_p=1.5"),
    ({"temperature": 1.0, "min_p": 1.0}, "min_p=1.0 is not allowed; it must be in [0, 1)"),
    ({"temperature": 1.0, "min_p": -0.1}, "min_p=-0.1"),
    ({"top_k": 5}, "top_k=5 is not allowed; it must be 0 (off) at temperature=0"),
    ({"top_p": 0.9}, "top_p=0.9 is not allowed; it must be 1.0 (off) at temperature=0"),
    ({"min_p": 0.1}, "min_p=0.1 is not allowed; it must be 0.0 (off) at temperature=0")])
def test_settings_out_of_range_are_field_errors(kwargs, message):
  with pytest.raises(FieldError, match=re.escape(message)):
    Sampling(**kwargs)


def test_the_default_is_greedy_and_settings_read_as_text():
  assert GREEDY.greedy and str(GREEDY) == "greedy" and Sampling(0.0) == GREEDY
  assert str(Sampling(0.8, top_p=0.9)) == "temperature=0.8, top_p=0.9"
  assert hash(Sampling(1.0, 5)) == hash(Sampling(1.0, 5))  # a static argument under jit


# --------------------------------------------------------------------------- greedy limits


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(1e-6), Sampling(1.0, top_k=1),
                                      Sampling(2.0, top_p=1e-6)], ids=str)
def test_temperature_to_zero_and_top_1_are_the_argmax(sampling):
  for seed in range(2):
    np.testing.assert_array_equal(draw(LOGITS, jax.random.key(seed), sampling),
                                  jnp.argmax(LOGITS, -1))


# --------------------------------------------------------------------------- supports


def test_top_k_draws_only_the_k_most_likely():
  tokens = _draws(LOGITS, Sampling(1.5, top_k=4), 2000)
  top = np.argsort(-np.asarray(LOGITS), axis=-1)[:, :4]
  for row in range(LOGITS.shape[0]):
    assert set(tokens[:, row]) == set(top[row])  # all of them, and nothing else


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_draws_only_the_nucleus(top_p):
  temperature = 1.2
  tokens = _draws(LOGITS, Sampling(temperature, top_p=top_p), 2000)
  probs = _softmax(LOGITS, temperature)
  for row in range(LOGITS.shape[0]):
    nucleus = _nucleus(probs[row], top_p)
    assert set(tokens[:, row]) <= set(nucleus) and nucleus[0] in tokens[:, row]


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_draws_nothing_below_min_p_times_the_top_probability(min_p):
  temperature = 0.9
  tokens = _draws(LOGITS, Sampling(temperature, min_p=min_p), 2000)
  probs = _softmax(LOGITS, temperature)
  for row in range(LOGITS.shape[0]):
    drawn = np.unique(tokens[:, row])
    assert np.all(probs[row, drawn] >= min_p * probs[row].max())
    assert probs[row].argmax() in drawn


# --------------------------------------------------------------------------- distribution


def _wrong(logits, sampling) -> dict[str, np.ndarray]:
  """Distributions a faulty sampler draws from, where they differ from the right one: no
  filter, the temperature ignored, the filters' leftover mass not renormalised away (on
  the least likely kept token, as a draw by inverse CDF over unnormalised probabilities
  gives)."""
  right = _expected(logits, sampling)
  leftover = _expected(logits, Sampling(sampling.temperature))
  kept = right > 0
  unnormalised = np.where(kept, leftover, 0)
  last = np.where(kept, leftover, np.inf).argmin(-1)
  unnormalised[np.arange(len(right)), last] += 1 - unnormalised.sum(-1)
  wrong = {"unfiltered": leftover,
           "temperature ignored": _expected(logits, Sampling(1.0, sampling.top_k,
                                                             sampling.top_p, sampling.min_p)),
           "not renormalised": unnormalised}
  return {name: p for name, p in wrong.items() if np.abs(p - right).max() > 0.02}


@pytest.mark.parametrize("sampling", [
    Sampling(0.6), Sampling(1.0, top_k=5), Sampling(1.3, top_p=0.8), Sampling(1.0, min_p=0.1),
    Sampling(0.8, top_k=8, top_p=0.9, min_p=0.05)], ids=str)
def test_draws_follow_the_renormalised_filtered_distribution(sampling):
  # 12 tokens, evenly spaced logits in a shuffled order: at these temperatures each is
  # expected 40 or more times in 20000 draws, so that Pearson's test holds.
  logits = jnp.asarray(np.random.default_rng(2).permutation(np.linspace(1.5, -1.5, 12)))[None]
  right = _expected(logits, sampling)[0]
  assert np.all((right == 0) | (right * 20000 >= 40))
  counts = np.bincount(_draws(logits, sampling, 20000, seed=1)[:, 0], minlength=12)
  assert _chi_square_p(counts, right) > 1e-3
  wrong = _wrong(logits, sampling)
  assert wrong  # each case tells the right distribution from some wrong one
  for name, p in wrong.items():
    assert _chi_square_p(counts, p[0]) < 1e-6, name


# --------------------------------------------------------------------------- seeds


def test_a_key_repeats_its_tokens_and_another_key_draws_others():
  sampling = Sampling(1.0)
  logits = jnp.tile(LOGITS, (8, 1))  # 64 rows
  first = draw(logits, jax.random.key(0), sampling)
  np.testing.assert_array_equal(first, draw(logits, jax.random.key(0), sampling))
  assert np.any(first != draw(logits, jax.random.key(1), sampling))


# --------------------------------------------------------------------------- decoding

PROMPTS = jnp.asarray(np.random.default_rng(1).integers(3, 13, (4, 4)), jnp.int32)
LENGTHS = jnp.array([1, 2, 4, 3])
generate_jit = nnx.jit(generate, static_argnums=(3, 4))
decode_jit = nnx.jit(greedy_decode, static_argnums=(2, 3))


def _language_model(seed=0):
  cfg = ModelConfig(**TINY_MODEL, arch="decoder", attention=AttentionConfig())
  return make_model(cfg, rngs=nnx.Rngs(seed))


def test_generation_at_temperature_to_zero_or_top_1_is_greedy_and_a_key_repeats():
  model = _language_model()
  greedy, _ = generate_jit(model, PROMPTS, LENGTHS, 12)
  for sampling in (Sampling(1e-6), Sampling(1.0, top_k=1)):
    for seed in (0, 1):
      np.testing.assert_array_equal(generate_jit(model, PROMPTS, LENGTHS, 12, sampling,
                                                 jax.random.key(seed))[0], greedy)
  sampled = [np.asarray(generate_jit(model, PROMPTS, LENGTHS, 12, Sampling(1.0),
                                     jax.random.key(seed))[0]) for seed in (0, 0, 1)]
  np.testing.assert_array_equal(sampled[0], sampled[1])
  assert np.any(sampled[0] != sampled[2]) and np.any(sampled[0] != np.asarray(greedy))
  for row, n in enumerate(np.asarray(LENGTHS)):  # the prompt kept; never PAD after it
    np.testing.assert_array_equal(sampled[2][row, :n], PROMPTS[row, :n])
    assert np.all(sampled[2][row, n:] != PAD_ID)


def test_encoder_decoder_decoding_at_top_1_is_greedy_and_sampled_rows_end_at_eos():
  model = EncoderDecoder(ModelConfig(**TINY_MODEL, attention=AttentionConfig()), rngs=nnx.Rngs(0))
  batch = {"inputs": jnp.concatenate([PROMPTS, jnp.full((4, 1), EOS_ID, jnp.int32)], 1)}
  greedy = decode_jit(model, batch, 8)
  np.testing.assert_array_equal(decode_jit(model, batch, 8, Sampling(1.0, top_k=1)), greedy)
  key = jax.random.key(3)
  sampled = np.asarray(decode_jit(model, batch, 8, Sampling(2.0), key))
  np.testing.assert_array_equal(sampled, decode_jit(model, batch, 8, Sampling(2.0), key))
  assert np.any(sampled != np.asarray(greedy))
  for row in sampled:  # PAD after the first EOS, as greedy decoding leaves it
    ends = np.flatnonzero(row == EOS_ID)
    if len(ends):
      assert np.all(row[ends[0] + 1:] == PAD_ID)


# ------------------------------------------------------------------ config defaults (config.eval)

SAMPLED = Sampling(temperature=0.8, top_p=0.9)


@pytest.mark.parametrize("defaults, overrides, seed, expected", [
    (Sampling(), {}, None, (Sampling(), 5)),  # the config's, its seed
    (SAMPLED, {}, None, (SAMPLED, 5)),
    (SAMPLED, {"top_k": 3}, 1, (Sampling(0.8, 3, 0.9), 1)),  # a flag replaces its field
    (SAMPLED, {"temperature": 0.0}, None, (Sampling(), 5)),  # greedy drops the config's filters
    (Sampling(), {"temperature": 1.0, "min_p": 0.1}, None, (Sampling(1.0, min_p=0.1), 5)),
])
def test_flags_replace_the_configs_sampling_field_by_field(defaults, overrides, seed, expected):
  from transformer.run.config import EvalConfig  # noqa: PLC0415
  from transformer.run.restored_run import chosen_sampling  # noqa: PLC0415

  cfg = EvalConfig(sampling=defaults, sample_seed=5)
  assert chosen_sampling(cfg, overrides, seed) == expected
  # beam search takes the config's sampling as greedy; sampling flags still meet its refusal
  assert chosen_sampling(cfg, {}, None, beam_size=4) == (Sampling(), 5)


def test_a_filter_without_a_temperature_and_a_seed_for_greedy_decoding_are_refused():
  from transformer.core.errors import ConfigError  # noqa: PLC0415
  from transformer.run.config import EvalConfig  # noqa: PLC0415
  from transformer.run.restored_run import chosen_sampling  # noqa: PLC0415

  with pytest.raises(FieldError, match="top_k=4"):
    chosen_sampling(EvalConfig(), {"top_k": 4})
  with pytest.raises(ConfigError, match="--sample_seed applies to sampling"):
    chosen_sampling(EvalConfig(sampling=SAMPLED), {"temperature": 0.0}, seed=2)


def test_training_evaluates_with_the_configs_sampling(tmp_path, monkeypatch, tiny_config):
  """The run's config.eval.sampling and sample_seed reach the evaluations during training;
  a family that neither decodes nor generates refuses a temperature in its config."""
  from transformer.core.errors import ConfigError  # noqa: PLC0415
  from transformer.run import training  # noqa: PLC0415
  from transformer.run.config import parse  # noqa: PLC0415
  from transformer.run.experiment import build  # noqa: PLC0415

  seen = []

  class Recording(training.Evaluator):
    def __init__(self, exp, **kwargs):
      seen.append(kwargs)
      super().__init__(exp, **kwargs)

  monkeypatch.setattr(training, "Evaluator", Recording)
  config = tiny_config(**{"train.num_steps": 2, "eval.sampling.temperature": 0.7,
                          "eval.sampling.top_k": 3, "eval.sample_seed": 9})
  training.train_and_evaluate(parse(config), str(tmp_path / "run"))
  assert seen == [{"sampling": Sampling(0.7, top_k=3), "seed": 9}]

  config = tiny_config(**{"eval.sampling.temperature": 0.7})
  config.data.source, config.model.arch, config.model.pooling = "labelled", "encoder", "cls"
  config.task = {"name": "listops"}
  with pytest.raises(ConfigError, match=r"eval.sampling \(temperature=0.7\) would change nothing"):
    build(parse(config))
