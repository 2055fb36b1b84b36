"""Encoder-only and decoder-only families: invariances (padding, packing, causality, cached
generation), every family × encoding × scorer builds and steps, the tasks are learned."""

import itertools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import (ROOT, TINY_MODEL, eight_devices, family_batch, listops_config,
                           make_tiny_config, train_losses)
from transformer.core.errors import ConfigError
from transformer.core.metrics import macro_f1
from transformer.core.vocab import EOS_ID, NUM_RESERVED
from transformer.data import SourceArgs, Targets
from transformer.data.lm import corpora
from transformer.data.lm import source as lm
from transformer.data.tasks import listops
from transformer.data.base import SourceSection
from transformer.data.tasks.casts import label_batch
from transformer.data.tasks.labelled import LabelledSource
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.decoding import generate, greedy_decode
from transformer.model.families import ARCHS, ModelFamily, make_model
from transformer.model.positions import POSITIONS
from transformer.model.scores import SCORES
from transformer.model.stack import Stack
from transformer.run import experiment
from transformer.run import step as step_lib
from transformer.run import training
from transformer.run.config import parse

TINY = {**TINY_MODEL, "num_encoder_layers": 2, "num_decoder_layers": 2, "max_len": 64}
forward = nnx.jit(lambda model, batch: model(batch))
# The encodings each family may use: an encoder stack is bidirectional, so no encoding
# declaring causal_only; the decoder-only family's stack is causal, so every one.
FAMILY_POSITIONS = {
    "encoder": sorted(name for name, cls in POSITIONS.items() if not cls.causal_only),
    "decoder": sorted(POSITIONS)}
# Layer-wise patterns (model/layer_pattern.py): a RoPE/NoPE hybrid; CoPE's and FIRE's layers.
DECODER_PATTERNS = ["rotary+none", "cope+fire"]


def _model(arch, position="sinusoidal", pooling="none", score="scaled_dot", **kw):
  cfg = ModelConfig(**TINY, arch=arch, position=position, pooling=pooling,
                    num_classes=5 if arch == "encoder" else 0,
                    attention=AttentionConfig(score=score, **kw))
  return make_model(cfg, rngs=nnx.Rngs(0))


def _without_zeros(model, seed=0):
  """model with every parameter that starts at zero (biases; CoPE's position table, which
  would make it the identity) drawn at random, so that every encoding acts in the
  equivalences below."""
  state = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(state)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(pure))))
  nnx.replace_by_pure_dict(state, jax.tree.map(
      lambda x, key: jnp.where(jnp.any(x != 0), x, 0.5 * jax.random.normal(key, x.shape)),
      pure, jax.tree.unflatten(jax.tree.structure(pure), list(keys))))
  nnx.update(model, state)
  return model


def _labelled(name, **fields):
  """A labelled task (task.name and fields: config.task) and its source."""
  task = LabelledSource.Task.parse({"name": name, **fields}, "task")
  return task, LabelledSource(SourceSection("labelled"), task, SourceArgs(0, 8, 8))


def _row(source, split, index, seed=0):
  """(tokens, labels, weights) of instance `index` of a split, as the source casts it."""
  return source.cast.row(source.task, source.task.example(seed, split, index))


def _examples(source, n=3):
  return [_row(source, "valid", i) for i in range(n)]


# --------------------------------------------------------------------------- every family


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_family_meets_the_interface(arch):
  """features · projectionᵀ is the forward pass, the stacks are named, and a family that
  decodes or generates does so with its cache: each decoded token is the argmax of a full
  forward pass over what was decoded (greedy, EOS and padding aside)."""
  family = ARCHS[arch]
  assert issubclass(family, ModelFamily) and family.learns and family.learns <= set(Targets)
  model = _model(arch)
  batch = family_batch(arch)
  y = np.asarray(nnx.jit(lambda m, b: m.features(b))(model, batch))
  w, bias = model.projection(jnp.float32)
  logits = np.asarray(forward(model, batch))
  assert y.shape == (2, 8, TINY["d_model"]) and logits.shape == (2, 8, w.shape[0])
  np.testing.assert_allclose(logits, y @ np.asarray(w).T + (0 if bias is None else bias),
                             atol=1e-5)
  assert model.stacks() and all(isinstance(s, Stack) for s in model.stacks().values())
  if family.decodes:
    tokens = np.asarray(nnx.jit(greedy_decode, static_argnums=2)(model, batch, 6))
    full = np.asarray(forward(model, {**batch, "targets": tokens,
                                      "targets_segmentation": np.ones_like(tokens)}))
    for row, out in zip(tokens, full):
      n = list(row).index(EOS_ID) + 1 if EOS_ID in row else len(row)
      np.testing.assert_array_equal(row[:n], out[:n].argmax(-1))
  if family.generates:
    prompts, lengths = batch["inputs"][:, :3], np.array([1, 3])
    tokens, _ = nnx.jit(generate, static_argnums=3)(model, prompts, lengths, 10)
    tokens = np.asarray(tokens)
    full = np.asarray(forward(model, {"inputs": tokens, "inputs_segmentation": np.ones_like(
        tokens)}))
    for row, out, n in zip(tokens, full, lengths):
      np.testing.assert_array_equal(row[n:], out[n - 1:-1, 1:].argmax(-1) + 1)  # never PAD
  if not (family.decodes or family.generates):
    with pytest.raises(NotImplementedError):
      model.init_decoding(batch, 4)


