"""CoPE (contextual position encoding) against a NumPy reference of the paper's formulas:
its content bias, the attention it gives, its gradients, its cap, and its pictures. What
every causal-only or content-biasing encoding owes (refused in an encoder, refused by the
kernels that cannot add it, cached generation = the full pass) is tested over the registry
in test_positions.py, test_attention.py and test_families.py."""

import importlib
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL, make_tiny_config
from transformer.core.errors import ConfigError
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.kernels.reference import reference_kernel
from transformer.model.masks import Mask
from transformer.model.positions import CoPE, PositionSettings, make_positional_encoding
from transformer.model.scores import ScaledDot
from transformer.run import experiment
from transformer.run.config import parse
from transformer.study import pictures, position_pictures

B, T, H, D = 2, 7, 2, 4
# Row 0: two packed sequences (4 and 2 tokens) and a padded slot; row 1: one sequence.
SEGMENTS = np.array([[1, 1, 1, 1, 2, 2, 0], [1] * 7])
POSITIONS = np.array([[0, 1, 2, 3, 0, 1, 0], list(range(7))])
MASK = Mask(jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS), jnp.asarray(POSITIONS),
            jnp.asarray(POSITIONS), causal=True)


def _visible():
  """[b, tq, tk]: same non-pad segment and the key not after the query."""
  same = (SEGMENTS[:, :, None] == SEGMENTS[:, None, :]) & (SEGMENTS[:, :, None] > 0)
  return same & (POSITIONS[:, None, :] <= POSITIONS[:, :, None])


def _cope(max_positions=64, seed=0):
  """CoPE for head_dim D with a random table (it starts at zero, which would hide it)."""
  settings = PositionSettings(cope=CoPE.Settings(max_positions=max_positions))
  enc = make_positional_encoding("cope", H * D, H, 16, causal=True, settings=settings,
                                 rngs=nnx.Rngs(0))
  assert enc.table.shape == (D, max_positions)
  enc.table[...] = jax.random.normal(jax.random.key(seed), enc.table.shape)
  return enc


def _sigmoid(x):
  return 1.0 / (1.0 + math.exp(-x))


def _cope_numpy(q, logits, visible, table, max_positions):
  """The paper's bias entry by entry, for self-attention (key j and query i index the same
  row): gates g_it = σ(logit_it) at the keys the query sees, p_ij = Σ_{t=j..i} g_it capped
  at max_positions − 1, and q_i·e[p] = (p − ⌊p⌋)·q_i·e[⌈p⌉] + (1 − p + ⌊p⌋)·q_i·e[⌊p⌋]."""
  b, t, h, _ = q.shape
  bias = np.zeros((b, h, t, t))
  for n, head, i, j in itertools.product(range(b), range(h), range(t), range(t)):
    gates = [_sigmoid(logits[n, head, i, s]) for s in range(j, i + 1) if visible[n, i, s]]
    p = min(sum(gates), max_positions - 1)
    lo, hi = math.floor(p), math.ceil(p)
    e = lambda m: float(q[n, i, head] @ table[:, m])  # noqa: E731, B023
    bias[n, head, i, j] = (p - lo) * e(hi) + (1 - (p - lo)) * e(lo)
  return bias


def _random(seed, *shape, scale=1.0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


@pytest.mark.parametrize("max_positions", [3, 64])
def test_content_bias_is_the_papers_formula(max_positions):
  """Random queries and logits (−inf at the masked keys, as a kernel hands them) under
  packing, padding and causality; a cap of 3 clamps most rows, 64 none."""
  enc = _cope(max_positions)
  q = _random(1, B, T, H, D)
  visible = _visible()
  logits = np.where(visible[:, None], _random(2, B, H, T, T, scale=2.0), -np.inf)
  got = np.asarray(enc.content_bias(jnp.asarray(q), jnp.asarray(logits, jnp.float32)))
  want = _cope_numpy(q, logits, visible, np.asarray(enc.table[...]), max_positions)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_with_every_gate_open_cope_counts_tokens():
  """Gates of 1 (large logits) make p_ij = i − j + 1, the keys from j to the query: relative
  positions, capped."""
  enc = _cope(max_positions=5)
  visible = _visible()[1:]  # one unpacked row
  p = np.asarray(enc.positions(jnp.where(visible[:, None], 100.0, -jnp.inf)))[0, 0]
  i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
  np.testing.assert_allclose(p, np.where(j <= i, np.minimum(i - j + 1, 4), 0), atol=1e-6)


def test_attention_with_cope_is_the_papers_attention():
  """The reference kernel with the scaled dot product: softmax over the visible keys of
  q·k/√d + CoPE's bias of those logits, times V; padded queries output 0."""
  enc, score = _cope(), ScaledDot(H, D)
  q, k, v = _random(3, B, T, H, D), _random(4, B, T, H, D), _random(5, B, T, H, D)
  out = np.asarray(reference_kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), MASK, enc,
                                    score, nnx.Dropout(0.0), None))
  visible = _visible()[:, None]  # [b, 1, tq, tk]
  scores = np.where(visible, np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D), -np.inf)
  logits = scores + _cope_numpy(q, scores, visible[:, 0], np.asarray(enc.table[...]), 64)
  weights = np.exp(logits - np.max(logits, -1, keepdims=True, initial=-1e30, where=visible))
  weights = np.where(visible, weights, 0.0)
  weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-30)
  np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", weights, v), rtol=1e-4,
                             atol=1e-5)
  assert np.all(out[0, 6] == 0.0)  # the padded slot sees nothing


