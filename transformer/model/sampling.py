"""Choosing the next token from a decoding step's logits: greedy (argmax), or a draw from the
softmax at a temperature, restricted in this order to the top-k tokens, the nucleus (top-p:
the most likely tokens whose probability reaches p; Holtzman et al. 2020) and the tokens at
least min_p times as likely as the most likely one (min-p; Nguyen et al. 2024). Each filter
sees the distribution the previous ones left, renormalised; the most likely token always
passes them all. The decoding loops (transformer/model/decoding.py) call next_tokens at every step
with their key folded with the step, so a key gives the same tokens again."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from transformer.core.fields import AT_LEAST_0, FRACTION, Range, check, check_ranges


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How decoding picks each next token; the default is greedy. Hashable: the decoding
  functions take it as a static (compile-time) argument, and the draws' PRNG key apart."""

  temperature: float = 0.0  # the logits are divided by it; 0: greedy (argmax), no filter
  top_k: int = 0  # draw among the k most likely tokens; 0: off
  top_p: float = 1.0  # draw within the nucleus of probability p; 1: off
  min_p: float = 0.0  # draw among tokens with p ≥ min_p · p(most likely); 0: off

  def __post_init__(self):
    check_ranges(self, temperature=AT_LEAST_0, top_k=AT_LEAST_0,
                 top_p=Range(0, 1, lo_open=True), min_p=FRACTION)
    check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool), "top_k", self.top_k,
          "an integer")
    if self.greedy:  # a filter at temperature 0 would be recorded beside output it did not change
      for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
        check(getattr(self, name) == off, name, getattr(self, name),
              f"{off} (off) at temperature=0, which decodes greedily; sampling needs "
              "temperature > 0")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def __str__(self) -> str:
    if self.greedy:
      return "greedy"
    filters = [f"top_k={self.top_k}"] if self.top_k else []
    filters += [f"top_p={self.top_p}"] if self.top_p < 1 else []
    filters += [f"min_p={self.min_p}"] if self.min_p > 0 else []
    return ", ".join([f"temperature={self.temperature}", *filters])


GREEDY = Sampling()


def filtered_logits(logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array | None]:
  """(scores [b, n] float32, ids [b, n] or None): softmax(scores) is the distribution that
  sampling draws the next token from, over the vocabulary (ids None: n = vocab) or, with
  top-k or top-p on, over the n ≤ vocab candidates `ids` in order of probability; the
  tokens the filters remove are at −inf."""
  logits = logits.astype(jnp.float32)
  # Less the maximum first: at a tiny temperature the quotients underflow to −inf, never inf.
  scores = (logits - jnp.max(logits, axis=-1, keepdims=True)) / sampling.temperature
  ids = None
  if sampling.top_k or sampling.top_p < 1:  # both look at the tokens in order of probability
    k = min(sampling.top_k or scores.shape[-1], scores.shape[-1])
    scores, ids = jax.lax.top_k(scores, k)  # descending; ties: the lower id first
  if sampling.top_p < 1:
    probs = jax.nn.softmax(scores, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
    scores = jnp.where(before < sampling.top_p, scores, -jnp.inf)  # the first: before = 0
  if sampling.min_p > 0:  # p_i ≥ min_p · p_max, as logits (renormalising changes no ratio)
    top = jnp.max(scores, axis=-1, keepdims=True)
    scores = jnp.where(scores >= top + math.log(sampling.min_p), scores, -jnp.inf)
  return scores, ids


def next_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling = GREEDY) -> jax.Array:
  """The next token [b] (int32) of each row of logits [b, vocab]: the argmax at temperature 0
  (key unused), else a draw from the filtered distribution (filtered_logits) with `key`."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scores, ids = filtered_logits(logits, sampling)
  choice = jax.random.categorical(key, scores, axis=-1)
  if ids is not None:
    choice = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
  return choice.astype(jnp.int32)
