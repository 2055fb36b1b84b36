"""Kernel choice (transformer/model/kernels/choice.py): a layer's Needs from its parts (the
capabilities of transformer/model/kernels/capabilities.py); each kernel refused exactly what
it does not offer; `auto` per layer, the first kernel of the backend's order that fits; a
kernel that does not run here or over the mesh refused in training and replaced in
evaluation; the log, one line per distinct choice.
The kernels' values and gradients: tests/test_kernel_conformance.py."""

import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.core.errors import ConfigError
from transformer.model.kernels import registry as kernels
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig
from transformer.model.families import make_model
from transformer.model.kernels.capabilities import CAPABILITIES, Needs
from transformer.model.kernels.choice import (AUTO, AUTO_ORDER, KernelChoice, Target, check,
                                             choose, choosing_for, kernel_choices,
                                             kernel_warnings, offered)
from transformer.model.kernels.registry import KERNELS
from transformer.model.layers import Dropout
from transformer.model.kernels.fallbacks import log_once
from transformer.model.masks import Mask
from transformer.model.positions import POSITIONS, make_positional_encoding
from transformer.model.positions.randomized import AtSampledOffsets
from transformer.model.kernels.reference import reference_kernel
from transformer.model.scores import SCORES, make_score
from transformer.run import experiment
from transformer.run.config import parse

H, D = 2, 8
DOT = {"scaled_dot", "dot", "gaussian", "cosine"}  # the scorers that are dot products
LEARNED = {"t5", "kerple", "fire"}  # the encodings whose bias has parameters
CONTENT = {"cope"}  # the encodings with a content bias
BIASED = sorted(name for name, cls in POSITIONS.items() if cls.biases)  # a positional bias
TWO_DEVICES = jax.sharding.AbstractMesh((2, 1, 1), ("data", "fsdp", "tensor"))


@functools.cache
def _needs(score="scaled_dot", position="none", **fields) -> Needs:
  encoding = make_positional_encoding(position, 16, H, 16, causal=True, rngs=nnx.Rngs(1))
  return Needs.of(make_score(score, H, D, rngs=nnx.Rngs(0)), encoding, score=score,
                  position=position, **fields)


def test_a_layer_states_its_needs_from_its_parts():
  """Scorer and encoding declarations, dropout, soft-cap, dtype, kv heads; the window only
  for self-attention (cross-attention's masks carry none)."""
  fire = make_positional_encoding("fire", 16, 4, 16, causal=True, rngs=nnx.Rngs(1))
  cfg = AttentionConfig(score="additive", window="local", dropout=0.1, logit_softcap=5.0,
                        block_size=8, kernel="reference")
  layer = lambda **kw: MultiHeadAttention(16, 4, cfg, num_kv_heads=2, rngs=nnx.Rngs(0), **kw)  # noqa: E731
  assert layer(encoding=fire, dtype=jnp.bfloat16).needs == Needs(
      {"any_score", "dropout", "softcap", "learned_bias", "local_window", "grouped_query"},
      score="additive", dropout=0.1, softcap=5.0, position="fire", bias=True,
      dtype="bfloat16", block_size=8)
  assert layer(cross=True).needs == Needs({"any_score", "dropout", "softcap", "grouped_query"},
                                          score="additive", dropout=0.1, softcap=5.0,
                                          block_size=8)
  cope = make_positional_encoding("cope", 16, 4, 16, causal=True, rngs=nnx.Rngs(1))
  assert MultiHeadAttention(16, 4, AttentionConfig(), encoding=cope,
                            rngs=nnx.Rngs(0)).needs == Needs({"content_bias"}, position="cope")


