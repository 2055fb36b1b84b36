"""Compiled for the accelerators the kernels declare, proven on this CPU: programs lowered for
`cuda` and `tpu` (jax.jit(f).trace(*args).lower(lowering_platforms=(p,))), from abstract
shapes, without the hardware.

- The Pallas flash attention (transformer/model/kernels/pallas/attention.py), its gradient (the
  forward kernel and the backward ones: one on cuda, which adds dq atomically, dq and dk/dv
  on tpu) with no bias and every encoding's BiasSpec ×
  {causal, bidirectional, local window}, the forward alone with each causal, head dims
  from 8 to 256, and the fused normalisers (a sink, a sigmoid) with FoX's data bias (its
  two vectors' gradients too), lowers to compiled Pallas calls (Triton's `__gpu$xla.gpu.triton` custom
  call on cuda, Mosaic's `tpu_custom_call` on tpu), and serialises with jax.export (the Triton call only with its safety check disabled: JAX
  gives it no compatibility guarantee, so such an artifact is for the jaxlib that wrote it).
- Each family's train step (run/step.make_train_step) lowers for each platform with every
  kernel that declares it (Kernel.backends) × every encoding the kernels see (the
  positional biases, and CoPE's content bias where the family and the kernel take it:
  decoder, reference) × the family's masks with and without a local window; the full
  window in float32 with as many K/V heads as query heads, the local one in bfloat16 with
  grouped K/V heads (2 of 4). Its evaluation step (the Evaluator's teacher-forced scoring),
  KV-cached decoding step (init_decoding, then one decode_step of one token) and prefill
  (a prompt of 8 tokens into the cache) lower for every kernel, each with one (encoding,
  window) rotating over the kernel and step, so that each kernel meets every bias encoding
  and both windows in them (and CoPE in all of them); per family and kernel, a variant with
  the Gaussian-as-dot scorer, rotary positions, one K/V head and dropout in bfloat16, every
  step but evaluation (whose forward the train step holds). Each family's train step
  (pallas, T5) also serialises with jax.export per platform.
- `auto` on a GPU and a TPU (a kernel_choice.Target: no device needed) gives the
  encoder-decoder's layers with a positional bias pallas, and its cross-attention xla: its
  train step lowers to the compiled Pallas calls, and exports, for each platform.

In every program, each Pallas kernel reachable for the platform (jax.lax.platform_dependent
picks the branch) is compiled, never interpreted, and the lowered module holds one custom
call per kernel: interpret mode would lower a kernel's body as ordinary ops and prove
nothing. `cudnn` declares the GPU but cannot be lowered here: JAX asks the cuDNN library for
its version while tracing, and this machine has none (test_cudnn_needs_the_library).

What this proves: the Pallas-to-Triton and Pallas-to-Mosaic lowerings (block shapes and
tiling, the kernels' operations) and XLA's StableHLO for both platforms. What it cannot: the
device compilers (Triton to PTX, Mosaic's layout passes) run on the device only.

Kept to about two minutes on 2 shared cores (90 s of CPU): tiny dims (T5 with 8 buckets,
FIRE 4 units wide: their in-kernel loops unroll per bucket and unit); no dropout but the
variant's (its random bits lower to many ops) and plain SGD in the train steps, whose
concern is attention; each program traced once, for both platforms' tests, and exported
from the same jitted function (JAX reuses the trace and the lowering).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from tests.support import TINY_MODEL
from transformer.core.errors import ConfigError
from transformer.core.metrics import token_metrics
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.families import ARCHS, make_model
from transformer.model.kernels.capabilities import Needs
from transformer.model.kernels.choice import KernelChoice, Target, check
from transformer.model.kernels.registry import KERNELS
from transformer.model.kernels.pallas.attention import flash_attention
from transformer.model.positions import POSITIONS, PositionSettings
from transformer.model.positions.relative import Fire, T5Bias
from transformer.model.scores import make_score
from transformer.run import step as step_lib

S = jax.ShapeDtypeStruct
PLATFORMS = ("cuda", "tpu")
BACKENDS = {"cuda": "gpu", "tpu": "tpu"}  # the names Kernel.backends uses
CUSTOM_CALLS = {"cuda": "custom_call @__gpu$xla.gpu.triton(", "tpu": "custom_call @tpu_custom_call("}
# jax.export refuses custom calls without a compatibility guarantee unless told: Triton's
# (its IR is serialised for this jaxlib only; Mosaic's tpu_custom_call is guaranteed).
UNGUARANTEED = {"cuda": [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
                "tpu": []}
# Kernels that declare a platform but cannot be lowered without its device here.
NEEDS_DEVICE = {"cudnn": "JAX checks the cuDNN library's version while tracing"}
BIAS_ENCODINGS = sorted(name for name, cls in POSITIONS.items() if cls.biases)
SETTINGS = PositionSettings(t5=T5Bias.Settings(num_buckets=8, max_distance=16),
                            fire=Fire.Settings(width=4))
MASKS = {"causal": (True, None), "bidirectional": (False, None), "window": (False, 16)}
# The kernels of flash attention's gradient per platform: Triton's and interpret mode's one
# backward kernel adds dq atomically; Mosaic TPU (no atomics) has a dq kernel besides dk/dv.
GRADIENT_KERNELS = {"cuda": ["flash_forward", "flash_backward"],
                    "cpu": ["flash_forward", "flash_backward"],
                    "tpu": ["flash_forward", "flash_dq", "flash_dkv"]}


def pallas_kernels(jaxpr, platform: str) -> list[tuple[str, bool]]:
  """(name, interpreted) of each Pallas kernel of `jaxpr` that lowering for `platform`
  reaches: of a platform_dependent conditional, only the platform's branch."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append((eqn.params["name"], bool(eqn.params["interpret"])))
      continue
    params = dict(eqn.params)
    if eqn.primitive.name == "cond" and params.get("branches_platforms"):
      index = next(i for i, ps in enumerate(params["branches_platforms"])
                   if ps is None or platform in ps)
      params["branches"] = (params["branches"][index],)
    for value in params.values():
      for x in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          found += pallas_kernels(inner, platform)
  return found


