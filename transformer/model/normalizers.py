"""Attention normalisers: how a row of logits becomes the weights of the values, keyed by
config string (`model.attention.normalizer`).

A normaliser maps the logits [b, h, tq, tk] (float32; the scorer's, capped, plus the
positional biases) and the visible keys (a boolean [b, 1 or h, tq, tk]) to the weights
[b, h, tq, tk] (float32; 0 at every masked key, and a row with no visible key all 0):
`normalizer(logits, visible, mask)`. Its constructor is `(num_heads, settings, *, max_len,
rngs)`, max_len the model's longest sequence. Each declares what it is, from which the
capabilities a layer needs of its kernel are read (transformer/model/kernels/capabilities.py:
`flash_normalizer`, `online_normalizer`, `row_normalizer`):

  * `plain_softmax`: it is exactly softmax over the visible keys, which every kernel
    computes;
  * `flash`: a flash-attention kernel computes it in closed form, `flash_form()` (softmax
    with a sink logit per head, or a sigmoid with no normaliser): the `pallas` kernel runs
    it;
  * `online`: it is computed block by block over the keys with a running state (start,
    step, divisor), as flash attention computes softmax: the `blockwise` kernel runs it;
  * neither: it needs each query's whole row of logits (the `reference` kernel);
  * `causal_only`: it is defined for causal self-attention only (keys ordered before the
    query), so a layer attending bidirectionally or across sequences refuses it.

Every normaliser depends on a query's row of visible keys alone, so cached decoding (the
row's keys in cache slots, the later slots masked) computes what the full pass computes.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.fields import AT_LEAST_0, check_ranges
from transformer.core.registry import NoSettings, lookup, settings_of, settings_sections
from transformer.model.masks import Mask, masked_softmax


@dataclasses.dataclass(frozen=True)
class FlashForm:
  """A normaliser as a flash-attention kernel computes it: softmax (with `sink` [h], one
  more logit per head in its normaliser, or None), or σ(x + sigmoid_bias) at each visible
  key with no normaliser (sigmoid_bias not None)."""

  sigmoid_bias: float | None = None
  sink: jax.Array | None = None


class Normalizer(nnx.Module):
  """The interface; an online normaliser also defines start, step and divisor (the
  blockwise kernel's running state over key blocks), a flash one flash_form()."""

  Settings = NoSettings
  plain_softmax = False
  flash = False
  online = False
  causal_only = False
  name = "softmax"  # its config name (make_normalizer sets it)

  def __call__(self, logits: jax.Array, visible: jax.Array, mask: Mask) -> jax.Array:
    raise NotImplementedError

  def start(self, shape: tuple[int, int, int]):
    """The running state of queries [b, h, block] before any key block."""
    raise NotImplementedError

  def step(self, state, logits: jax.Array, visible: jax.Array):
    """One key block's (new state, unnormalised weights p [b, h, bq, bk], the factor
    [b, h, bq] rescaling the values accumulated so far); logits are −inf where masked."""
    raise NotImplementedError

  def divisor(self, state) -> jax.Array:
    """What the accumulated p·V is divided by at the end, broadcastable to [b, h, bq]
    (never 0)."""
    raise NotImplementedError

  def flash_form(self) -> FlashForm:
    """What a flash-attention kernel computes for it (a `flash` normaliser)."""
    raise NotImplementedError


class Softmax(Normalizer):
  """softmax over the visible keys ("Attention Is All You Need")."""

  plain_softmax = True
  flash = True
  online = True

  def __init__(self, num_heads: int = 0, settings=None, *, max_len: int = 0, rngs=None):
    del num_heads, settings, max_len, rngs

  def flash_form(self):
    return FlashForm()

  def __call__(self, logits, visible, mask):
    del mask
    return masked_softmax(logits, visible)

  def start(self, shape):
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)

  def step(self, state, logits, visible):
    top, total = state  # running max, running Σ exp(logit − max)
    new_top = jnp.maximum(top, logits.max(-1))
    safe_top = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
    p = jnp.where(visible, jnp.exp(logits - safe_top[..., None]), 0.0)
    rescale = jnp.exp(jnp.where(jnp.isfinite(top), top - safe_top, -jnp.inf))
    return (new_top, total * rescale + p.sum(-1)), p, rescale

  def divisor(self, state):
    total = state[1]
    return jnp.where(total > 0, total, 1.0)  # no visible key: 0


class Sink(Softmax):
  """Softmax with a sink: one more logit s_h per head in the normaliser, with no value,
  exp(x_j) / (exp(s_h) + Σ_k exp(x_k)) — gpt-oss (2025): a learned s_h per head, the column
  appended to the logits before the softmax and dropped after; with learned=False and
  init 0 it is "softmax off by one" (Miller 2023). A row with no visible key gives its
  whole mass to the sink (0, as softmax's)."""

  plain_softmax = False

  @dataclasses.dataclass(frozen=True)
  class Settings:
    learned: bool = True  # s_h learned per head (gpt-oss), or fixed at init (off by one: 0)
    init: float = 0.0  # s_h of every head at initialisation

  def __init__(self, num_heads, settings=None, *, max_len=0, rngs=None):
    settings = settings or self.Settings()
    self.learned = settings.learned
    self.sink = nnx.Param(jnp.full((num_heads,), settings.init, jnp.float32))

  def logit(self) -> jax.Array:
    """s_h [h]; a fixed sink's parameter exists but never moves."""
    sink = self.sink[...]
    return sink if self.learned else jax.lax.stop_gradient(sink)

  def __call__(self, logits, visible, mask):
    del mask
    b, h, tq, _ = logits.shape
    column = jnp.broadcast_to(self.logit()[:, None, None], (b, h, tq, 1))
    visible = jnp.broadcast_to(visible, logits.shape)
    weights = masked_softmax(jnp.concatenate([logits.astype(jnp.float32), column], -1),
                             jnp.concatenate([visible, jnp.ones_like(visible[..., :1])], -1))
    return weights[..., :-1]

  def flash_form(self):
    return FlashForm(sink=self.logit())

  def start(self, shape):  # the sink as a key already seen: max s_h, total exp(0) = 1
    return (jnp.broadcast_to(self.logit()[:, None], shape), jnp.ones(shape, jnp.float32))


