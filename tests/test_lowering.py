"""Compiled for the accelerators the kernels declare, proven on this CPU: programs lowered for
`cuda` and `tpu` (jax.jit(f).trace(*args).lower(lowering_platforms=(p,))), from abstract
shapes, without the hardware.

- The Pallas flash attention (transformer/model/pallas_attention.py), forward and gradient,
  with no bias and every encoding's BiasSpec × {causal, bidirectional, local window}, lowers
  to compiled Pallas calls (Triton's `__gpu$xla.gpu.triton` custom call on cuda, Mosaic's
  `tpu_custom_call` on tpu), and serialises with jax.export (the Triton
  call only with its safety check disabled: JAX gives it no compatibility guarantee, so such
  an artifact is for the jaxlib that wrote it).
- Each family's train step (run/step.make_train_step), evaluation step (the Evaluator's
  teacher-forced scoring) and KV-cached decoding step (init_decoding, then one decode_step
  of one token) lower for each platform with every kernel that declares it
  (Kernel.backends), every bias encoding, full and local windows; and per family and
  kernel a variant with the Gaussian-as-dot scorer, rotary positions, grouped-query
  attention (one K/V head) in bfloat16 (the grid's cases compute in float32).

In every program, each Pallas kernel reachable for the platform (jax.lax.platform_dependent
picks the branch) is compiled, never interpreted, and the lowered module holds one custom
call per kernel: interpret mode would lower a kernel's body as ordinary ops and prove
nothing. `cudnn` declares the GPU but cannot be lowered here: JAX asks the cuDNN library for
its version while tracing, and this machine has none (test_cudnn_needs_the_library).

What this proves: the Pallas-to-Triton and Pallas-to-Mosaic lowerings (block shapes and
tiling, the kernels' operations) and XLA's StableHLO for both platforms. What it cannot: the
device compilers (Triton to PTX, Mosaic's layout passes) run on the device only.

Tiny dims (T5 with 8 buckets, FIRE 4 units wide: their in-kernel loops unroll per bucket and
unit) keep the module to a few minutes; each trace is shared by the two platforms' tests.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from transformer.core.metrics import token_metrics
from transformer.model.attention import AttentionConfig
from transformer.model.config import ModelConfig
from transformer.model.families import ARCHS, make_model
from transformer.model.kernel_choice import Target
from transformer.model.kernels import KERNELS
from transformer.model.pallas_attention import flash_attention
from transformer.model.positions import POSITIONS, PositionSettings
from transformer.model.positions.relative import Fire, T5Bias
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

FLASH_CASES = [(bias, mask, dtype, kv_heads)
               for bias in ["none"] + BIAS_ENCODINGS for mask in MASKS
               for dtype, kv_heads in [("bfloat16", 4) if mask != "window" else ("float32", 2)]]


def _flash(bias, mask, dtype, kv_heads, gradient):
  """(function, abstract args): flash attention (or its gradient in q, k, v and the bias
  parameters) at batch 2, length 256, 4 heads of 64."""
  causal, window = MASKS[mask]
  spec = None if bias == "none" else POSITIONS[bias](
      256, 4, 512, causal=causal, settings=getattr(SETTINGS, bias),
      rngs=nnx.Rngs(0)).bias_spec()

  def attend(q, k, v, segments, positions, params):
    bias_spec = None if spec is None else type(spec)(spec.fn, params, spec.learned)
    return flash_attention(q, k, v, q_segments=segments, k_segments=segments,
                           q_positions=positions, k_positions=positions, causal=causal,
                           window=window, bias_spec=bias_spec, scale=0.125)

  def loss(*args):
    return jnp.sum(attend(*args).astype(jnp.float32))

  dtype = jnp.dtype(dtype)
  args = (S((2, 256, 4, 64), dtype), S((2, 256, kv_heads, 64), dtype),
          S((2, 256, kv_heads, 64), dtype), S((2, 256), jnp.int32), S((2, 256), jnp.int32),
          {} if spec is None else jax.tree.map(lambda x: S(x.shape, x.dtype), spec.params))
  return (jax.grad(loss, (0, 1, 2, 5)) if gradient else attend), args


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "gradient"])
@pytest.mark.parametrize("bias,mask,dtype,kv_heads", FLASH_CASES,
                         ids=[f"{b}-{m}-{d}-kv{k}" for b, m, d, k in FLASH_CASES])
def test_flash_attention_lowers_to_compiled_pallas_calls(platform, gradient, bias, mask, dtype,
                                                         kv_heads):
  fn, args = _flash(bias, mask, dtype, kv_heads, gradient)
  traced = jax.jit(fn).trace(*args)
  names = check_compiled(traced, traced.lower(lowering_platforms=(platform,)).as_text(),
                         platform, at_least=3 if gradient else 1)
  assert names == (["flash_forward", "flash_dq", "flash_dkv"] if gradient
                   else ["flash_forward"])
  exported = jax.export.export(jax.jit(fn), platforms=[platform],
                              disabled_checks=UNGUARANTEED[platform])(*args)
  # The serialised StableHLO (the portable artifact) read back. Exported.serialize() would
  # wrap it with its calling convention in a flatbuffer: the flatbuffers package is not
  # installed here.
  assert exported.platforms == (platform,) and exported.mlir_module_serialized
  assert exported.mlir_module().count(CUSTOM_CALLS[platform]) == len(names)


def test_the_cpu_interprets_the_same_function():
  """The function lowered above, lowered for the CPU: its kernels are interpreted there,
  so no Pallas custom call is left."""
  fn, args = _flash("alibi", "causal", "bfloat16", 4, gradient=True)
  traced = jax.jit(fn).trace(*args)
  kernels = pallas_kernels(traced.jaxpr.jaxpr, "cpu")
  assert len(kernels) == 3 and all(interpret for _, interpret in kernels)
  text = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert not any(call in text for call in CUSTOM_CALLS.values())


# --------------------------------------------------------------------------- model steps

FAMILIES = sorted(ARCHS)


def kernels_declaring(platform: str) -> list[str]:
  return [name for name, kernel in KERNELS.items()
          if (kernel.backends is None or BACKENDS[platform] in kernel.backends)
          and name not in NEEDS_DEVICE]


# (position, score, window, dtype, kv_heads) per case: every bias encoding in float32, the
# window alternating so that each (family, kernel) and each (kernel, encoding) meets both;
# and a variant of the Gaussian-as-dot scorer with rotary positions and one K/V head, bf16.
VARIANTS = {**{position: (position, "scaled_dot", None, "float32", 0)
               for position in BIAS_ENCODINGS},
            "variant": ("rotary", "gaussian", None, "bfloat16", 1)}


def _window(family, name):
  if name == "variant":
    return "full"
  return "local" if (FAMILIES.index(family) + BIAS_ENCODINGS.index(name)) % 2 else "full"


# A family's steps: "decode" is one token against the KV cache; "prefill" (the families that
# generate) a prompt of 8 tokens into it, as generate() starts.
STEPS = ["train", "eval", "decode", "prefill"]


def _steps(family):
  cls = ARCHS[family]
  return [s for s in STEPS if s in ("train", "eval") or (s == "decode" and
                                                         (cls.decodes or cls.generates))
          or (s == "prefill" and cls.generates)]


MODEL_CASES = [(platform, family, kernel, name, step) for platform in PLATFORMS
               for family in FAMILIES for kernel in kernels_declaring(platform)
               for name in VARIANTS for step in _steps(family)]


def _config(family, kernel, name):
  position, score, _, dtype, kv_heads = VARIANTS[name]
  return ModelConfig(
      vocab_size=19, d_model=32, num_heads=2, num_kv_heads=kv_heads, d_ff=32,
      num_encoder_layers=1, num_decoder_layers=1, dropout=0.1, max_len=64, arch=family,
      position=position, num_classes=5 if family == "encoder" else 0, dtype=dtype,
      position_settings=SETTINGS,
      attention=AttentionConfig(score=score, kernel=kernel, block_size=16,
                                window=_window(family, name), window_size=4))


@functools.cache
def _traced(family, kernel, name, step):
  """The step jitted and traced from abstract shapes (shared by both platforms' tests)."""
  cfg = _config(family, kernel, name)
  # Built for a backend the kernel runs on (a kernel named by hand is chosen alike on each).
  target = Target((KERNELS[kernel].backends or (jax.default_backend(),))[0])
  graphdef, params = nnx.split(nnx.eval_shape(
      lambda: make_model(cfg, rngs=nnx.Rngs(0), target=target)))
  params = nnx.to_pure_dict(params)
  tokens = S((2, 32), jnp.int32)
  batch = {key: tokens for key in ("inputs", "targets", "inputs_segmentation",
                                   "targets_segmentation", "inputs_positions",
                                   "targets_positions")}
  if step == "train":
    optimizer = optax.adam(1e-3)
    fn = step_lib.make_train_step(graphdef, optimizer, lambda s: 1e-3, label_smoothing=0.1,
                                  seed=0)
    state = {"step": S((), jnp.int32), "params": params,
             "opt_state": jax.eval_shape(optimizer.init, params)}
    return jax.jit(fn).trace(state, batch)
  if step == "eval":
    def score(params, batch):
      logits = nnx.merge(graphdef, params)(batch)
      return token_metrics(logits, batch["targets"], batch["targets_segmentation"] > 0)
    return jax.jit(score).trace(params, batch)

  def decode(params, prompts, tokens, index):
    model = nnx.merge(graphdef, params)
    model.init_decoding(prompts, 48)
    return model.decode_step(tokens, index)
  new = S((2, 8 if step == "prefill" else 1), jnp.int32)
  return jax.jit(decode).trace(params, {"inputs": tokens}, new, S((), jnp.int32))


@pytest.mark.parametrize("platform,family,kernel,name,step", MODEL_CASES, ids=[
    f"{p}-{f}-{k}-{n}-{_window(f, n)}-{s}" for p, f, k, n, s in MODEL_CASES])
def test_family_step_lowers(platform, family, kernel, name, step):
  traced = _traced(family, kernel, name, step)
  text = traced.lower(lowering_platforms=(platform,)).as_text()
  # Pallas kernels in every attention layer, but in a one-query decoding step (the
  # reference formula, logged): there only the encoder-decoder's encoder has them.
  one_query = step == "decode" and family != "encoder_decoder"
  check_compiled(traced, text, platform, at_least=kernel == "pallas" and not one_query)
  if kernel != "pallas":
    assert CUSTOM_CALLS[platform] not in text


def test_cudnn_needs_the_library():
  """cuDNN's kernel declares the GPU; without one (this machine) lowering it fails while
  tracing, as JAX asks the cuDNN library for its version; with one, it lowers for cuda."""
  if any(device.platform == "gpu" for device in jax.devices()):
    assert "cudnn" in _traced("decoder", "cudnn", "variant", "eval").lower(
        lowering_platforms=("cuda",)).as_text()
    return
  with pytest.raises(Exception, match="cuDNN"):
    _traced("decoder", "cudnn", "variant", "eval")