# --------------------------------------------------------------------------- encoder


@pytest.mark.parametrize("position,pooling", [
    (p, ("cls", "mean")[i % 2]) for i, p in enumerate(FAMILY_POSITIONS["encoder"])])
def test_classification_is_invariant_to_padding_and_packing(position, pooling):
  model = _model("encoder", position, pooling)
  examples = _examples(_labelled("listops", min_len=6, max_len=20, max_depth=3)[1])
  first = examples[0]
  alone = np.asarray(forward(model, label_batch([first], len(first[0]))))[0, 0]
  padded = label_batch(examples, 24)  # one per row, padded
  packed = label_batch(examples, 64, pack=True)  # all three in one row
  assert len(packed["inputs"]) == 1
  by_padded = np.asarray(forward(model, padded))[:, 0]
  starts = np.flatnonzero(packed["targets_segmentation"][0])
  by_packed = np.asarray(forward(model, packed))[0, starts]
  np.testing.assert_allclose(by_padded[0], alone, atol=2e-5)
  np.testing.assert_allclose(by_packed, by_padded, atol=2e-5)


@pytest.mark.parametrize("position", ["sinusoidal", "rotary", "t5"])
def test_token_labels_of_a_packed_row_equal_each_sequence_alone(position):
  model = _model("encoder", position)
  examples = _examples(_labelled("duplicates", min_len=3, max_len=9)[1], n=4)
  packed = label_batch(examples, 40, pack=True)
  logits = np.asarray(forward(model, packed))
  segments = packed["inputs_segmentation"]
  for row, segment in {(r, s) for r, s in zip(*np.nonzero(segments))
                       for s in [segments[r, s]]}:
    ex = examples[sum(len(np.unique(segments[i][segments[i] > 0])) for i in range(row))
                  + segment - 1]
    alone = np.asarray(forward(model, label_batch([ex], 12)))[0, :len(ex[0])]
    np.testing.assert_allclose(logits[row][segments[row] == segment], alone, atol=2e-5)


def test_bidirectional_labels_need_both_sides():
  tokens, labels, weights = _row(_labelled("duplicates", num_symbols=4, min_len=6,
                                           max_len=6)[1], "train", 0)
  counts = [(tokens == t).sum() - 1 for t in tokens]
  np.testing.assert_array_equal(labels, np.minimum(counts, 1))
  assert weights.tolist() == [1] * 6
  # the first token's label depends on tokens to its right only
  assert labels[0] == int(any(tokens[1:] == tokens[0]))


def test_listops_values_and_purity():
  _, source = _labelled("listops", min_len=5, max_len=40, max_depth=3)
  a, b = _row(source, "train", 7, seed=3), _row(source, "train", 7, seed=3)
  np.testing.assert_array_equal(a[0], b[0])
  pieces = [listops.PIECES[t - NUM_RESERVED] for t in a[0][1:]]

  def evaluate(i):  # a reference evaluator of the prefix notation
    if pieces[i].isdigit():
      return int(pieces[i]), i + 1
    op, args, i = pieces[i], [], i + 1
    while pieces[i] != "]":
      value, i = evaluate(i)
      args.append(value)
    return listops.OPERATORS[op](args), i + 1

  assert evaluate(0) == (a[1][0], len(pieces))
  assert listops.OPERATORS["[MED"]([1, 4, 6, 9]) == 5 and listops.OPERATORS["[SM"]([7, 8]) == 5
  assert a[2].tolist() == [1] + [0] * (len(a[0]) - 1)  # scored at the CLS token only
  heldout = _row(source, "valid", 7, seed=3)
  # held out: the CRC32 of the tokens, CLS included, is a multiple of heldout_modulus (10)
  assert zlib.crc32(heldout[0].tobytes()) % 10 == 0 and zlib.crc32(a[0].tobytes()) % 10