def check_compiled(traced, text: str, platform: str, at_least: int = 0) -> list[str]:
  """Asserts that `text`, `traced` lowered for `platform`, compiles every Pallas kernel the
  platform reaches (none interpreted) into one custom call each, and that there are at least
  `at_least`; returns the kernels' names."""
  kernels = pallas_kernels(traced.jaxpr.jaxpr, platform)
  interpreted = sorted({name for name, interpret in kernels if interpret})
  assert not interpreted, f"{platform}: Pallas kernels in interpret mode: {interpreted}"
  calls = text.count(CUSTOM_CALLS[platform])
  assert calls == len(kernels) >= at_least, (
      f"{platform}: {calls} {CUSTOM_CALLS[platform]} calls for {len(kernels)} kernels "
      f"(at least {at_least} expected)")
  return [name for name, _ in kernels]


# --------------------------------------------------------------------------- flash attention

# (gradient, bias, mask, dtype, kv_heads): the gradient (which holds the forward kernel too)
# for every bias × mask, the forward alone for every bias with the causal mask.
FLASH_CASES = [(gradient, bias, mask, dtype, kv_heads)
               for bias in ["none"] + BIAS_ENCODINGS for mask in MASKS
               for dtype, kv_heads in [("bfloat16", 4) if mask != "window" else ("float32", 2)]
               for gradient in [True] + [False] * (mask == "causal")]


