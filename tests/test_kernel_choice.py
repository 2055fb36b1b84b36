"""kernel=auto: per layer, the first kernel of the backend's order of preference whose declared
capabilities fit the layer's scorer, dropout, encoding and dtype; the log line per layer;
cuDNN refused by hand for a learned bias."""

import itertools
import logging

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.model import kernel_choice
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.kernel_choice import AUTO_ORDER, choose_kernel, kernel_choices
from transformer.model.kernels import KERNELS
from transformer.model.positions import POSITIONS, make_positional_encoding
from transformer.model.scores import SCORES, make_score
from transformer.run import experiment
from transformer.run.config import parse

H, D = 2, 8
DOT = {"scaled_dot", "dot", "gaussian", "cosine"}  # the scorers that are dot products
LEARNED = {"t5", "kerple", "fire"}  # the encodings whose bias has parameters
CONTENT = {"cope"}  # the encodings with a content bias


def expected(backend, score, position, dropout, dtype):
  """The kernel auto should choose, from the kernels' documented capabilities (README's
  kernel table), without a Pallas kernel."""
  fused_fits = score in DOT and not dropout and position not in CONTENT
  if backend == "gpu" and fused_fits and position not in LEARNED and dtype == "bfloat16":
    return "cudnn"
  if backend != "cpu" and fused_fits:
    return "xla"
  return "reference"


CASES = list(itertools.product(["cpu", "gpu", "tpu"], sorted(SCORES),
                               ["none", "alibi", "t5", "fire", "cope"], [0.0, 0.1],
                               ["float32", "bfloat16"]))


@pytest.mark.parametrize("backend,score,position,dropout,dtype", CASES)
def test_auto_takes_the_first_kernel_that_fits(monkeypatch, backend, score, position, dropout,
                                               dtype):
  monkeypatch.setitem(AUTO_ORDER, "gpu", ("cudnn", "xla", "reference"))  # no Pallas here
  monkeypatch.setitem(AUTO_ORDER, "tpu", ("xla", "reference"))
  choice, function = choose_kernel(
      "auto", score_name=score, score=make_score(score, H, D, rngs=nnx.Rngs(0)),
      dropout=dropout, block_size=4, position=position, dtype=jnp.dtype(dtype), backend=backend,
      encoding=make_positional_encoding(position, 16, H, 16, causal=True, rngs=nnx.Rngs(1)))
  assert choice.name == expected(backend, score, position, dropout, dtype)
  preferred = AUTO_ORDER[backend][:AUTO_ORDER[backend].index(choice.name)]
  assert [name for name, _ in choice.passed_over] == list(preferred)  # each with its reason
  assert callable(function)


def test_a_kernel_missing_from_the_registry_is_passed_over(monkeypatch):
  monkeypatch.setitem(AUTO_ORDER, "gpu", ("not_yet_registered", "cudnn", "xla"))
  choice, _ = choose_kernel("auto", score_name="scaled_dot", score=make_score(
      "scaled_dot", H, D, rngs=nnx.Rngs(0)), dropout=0.0, block_size=4, dtype=jnp.bfloat16,
      backend="gpu")
  assert (choice.name, choice.passed_over) == ("cudnn", ())


def test_an_unknown_backend_gets_xla_then_reference():
  score = make_score("additive", H, D, rngs=nnx.Rngs(0))
  choice, _ = choose_kernel("auto", score_name="additive", score=score, dropout=0.0,
                            block_size=4, backend="metal")
  assert choice.name == "reference"
  assert choice.passed_over[0][0] == "xla" and "declares no dot product" in choice.passed_over[0][1]


def _model(monkeypatch, backend, **cfg):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  cfg = ModelConfig(vocab_size=8, d_model=16, num_heads=H, d_ff=16, num_encoder_layers=1,
                    num_decoder_layers=1, **cfg)
  return nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))


def test_each_layer_is_chosen_for_and_logs_its_choice(monkeypatch):
  """On a (faked) GPU in bf16 with T5's learned bias: the self-attention layers pass cuDNN
  over for that bias and take XLA; the decoder's cross-attention, which has no positional
  bias, takes cuDNN. One line per layer, with the reason."""
  monkeypatch.setitem(AUTO_ORDER, "gpu", ("cudnn", "xla", "reference"))
  model = _model(monkeypatch, "gpu", position="t5", dtype="bfloat16")
  lines = kernel_choices(model)
  able = " or ".join(repr(name) for name, kernel in KERNELS.items() if kernel.learned_bias)
  learned = ("(cudnn: attention.kernel 'cudnn' gives no reliable gradient for the learned logit "
             f"bias of position 't5' (cuDNN's bias gradient, JAX issue #23701); use kernel {able} "
             "or 'auto')")
  assert lines == ["decoder.layers.0.cross_attention: kernel auto -> cudnn",
                   f"decoder.layers.0.self_attention: kernel auto -> xla {learned}",
                   f"encoder.layers.0.self_attention: kernel auto -> xla {learned}"]
  assert kernel_choices(_model(monkeypatch, "gpu", position="t5", dtype="bfloat16",
                               attention=AttentionConfig(kernel="xla"))) == []  # not chosen