def test_macro_f1_against_hand_computed_values():
  predictions = np.array([0, 0, 1, 1, 2, 0])
  labels = np.array([0, 1, 1, 1, 2, 2])
  # class 0: tp 1 fp 2 fn 0 -> 0.5; class 1: tp 2 fp 0 fn 1 -> 0.8; class 2: tp 1 fn 1 -> 2/3
  assert macro_f1(predictions, labels, np.ones(6), 3) == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
  assert macro_f1(predictions, labels, np.array([1, 0, 1, 1, 1, 0]), 3) == pytest.approx(1.0)


# --------------------------------------------------------------------------- decoder


@pytest.mark.parametrize("position", FAMILY_POSITIONS["decoder"] + DECODER_PATTERNS)
def test_cached_generation_equals_full_recomputation_and_prefixes_ignore_the_future(position):
  model = _without_zeros(_model("decoder", position))
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 19, (3, 5)), jnp.int32)
  lengths = jnp.array([1, 3, 5])
  tokens, cached = nnx.jit(lambda m, p, n: generate(m, p, n, 12))(model, prompts, lengths)
  tokens = np.asarray(tokens)
  np.testing.assert_array_equal(tokens[1, :3], prompts[1, :3])
  ones = np.ones_like(tokens)  # explicit: a generated token may be any id
  full = np.asarray(forward(model, {"inputs": tokens, "inputs_segmentation": ones}))
  np.testing.assert_allclose(np.asarray(cached), full[:, :-1], atol=5e-5, rtol=1e-4)
  generated = np.arange(1, 12)[None] >= np.asarray(lengths)[:, None]
  full_greedy = full[:, :-1, 1:].argmax(-1) + 1  # never PAD (id 0)
  np.testing.assert_array_equal(np.where(generated, full_greedy, tokens[:, 1:]),
                                tokens[:, 1:])
  changed = tokens.copy()
  changed[:, 7:] = 3 + (changed[:, 7:] - 2) % 16  # other tokens after position 6
  np.testing.assert_allclose(np.asarray(forward(model, {"inputs": changed,
                                                       "inputs_segmentation": ones}))[:, :7],
                             full[:, :7], atol=1e-5)


@pytest.mark.parametrize("position", FAMILY_POSITIONS["decoder"])
def test_lm_packed_row_equals_each_sequence_alone(position):
  """Three sequences packed into one row (segment ids, positions restarting, padding at the
  end) give each the logits it has alone: nothing crosses segments, whatever the encoding
  (CoPE's gates count only the keys the query sees)."""
  model = _without_zeros(_model("decoder", position))
  lengths = (5, 3, 6)
  alone = np.random.default_rng(1).integers(3, 19, (3, 6)).astype(np.int32)
  alone[np.arange(6)[None] >= np.array(lengths)[:, None]] = 0  # PAD: segment 0
  row = lambda per_sequence, pad: np.concatenate(  # noqa: E731
      [per_sequence(i, n) for i, n in enumerate(lengths)] + [np.full(2, pad)])[None]
  packed = {"inputs": row(lambda i, n: alone[i, :n], 0).astype(np.int32),
            "inputs_segmentation": row(lambda i, n: np.full(n, i + 1), 0).astype(np.int32),
            "inputs_positions": row(lambda i, n: np.arange(n), 0).astype(np.int32)}
  by_sequence = np.asarray(forward(model, {"inputs": alone}))
  by_packed = np.asarray(forward(model, packed))[0]
  starts = np.cumsum((0,) + lengths)
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(by_packed[starts[i]:starts[i] + n], by_sequence[i, :n],
                               atol=2e-5, rtol=1e-5)