class Sigmoid(Normalizer):
  """σ(x_j + b) at each visible key, no normaliser across keys (Ramapuram et al., ICLR
  2025, FlashSigmoid): b = −log n, n the training sequence length, a constant added to
  every logit (their code: the buffer `attn_bias`, `sigmoid_bias: -7.62` = −ln 2048 for
  2048-token training)."""

  flash = True
  online = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    length: int = 0  # n of b = −log n (1: b = 0); 0: model.max_len

    def __post_init__(self):
      check_ranges(self, length=AT_LEAST_0)

  def __init__(self, num_heads, settings=None, *, max_len=0, rngs=None):
    settings = settings or self.Settings()
    length = settings.length or max_len
    if length < 1:
      raise ConfigError("normalizer 'sigmoid' needs n ≥ 1 for its bias b = −log n: set "
                        "model.attention.normalizer_settings.sigmoid.length")
    self.bias = -math.log(length)

  def __call__(self, logits, visible, mask):
    del mask
    return jnp.where(visible, jax.nn.sigmoid(logits.astype(jnp.float32) + self.bias), 0.0)

  def flash_form(self):
    return FlashForm(sigmoid_bias=self.bias)

  def start(self, shape):
    return ()

  def step(self, state, logits, visible):
    p = jnp.where(visible, jax.nn.sigmoid(logits + self.bias), 0.0)
    return state, p, jnp.ones(p.shape[:-1], jnp.float32)

  def divisor(self, state):
    del state
    return jnp.ones((), jnp.float32)


class StickBreaking(Normalizer):
  """Stick-breaking (Tan et al., ICLR 2025): β_ij = σ(x_ij) and, from the query backward,
  A_ij = β_ij · Π_{j<k<i} (1 − β_ik) over the visible keys k before the query, in log
  space: log A_ij = log σ(x_ij) + Σ_{j<k<i} log σ(−x_ik) (their sb_ref.py: a reversed
  cumulative sum). What is left of the stick, 1 − Σ_j A_ij, goes to the query's own value
  (their test's reference: o + rem·v), computed as Π_k (1 − β_ik), which is the same in
  exact arithmetic and does not lose the small rests to cancellation in float32. With attend_current the query's own key takes part
  in the breaking too (their attend_current=True), still receiving the rest. Keys are
  taken in the order of the key axis, which is position order in self-attention (cache
  slots included)."""

  causal_only = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    attend_current: bool = False  # the query's own key breaks the stick too (theirs: False)

  def __init__(self, num_heads, settings=None, *, max_len=0, rngs=None):
    self.attend_current = (settings or self.Settings()).attend_current

  def __call__(self, logits, visible, mask):
    logits = logits.astype(jnp.float32)
    q_pos, k_pos = mask.q_positions[:, None, :, None], mask.k_positions[:, None, None, :]
    visible = jnp.broadcast_to(visible, logits.shape)
    before = visible & ((k_pos <= q_pos) if self.attend_current else (k_pos < q_pos))
    log_beta = jnp.where(before, jax.nn.log_sigmoid(logits), 0.0)
    log_rest = jnp.where(before, jax.nn.log_sigmoid(-logits), 0.0)
    # Σ over the keys after j (nearer the query) of log(1 − β): a reversed exclusive cumsum
    after = jnp.cumsum(log_rest[..., ::-1], axis=-1)[..., ::-1] - log_rest
    weights = jnp.where(before, jnp.exp(log_beta + after), 0.0)
    rest = jnp.exp(log_rest.sum(-1, keepdims=True))  # Π (1 − β) = 1 − Σ A, without cancelling
    own = visible & (k_pos == q_pos)
    return weights + jnp.where(own, rest, 0.0)


NORMALIZERS: dict[str, type[Normalizer]] = {
    "softmax": Softmax,
    "sigmoid": Sigmoid,
    "sink": Sink,
    "stick_breaking": StickBreaking,
}

# config.model.attention.normalizer_settings: a section per normaliser with settings.
NormalizerSettings = settings_sections(NORMALIZERS, "NormalizerSettings")

SOFTMAX = Softmax()  # the kernels' default


def causal_only_error(field: str, name: str, why: str) -> ConfigError:
  """The error of model.attention.FIELD=NAME, defined for causal self-attention only
  (`why`), in a layer that is not."""
  return ConfigError(
      f"model.attention.{field}={name!r} is defined for causal self-attention only ({why}), "
      "and this model has bidirectional or cross-attention (an encoder stack, or an "
      "encoder-decoder's cross-attention): use model.arch=decoder or another "
      f"{field}")


def make_normalizer(name: str, num_heads: int, settings=None, *, max_len: int,
                    causal: bool, rngs: nnx.Rngs) -> Normalizer:
  """The normaliser `name` with its section of `settings` (a NormalizerSettings; None:
  defaults) for a layer of num_heads heads; a ConfigError if it is causal-only and the
  layer is not causal self-attention."""
  cls = lookup(NORMALIZERS, name, "attention normalizer")
  if cls.causal_only and not causal:
    raise causal_only_error("normalizer", name, "keys ordered before the query")
  normalizer = cls(num_heads, settings_of(settings, NORMALIZERS, name), max_len=max_len,
                   rngs=rngs)
  normalizer.name = name
  return normalizer
