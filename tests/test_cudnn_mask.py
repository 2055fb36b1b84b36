"""How each mask reaches cuDNN (transformer/model/kernels/cudnn_mask.py): the arguments the
`cudnn` kernel hands jax.nn.dot_product_attention, recorded (cuDNN cannot be lowered without
a GPU), and the attention they define, computed by XLA, against the dense mask's."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.model.embeddings import inputs_mask
from transformer.model.kernels.fallbacks import log_once
from transformer.model.kernels.registry import fused_kernel
from transformer.model.masks import Mask
from transformer.model.positions import make_positional_encoding
from transformer.model.scores import make_score

B, T, S, H, D = 3, 12, 10, 4, 8
LENGTHS, SOURCE_LENGTHS = [12, 7, 1], [10, 4, 6]


def padded(lengths, size):
  """[b, size] segment ids 1…1 0…0 and positions 0, 1, …"""
  segments = (np.arange(size)[None] < np.array(lengths)[:, None]).astype(np.int32)
  return jnp.asarray(segments), jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, size))


def mask_of(kind: str) -> Mask:
  seg, pos = padded(LENGTHS, T)
  if kind == "cross":
    k_seg, k_pos = padded(SOURCE_LENGTHS, S)
    return Mask(seg, k_seg, pos, k_pos, padded=True)
  if kind == "packed":  # two sequences in row 0
    seg = seg.at[0, 5:].set(2)
    pos = pos.at[0, 5:].add(-5)
    return Mask(seg, seg, pos, pos, causal=True)
  causal, window = {"causal": (True, None), "padding": (False, None),
                    "causal_window": (True, 3), "window": (False, 3)}[kind]
  return Mask(seg, seg, pos, pos, causal=causal, window=window, padded=True)


def attend(kind: str, position: str, implementation: str, monkeypatch=None):
  """(the output [b, t, h, d], the keyword arguments of each dot_product_attention call) of
  the fused kernel `implementation`; a `cudnn` call is recorded and computed by XLA."""
  mask = mask_of(kind)
  tk = mask.k_segments.shape[1]
  q, k, v = (jax.random.normal(jax.random.key(i), (B, n, H, D), jnp.bfloat16)
             for i, n in ((0, T), (1, tk), (2, tk)))
  encoding = make_positional_encoding(position, H * D, H, 64, causal=mask.causal,
                                      rngs=nnx.Rngs(1))
  calls = []
  if monkeypatch is not None:
    real = jax.nn.dot_product_attention

    def recorded(*args, implementation=None, **kwargs):
      calls.append(dict(kwargs, implementation=implementation))
      return real(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recorded)
  kernel = fused_kernel(implementation)
  out = kernel(q, k, v, mask, encoding, make_score("scaled_dot", H, D, rngs=nnx.Rngs(2)), 0.0, None)
  return out, calls, mask


CASES = [(kind, position) for kind in ("causal", "padding", "causal_window", "cross")
         for position in ("none", "alibi") if kind != "cross" or position == "none"]


@pytest.mark.parametrize("kind, position", CASES)
def test_a_padded_mask_reaches_cudnn_as_its_own_arguments(kind, position, monkeypatch):
  out, calls, mask = attend(kind, position, "cudnn", monkeypatch)
  (call,) = calls
  assert call["implementation"] == "cudnn" and "mask" not in call
  assert call["is_causal"] == mask.causal
  np.testing.assert_array_equal(call["query_seq_lengths"], LENGTHS)
  np.testing.assert_array_equal(call["key_value_seq_lengths"],
                                SOURCE_LENGTHS if kind == "cross" else LENGTHS)
  assert call.get("local_window_size") == ((3, 0) if kind == "causal_window" else None)
  if position == "alibi":  # one row of positions: [1, h, t, t], not [b, h, t, t]
    assert call["bias"].shape == (1, H, T, T)
  else:
    assert call["bias"] is None
  dense, dense_calls, _ = attend(kind, position, "xla")
  assert dense_calls == [] and out.shape == dense.shape
  real = np.asarray(mask.q_segments, bool)  # padding rows are cuDNN's to fill: not compared
  got, want = np.asarray(out, np.float32)[real], np.asarray(dense, np.float32)[real]
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind, why", [("packed", "packed rows"),
                                       ("window", "bidirectional local window")])
def test_other_masks_reach_cudnn_whole_with_one_log_line(kind, why, monkeypatch, caplog):
  log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="transformer"):
    for _ in range(2):
      out, calls, mask = attend(kind, "none", "cudnn", monkeypatch)
  said = [r.message for r in caplog.records if why in r.message]
  assert len(said) == 1 and said[0].startswith("kernel cudnn: ")
  call = calls[0]
  assert call["implementation"] == "cudnn"
  assert "is_causal" not in call and "query_seq_lengths" not in call
  dense = mask.dense()
  np.testing.assert_array_equal(call["mask"], dense | ~jnp.any(dense, -1, keepdims=True))


def test_a_batch_without_segment_ids_declares_padded_rows():
  tokens = jnp.array([[5, 6, 7, 0], [5, 0, 0, 0]])
  _, mask = inputs_mask({"inputs": tokens}, causal=True)
  assert mask.padded
  np.testing.assert_array_equal(mask.q_segments, [[1, 1, 1, 0], [1, 0, 0, 0]])
  np.testing.assert_array_equal(mask.q_positions, [[0, 1, 2, 3]] * 2)
  given = {"inputs": tokens, "inputs_segmentation": (tokens != 0).astype(jnp.int32)}
  assert not inputs_mask(given, causal=True)[1].padded  # segment ids: packed, maybe


def test_a_block_of_a_padded_mask_is_not_declared_padded():
  mask = mask_of("causal")
  assert not mask.block(4, 4, 0, 8).padded
