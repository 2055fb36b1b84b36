"""Model shapes for every registry entry, packing equivalence, embeddings."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL, jaxpr_equations
from transformer.core.errors import ConfigError
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.decoding import greedy_decode
from transformer.model.families import EncoderDecoder, shift_right
from transformer.model.positions import POSITIONS, make_positional_encoding
from transformer.model.scores import SCORES, make_score

# 11 tokens: the shapes and parameter counts below; dropout on: the tests of it turn it off
TINY = {**TINY_MODEL, "vocab_size": 11, "num_decoder_layers": 2, "dropout": 0.1}
# The encodings an encoder-decoder may use: its encoder stack is bidirectional, so not those
# declaring causal_only (tested in the decoder-only family, tests/test_families.py).
ENCODER_POSITIONS = sorted(name for name, cls in POSITIONS.items() if not cls.causal_only)

# Compiled whole: eager NNX dispatches every op separately and is several times slower.
forward = nnx.jit(lambda model, batch: model(batch))
forward_train = nnx.jit(lambda model, batch, key: model(batch, rngs=nnx.Rngs(dropout=key)))


def _batch(b=2, s=5, t=6, seed=0):
  rng = np.random.default_rng(seed)
  return {"inputs": jnp.asarray(rng.integers(3, 11, (b, s)), jnp.int32),
          "targets": jnp.asarray(rng.integers(3, 11, (b, t)), jnp.int32)}


@pytest.mark.parametrize("position,score,window,norm", [
    *[(p, "scaled_dot", "full", "post") for p in ENCODER_POSITIONS],
    *[("sinusoidal", s, "full", "post") for s in sorted(SCORES)],
    ("rotary", "additive", "local", "pre"), ("learned", "gaussian", "local", "post")])
def test_forward_shapes_and_finite(position, score, window, norm):
  cfg = ModelConfig(**TINY, position=position, norm=norm,
                    attention=AttentionConfig(score=score, window=window, window_size=2))
  model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
  batch = _batch()
  logits = forward(model, batch)
  assert logits.shape == (2, 6, 11) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  train_logits = forward_train(model, batch, jax.random.key(1))  # dropout on
  assert not np.allclose(train_logits, logits)


def test_every_named_combination_has_right_abstract_shapes():
  for position, score in itertools.product(ENCODER_POSITIONS, sorted(SCORES)):
    cfg = ModelConfig(**TINY, position=position, attention=AttentionConfig(score=score))
    model = nnx.eval_shape(lambda cfg=cfg: EncoderDecoder(cfg, rngs=nnx.Rngs(0)))
    out = jax.eval_shape(lambda m, b: m(b), model, _batch())
    assert out.shape == (2, 6, 11)


@pytest.mark.parametrize("position", ENCODER_POSITIONS)
def test_packed_rows_equal_separate_rows(position):
  """Two pairs packed into one row with segment ids and restarting positions give the same
  logits as each pair alone: attention and positions never cross segments."""
  cfg = ModelConfig(**{**TINY, "dropout": 0.0}, position=position)
  model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
  a, b = _batch(1, 3, 4, seed=1), _batch(1, 2, 3, seed=2)
  alone = [forward(model, x) for x in (a, b)]
  cat = lambda k: jnp.concatenate([a[k], b[k], jnp.zeros((1, 1), jnp.int32)], 1)  # noqa: E731
  packed = {
      "inputs": cat("inputs"), "targets": cat("targets"),
      "inputs_segmentation": jnp.array([[1, 1, 1, 2, 2, 0]]),
      "inputs_positions": jnp.array([[0, 1, 2, 0, 1, 0]]),
      "targets_segmentation": jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
      "targets_positions": jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
  }
  logits = forward(model, packed)
  np.testing.assert_allclose(logits[0, :4], alone[0][0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits[0, 4:7], alone[1][0], rtol=1e-4, atol=1e-4)


def test_shift_right_restarts_each_segment_with_bos():
  targets = jnp.array([[5, 6, 7, 8, 9, 0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 0]])
  np.testing.assert_array_equal(shift_right(targets, positions), [[1, 5, 6, 1, 8, 1]])


def test_shared_embeddings_tie_output_projection():
  shared = EncoderDecoder(ModelConfig(**TINY), rngs=nnx.Rngs(0))
  separate = EncoderDecoder(ModelConfig(**TINY, share_embeddings=False), rngs=nnx.Rngs(0))
  n = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m)))  # noqa: E731
  assert n(separate) - n(shared) == 11 * 16 + (16 * 11 + 11)
  y = jnp.ones((1, 2, 16))
  table = shared.embeddings.source_table.embedding[...]
  np.testing.assert_allclose(shared.embeddings.logits(y), y @ table.T, rtol=1e-6)
  np.testing.assert_allclose(shared.embeddings.source(jnp.array([[3]]))[0, 0],
                             table[3] * 4.0, rtol=1e-6)  # scaled by √16


def _param_shapes(module) -> dict[str, tuple[int, ...]]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)))[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf.shape for path, leaf in flat}


def test_existing_entries_keep_their_checkpoint_layout():
  """Checkpoints of runs made before the settings sections restore: the encodings and
  scorers that existed then keep their parameters' paths and shapes (d_model 16, 2 heads,
  max_len 32), and a new entry owns its own."""
  positions = {"none": {}, "sinusoidal": {}, "rotary": {}, "alibi": {},
               "learned": {"table/embedding": (32, 16)}, "t5": {"table": (32, 2)}}
  for name, shapes in positions.items():
    for causal in (False, True):
      encoding = nnx.eval_shape(lambda n=name, c=causal: make_positional_encoding(
          n, 16, 2, 32, causal=c, rngs=nnx.Rngs(0)))
      assert _param_shapes(encoding) == shapes, name
  scores = {"scaled_dot": {}, "dot": {}, "gaussian": {"log_sigma": (2,)},
            "additive": {"w_q": (2, 8, 8), "w_k": (2, 8, 8), "w_v": (2, 8)}}
  for name, shapes in scores.items():
    scorer = nnx.eval_shape(lambda n=name: make_score(n, 2, 8, rngs=nnx.Rngs(0)))
    assert _param_shapes(scorer) == shapes, name
  layer = nnx.eval_shape(lambda: MultiHeadAttention(16, 2, AttentionConfig(), rngs=nnx.Rngs(0)))
  assert _param_shapes(layer) == {f"{p}/kernel": (16, 16) for p in ("key", "out", "query",
                                                                      "value")}


def test_unknown_norm_and_window():
  with pytest.raises(ConfigError, match="unknown norm 'mid'; choose one of: post, pre"):
    EncoderDecoder(ModelConfig(**TINY, norm="mid"), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="unknown attention window 'causal'; choose one of: full, local"):
    EncoderDecoder(ModelConfig(**TINY, attention=AttentionConfig(window="causal")), rngs=nnx.Rngs(0))


def test_bfloat16_computes_in_bfloat16_with_float32_parameters():
  """dtype=bfloat16: every matmul takes bf16 operands, the parameters stay float32, and the
  logits stay near the float32 model's (same parameters)."""
  cfg = ModelConfig(**{**TINY, "dropout": 0.0})
  ref = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
  low = EncoderDecoder(dataclasses.replace(cfg, dtype="bfloat16"), rngs=nnx.Rngs(0))
  assert {x.dtype for x in jax.tree.leaves(nnx.state(low, nnx.Param))} == {jnp.dtype("float32")}
  batch = _batch()
  dots = jaxpr_equations(jax.make_jaxpr(lambda m, b: m(b))(low, batch).jaxpr, "dot_general")
  assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  a, b = np.asarray(forward(ref, batch)), np.asarray(forward(low, batch))
  assert np.linalg.norm(b - a) / np.linalg.norm(a) < 2e-2
  with pytest.raises(ConfigError, match="unknown model dtype 'float8'"):
    EncoderDecoder(dataclasses.replace(cfg, dtype="float8"), rngs=nnx.Rngs(0))