@functools.cache
def _flash(bias, mask, dtype, kv_heads, gradient, head_dim=64, fused=""):
  """(jitted function, abstract args, its trace): flash attention (or its gradient in q, k,
  v, the bias parameters and the fused terms) at batch 2, length 256, 4 heads of head_dim;
  traced once for both platforms, and jax.export reuses the trace of the same jitted
  function. fused: "NORMALIZER+forget" or either alone: a sink's logits [4] or a sigmoid's
  bias, FoX's two vectors [2, 256, 4] (FUSED_CASES)."""
  causal, window = MASKS[mask]
  spec = None if bias == "none" else POSITIONS[bias](
      256, 4, 512, causal=causal, settings=getattr(SETTINGS, bias),
      rngs=nnx.Rngs(0)).bias_spec()
  parts = fused.split("+")

  def attend(q, k, v, segments, positions, params, sink=None, vectors=None):
    bias_spec = None if spec is None else dataclasses.replace(spec, params=params)
    return flash_attention(q, k, v, q_segments=segments, k_segments=segments,
                           q_positions=positions, k_positions=positions, causal=causal,
                           window=window, bias_spec=bias_spec, scale=0.125, sink=sink,
                           sigmoid_bias=-5.5 if "sigmoid" in parts else None,
                           bias_vectors=vectors)

  def loss(*args):
    return jnp.sum(attend(*args).astype(jnp.float32))

  dtype = jnp.dtype(dtype)
  args = (S((2, 256, 4, head_dim), dtype), S((2, 256, kv_heads, head_dim), dtype),
          S((2, 256, kv_heads, head_dim), dtype), S((2, 256), jnp.int32),
          S((2, 256), jnp.int32),
          {} if spec is None else jax.tree.map(lambda x: S(x.shape, x.dtype), spec.params),
          S((4,), jnp.float32) if "sink" in parts else None,
          (S((2, 256, 4), jnp.float32),) * 2 if "forget" in parts else None)
  jitted = jax.jit(jax.grad(loss, (0, 1, 2, 5, 6, 7)) if gradient else attend)
  return jitted, args, jitted.trace(*args)


def check_flash(platform, gradient, *case, head_dim=64, fused=""):
  """The flash attention case lowered and exported for `platform`: its compiled kernels."""
  jitted, args, traced = _flash(*case, gradient, head_dim, fused)
  names = check_compiled(traced, traced.lower(lowering_platforms=(platform,)).as_text(),
                         platform, at_least=len(GRADIENT_KERNELS[platform]) if gradient else 1)
  assert names == (GRADIENT_KERNELS[platform] if gradient else ["flash_forward"])
  exported = jax.export.export(jitted, platforms=[platform],
                               disabled_checks=UNGUARANTEED[platform])(*args)
  # The serialised StableHLO (the portable artifact) read back. Exported.serialize() would
  # wrap it with its calling convention in a flatbuffer: the flatbuffers package is not
  # installed here.
  assert exported.platforms == (platform,) and exported.mlir_module_serialized
  assert exported.mlir_module().count(CUSTOM_CALLS[platform]) == len(names)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("gradient,bias,mask,dtype,kv_heads", FLASH_CASES, ids=[
    f"{'gradient' if g else 'forward'}-{b}-{m}-{d}-kv{k}" for g, b, m, d, k in FLASH_CASES])
def test_flash_attention_lowers_to_compiled_pallas_calls(platform, gradient, bias, mask, dtype,
                                                         kv_heads):
  check_flash(platform, gradient, bias, mask, dtype, kv_heads)


# The normalisers and the data bias run in the kernels (the gradient: forward and backward
# kernels): a sink with FoX's vectors and ALiBi, causal, bf16; a sigmoid with FoX's vectors
# and T5, a local window, float32, grouped K/V heads.
FUSED_CASES = [("sink+forget", "alibi", "causal", "bfloat16", 4),
               ("sigmoid+forget", "t5", "window", "float32", 2)]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("fused,bias,mask,dtype,kv_heads", FUSED_CASES,
                         ids=[case[0] for case in FUSED_CASES])
