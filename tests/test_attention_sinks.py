"""The first-token attention mass (transformer/study/attention_sinks.py) against its formulas:
uniform causal attention gives (H_T − 1) / (T − 1), a softmax with a sink logit of 0 gives
the mean of 1 / (q + 2); padded queries are not counted; the table pairs each variant with
its baseline by seed."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.study import attention_sinks as sinks

T = 6


def _uniform_causal(batch: int, heads: int, t: int) -> np.ndarray:
  """[batch, heads, t, t]: each query's weight spread evenly over keys 0..q."""
  w = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]
  return np.broadcast_to(w, (batch, heads, t, t))


def test_uniform_causal_attention_gives_the_harmonic_mass():
  assert sinks.uniform_mass(4) == pytest.approx(13 / 36)  # (1/2 + 1/3 + 1/4) / 3
  assert sinks.first_token_mass(_uniform_causal(2, 3, 4)) == pytest.approx(13 / 36)
  one_hot = np.zeros((1, 2, T, T))
  one_hot[..., 0] = 1.0
  assert sinks.first_token_mass(one_hot) == 1.0  # every query on the first token: a sink


def test_padded_queries_are_not_counted():
  """Two rows of T, the second with its last two queries padding that look at token 0."""
  w = _uniform_causal(2, 1, T).copy()
  w[1, :, T - 2:, :] = 0.0
  w[1, :, T - 2:, 0] = 1.0
  real = np.ones((2, T), bool)
  real[1, T - 2:] = False
  counted = [1 / (q + 1) for q in range(1, T)] + [1 / (q + 1) for q in range(1, T - 2)]
  assert sinks.first_token_mass(w, real) == pytest.approx(np.mean(counted))
  with pytest.raises(ValueError, match="no query"):
    sinks.first_token_mass(w, np.zeros((2, T), bool))


@pytest.mark.parametrize("normalizer, expected", [
    ("softmax", sinks.uniform_mass(T)),  # equal logits: uniform
    ("sink", np.mean([1 / (q + 2) for q in range(1, T)]))])  # sink logit 0: one more term
def test_layer_masses_of_a_model_with_equal_logits(normalizer, expected):
  """Zero query projections make every logit 0 in both layers of a tiny decoder."""
  cfg = ModelConfig(**{**TINY_MODEL, "arch": "decoder", "num_decoder_layers": 2},
                    attention=AttentionConfig(normalizer=normalizer))
  model = make_model(cfg, rngs=nnx.Rngs(0))
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MultiHeadAttention):
      module.query.kernel[...] = jnp.zeros_like(module.query.kernel[...])
  batch = {"inputs": np.arange(3, 3 + T, dtype=np.int32)[None],
           "inputs_segmentation": np.ones((1, T), np.int32)}
  np.testing.assert_allclose(sinks.layer_masses(model, batch), [expected] * 2, rtol=1e-5)


def test_variants_seeds_and_paired_table():
  assert sinks.variant_and_seed("d/a=1,seed=2,b=x") == ("a=1,b=x", 2)
  assert sinks.variant_and_seed("d/a=1,seed=0/") == ("a=1", 0)
  assert sinks.baseline_of("n=softmax,g=none", "p=rope,n=sink,g=none") == "p=rope,n=softmax,g=none"
  masses = {"p=1,n=softmax": {0: [0.5], 1: [0.7]}, "p=1,n=sink": {0: [0.1], 1: [0.2]}}
  rows = sinks.table(masses, "n=softmax").splitlines()
  assert rows[0] == "| variant | layer 1 | Δ layer 1 |"
  assert rows[2].startswith("| p=1,n=softmax | 0.600 [") and rows[2].endswith("| - |")
  assert "| -0.450 [" in rows[3]  # (0.1 − 0.5 + 0.2 − 0.7) / 2