# The words of each capability's refusal, and the Needs fields they name (a capability
# missing here is checked for the refusal's form and the kernels it names).
REFUSALS = {
    "any_score": (dict(score="additive"),
                  "computes dot-product scores only, and score 'additive' declares no dot product"),
    "dropout": (dict(dropout=0.1),
                r"has no attention dropout; set model.attention.dropout=0 \(got 0.1\)"),
    "softcap": (dict(softcap=30.0), "cannot soft-cap the attention "
                r"logits; set model.attention.logit_softcap=0 \(got 30.0\)"),
    "content_bias": (dict(position="cope"),
                     "cannot add the content-dependent logit bias of position 'cope' "
                     r"\(it needs each query's whole row of logits\)"),
    "gathered_bias": (dict(position="alibi"),
                      "evaluates positional biases in-kernel from positions, and position "
                      "'alibi' with model.random_positions_draw=per_batch reads its bias at "
                      "sampled offsets"),
    "learned_bias": (dict(position="t5"),
                     "gives no reliable gradient for the learned logit bias of position 't5'"),
    "local_window": ({}, "takes no local attention window"),
    "grouped_query": ({}, "has no grouped-query attention"),
}


@pytest.mark.parametrize("need", sorted(CAPABILITIES))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_kernel_is_refused_exactly_what_it_does_not_offer(name, need):
  """Every kernel accepts a plain bf16 layer; given one need more, it is refused exactly when
  it does not offer the capability, with one ConfigError naming the kernel, the need and
  the kernels that offer it."""
  fields, words = REFUSALS.get(need, ({}, ""))
  check(name, Needs(dtype="bfloat16"))
  needs = Needs({need}, dtype="bfloat16", **fields)
  if need in KERNELS[name].offers:
    check(name, needs)
    return
  able = kernels.able(need)
  assert able  # some kernel offers every capability
  with pytest.raises(ConfigError, match=f"^attention.kernel '{name}' {words}.*{able}"):
    check(name, needs)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_kernel_is_refused_a_dtype_it_does_not_take(name):
  dtypes = KERNELS[name].dtypes
  if dtypes is None or "float32" in dtypes:
    check(name, Needs(dtype="float32"))
    return
  with pytest.raises(ConfigError, match=f"^attention.kernel '{name}' computes in .* only, and "
                                        "model.dtype is float32; set model.dtype=.* or use "
                                        "kernel 'reference'"):
    check(name, Needs(dtype="float32"))


def _expected(backend, score, position, dropout, dtype, softcap):
  """The kernel auto should choose, from the kernels' documented capabilities (the docs'
  kernel table and orders): cuDNN where it applies (GPU, bf16, no learned bias), then
  pallas for a layer with a positional bias, then xla, then the formula."""
  fused_fits = score in DOT and not dropout and not softcap and position not in CONTENT
  if backend == "gpu" and fused_fits and position not in LEARNED and dtype == "bfloat16":
    return "cudnn"
  if backend != "cpu" and fused_fits and position in BIASED:
    return "pallas"
  if backend != "cpu" and fused_fits:
    return "xla"
  return "reference"


CASES = list(itertools.product(["cpu", "gpu", "tpu"], sorted(SCORES),
                               ["none", *BIASED, "cope"], [0.0, 0.1], ["float32", "bfloat16"]))


@pytest.mark.parametrize("backend,score,position,dropout,dtype", CASES)
def test_auto_takes_the_first_kernel_that_fits(backend, score, position, dropout, dtype):
  """Every kernel of the backend's order before the choice is passed over with its reason,
  but pallas for a layer without a positional bias: auto does not offer it there (and the
  log does not name it)."""
  choice, function = choose(AUTO, _needs(score, position, dropout=dropout, dtype=dtype),
                            Target(backend))
  assert choice.name == _expected(backend, score, position, dropout, dtype, softcap=0)
  preferred = AUTO_ORDER[backend][:AUTO_ORDER[backend].index(choice.name)]
  offered = [n for n in preferred if n != "pallas" or position in BIASED]
  assert [name for name, _ in choice.passed_over] == offered
  assert callable(function)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("position", BIASED)