def test_fused_normalizers_and_data_bias_lower(platform, fused, bias, mask, dtype, kv_heads):
  check_flash(platform, True, bias, mask, dtype, kv_heads, fused=fused)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("head_dim", [8, 96, 256])
def test_flash_attention_lowers_for_any_head_dim(platform, head_dim):
  """No head dim is refused by the lowerings (Triton pads it to a power of two ≥ 16,
  Mosaic takes a block's whole last dimension): pallas declares no limit (whether a large
  one fits a GPU's registers and shared memory is for the device to tell)."""
  check_flash(platform, True, "t5", "causal", "bfloat16", 2, head_dim=head_dim)


def test_the_cpu_interprets_the_same_function():
  """The function lowered above, lowered for the CPU: its kernels are interpreted there,
  so no Pallas custom call is left."""
  _, _, traced = _flash("alibi", "causal", "bfloat16", 4, True)
  kernels = pallas_kernels(traced.jaxpr.jaxpr, "cpu")
  assert [name for name, _ in kernels] == GRADIENT_KERNELS["cpu"]
  assert all(interpret for _, interpret in kernels)
  text = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert not any(call in text for call in CUSTOM_CALLS.values())


# --------------------------------------------------------------------------- model steps

FAMILIES = sorted(ARCHS)
# The families with a bidirectional (encoder) stack, which refuse an encoding defined for
# causal attention only (CoPE); test_the_grid_leaves_out_only_what_the_model_refuses.
BIDIRECTIONAL = {"encoder", "encoder_decoder"}
# Every encoding a kernel sees: a positional bias, or a content bias (CoPE).
ENCODINGS = BIAS_ENCODINGS + sorted(n for n, cls in POSITIONS.items() if cls.content_biases)
HEADS = 4
# Per window, (dtype, K/V heads): each (family, kernel, encoding) lowers in float32 with as
# many K/V heads as query heads and in bfloat16 with grouped K/V heads.
WINDOWS = {"full": ("float32", HEADS), "local": ("bfloat16", 2)}
# And per family and kernel, with a full window: rotary positions with the Gaussian-as-dot
# scorer (its augmented head dim) and one K/V head, in bfloat16.
VARIANT = ("rotary", "gaussian", "bfloat16", 1)


def kernels_declaring(platform: str) -> list[str]:
  return [name for name, kernel in KERNELS.items()
          if (kernel.backends is None or BACKENDS[platform] in kernel.backends)
          and name not in NEEDS_DEVICE]


# A family's steps: "decode" is one token against the KV cache; "prefill" (the families that
# generate) a prompt of 8 tokens into it, as generate() starts.
STEPS = ["train", "eval", "decode", "prefill"]


def _steps(family):
  cls = ARCHS[family]
  return [s for s in STEPS if s in ("train", "eval") or (s == "decode" and
                                                         (cls.decodes or cls.generates))
          or (s == "prefill" and cls.generates)]


def _accepts(family, kernel, position, window) -> bool:
  """Whether the family takes the encoding, and the kernel its layers (kernels.choice.check
  on what the encoding's class declares)."""
  cls = POSITIONS[position]
  if cls.causal_only and family in BIDIRECTIONAL:
    return False
  dtype, kv_heads = WINDOWS[window]
  try:
    check(kernel, Needs.of(make_score("scaled_dot", HEADS, 8, rngs=nnx.Rngs(0)), cls,
                           position=position, window=window == "local",
                           grouped=kv_heads < HEADS, dtype=dtype))
  except ConfigError:
    return False
  return True


OTHER_STEPS = [(family, step) for family in FAMILIES for step in _steps(family) if step != "train"]


def _windows(kernel) -> list[str]:
  """The windows whose dtype the kernel takes (mosaic_gpu: bfloat16's, local, only)."""
  dtypes = KERNELS[kernel].dtypes
  return [w for w, (dtype, _) in WINDOWS.items() if dtypes is None or dtype in dtypes]