def test_the_run_logs_the_choices_once_per_layer(tiny_config, caplog):
  with caplog.at_level(logging.INFO, logger="transformer"):
    experiment.build(parse(tiny_config()))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention ")]
  assert lines == ["attention decoder.layers.0.cross_attention: kernel auto -> reference",
                   "attention decoder.layers.0.self_attention: kernel auto -> reference",
                   "attention encoder.layers.0.self_attention: kernel auto -> reference"]


@pytest.mark.parametrize("position", sorted(LEARNED))
def test_cudnn_by_hand_is_refused_for_a_learned_bias(position):
  encoding = make_positional_encoding(position, 16, H, 16, causal=True, rngs=nnx.Rngs(1))
  with pytest.raises(ConfigError, match=(
      f"^attention.kernel 'cudnn' gives no reliable gradient for the learned logit bias of "
      f"position '{position}' \\(cuDNN's bias gradient, JAX issue #23701\\); use kernel "
      "'reference' or 'xla'")):
    MultiHeadAttention(16, H, AttentionConfig(kernel="cudnn"), dtype=jnp.bfloat16,
                       encoding=encoding, position=position, rngs=nnx.Rngs(0))


def test_cudnn_by_hand_takes_a_fixed_bias_and_refuses_float32():
  alibi = make_positional_encoding("alibi", 16, H, 16, causal=True, rngs=None)
  layer = MultiHeadAttention(16, H, AttentionConfig(kernel="cudnn"), dtype=jnp.bfloat16,
                             encoding=alibi, position="alibi", rngs=nnx.Rngs(0))
  assert layer.kernel_choice.name == "cudnn"
  with pytest.raises(ConfigError, match="^attention.kernel 'cudnn' computes in bfloat16 or "
                                        "float16 only, and model.dtype is float32"):
    MultiHeadAttention(16, H, AttentionConfig(kernel="cudnn"), rngs=nnx.Rngs(0))


def test_auto_is_a_kernel_name_and_the_default(tiny_config):
  assert AttentionConfig().kernel == "auto" == tiny_config().model.attention.kernel
  with pytest.raises(ConfigError, match="unknown attention kernel 'fast'; choose one of: auto, "):
    AttentionConfig(kernel="fast")
  cfg = parse(tiny_config())
  assert experiment.runnable_kernel(cfg, substitute=False) is cfg
  assert kernel_choice.AUTO == "auto"


@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_an_encoding_declares_learned_bias_iff_its_bias_has_parameters(position):
  """The declaration cuDNN's refusal reads: True exactly when the bias moves with some
  parameter of the encoding (its gradient is not zero)."""
  encoding = make_positional_encoding(position, 16, H, 16, causal=True, rngs=nnx.Rngs(1))
  pos = jnp.array([[0, 1, 2, 5], [3, 4, 6, 9]])
  weights = jax.random.normal(jax.random.key(0), (2, H, 4, 4))
  grads = nnx.grad(lambda e: jnp.sum(e.bias(pos, pos) * weights))(encoding)
  moves = any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
  assert encoding.learned_bias == moves
  spec = encoding.bias_spec()  # what kernel=pallas reads declares the same
  assert (spec is not None) == encoding.biases
  assert (spec is not None and spec.learned) == encoding.learned_bias


def _kernel_of(exp) -> str:
  return exp.config.model.attention.kernel


def test_evaluation_runs_a_refused_or_emulated_kernel_as_the_same_function(tiny_config):
  """A run is evaluated with what this machine runs: `pallas` (Pallas emulated on the CPU)
  as its stand-in `xla`; a kernel the model's checks refuse (here `xla` with a scorer it
  cannot compute, as a newer check might refuse a trained run's kernel) as `auto`.
  Training keeps both refusals as they are, and pallas as asked (slow, logged)."""
  pallas = parse(tiny_config(**{"model.attention.kernel": "pallas"}))
  assert _kernel_of(experiment.build(pallas, evaluating=True)) == "xla"
  assert _kernel_of(experiment.build(pallas)) == "pallas"
  refused = parse(tiny_config(**{"model.attention.kernel": "xla",
                                 "model.attention.score": "additive"}))
  exp = experiment.build(refused, evaluating=True)
  assert _kernel_of(exp) == "auto"
  assert {line.split(" -> ")[1] for line in kernel_choices(exp.abstract_model)} == {"reference"}
  with pytest.raises(ConfigError, match="'xla' computes dot-product scores only"):
    experiment.build(refused)


def test_a_single_device_kernel_is_refused_on_a_mesh_of_several(tiny_config):
  exp = experiment.build(parse(tiny_config(**{"model.attention.kernel": "pallas"})))
  two = jax.sharding.AbstractMesh((2, 1, 1), ("data", "fsdp", "tensor"))
  with pytest.raises(ConfigError, match="'pallas' runs on one device.*mesh has 2.*'auto'"):
    experiment.check_kernels_on_mesh(exp.abstract_model, two)
  experiment.check_kernels_on_mesh(exp.abstract_model, exp.mesh)  # one device: runs
  auto = experiment.build(parse(tiny_config()))
  experiment.check_kernels_on_mesh(auto.abstract_model, two)