def test_auto_offers_pallas_on_accelerators_for_each_bias_encoding(backend, position):
  """On a GPU or a TPU (a Target: no such device needed), on one device or a mesh: a bias
  encoding's layer takes pallas unless cuDNN applies (GPU, bf16, a bias without
  parameters), each kernel passed over with its reason; a layer without a bias (no
  encoding, as a cross-attention; rotary) takes xla or cuDNN, as before pallas had a place,
  and pallas is not named in its log line."""
  for mesh, dtype in itertools.product([None, TWO_DEVICES], ["float32", "bfloat16"]):
    target = Target(backend, mesh)
    choice, _ = choose(AUTO, _needs("scaled_dot", position, dtype=dtype), target)
    cudnn = backend == "gpu" and dtype == "bfloat16" and position not in LEARNED
    assert choice.name == ("cudnn" if cudnn else "pallas")
    reasons = dict(choice.passed_over)
    if backend == "gpu" and not cudnn:
      assert list(reasons) == ["cudnn"]
      assert (f"learned logit bias of position '{position}'" if position in LEARNED
              else "computes in bfloat16 or float16 only") in reasons["cudnn"]
    else:
      assert reasons == {}
    for plain in ("none", "rotary"):
      bare, _ = choose(AUTO, _needs("scaled_dot", plain, dtype=dtype), target)
      assert bare.name == ("cudnn" if backend == "gpu" and dtype == "bfloat16" else "xla")
      assert "pallas" not in dict(bare.passed_over)


# What passes pallas over on an accelerator for a layer with ALiBi's bias: the layer's
# scorer and other Needs fields, and the words of pallas' reason.
PALLAS_REFUSALS = {
    "softcap": ("scaled_dot", dict(softcap=30.0), "cannot soft-cap the attention logits"),
    "dropout": ("scaled_dot", dict(dropout=0.1), "has no attention dropout"),
    "score": ("additive", {}, "computes dot-product scores only"),
}


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("need", sorted(PALLAS_REFUSALS))
def test_auto_falls_back_from_pallas_with_its_reason(backend, need):
  """A bias layer that pallas cannot run (the same check as by hand) passes it over, its
  reason in the log line, for the next kernel of the order that can (xla declares no more
  than pallas here: the reference). CoPE's content bias is no positional bias: pallas is
  not offered, and xla refuses it."""
  score, fields, words = PALLAS_REFUSALS[need]
  choice, _ = choose(AUTO, _needs(score, "alibi", **fields), Target(backend))
  assert choice.name == "reference" == _expected(
      backend, score, "alibi", fields.get("dropout", 0.0), "float32", fields.get("softcap", 0))
  assert words in dict(choice.passed_over)["pallas"]
  assert f"pallas: attention.kernel 'pallas' {words}" in choice.describe()
  cope, _ = choose(AUTO, _needs("scaled_dot", "cope"), Target(backend))
  assert cope.name == "reference" and "pallas" not in dict(cope.passed_over)
  assert "content-dependent" in dict(cope.passed_over)["xla"]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_passes_pallas_over_for_a_bias_at_sampled_offsets(backend):
  """ALiBi at randomized offsets drawn per batch (random_positions_draw=per_batch) reads its
  bias from a table, which pallas cannot do in-kernel: passed over with that reason, for
  xla (float32: cuDNN passes the GPU's layer over too)."""
  alibi = make_positional_encoding("alibi", 16, H, 16, causal=True, rngs=None)
  needs = Needs.of(make_score("scaled_dot", H, D, rngs=nnx.Rngs(0)),
                   AtSampledOffsets(alibi, None), position="alibi")
  assert needs.bias and "gathered_bias" in needs.capabilities
  choice, _ = choose(AUTO, needs, Target(backend))
  assert choice.name == "xla"
  assert "reads its bias at sampled offsets" in dict(choice.passed_over)["pallas"]


def test_the_declaration_decides_what_auto_offers(monkeypatch):
  """A kernel declaring auto_only_with_bias (here xla's function, first in the CPU's order)
  is auto's choice for a layer with a positional bias and no candidate for one without
  (nor named in its log line): the declaration decides, not the kernel's name."""
  monkeypatch.setitem(KERNELS, "biased",
                      dataclasses.replace(KERNELS["xla"], auto_only_with_bias=True))
  monkeypatch.setitem(AUTO_ORDER, "cpu", ("biased", "reference"))
  assert choose(AUTO, _needs("scaled_dot", "alibi"), Target("cpu"))[0].name == "biased"
  assert choose(AUTO, _needs(), Target("cpu"))[0] == KernelChoice(AUTO, "reference")
  assert offered("biased", _needs("scaled_dot", "t5")) and offered("xla", _needs())
  assert not offered("biased", _needs("scaled_dot", "cope"))  # a content bias is no position's
  assert [name for name, k in KERNELS.items() if k.auto_only_with_bias] == ["pallas", "biased"]