def _rotation(kernel, family, step):
  """The (bias encoding, window) a step other than train is lowered with for `kernel`: the
  encoding turns with the kernel and the step, the window with the step, so that each
  kernel meets every bias encoding and the windows it takes in those steps, and each
  (encoding, window) meets some kernel in each."""
  j = OTHER_STEPS.index((family, step))
  i = list(KERNELS).index(kernel) + j
  windows = _windows(kernel)
  return BIAS_ENCODINGS[i % len(BIAS_ENCODINGS)], windows[j % len(windows)]


def _model_cases(platform):
  """(platform, family, kernel, position, window, step): the train step for every
  combination the model takes, the others for the rotation (and every content-bias case,
  few: decoder and reference only); the variant for every step."""
  for family in FAMILIES:
    for kernel in kernels_declaring(platform):
      for step in _steps(family):
        for position in ENCODINGS:
          for window in WINDOWS:
            if _accepts(family, kernel, position, window) and (
                step == "train" or position not in BIAS_ENCODINGS
                or _rotation(kernel, family, step) == (position, window)):
              yield platform, family, kernel, position, window, step
        if step != "eval":  # its forward is the train step's
          yield platform, family, kernel, "variant", "full", step


MODEL_CASES = [case for platform in PLATFORMS for case in _model_cases(platform)]


def _config(family, kernel, position, window):
  if position == "variant":
    position, score, dtype, kv_heads = VARIANT
  else:
    score, (dtype, kv_heads) = "scaled_dot", WINDOWS[window]
  # Heads of 8 (not TINY_MODEL's 2 of 8: the grid groups K/V heads) and blocks of 16: the
  # Pallas lowerings' layout rules are checked at these sizes. Dropout (its random bits lower
  # to many ops) in the variant only: the grid's concern is attention, which takes no
  # dropout but the reference's.
  tiny = {**TINY_MODEL, "d_model": 8 * HEADS, "num_heads": HEADS, "max_len": 64,
          "dropout": 0.1 if score == "gaussian" else 0.0}
  return ModelConfig(
      **tiny, num_kv_heads=kv_heads, arch=family, position=position,
      num_classes=5 if family == "encoder" else 0, dtype=dtype, position_settings=SETTINGS,
      attention=AttentionConfig(score=score, kernel=kernel, block_size=16, window=window,
                                window_size=4))


def _trace(model, step):
  """(jitted function, abstract args, its trace) of one step of an abstract `model`."""
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  tokens = S((2, 32), jnp.int32)
  batch = {key: tokens for key in ("inputs", "targets", "inputs_segmentation",
                                   "targets_segmentation", "inputs_positions",
                                   "targets_positions")}
  if step == "train":
    optimizer = optax.sgd(1e-3)  # elementwise updates: Adam's would only add XLA ops
    fn = step_lib.make_train_step(graphdef, optimizer, lambda s: 1e-3, label_smoothing=0.1,
                                  seed=0)
    args = ({"step": S((), jnp.int32), "params": params,
             "opt_state": jax.eval_shape(optimizer.init, params)}, batch)
  elif step == "eval":
    def fn(params, batch):
      logits = nnx.merge(graphdef, params)(batch)
      return token_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)
    args = (params, batch)
  else:
    def fn(params, prompts, tokens, index):
      model = nnx.merge(graphdef, params)
      model.init_decoding(prompts, 48)
      return model.decode_step(tokens, index)
    new = S((2, 8 if step == "prefill" else 1), jnp.int32)
    args = (params, {"inputs": tokens}, new, S((), jnp.int32))
  jitted = jax.jit(fn)
  return jitted, args, jitted.trace(*args)


