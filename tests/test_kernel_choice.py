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
from transformer.model.kernels.measured import SPEEDS, ranked
from transformer.model.kernels.memory import too_big
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
      dtype="bfloat16", block_size=8, heads=4)
  assert layer(cross=True).needs == Needs({"any_score", "dropout", "softcap", "grouped_query"},
                                          score="additive", dropout=0.1, softcap=5.0,
                                          block_size=8, heads=4)
  cope = make_positional_encoding("cope", 16, 4, 16, causal=True, rngs=nnx.Rngs(1))
  assert MultiHeadAttention(16, 4, AttentionConfig(), encoding=cope,
                            rngs=nnx.Rngs(0)).needs == Needs({"content_bias"}, position="cope",
                                                             heads=4)


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
    "data_bias_array": ({}, "takes a data-dependent logit bias as two vectors per head only"),
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


def _order(backend, position, dtype, training=True):
  """The kernels auto tries, in order: those measured for the layer (kernels/measured.py),
  fastest first, then the backend's AUTO_ORDER."""
  measured = ranked(backend, dtype, position if position in BIASED else "none", None, training)
  return list(dict.fromkeys([*measured[0], *AUTO_ORDER.get(backend, ("xla", "reference"))]))


def _expected(backend, score, position, dropout, dtype, softcap):
  """The kernel auto should choose, from the kernels' documented capabilities and the
  measured order: cuDNN where it applies (GPU, bf16, no learned bias); on a GPU in bf16, a
  learned bias's fastest measured kernel; elsewhere xla (pallas, never measured faster
  there, is not first), then the formula."""
  fused_fits = score in DOT and not dropout and not softcap and position not in CONTENT
  if backend == "gpu" and fused_fits and position not in LEARNED and dtype == "bfloat16":
    return "cudnn"
  if backend == "gpu" and fused_fits and position in LEARNED and dtype == "bfloat16":
    return next(k for k in _order(backend, position, dtype) if k != "cudnn")
  if backend != "cpu" and fused_fits:
    return "xla"
  return "reference"


CASES = list(itertools.product(["cpu", "gpu", "tpu"], sorted(SCORES),
                               ["none", *BIASED, "cope"], [0.0, 0.1], ["float32", "bfloat16"]))


@pytest.mark.parametrize("backend,score,position,dropout,dtype", CASES)
def test_auto_takes_the_first_kernel_that_fits(backend, score, position, dropout, dtype):
  """Every kernel tried before the choice is passed over with its reason, but pallas for a
  layer without a positional bias that a kernel before it takes: auto does not offer it
  there (and the log does not name it); where every kernel before it refused the layer,
  pallas is tried too."""
  choice, function = choose(AUTO, _needs(score, position, dropout=dropout, dtype=dtype),
                            Target(backend))
  assert choice.name == _expected(backend, score, position, dropout, dtype, softcap=0)
  order = _order(backend, position, dtype)
  offered = [n for n in order[:order.index(choice.name)] if n != "pallas" or position in BIASED
             or choice.name == "reference"]
  assert [name for name, _ in choice.passed_over] == offered
  assert callable(function)


def test_the_measured_table_decides_the_gpu_order():
  """On a GPU in bf16, training: T5's layer takes pallas (22.4 ms forward + backward against
  xla's 30.4 at L 2048 on the H100), FIRE's and KERPLE's xla (14.4 and 6.21 against
  pallas' 110 and 6.44), ALiBi's cuDNN; evaluating (forward), T5's takes xla (3.41 against
  14.2). The log line names the measurement."""
  training, evaluating = Target("gpu"), Target("gpu", evaluating=True)
  picks = {p: choose(AUTO, _needs("scaled_dot", p, dtype="bfloat16"), training)[0]
           for p in ("t5", "fire", "kerple", "alibi")}
  assert {p: c.name for p, c in picks.items()} == {
      "t5": "pallas", "fire": "xla", "kerple": "xla", "alibi": "cudnn"}
  assert picks["t5"].describe().endswith(
      "[fastest forward + backward at L 2048 measured on NVIDIA H100 80GB HBM3, 2026-11-28]")
  t5 = choose(AUTO, _needs("scaled_dot", "t5", dtype="bfloat16"), evaluating)[0]
  assert t5.name == "xla" and "[fastest forward at L 2048" in t5.describe()
  assert SPEEDS["gpu", "bfloat16", 2048][1]["t5"]["pallas"][1] < \
      SPEEDS["gpu", "bfloat16", 2048][1]["t5"]["xla"][1]


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("position", BIASED)
def test_auto_puts_no_unmeasured_kernel_first(backend, position):
  """Where nothing was measured (a TPU; float32 on a GPU), a bias layer takes xla, not the
  never-measured pallas, on one device or a mesh; a layer without a bias takes xla or
  cuDNN, pallas unnamed in its log line."""
  for mesh, dtype in itertools.product([None, TWO_DEVICES], ["float32", "bfloat16"]):
    target = Target(backend, mesh)
    choice, _ = choose(AUTO, _needs("scaled_dot", position, dtype=dtype), target)
    if backend == "tpu" or dtype == "float32":
      assert ranked(backend, dtype, position, None, True) == ((), "")
      assert choice.name == "xla" and "pallas" not in dict(choice.passed_over)
    for plain in ("none", "rotary"):
      bare, _ = choose(AUTO, _needs("scaled_dot", plain, dtype=dtype), target)
      assert bare.name == ("cudnn" if backend == "gpu" and dtype == "bfloat16" else "xla")
      assert "pallas" not in dict(bare.passed_over)