def test_a_kernel_missing_from_the_registry_is_passed_over(monkeypatch):
  monkeypatch.setitem(AUTO_ORDER, "gpu", ("not_yet_registered", "cudnn", "xla"))
  choice, _ = choose(AUTO, Needs(dtype="bfloat16"), Target("gpu"))
  assert (choice.name, choice.passed_over) == ("cudnn", ())


def test_an_unknown_backend_gets_xla_then_reference():
  choice, _ = choose(AUTO, _needs("additive"), Target("metal"))
  assert choice.name == "reference"
  assert choice.passed_over[0][0] == "xla" and "declares no dot product" in choice.passed_over[0][1]


@pytest.fixture
def one_device_kernel(monkeypatch):
  """'solo': xla's function, declared to run on one device only, first in auto's CPU order."""
  monkeypatch.setitem(KERNELS, "solo", dataclasses.replace(KERNELS["xla"], stand_in="xla",
                                                           multi_device=False))
  monkeypatch.setitem(AUTO_ORDER, "cpu", ("solo", "reference"))
  return "solo"


def test_a_kernel_is_refused_or_replaced_where_it_does_not_run(one_device_kernel):
  """Not on this backend, or not over a mesh of several devices: refused by hand in
  training, passed over by auto, replaced by its stand-in in evaluation."""
  with pytest.raises(ConfigError, match="kernel='cudnn' runs on gpu only; this machine's JAX "
                                        "backend is cpu: use 'xla'"):
    choose("cudnn", Needs(dtype="bfloat16"), Target("cpu"))
  with pytest.raises(ConfigError, match=r"kernel='solo' runs on one device .* mesh has 2; use "
                                        "kernel 'auto' or 'reference' or 'xla'"):
    choose("solo", Needs(), Target("cpu", TWO_DEVICES))
  assert choose("solo", Needs(), Target("cpu"))[0] == KernelChoice("solo", "solo")
  auto, _ = choose(AUTO, Needs(), Target("cpu", TWO_DEVICES))
  assert auto.name == "reference" and "runs on one device" in auto.passed_over[0][1]
  for name, target in (("solo", Target("cpu", TWO_DEVICES, evaluating=True)),
                       ("cudnn", Target("cpu", evaluating=True))):
    choice, _ = choose(name, Needs(dtype="bfloat16"), target)
    assert (choice.asked, choice.name) == (name, "xla")
    assert "evaluating with its stand-in 'xla', the same function" in choice.passed_over[0][1]


def test_an_emulated_kernel_trains_with_a_warning_and_is_evaluated_as_its_stand_in():
  """pallas on the CPU (interpret mode): kept, with a warning, when asked for in training;
  its stand-in xla in evaluation; never auto's choice."""
  choice, _ = choose("pallas", Needs(), Target("cpu"))
  assert choice.name == "pallas"
  assert choice.warning == ("model.attention.kernel 'pallas' runs emulated on cpu (Pallas' "
                            "interpret mode): slow, for tests; 'xla' computes the same "
                            "function here")
  assert choose("pallas", Needs(), Target("cpu", evaluating=True))[0].name == "xla"
  # With no stand-in that fits (cope's content bias), evaluation falls back on auto.
  evaluated, _ = choose("xla", _needs("scaled_dot", "cope"), Target("cpu", evaluating=True))
  assert (evaluated.asked, evaluated.name) == ("xla", "reference")
  assert "content-dependent" in evaluated.passed_over[0][1]


def _model(monkeypatch, backend, **cfg):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  # heads of D = 8 (a kernel's choice depends on the head dim); 2 layers a stack: the lines
  # below count them
  cfg = ModelConfig(**{**TINY_MODEL, "d_model": H * D, "num_heads": H, "num_encoder_layers": 2,
                       "num_decoder_layers": 2, **cfg})
  return nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0)))