def test_lm_windows_score_the_same_tokens_at_every_length(tmp_path):
  stream = np.arange(3, 3 + 200, dtype=np.int32)
  batch = lm.window_batch(stream, [0, 10], 8, ends=[4, 30], scored_from=[0, 5])
  assert batch["inputs_segmentation"][0].tolist() == [1] * 4 + [0] * 4
  np.testing.assert_array_equal(batch["inputs"][1], stream[10:18])
  np.testing.assert_array_equal(batch["targets"][1], stream[11:19])
  assert batch["targets_segmentation"][1].tolist() == [0] * 5 + [1] * 3
  for name in ("train", "valid"):
    (tmp_path / f"{name}.txt").write_text("\n".join(f"def f{i}(x):\n  return x + {i}"
                                                    for i in range(400)))
  config = make_tiny_config()
  config.data = dict(source="lm", corpus="files", dir=str(tmp_path), train_files="train.txt",
                     valid_files="valid.txt", vocab_size=64, max_len=8, max_factor=4)
  config.model.update(arch="decoder", max_len=32)
  config.eval.num_examples = 5
  source = experiment.build(parse(config), str(tmp_path)).source
  source.prepare()
  splits = source.eval_splits()
  assert sorted(splits) == ["len16", "len16_sliding", "len32", "len32_sliding", "len8"]
  scored = {name: int((s.arrays["targets_segmentation"] > 0).sum())
            for name, s in splits.items()}
  assert set(scored.values()) == {5 * 32}
  np.testing.assert_array_equal(  # the same tokens, cut differently
      splits["len8"].arrays["targets"].reshape(-1),
      splits["len32"].arrays["targets"].reshape(-1))
  train, valid = corpora.stdlib_files(lm.LMData(python_version="{}.{}".format(
      *__import__("sys").version_info[:2])))
  assert train and valid and not set(train) & set(valid) and train == sorted(train)


# --------------------------------------------------------------------------- every combination