@functools.cache
def _traced(family, kernel, position, window, step):
  """(jitted function, abstract args, its trace) of the step, from abstract shapes (shared
  by both platforms' tests)."""
  cfg = _config(family, kernel, position, window)
  # Built for a backend the kernel runs on (a kernel named by hand is chosen alike on each).
  target = Target((KERNELS[kernel].backends or (jax.default_backend(),))[0])
  return _trace(nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0), target=target)),
                step)


def _case_id(case):
  return "-".join(case)


@pytest.mark.parametrize("platform,family,kernel,position,window,step", MODEL_CASES,
                         ids=[_case_id(case) for case in MODEL_CASES])
def test_family_step_lowers(platform, family, kernel, position, window, step):
  _, _, traced = _traced(family, kernel, position, window, step)
  text = traced.lower(lowering_platforms=(platform,)).as_text()
  # Pallas kernels in every attention layer, but in a one-query decoding step (the
  # reference formula, logged): there only the encoder-decoder's encoder has them.
  one_query = step == "decode" and family != "encoder_decoder"
  check_compiled(traced, text, platform, at_least=kernel == "pallas" and not one_query)
  if kernel != "pallas":
    assert CUSTOM_CALLS[platform] not in text


@pytest.mark.parametrize("kernel", ["pallas", "xla"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_latent_attention_lowers(platform, kernel):
  """A decoder with multi-head latent attention (its rotary key decoupled): the train step
  and the prefill step through pallas (compiled Pallas calls) and xla (none), for the
  platform."""
  rotary = dataclasses.replace(POSITIONS["rotary"].Settings(), rotated_fraction=0.5)
  cfg = ModelConfig(**{**TINY_MODEL, "d_model": 8 * HEADS, "num_heads": HEADS, "max_len": 64},
                    arch="decoder", position="rotary", dtype="bfloat16",
                    position_settings=PositionSettings(rotary=rotary),
                    attention=AttentionConfig(kernel=kernel, block_size=16, kv="latent"))
  target = Target(jax.default_backend())
  model = nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0), target=target))
  for step in ("train", "prefill"):
    _, _, traced = _trace(model, step)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    check_compiled(traced, text, platform, at_least=kernel == "pallas")
    if kernel != "pallas":
      assert CUSTOM_CALLS[platform] not in text


def test_the_grid_covers_every_train_step_and_each_kernel_every_encoding_in_the_others():
  """The train step: every family × kernel × encoding × window the model takes (and the
  variant); the other steps: each kernel meets every bias encoding and both windows."""
  for platform in PLATFORMS:
    cases = [case[1:] for case in MODEL_CASES if case[0] == platform]
    kernels = kernels_declaring(platform)
    trains = {case[:4] for case in cases if case[4] == "train"}
    assert trains == {(f, k, p, w) for f, k, p, w in itertools.product(
        FAMILIES, kernels, ENCODINGS, WINDOWS) if _accepts(f, k, p, w)} | {
            (f, k, "variant", "full") for f, k in itertools.product(FAMILIES, kernels)}
    for kernel in kernels:
      others = {(p, w) for f, k, p, w, s in cases if k == kernel and s != "train"}
      assert {p for p, _ in others} >= set(BIAS_ENCODINGS)
      assert {w for p, w in others if p != "variant"} == set(_windows(kernel))
    assert {s for _, k, p, _, s in cases if p == "cope"} == set(STEPS)  # decoder, reference