def test_each_layer_is_chosen_for_and_the_log_says_each_distinct_choice_once(monkeypatch):
  """On a (faked) GPU in bf16 with T5's learned bias: the self-attention layers pass cuDNN
  over for that bias and take pallas; the decoder's cross-attention, which has no positional
  bias, takes cuDNN. On a (faked) TPU: pallas and xla, pallas unnamed in xla's line (not
  offered to a layer without a bias). One line per distinct choice, with its layers and
  reasons."""
  model = _model(monkeypatch, "gpu", position="t5", dtype="bfloat16")
  able = kernels.able("learned_bias")
  learned = ("(cudnn: attention.kernel 'cudnn' gives no reliable gradient for the learned logit "
             f"bias of position 't5' (cuDNN's bias gradient, JAX issue #23701); use kernel {able} "
             "or 'auto')")
  assert kernel_choices(model) == [
      "kernel auto -> cudnn for 2 layers: decoder.layers.*.cross_attention",
      "kernel auto -> pallas for 4 layers: decoder.layers.*.self_attention, "
      f"encoder.layers.*.self_attention {learned}"]
  assert kernel_choices(_model(monkeypatch, "tpu", position="t5", dtype="bfloat16")) == [
      "kernel auto -> xla for 2 layers: decoder.layers.*.cross_attention",
      "kernel auto -> pallas for 4 layers: decoder.layers.*.self_attention, "
      "encoder.layers.*.self_attention"]
  assert kernel_choices(_model(monkeypatch, "gpu", position="t5", dtype="bfloat16",
                               attention=AttentionConfig(kernel="xla"))) == []  # not chosen
  assert kernel_warnings(model) == []


def test_a_layer_wise_pattern_chooses_each_layers_kernel_and_the_log_lists_its_layers(
    monkeypatch):
  """Under model.position=rotary+t5 (faked GPU, bf16) the rotary layers take cuDNN and the
  T5 layers, whose bias is learned, pallas: the log lists the layers of each choice by
  index where the choice is not every layer's at that place."""
  model = _model(monkeypatch, "gpu", position="rotary+t5", dtype="bfloat16",
                 num_decoder_layers=3)
  lines = kernel_choices(model)
  assert lines[0] == ("kernel auto -> cudnn for 6 layers: decoder.layers.*.cross_attention, "
                      "decoder.layers.{0,2}.self_attention, encoder.layers.0.self_attention")
  assert lines[1].startswith("kernel auto -> pallas for 2 layers: "
                             "decoder.layers.1.self_attention, encoder.layers.1.self_attention "
                             "(cudnn: ")
  assert "position 't5'" in lines[1] and len(lines) == 2


def test_a_run_logs_its_choices_once_and_a_sweep_check_logs_none(tiny_config, caplog):
  with caplog.at_level(logging.INFO, logger="transformer"):
    experiment.build(parse(tiny_config()))
    experiment.build(parse(tiny_config(**{"model.attention.kernel": "pallas"})))
    experiment.build(parse(tiny_config()), announce=False)
  said = [r.getMessage() for r in caplog.records]
  assert [line for line in said if "kernel" in line] == [
      "attention kernel auto -> reference for 3 layers: decoder.layers.*.cross_attention, "
      "decoder.layers.*.self_attention, encoder.layers.*.self_attention",
      "model.attention.kernel 'pallas' runs emulated on cpu (Pallas' interpret mode): slow, "
      "for tests; 'xla' computes the same function here"]


def test_a_decoding_step_says_its_kernel_fallback_once(caplog):
  """A one-query row (a KV-cached decoding step) runs, for cudnn, XLA's attention (cuDNN
  has no one-query step: traced on any backend, so checked here against the reference),
  and for pallas the reference formula; each says so once per distinct line, not once
  per layer or per trace."""
  log_once.cache_clear()
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 1, H, D), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 5, 1, D), jnp.bfloat16) for key in keys[1:])
  slots = jnp.broadcast_to(jnp.arange(5), (2, 5))
  mask = Mask(jnp.ones((2, 1), jnp.int32), (slots < jnp.array([[5], [3]])).astype(jnp.int32),
              jnp.array([[4], [2]]), slots, causal=True)
  alibi = make_positional_encoding("alibi", H * D, H, 16, causal=True, rngs=None)
  score = make_score("scaled_dot", H, D, rngs=nnx.Rngs(0))
  want = reference_kernel(q, k, v, mask, alibi, score, Dropout(0.0), None)
  with caplog.at_level(logging.INFO, logger="transformer"):
    for name in ("cudnn", "pallas") * 2:  # two layers
      out = KERNELS[name].make(block_size=8)(q, k, v, mask, alibi, score, None, None)
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2)
  assert [r.getMessage() for r in caplog.records] == [
      "kernel cudnn: one query per row (a decoding step) runs XLA's attention over the row "
      "[b, h, 1, 5], not cuDNN's",
      "flash_attention: one query per row (a decoding step) runs the reference formula over "
      "the row [b, h, 1, 5], not the Pallas kernels"]