def _step(model):
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  import optax  # noqa: PLC0415
  optimizer = optax.adam(1e-3)
  step = step_lib.make_train_step(graphdef, optimizer, lambda s: 1e-3, label_smoothing=0.1,
                                  seed=0)
  return step, {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": optimizer.init(params)}


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_every_family_encoding_and_scorer_traces(arch):
  positions = FAMILY_POSITIONS[arch]
  for position, score in itertools.product(positions, sorted(SCORES)):
    model = nnx.eval_shape(lambda p=position, s=score: _model(arch, p, score=s))
    out = jax.eval_shape(lambda m, b: m(b), model, family_batch(arch))
    assert out.shape == (2, 8, 5 if arch == "encoder" else 19)
  for position, score in [*((p, "scaled_dot") for p in positions),
                          *(("rotary", s) for s in SCORES)]:
    step, state = _step(nnx.eval_shape(lambda p=position, s=score: _model(arch, p, score=s)))
    _, sums = jax.eval_shape(step, state, family_batch(arch))
    assert sums["loss"].shape == ()


@pytest.mark.parametrize("arch,pooling,kw", [
    ("encoder", "mean", dict(kernel="blockwise", block_size=4, window="local", window_size=2)),
    ("encoder", "none", dict(kernel="xla")),
    ("decoder", "none", dict(kernel="blockwise", block_size=4, window="local", window_size=3))])
def test_one_train_step_computes_with_other_kernels_and_windows(arch, pooling, kw):
  step, state = _step(_model(arch, "alibi", pooling, **kw))
  new, sums = jax.jit(step)(state, family_batch(arch))
  assert np.isfinite(float(sums["loss"])) and float(sums["tokens"]) == 16
  assert int(new["step"]) == 1


def test_family_and_data_must_fit():
  config = make_tiny_config()
  config.data.source = "labelled"
  config.task = dict(name="duplicates", min_len=2, max_len=6, num_symbols=6)
  with pytest.raises(ConfigError, match="model.arch='encoder_decoder' cannot learn"):
    experiment.build(parse(config))
  config.model.arch = "encoder"
  config.model.pooling = "cls"
  with pytest.raises(ConfigError, match="pooling='cls' does not fit"):
    experiment.build(parse(config))
  config.model.pooling = "max"
  with pytest.raises(ConfigError, match="unknown model pooling 'max'; choose one of"):
    experiment.build(parse(config))
  config.model.pooling, config.model.arch = "none", "prefix_lm"
  with pytest.raises(ConfigError, match="unknown model arch 'prefix_lm'"):
    experiment.build(parse(config))
  config.model.arch, config.task.name = "encoder", "no_such_task"
  with pytest.raises(ConfigError, match="unknown labelled task 'no_such_task'"):
    experiment.build(parse(config))


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize("task,pooling,chance", [
    (dict(name="duplicates", num_symbols=8, min_len=4, max_len=8), "none", 0.5),  # balanced
    (dict(name="listops", min_len=5, max_len=12, max_depth=2, max_args=4), "cls", 0.1)])
def test_a_tiny_encoder_learns_each_task(tmp_path, task, pooling, chance):
  config = make_tiny_config()
  config.data.source = "labelled"
  config.task = task
  config.model.update(arch="encoder", pooling=pooling, num_encoder_layers=2, max_len=16)
  config.train.update(num_steps=300, learning_rate=0.25, warmup_steps=50, log_every=100,
                      checkpoint_every=300)
  config.eval.update(num_examples=256, batch_size=128)
  training.train_and_evaluate(parse(config), str(tmp_path))
  final = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  valid = [r for r in final if r["split"] == "valid"][-1]
  assert valid["accuracy"] > chance + 0.3 and valid["macro_f1"] > 0.5, valid


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_pictures_of_each_family(tmp_path, arch):
  from transformer.study import pictures, position_pictures  # noqa: PLC0415 - matplotlib only here
  model = _model(arch, "alibi")
  source = _labelled("duplicates", num_symbols=16)[1]
  encoded = [np.array([3, 4, 5, 3], np.int32), np.array([6, 7], np.int32)]
  paths = pictures.draw_self_attention(model, source, ["0 1 2 0", "3 4"], encoded,
                                       str(tmp_path))
  assert [p.rsplit("/", 1)[1] for p in paths] == [f"attention_{i}_{arch}.png" for i in (0, 1)]
  weights = pictures.attention_weights(model, {"inputs": np.stack([encoded[0]])})
  assert list(weights) == [arch] and weights[arch][0].shape == (1, 2, 4, 4)
  if arch == "decoder":  # causal: nothing above the diagonal
    assert np.allclose(np.triu(weights[arch][0][0, 0], 1), 0)
  assert position_pictures.draw_positions(model, 16, str(tmp_path / "positions.png"))


def test_sweep_plots_perplexity_by_length(tmp_path):
  from transformer.study import figures, report_plots  # noqa: PLC0415
  run = lambda scale: {f"len{w}{s}": {"eval_length": float(w), "perplexity": scale * w ** 0.5,  # noqa: E731
                                      "loss_by_position": {"0": 3.0, "64": 2.0 * scale}}
                       for w in (64, 128) for s in ("", "_sliding")}
  report_plots.plot_lengths(figures.pyplot(), str(tmp_path), {"alibi": [run(1.0), run(1.1)],
                                                                 "rotary": [run(2.0)]}, 64)
  assert (tmp_path / "perplexity.png").stat().st_size and (tmp_path / "position_loss.png").exists()


SHARDED_RUN = """
import json, sys
from tests.support import listops_config
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
train_and_evaluate(parse(listops_config(**json.loads(sys.argv[2]))), sys.argv[1])
"""


def test_sharded_encoder_run_matches_one_device(tmp_path):
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
  training.train_and_evaluate(parse(listops_config()), single)
  mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.scan_layers": True}
  proc = subprocess.run([sys.executable, "-c", SHARDED_RUN, sharded, json.dumps(mesh)], cwd=ROOT,
                        env=eight_devices(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_allclose(train_losses(sharded), train_losses(single), rtol=1e-5)


def test_lra_sized_listops_config_builds():
  from configs import listops  # noqa: PLC0415
  config = listops.get_config("lra")
  exp = experiment.build(parse(config))
  assert (exp.config.task.max_len, exp.model.num_encoder_layers, exp.model.pooling) == (
      2000, 4, "mean")
  with pytest.raises(ValueError, match="takes '' or 'lra'"):
    listops.get_config("big")


def test_listops_input_must_be_one_expression():
  """eval.py --sentence on ListOps: an expression's value is the generator's label, and a
  malformed one (left open, an operator without arguments, a ']' closing nothing, pieces
  after the end) is refused, saying where."""
  _, source = _labelled("listops", min_len=5, max_len=40, max_depth=4, max_args=4)
  for i in range(200):
    tokens, labels, _ = _row(source, ("valid", "train")[i % 2], i)
    pieces = [listops.PIECES[t - NUM_RESERVED] for t in tokens[1:]]
    assert listops.listops_value(pieces) == labels[0]
    np.testing.assert_array_equal(source.encode(" ".join(pieces)), tokens)
  assert listops.listops_value("[MED 1 [SM 5 7 ] 9 ]".split()) == 2
  for sentence, problem in [("[MAX 1 2", "[MAX (piece 1) is not closed"),
                            ("[MAX 1 [MIN 2 ]", "[MAX (piece 1) is not closed"),
                            ("[MAX ]", "[MAX (piece 1) has no arguments"),
                            ("] 1", "piece 1 (']') closes no operator"),
                            ("[SM 1 ] 2", "piece 4 ('2') follows the end"),
                            ("4 5", "piece 2 ('5') follows the end")]:
    with pytest.raises(ConfigError, match="is not an expression") as e:
      source.encode(sentence)
    assert problem in str(e.value), str(e.value)
