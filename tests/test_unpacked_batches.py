"""Training batches declared unpacked (data/pipeline.py unpacked, DataSource.unpacked_batches)
against the same rows with their segment ids and positions, from the real sources (the
default config's synthetic task, the LM source's windows): two train steps give the same
losses and parameters bit for bit (the CPU's kernels compute the same mask from either),
and the masks reach cuDNN as its own arguments (model/kernels/cudnn_mask.py) where the rows
with the keys reach it dense, checked on the call's arguments as tests/test_cudnn_mask.py
does (cuDNN cannot be lowered without a GPU)."""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from tests.support import source_config
from transformer.data import pipeline
from transformer.data.lm.source import LanguageModelSource
from transformer.model.kernels import registry
from transformer.run import experiment
from transformer.run.config import parse
from transformer.run.step import batch_sums, make_train_step

BATCH = 8


def _config(source: str, tmp_path, overrides: dict):
  """The default config (synthetic reverse_string, encoder-decoder) or the LM source's
  example (decoder-only), `BATCH` rows, with `overrides`."""
  if source == "default":
    config = default.get_config()
    config.train.batch_size = BATCH
    raw = config.to_dict()
  else:
    raw = source_config(LanguageModelSource.example(str(tmp_path)).sections,
                        **{"train.batch_size": BATCH})
  for key, value in overrides.items():
    section, *inner, field = key.split(".")
    target = raw[section]
    for name in inner:
      target = target[name]
    target[field] = value
  return parse(raw)


def _batches(exp, monkeypatch) -> tuple[dict, dict]:
  """(the source's first training batch, the same rows with their segment ids and
  positions, as the source builds them before pipeline.unpacked drops them)."""
  exp.source.prepare()
  assert exp.source.unpacked_batches
  batch = next(iter(exp.source.train_batches()))
  with monkeypatch.context() as patch:
    patch.setattr(pipeline, "unpacked", lambda arrays: arrays)
    whole = next(iter(exp.source.train_batches()))
  structure = set(pipeline.STRUCTURE_KEYS)
  assert structure <= set(whole) and not structure & set(batch)
  for key in batch:
    np.testing.assert_array_equal(batch[key], whole[key])
  return batch, whole


STEP_CASES = [("default", {}), ("default", {"model.random_positions": True}),
              ("default", {"model.random_positions": True,
                           "model.random_positions_draw": "per_row"}),
              ("lm", {}), ("lm", {"model.position": "alibi", "model.attention.kernel": "xla"}),
              ("lm", {"model.random_positions": True, "model.position": "rotary"})]


@pytest.mark.parametrize("source, overrides", STEP_CASES)
def test_unpacked_rows_train_as_the_rows_with_their_keys(source, overrides, tmp_path,
                                                         monkeypatch):
  exp = experiment.build(_config(source, tmp_path, overrides), str(tmp_path / "run"))
  batch, whole = _batches(exp, monkeypatch)
  step = jax.jit(make_train_step(exp.graphdef, exp.optimizer, exp.schedule,
                                 label_smoothing=exp.config.train.label_smoothing,
                                 seed=exp.config.seed))
  runs = []
  for rows in (batch, whole):
    state, metrics = exp.init(), []
    for _ in range(2):
      state, sums = step(state, rows)
      metrics.append(sums)
    runs.append((jax.device_get(metrics), jax.device_get(state["params"])))
  (metrics, params), (want_metrics, want_params) = runs
  assert metrics[0]["tokens"] == (whole["targets_segmentation"] > 0).sum()
  jax.tree.map(np.testing.assert_array_equal, metrics, want_metrics)
  jax.tree.map(np.testing.assert_array_equal, params, want_params)
  initial = jax.tree.leaves(jax.device_get(exp.init()["params"]))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), initial))


def _cudnn_calls(exp_config, tmp_path, monkeypatch, rows_of):
  """The keyword arguments of each jax.nn.dot_product_attention call of one forward and
  backward pass of the loss on the source's batch (rows_of picks it from _batches' pair),
  every layer's kernel being `cudnn` (recorded, computed by XLA); and the batch."""
  calls = []
  real_attention, real_fused = jax.nn.dot_product_attention, registry.fused_kernel

  def recorded(*args, implementation=None, **kwargs):
    calls.append(dict(kwargs, implementation=implementation))
    return real_attention(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
  monkeypatch.setattr(registry, "fused_kernel", lambda implementation: real_fused("cudnn"))
  exp = experiment.build(exp_config, str(tmp_path / "run"))
  rows = rows_of(_batches(exp, monkeypatch))
  model = nnx.merge(exp.graphdef, exp.init()["params"])
  nnx.grad(lambda m: batch_sums(m, rows, nnx.Rngs(dropout=0))["loss"])(model)
  return calls, rows


def _lengths(tokens) -> list[int]:
  return np.maximum((np.asarray(tokens) != 0).sum(1), 1).tolist()


def test_the_default_synthetic_batch_reaches_cudnn_as_sequence_lengths(tmp_path, monkeypatch):
  config = _config("default", tmp_path, {"model.attention.kernel": "xla"})
  calls, batch = _cudnn_calls(config, tmp_path, monkeypatch, lambda pair: pair[0])
  source, target = _lengths(batch["inputs"]), _lengths(batch["targets"])
  assert len(source) == BATCH and len(set(source)) > 1  # rows of several lengths
  expected = {(tuple(source), tuple(source), False),  # encoder self-attention
              (tuple(target), tuple(target), True),  # decoder self-attention
              (tuple(target), tuple(source), False)}  # cross-attention
  got = set()
  for call in calls:
    assert call["implementation"] == "cudnn" and "mask" not in call, sorted(call)
    got.add((tuple(np.asarray(call["query_seq_lengths"]).tolist()),
             tuple(np.asarray(call["key_value_seq_lengths"]).tolist()), call["is_causal"]))
  assert got == expected
  layers = config.model.num_encoder_layers + 2 * config.model.num_decoder_layers
  assert len(calls) == layers


def test_lm_windows_reach_cudnn_as_a_causal_flag(tmp_path, monkeypatch):
  config = _config("lm", tmp_path, {"model.attention.kernel": "xla"})
  calls, batch = _cudnn_calls(config, tmp_path, monkeypatch, lambda pair: pair[0])
  length = batch["inputs"].shape[1]
  assert len(calls) == config.model.num_decoder_layers
  for call in calls:
    assert call["implementation"] == "cudnn" and "mask" not in call, sorted(call)
    assert call["is_causal"] is True and call.get("local_window_size") is None
    np.testing.assert_array_equal(call["query_seq_lengths"], [length] * BATCH)
    np.testing.assert_array_equal(call["key_value_seq_lengths"], [length] * BATCH)


@pytest.mark.parametrize("source", ["default", "lm"])
def test_the_same_rows_with_their_keys_reach_cudnn_dense(source, tmp_path, monkeypatch):
  config = _config(source, tmp_path, {"model.attention.kernel": "xla"})
  calls, _ = _cudnn_calls(config, tmp_path, monkeypatch, lambda pair: pair[1])
  assert calls and all(call["implementation"] == "cudnn" and "mask" in call
                       and "query_seq_lengths" not in call for call in calls)