def test_remat_gives_the_same_loss_and_gradients_with_dropout():
  """Rematerialised layers recompute the same activations (dropout masks included)."""
  batch, key = _batch(), jax.random.key(3)

  def loss_and_grads(remat):
    model = EncoderDecoder(ModelConfig(**TINY, remat=remat), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(batch, rngs=nnx.Rngs(dropout=key)) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss, grads), (remat_loss, remat_grads) = loss_and_grads(False), loss_and_grads(True)
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads), strict=True):
    np.testing.assert_allclose(r, g, rtol=1e-4, atol=1e-5)  # recomputation reorders sums


@pytest.mark.parametrize("position,window,layers", [
    ("t5", "full", (2, 3)),  # a bias table every layer reads, inside the scan
    ("t5+rotary", "full+local", (3, 4))])  # a layer-wise pattern: two layers a scan step
def test_scanned_layers_equal_the_layer_loop(position, window, layers):
  """scan_layers: the same parameter layout (checkpoints interchangeable), logits, gradients
  and cached greedy decoding as the per-layer loop, with the layer traced once per stack
  (under a pattern of period 2: the two layers of a period once, and a last layer of an
  unfinished period by itself)."""
  cfg = ModelConfig(**{**TINY, "dropout": 0.0, "num_encoder_layers": layers[0],
                       "num_decoder_layers": layers[1]}, position=position,
                    attention=AttentionConfig(window=window, window_size=2))
  batch = _batch()

  def run(scan):
    model = EncoderDecoder(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(batch) ** 2)  # noqa: E731
    decoded = nnx.jit(greedy_decode, static_argnums=2)(model, batch, 6)
    jaxpr = jax.make_jaxpr(lambda m, b: m(b))(model, batch).jaxpr
    dots = len(jaxpr_equations(jaxpr, "dot_general"))
    return params, jax.jit(jax.value_and_grad(loss))(params), decoded, dots

  params, (loss, grads), decoded, dots = run(False)
  scan_params, (scan_loss, scan_grads), scan_decoded, scan_dots = run(True)
  assert jax.tree.structure(scan_params) == jax.tree.structure(params)
  np.testing.assert_allclose(scan_loss, loss, rtol=1e-5)
  for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(scan_grads), strict=True):
    np.testing.assert_allclose(s, g, rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(scan_decoded, decoded)
  assert scan_dots < dots  # one traced layer per stack instead of one per layer


def test_scanned_layers_with_dropout_and_remat():
  """Dropout draws a key per layer inside the scan; remat recomputes the same masks."""
  batch, key = _batch(), jax.random.key(3)

  def loss(remat):
    model = EncoderDecoder(ModelConfig(**TINY, scan_layers=True, remat=remat), rngs=nnx.Rngs(0))
    return forward_train(model, batch, key), forward(model, batch)

  (train, deterministic), (remat_train, _) = loss(False), loss(True)
  np.testing.assert_allclose(remat_train, train, rtol=1e-5, atol=1e-6)
  assert np.all(np.isfinite(train)) and not np.allclose(train, deterministic)