def test_a_layer_whose_temporaries_would_not_fit_takes_the_o_l_kernel():
  """With the device's memory, rows and length known: FIRE's layer (measured fastest with
  xla) at L 16384 × 4 rows × 16 heads would need ~160 GiB of xla temporaries, so it takes
  pallas, the reason logged; so does a layer without a bias in float32 (pallas offered
  once xla is passed over for memory); with the memory unknown, xla as before."""
  heads16 = dict(dtype="bfloat16", heads=16)
  big = Target("gpu", memory=80 * 2**30, rows=4, length=16384)
  choice, _ = choose(AUTO, _needs("scaled_dot", "fire", **heads16), big)
  assert choice.name == "pallas"
  assert "would not fit in half of this device's 80 GiB" in dict(choice.passed_over)["xla"]
  assert "about 160.0 GiB at 4 rows x 16 heads x L 16384" in choice.describe()
  plain, _ = choose(AUTO, _needs(dtype="float32", heads=16), big)
  assert plain.name == "pallas" and "would not fit" in dict(plain.passed_over)["xla"]
  unknown = Target("gpu", rows=4, length=16384)
  assert choose(AUTO, _needs("scaled_dot", "fire", **heads16), unknown)[0].name == "xla"
  small = Target("gpu", memory=80 * 2**30, rows=4, length=2048)
  assert choose(AUTO, _needs("scaled_dot", "fire", **heads16), small)[0].name == "xla"


