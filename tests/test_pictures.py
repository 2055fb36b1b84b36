"""Pictures: the recorded attention weights are the attention distributions (masks exact,
rows summing to 1, the model's output unchanged) and the position panels are the formulas;
a draw shows what a family that does not decode predicts, and replaces an earlier draw."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL, make_tiny_config
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import EncoderDecoder
from transformer.model.positions import POSITIONS, alibi_slopes, make_positional_encoding, sinusoid
from transformer.run import experiment, restored_run
from transformer.run.config import parse
from transformer.study import pictures, position_pictures

PNG = b"\x89PNG\r\n\x1a\n"
forward = nnx.jit(lambda model, batch: model(batch))


def _model(position="sinusoidal", kernel="reference", **kw):
  cfg = ModelConfig(**{**TINY_MODEL, "num_encoder_layers": 2, "num_decoder_layers": 2},
                    position=position, attention=AttentionConfig(kernel=kernel, block_size=4),
                    **kw)
  return EncoderDecoder(cfg, rngs=nnx.Rngs(0))


def _batch():
  inputs = np.array([[5, 6, 7, 8, 9, 2], [4, 5, 2, 0, 0, 0]], np.int32)  # row 1 padded
  targets = np.array([[9, 8, 7, 6, 2], [5, 4, 2, 0, 0]], np.int32)
  return {"inputs": inputs, "targets": targets}


@pytest.mark.parametrize("kernel", ["reference", "blockwise"])
def test_recorded_weights_are_the_attention_distributions(kernel):
  model, batch = _model(kernel=kernel), _batch()
  expected_logits = forward(model, batch)
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, MultiHeadAttention)]
  kernels = [layer.kernel for layer in layers]
  weights = pictures.attention_weights(model, batch)
  assert {k: len(v) for k, v in weights.items()} == {"encoder": 2, "decoder": 2, "cross": 2}
  src_real, tgt_real = batch["inputs"] != 0, batch["targets"] != 0
  for kind, (q_real, k_real) in {"encoder": (src_real, src_real), "decoder": (tgt_real, tgt_real),
                                 "cross": (tgt_real, src_real)}.items():
    for w in weights[kind]:
      assert w.shape == (2, 2, q_real.shape[1], k_real.shape[1])
      sums = w.sum(-1)  # [b, h, tq]
      np.testing.assert_allclose(sums[np.broadcast_to(q_real[:, None], sums.shape)], 1.0,
                                 rtol=1e-5)
      padded_keys = np.broadcast_to(~k_real[:, None, None, :], w.shape)
      assert np.all(w[padded_keys] == 0.0), kind  # exactly zero, not merely small
  for w in weights["decoder"]:
    assert np.all(np.triu(w, k=1) == 0.0)  # causal: no weight on later positions
  assert not nnx.state(model, nnx.Intermediate)  # recorded on a copy: nothing left on the model
  assert [layer.kernel for layer in layers] == kernels  # the run's kernels, not recording ones
  np.testing.assert_allclose(forward(model, batch), expected_logits, rtol=1e-6, atol=1e-6)


def test_scanned_and_rematerialised_layers_record_the_same_weights():
  """Layers run as one scan, or rematerialised, are recorded one by one all the same, and
  the model keeps its options."""
  batch = _batch()
  plain = pictures.attention_weights(_model(), batch)
  model = _model(scan_layers=True, remat=True)
  for kind, maps in pictures.attention_weights(model, batch).items():
    for got, want in zip(maps, plain[kind], strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert model.encoder.scan_layers and model.decoder.remat


def test_position_panels_are_the_formulas():
  length, d, heads = 12, 16, 4
  none = make_positional_encoding("none", d, heads, length, rngs=nnx.Rngs(0))
  assert position_pictures.position_panels(none, length, d, heads) == []

  sin = make_positional_encoding("sinusoidal", d, heads, length, rngs=nnx.Rngs(0))
  (_, table), (_, similarity) = position_pictures.position_panels(sin, length, d, heads)
  np.testing.assert_allclose(table, sinusoid(jnp.arange(length), d), atol=1e-6)
  np.testing.assert_allclose(np.diag(similarity), 1.0, rtol=1e-5)

  rotary = make_positional_encoding("rotary", d, heads, length, rngs=nnx.Rngs(0))
  (_, rotated), (_, dots) = position_pictures.position_panels(rotary, length, d, heads)
  assert rotated.shape == (length, d // heads)
  # RoPE's relative property: the similarity depends on p - p' only (a Toeplitz matrix).
  np.testing.assert_allclose(dots[1:, 1:], dots[:-1, :-1], atol=1e-5)

  alibi = make_positional_encoding("alibi", d, heads, length, rngs=nnx.Rngs(0))
  panels = position_pictures.position_panels(alibi, length, d, heads)
  assert len(panels) == heads
  distance = np.abs(np.arange(length)[:, None] - np.arange(length)[None, :])
  before = np.tri(length, k=-1)  # keys before the query: an encoder's offset 0.5
  for (_, bias), slope in zip(panels, alibi_slopes(heads)):
    np.testing.assert_allclose(bias, -slope * (distance - 0.5 * before), rtol=1e-6)

  xpos = make_positional_encoding("xpos", d, heads, length, rngs=nnx.Rngs(0))
  (_, scaled), (_, dots) = position_pictures.position_panels(xpos, length, d, heads)
  np.testing.assert_allclose(scaled, xpos.rotate_queries(jnp.ones((1, length, 1, d // heads)),
                                                         jnp.arange(length)[None])[0, :, 0])
  np.testing.assert_allclose(dots[1:, 1:], dots[:-1, :-1], rtol=1e-4)  # relative, as rotary

  kerple = make_positional_encoding("kerple", d, heads, length, rngs=nnx.Rngs(0))
  panels = position_pictures.position_panels(kerple, length, d, heads)
  r1, r2 = np.exp(kerple.log_r1[...]), np.exp(kerple.log_r2[...])
  for h, (_, bias) in enumerate(panels):
    np.testing.assert_allclose(bias, -r1[h] * np.log1p(r2[h] * distance), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(set(POSITIONS) - {"none"}))
def test_every_encoding_has_position_panels(name):
  """What each encoding does from positions alone is drawn: panels of those seams, as many
  as it has. An encoding acting on content (content_biases, CoPE) may have none, and then
  gets no panel: a bias of content is no function of positions."""
  length, d, heads = 6, 16, 2
  for causal in (True,) if POSITIONS[name].causal_only else (False, True):
    enc = make_positional_encoding(name, d, heads, length, causal=causal, rngs=nnx.Rngs(0))
    panels = position_pictures.position_panels(enc, length, d, heads)
    assert panels or enc.content_biases
    assert all(np.all(np.isfinite(values)) for _, values in panels)
    assert len(panels) in ((heads,) if enc.biases else (0, 2) if enc.content_biases else (2,))


def test_draw_positions_writes_a_png_or_nothing(tmp_path):
  for position in ("learned", "fire"):
    path = position_pictures.draw_positions(_model(position), 16, str(tmp_path / f"{position}.png"))
    with open(path, "rb") as f:
      assert f.read(8) == PNG
  assert position_pictures.draw_positions(_model("none"), 16, str(tmp_path / "none.png")) is None
  assert not (tmp_path / "none.png").exists()


# --------------------------------------------------------------------------- draws of a run


def _run(config, workdir):
  """An untrained run of `config` as restored_run.restore_run gives one (its initial
  parameters stand for a checkpoint's)."""
  exp = experiment.build(parse(config), str(workdir), evaluating=True)
  exp.source.prepare()
  return restored_run.RestoredRun(str(workdir), exp, [0], jax.jit(exp.init)()["params"])


def _labelled(task, pooling):
  config = make_tiny_config()
  config.data.source = "labelled"
  config.task = task
  config.model.update(arch="encoder", pooling=pooling)
  return config


def _lm(corpus):
  """The LM source's own example corpus, at one evaluation length."""
  from transformer.data.lm.source import LanguageModelSource  # noqa: PLC0415

  config = make_tiny_config()
  config.data = {**LanguageModelSource.example(str(corpus)).sections["data"], "max_factor": 1}
  config.model.update(arch="decoder")
  config.eval.num_examples = 8
  del config.task
  return config


@pytest.mark.parametrize("kind", ["listops", "duplicates", "lm"])
def test_a_family_that_does_not_decode_shows_its_predictions(tmp_path, monkeypatch, kind):
  """eval.py --sentence on a classifier or a language model: the predicted label of the
  sequence (read at its CLS token), of each token, or the next token, as the model's
  forward pass gives them, in the pictures' titles."""
  if kind == "listops":
    config = _labelled(dict(name="listops", min_len=5, max_len=16, max_depth=3, max_args=3), "cls")
    sentences = ["[MAX 2 9 [MIN 4 7 ] 0 ]", "[SM 1 2 ]"]
  elif kind == "duplicates":
    config = _labelled(dict(name="duplicates", num_symbols=6, min_len=2, max_len=8), "none")
    sentences = ["0 1 2 0", "3 4"]
  else:
    (tmp_path / "corpus").mkdir()
    config = _lm(tmp_path / "corpus")
    sentences = ["def f1(x):", "return"]
  run = _run(config, tmp_path)
  exp = run.experiment
  captions = restored_run.sentence_predictions(run, sentences)
  model = nnx.merge(exp.graphdef, run.params)
  for sentence, caption in zip(sentences, captions):
    tokens = exp.source.encode(sentence)
    predicted = np.asarray(jnp.argmax(forward(model, {"inputs": tokens[None]})[0], -1))
    assert caption == {
        "listops": f"predicted label {predicted[0]}",
        "duplicates": "predicted labels " + " ".join(
            f"{p}:{label}" for p, label in zip(exp.source.pieces(tokens), predicted)),
        "lm": f"predicted next token {exp.source.pieces(predicted[-1:])[0]!r}"}[kind]
  titles = []
  monkeypatch.setattr(pictures, "_grid", lambda maps, q, k, title, path, **kw: titles.append(
      title))
  pictures.draw(run, sentences, str(tmp_path / "plots"))
  assert [t.split("\n")[1] for t in titles] == [f"{s!r} → {c}" for s, c in zip(sentences, captions)]


def test_a_draw_replaces_the_pictures_of_an_earlier_one(tmp_path):
  """Pictures an earlier draw left (another sentence, a stack this model has not) are
  removed; files this code does not write are kept."""
  config = _labelled(dict(name="listops", min_len=5, max_len=16, max_depth=3, max_args=3), "cls")
  run = _run(config, tmp_path)
  plots = tmp_path / "plots"
  plots.mkdir()
  earlier = ["attention_0_encoder.png", "attention_1_encoder.png", "attention_3_cross.png",
             "attention_0_decoder.png", "positions.png"]
  kept = ["notes.txt", "attention_map.png", "attention_0_encoder.png.bak", "my_positions.png"]
  for name in earlier + kept:
    (plots / name).write_bytes(b"earlier")
  paths = pictures.draw(run, ["[MAX 2 9 ]"], str(plots))
  assert sorted(os.path.basename(p) for p in paths) == ["attention_0_encoder.png",
                                                         "positions.png"]
  assert sorted(os.listdir(plots)) == sorted(kept + ["attention_0_encoder.png", "positions.png"])
  for name in ("attention_0_encoder.png", "positions.png"):
    assert (plots / name).read_bytes()[:8] == PNG