def test_the_grid_leaves_out_only_what_the_model_refuses():
  """A (family, kernel, encoding, window) the grid leaves out is refused when its model is
  built (a causal-only encoding with an encoder stack; a kernel without CoPE's content
  bias; a window's dtype the kernel does not compute in): the grid's rule (_accepts) is the
  model's."""
  left_out = [case for case in itertools.product(FAMILIES, kernels_declaring("cuda"), ENCODINGS,
                                                 WINDOWS) if not _accepts(*case)]
  assert {p for _, k, p, w in left_out if w in _windows(k)} == {"cope"}
  for family, kernel, position, window in left_out:
    cfg = _config(family, kernel, position, window)
    why = "cope" if position == "cope" else "computes in bfloat16 or float16 only"
    with pytest.raises(ConfigError, match=why):
      nnx.eval_shape(lambda: make_model(cfg, rngs=nnx.Rngs(0), target=Target("cpu")))  # noqa: B023


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_train_step_exports(platform, family):
  """Each family's train step with pallas and T5's learned bias serialises with jax.export
  for the platform, its Pallas calls compiled (the trace and lowering of the grid's case,
  reused: JAX caches them on the jitted function)."""
  jitted, args, traced = _traced(family, "pallas", "t5", "full", "train")
  check_exported(jitted, args, traced, platform, at_least=len(GRADIENT_KERNELS[platform]))


def check_exported(jitted, args, traced, platform, at_least):
  """`jitted` lowered and exported for `platform`: every Pallas kernel it reaches there is
  a compiled call, at least `at_least`, in the lowering and in the exported module."""
  names = check_compiled(traced, traced.lower(lowering_platforms=(platform,)).as_text(),
                         platform, at_least=at_least)
  exported = jax.export.export(jitted, platforms=[platform],
                               disabled_checks=UNGUARANTEED[platform])(*args)
  assert exported.platforms == (platform,) and exported.mlir_module_serialized
  assert exported.mlir_module().count(CUSTOM_CALLS[platform]) == len(names)


# --------------------------------------------------------------------------- auto

def _kernel_names(model) -> dict[str, str]:
  """{layer path: the kernel it runs} of the model's attention layers."""
  return {".".join(map(str, path)): node.kernel_choice.name
          for path, node in nnx.iter_modules(model)
          if isinstance(getattr(node, "kernel_choice", None), KernelChoice)}


@functools.cache
def _auto_traced():
  """(jitted train step, args, trace, {layer: kernel}) of the encoder-decoder with
  kernel=auto and T5's bias in float32 (cuDNN passes a GPU's layers over), the model built
  for a GPU and for a TPU whose memory (512 KiB) xla's L×L temporaries would not fit: both
  choose pallas alike, so one program serves both platforms."""
  cfg = _config("encoder_decoder", "auto", "t5", "full")
  target = lambda b: Target(b, memory=2**19, rows=2, length=64)  # noqa: E731
  models = {backend: nnx.eval_shape(lambda b=backend: make_model(cfg, rngs=nnx.Rngs(0),
                                                                 target=target(b)))
            for backend in ("gpu", "tpu")}
  choices = _kernel_names(models["gpu"])
  assert _kernel_names(models["tpu"]) == choices
  return (*_trace(models["gpu"], "train"), choices)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_auto_lowers_to_compiled_pallas_calls_and_exports(platform):
  """The encoder-decoder's train step with kernel=auto, built for the platform's backend
  with too little memory for xla: every layer takes pallas (the cross-attention too, once
  xla is passed over for memory); lowered, each pallas layer's forward and two backward
  kernels are compiled calls, and the step serialises with jax.export for the platform."""
  jitted, args, traced, choices = _auto_traced()
  assert choices == {"decoder.layers.0.cross_attention": "pallas",
                     "decoder.layers.0.self_attention": "pallas",
                     "encoder.layers.0.self_attention": "pallas"}
  check_exported(jitted, args, traced, platform, at_least=3 * len(GRADIENT_KERNELS[platform]))


def test_cudnn_needs_the_library():
  """cuDNN's kernel declares the GPU; without one (this machine) lowering it fails while
  tracing, as JAX asks the cuDNN library for its version; with one, it lowers for cuda."""
  if any(device.platform == "gpu" for device in jax.devices()):
    assert "cudnn" in _traced("decoder", "cudnn", "variant", "full", "eval")[2].lower(
        lowering_platforms=("cuda",)).as_text()
    return
  with pytest.raises(Exception, match="cuDNN"):
    _traced("decoder", "cudnn", "variant", "full", "eval")