def _kernels_run(exp) -> set[str]:
  return {node.kernel_choice.name for _, node in nnx.iter_modules(exp.abstract_model)
          if isinstance(getattr(node, "kernel_choice", None), KernelChoice)}


def test_evaluation_runs_a_refused_or_emulated_kernel_as_the_same_function(tiny_config):
  """A run is evaluated with what this machine runs: `pallas` (Pallas emulated on the CPU)
  as its stand-in `xla`; a kernel the model's checks refuse (here `xla` with a scorer it
  cannot compute, as a newer check might refuse a trained run's kernel) as auto's choice.
  Training keeps both refusals as they are, and pallas as asked (slow, logged). The config
  keeps the kernel asked for."""
  pallas = parse(tiny_config(**{"model.attention.kernel": "pallas"}))
  assert _kernels_run(experiment.build(pallas, evaluating=True)) == {"xla"}
  trained = experiment.build(pallas)
  assert _kernels_run(trained) == {"pallas"} and trained.model.attention.kernel == "pallas"
  refused = parse(tiny_config(**{"model.attention.kernel": "xla",
                                 "model.attention.score": "additive"}))
  assert _kernels_run(experiment.build(refused, evaluating=True)) == {"reference"}
  with pytest.raises(ConfigError, match="'xla' computes dot-product scores only"):
    experiment.build(refused)


@pytest.mark.parametrize("position", sorted(LEARNED))
def test_cudnn_by_hand_is_refused_for_a_learned_bias(position):
  encoding = make_positional_encoding(position, 16, H, 16, causal=True, rngs=nnx.Rngs(1))
  with pytest.raises(ConfigError, match=(
      f"^attention.kernel 'cudnn' gives no reliable gradient for the learned logit bias of "
      f"position '{position}' \\(cuDNN's bias gradient, JAX issue #23701\\); use kernel "
      "'reference' or 'xla'")), choosing_for(Target("gpu")):
    MultiHeadAttention(16, H, AttentionConfig(kernel="cudnn"), dtype=jnp.bfloat16,
                       encoding=encoding, rngs=nnx.Rngs(0))


def test_cudnn_by_hand_takes_a_fixed_bias_and_refuses_float32():
  """A layer made inside choosing_for(gpu) is chosen for the GPU, and one made after it for
  this process's backend again (the CPU, where cudnn is refused)."""
  alibi = make_positional_encoding("alibi", 16, H, 16, causal=True, rngs=None)
  cudnn = lambda **kw: MultiHeadAttention(16, H, AttentionConfig(kernel="cudnn"),  # noqa: E731
                                          rngs=nnx.Rngs(0), **kw)
  with choosing_for(Target("gpu")):
    layer = cudnn(dtype=jnp.bfloat16, encoding=alibi)
    assert layer.kernel_choice.name == "cudnn"
    with pytest.raises(ConfigError, match="^attention.kernel 'cudnn' computes in bfloat16 or "
                                          "float16 only, and model.dtype is float32"):
      cudnn()
  with pytest.raises(ConfigError, match="kernel='cudnn' runs on gpu only; this machine's JAX "
                                        "backend is cpu"):
    cudnn(dtype=jnp.bfloat16)


def test_auto_is_a_kernel_name_and_the_default(tiny_config):
  assert AttentionConfig().kernel == "auto" == tiny_config().model.attention.kernel == AUTO
  with pytest.raises(ConfigError, match="unknown attention kernel 'fast'; choose one of: auto, "):
    AttentionConfig(kernel="fast")


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