def test_the_gradient_reaches_the_table_and_the_gates():
  """From the paper's zero table, the loss moves the rows of the positions that occur
  (p < 7 here: rows 0..7) and no others; through the interpolation weight p − ⌊p⌋ it
  reaches the gates' logits at the visible keys and no others; no NaN from the masked
  keys' −inf or the padded query."""
  enc = make_positional_encoding("cope", H * D, H, 16, causal=True, rngs=nnx.Rngs(0))
  assert not np.any(np.asarray(enc.table[...]))
  q, k, v = (jnp.asarray(_random(s, B, T, H, D)) for s in (6, 7, 8))
  weights = jnp.asarray(_random(9, B, T, H, D))

  def loss(enc, q, k):
    out = reference_kernel(q, k, v, MASK, enc, ScaledDot(H, D), nnx.Dropout(0.0), None)
    return jnp.sum(out * weights)

  grads, dq, dk = nnx.grad(loss, argnums=(0, 1, 2))(enc, q, k)
  table = np.asarray(grads["table"][...])
  assert np.all(table[:, :3] != 0) and np.all(table[:, T + 1:] == 0)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in (dq, dk))

  enc = _cope(max_positions=64)
  visible = _visible()[:, None]
  logits = jnp.where(visible, jnp.asarray(_random(10, B, H, T, T)), -jnp.inf)
  dlogits = np.asarray(jax.grad(lambda x: jnp.sum(enc.content_bias(q, x)))(logits))
  seen = np.broadcast_to(visible, dlogits.shape)
  assert np.all(np.isfinite(dlogits)) and np.all(dlogits[~seen] == 0)
  assert np.count_nonzero(dlogits) > 0.9 * np.count_nonzero(seen)


def test_no_sequence_is_too_long():
  """Positions are capped, so CoPE encodes any length: no check refuses one, and a long row
  of open gates stays finite at the cap."""
  enc = _cope(max_positions=4)
  enc.check_length(10 ** 6)
  t = 300
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 5.0, -jnp.inf)[None, None]  # [1,1,t,t]
  bias = np.asarray(enc.content_bias(jnp.ones((1, t, 1, D)), logits))
  assert np.all(np.isfinite(bias))
  cfg = ModelConfig(**{**TINY_MODEL, "arch": "decoder"}, position="cope")
  model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))
  experiment.check_length(model, 10 ** 5, "data.max_len")  # what experiment.build checks


def test_pictures_record_the_content_bias_and_draw_no_position_panel(tmp_path):
  """CoPE acts at no positional seam, so it has no position picture (no bogus zero panel);
  its attention maps are the formula's, content bias included."""
  enc = _cope()
  assert position_pictures.position_panels(enc, 8, H * D, H) == []
  # H heads of D: the layer takes _cope's table
  cfg = ModelConfig(**{**TINY_MODEL, "d_model": H * D, "num_heads": H, "arch": "decoder"},
                    position="cope")
  model = make_model(cfg, rngs=nnx.Rngs(0))
  assert position_pictures.draw_positions(model, 16, str(tmp_path / "positions.png")) is None
  batch = {"inputs": np.array([[3, 4, 5, 6, 7]], np.int32)}
  flat = pictures.attention_weights(model, batch)["decoder"][0]
  model.decoder.position.table[...] = enc.table[...]
  counted = pictures.attention_weights(model, batch)["decoder"][0]
  assert np.all(np.triu(counted[0, 0], 1) == 0.0)
  np.testing.assert_allclose(counted.sum(-1), 1.0, rtol=1e-5)
  assert not np.allclose(counted, flat, atol=1e-3)


def test_the_configs_named_for_an_encoder_that_refuses_cope_take_it():
  """The refusal of CoPE in an encoder must not advise model.arch=decoder, which the
  default task refuses in turn; it names decoder-only configs, and each builds with it."""
  with pytest.raises(ConfigError) as refused:
    experiment.build(parse(make_tiny_config(**{"model.position": "cope"})))
  for (path, overrides), command in zip(experiment.DECODER_ONLY,
                                        experiment.decoder_only_commands("cope")):
    assert command in str(refused.value)
    config = importlib.import_module(path.removesuffix(".py").replace("/", ".")).get_config()
    for override in (*overrides, "model.position=cope"):
      (section, field), value = override.split("=")[0].split("."), override.split("=")[1]
      config[section][field] = value
    exp = experiment.build(parse(config), announce=False)
    assert exp.model.arch == "decoder" and exp.model.position == "cope"