def test_the_memory_estimate_meets_the_h100_measurement():
  """xla's forward + backward at batch 4, 16 heads, L 8192, bf16: XLA allocated 40 GiB on
  the H100; cuDNN with ALiBi's bias 24 GiB; estimated from the bytes per pair."""
  for kernel, gib in (("xla", 40), ("cudnn", 24)):
    why = too_big(kernel, "bfloat16", True, 16, 4, 8192, 2**30, training=True)
    assert f"about {gib}.0 GiB" in why
  assert too_big("pallas", "bfloat16", True, 16, 4, 8192, 2**30, training=True) == ""
  assert too_big("cudnn", "bfloat16", False, 16, 4, 8192, 2**30, training=True) == ""


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
  than pallas here: the reference). CoPE's content bias is no positional bias, but xla
  refuses it, so pallas is tried too, and refuses it alike."""
  score, fields, words = PALLAS_REFUSALS[need]
  choice, _ = choose(AUTO, _needs(score, "alibi", **fields), Target(backend))
  assert choice.name == "reference" == _expected(
      backend, score, "alibi", fields.get("dropout", 0.0), "float32", fields.get("softcap", 0))
  assert words in dict(choice.passed_over)["pallas"]
  assert f"pallas: attention.kernel 'pallas' {words}" in choice.describe()
  cope, _ = choose(AUTO, _needs("scaled_dot", "cope"), Target(backend))
  assert cope.name == "reference"
  assert all("content-dependent" in dict(cope.passed_over)[name] for name in ("xla", "pallas"))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_passes_pallas_over_for_a_bias_at_sampled_offsets(backend):
  """ALiBi at randomized offsets drawn per batch (random_positions_draw=per_batch) reads its
  bias from a table, which pallas cannot do in-kernel: where xla's temporaries do not fit,
  pallas is passed over with that reason, for the formula's (which still holds them: no
  kernel fits, one error line); otherwise xla (float32: cuDNN passes the GPU's layer over
  too)."""
  alibi = make_positional_encoding("alibi", 16, H, 16, causal=True, rngs=None)
  needs = Needs.of(make_score("scaled_dot", H, D, rngs=nnx.Rngs(0)),
                   AtSampledOffsets(alibi, None), position="alibi", heads=H)
  assert needs.bias and "gathered_bias" in needs.capabilities
  choice, _ = choose(AUTO, needs, Target(backend))
  assert choice.name == "xla"
  big = Target(backend, memory=2**30, rows=4, length=16384)
  with pytest.raises(ConfigError, match="pallas: attention.kernel 'pallas' evaluates "
                                        "positional biases in-kernel"):
    choose(AUTO, needs, big)


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
  """On a (faked) GPU in bf16 with T5's learned bias: the self-attention layers take pallas,
  measured fastest for T5 there (cuDNN, which refuses that bias, was not measured for it
  and is not tried first); the decoder's cross-attention, which has no positional bias,
  takes cuDNN. On a (faked) TPU, where nothing was measured: xla for all. One line per
  distinct choice, with its layers, reasons and the measurement that ordered it."""
  model = _model(monkeypatch, "gpu", position="t5", dtype="bfloat16")
  measured = "[fastest forward + backward at L 2048 measured on NVIDIA H100 80GB HBM3, 2026-11-28]"
  assert kernel_choices(model) == [
      f"kernel auto -> cudnn for 2 layers: decoder.layers.*.cross_attention {measured}",
      "kernel auto -> pallas for 4 layers: decoder.layers.*.self_attention, "
      f"encoder.layers.*.self_attention {measured}"]
  assert kernel_choices(_model(monkeypatch, "tpu", position="t5", dtype="bfloat16")) == [
      "kernel auto -> xla for 6 layers: decoder.layers.*.cross_attention, "
      "decoder.layers.*.self_attention, encoder.layers.*.self_attention"]
  assert kernel_choices(_model(monkeypatch, "gpu", position="t5", dtype="bfloat16",
                               attention=AttentionConfig(kernel="xla"))) == []  # not chosen
  assert kernel_warnings(model) == []


def test_a_layer_wise_pattern_chooses_each_layers_kernel_and_the_log_lists_its_layers(
    monkeypatch):
  """Under model.position=rotary+t5 (faked GPU, bf16) the rotary layers take cuDNN and the
  T5 layers pallas: the log lists the layers of each choice by index where the choice is
  not every layer's at that place."""
  model = _model(monkeypatch, "gpu", position="rotary+t5", dtype="bfloat16",
                 num_decoder_layers=3)
  lines = kernel_choices(model)
  assert lines[0].startswith("kernel auto -> cudnn for 6 layers: decoder.layers.*.cross_attention, "
                             "decoder.layers.{0,2}.self_attention, encoder.layers.0.self_attention")
  assert lines[1].startswith("kernel auto -> pallas for 2 layers: "
                             "decoder.layers.1.self_attention, encoder.layers.1.self_attention "
                             "[fastest ")
  assert len(lines) == 2


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
  Training keeps both refusals as they are, and pallas as asked (slow, logged), and so does
  an evaluation given the kernel (eval.py's override, which names its files). The config
  keeps the kernel asked for."""
  pallas = parse(tiny_config(**{"model.attention.kernel": "pallas"}))
  assert _kernels_run(experiment.build(pallas, evaluating=True)) == {"xla"}
  assert _kernels_run(experiment.build(pallas, evaluating=True, kernel_asked_here=True)) == {
      "pallas"}
  trained = experiment.build(pallas)
  assert _kernels_run(trained) == {"pallas"} and trained.model.attention.kernel == "pallas"
  refused = parse(tiny_config(**{"model.attention.kernel": "xla",
                                 "model.attention.score": "additive"}))
  assert _kernels_run(experiment.build(refused, evaluating=True)) == {"reference"}
  for asked_here in ({}, {"evaluating": True, "kernel_asked_here": True}):
    with pytest.raises(ConfigError, match="'xla' computes dot-product scores only"):
      experiment.build(refused, **asked_here)


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


@pytest.mark.parametrize("normalizer,dtype,want", [("sink", "bfloat16", "pallas"),
                                                   ("sink", "float32", "pallas"),
                                                   ("stick_breaking", "bfloat16", "reference"),
                                                   ("softmax", "float32", "xla")])
def test_auto_offers_pallas_a_layer_only_it_fuses(normalizer, dtype, want):
  """On a GPU, a layer without a positional bias whose normaliser cuDNN and XLA refuse goes to
  pallas where pallas fuses it (a sink), to the formula where nothing does
  (stick-breaking); a layer they take stays with them."""
  needs = dataclasses.replace(
      _needs(), dtype=dtype, normalizer=normalizer,
      capabilities=_needs().capabilities | (set() if normalizer == "softmax" else
                                            {"flash_normalizer"})
      | ({"online_normalizer"} if normalizer == "stick_breaking" else set()))
  choice, _ = choose(AUTO, needs, Target("gpu"))
  assert choice.name == want
