"""Relative positions as a logit bias (the `bias` seam): ALiBi, T5's buckets, KERPLE and
FIRE."""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.fields import AT_LEAST_1, POSITIVE, Range, check, check_ranges
from transformer.layers import Dense
from transformer.positions.base import PositionalEncoding


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> list[float]:
  """ALiBi's head slopes: the geometric sequence 2^(-max_bias/n), 2^(-2·max_bias/n), ...,
  2^(-max_bias) for n a power of two; otherwise those of the next lower power of two, then
  every other slope of the next higher one (Press et al. 2022, where max_bias = 8)."""
  if num_heads & (num_heads - 1) == 0:
    return [2.0 ** (-max_bias * (h + 1) / num_heads) for h in range(num_heads)]
  lower = 2 ** int(math.floor(math.log2(num_heads)))
  return (alibi_slopes(lower, max_bias)
          + alibi_slopes(2 * lower, max_bias)[0::2][:num_heads - lower])


class ALiBi(PositionalEncoding):
  """Attention with linear biases: logits − m_h·|i − j| per head, no position embedding."""

  biases = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    max_bias: float = 8.0  # slopes 2^(-max_bias·h/n), h = 1..n: the last head's is 2^-max_bias

    def __post_init__(self):
      check_ranges(self, max_bias=POSITIVE)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    self.slopes = tuple(alibi_slopes(num_heads, (settings or self.Settings()).max_bias))

  def bias(self, q_positions, k_positions):
    distance = jnp.abs(q_positions[:, None, :, None] - k_positions[:, None, None, :])
    return -jnp.asarray(self.slopes, jnp.float32)[None, :, None, None] * distance


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool,
                             num_buckets: int = 32, max_distance: int = 128) -> jax.Array:
  """T5's buckets of relative_position = key − query: exact for small distances, then
  logarithmic up to max_distance, beyond which all share the last bucket. Bidirectional
  buckets give half the range to keys after the query."""
  n = -relative_position
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket += (n < 0).astype(n.dtype) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
      max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(n.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


class T5Bias(PositionalEncoding):
  """T5's learned relative position bias: one scalar per (bucket, head), shared by the
  layers of a stack; bidirectional in the encoder, causal in the decoder."""

  biases = True
  learned_bias = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    num_buckets: int = 32  # rows of the bias table (half per direction in the encoder)
    max_distance: int = 128  # distances from here on share the last bucket

    def __post_init__(self):
      check_ranges(self, num_buckets=Range(4), max_distance=AT_LEAST_1)
      check(self.max_distance > self.num_buckets // 2, "max_distance", self.max_distance,
            f"> num_buckets // 2 ({self.num_buckets // 2})")

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs):
    settings = settings or self.Settings()
    self.bidirectional = not causal
    self.num_buckets, self.max_distance = settings.num_buckets, settings.max_distance
    self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                         (self.num_buckets, num_heads)))

  def bias(self, q_positions, k_positions):
    relative = k_positions[:, None, :] - q_positions[:, :, None]  # [b, q, k]
    buckets = relative_position_bucket(relative, bidirectional=self.bidirectional,
                                       num_buckets=self.num_buckets,
                                       max_distance=self.max_distance)
    return jnp.transpose(self.table[...][buckets], (0, 3, 1, 2))  # [b, h, q, k]


def _distance(q_positions, k_positions) -> jax.Array:
  """|i − j| as float32 [b, 1, q, k]."""
  return jnp.abs(q_positions[:, None, :, None] - k_positions[:, None, None, :]).astype(jnp.float32)


class Kerple(PositionalEncoding):
  """KERPLE's logarithmic kernel (Chi et al. 2022): logits − r₁·log(1 + r₂·|i − j|), with
  r₁, r₂ > 0 learned per head. They stay positive as exponentials of learned logs (the
  paper clamps them at 0.01 after each update, an optimizer hook pure model code has not);
  initialised uniformly in [0.01, max_init_r1] and [0.01, max_init_r2], the paper's
  U(0, 2) and U(0, 1) clamped at 0.01."""

  biases = True
  learned_bias = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    max_init_r1: float = 2.0  # r₁ (the bias's scale) drawn from U(0.01, this)
    max_init_r2: float = 1.0  # r₂ (inside the log) drawn from U(0.01, this)

    def __post_init__(self):
      above = Range(0.01, lo_open=True)
      check_ranges(self, max_init_r1=above, max_init_r2=above)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs):
    settings = settings or self.Settings()
    log_uniform = lambda hi: jnp.log(jax.random.uniform(  # noqa: E731
        rngs.params(), (num_heads,), jnp.float32, 0.01, hi))
    self.log_r1 = nnx.Param(log_uniform(settings.max_init_r1))
    self.log_r2 = nnx.Param(log_uniform(settings.max_init_r2))

  def bias(self, q_positions, k_positions):
    r1 = jnp.exp(self.log_r1[...])[None, :, None, None]
    r2 = jnp.exp(self.log_r2[...])[None, :, None, None]
    return -r1 * jnp.log1p(r2 * _distance(q_positions, k_positions))  # [b, h, q, k]


class Fire(PositionalEncoding):
  """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long
  Context Transformers"): bias b(i, j) = f_θ(ψ(i − j) / ψ(max(i, L))) per head, f_θ an MLP
  (1 → width → heads, ReLU), ψ(x) = log(c·x + 1), c and the threshold L learned (L as
  |s|·init_threshold with s learned from 1), as in the paper's reference code. The MLP's
  input is the distance progressively normalised by the query's position, in [0, 1] for
  keys at or before the query, however long the sequence.

  Bidirectional (encoder), the input is the signed distance normalised by the later of
  the two positions, sign(i − j)·ψ(|i − j|) / ψ(max(i, j, L)): in [−1, 1], negative for keys
  after the query, so the MLP can tell the two sides apart. For keys at or before the
  query it is the paper's input, so one formula serves both stacks (causal masks hide the
  keys after the query)."""

  biases = True
  learned_bias = True
  EPS = 1e-6  # keeps the normaliser ψ(·) + EPS away from 0 (c → 0)

  @dataclasses.dataclass(frozen=True)
  class Settings:
    width: int = 32  # hidden units of the MLP f_θ
    init_c: float = 0.1  # c of ψ(x) = log(c·x + 1) at initialisation
    init_threshold: float = 512.0  # L at initialisation (positions below it: not rescaled)

    def __post_init__(self):
      check_ranges(self, width=AT_LEAST_1, init_c=POSITIVE, init_threshold=POSITIVE)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs):
    settings = settings or self.Settings()
    self.hidden = Dense(1, settings.width, rngs=rngs)
    self.output = Dense(settings.width, num_heads, rngs=rngs)
    self.c = nnx.Param(jnp.asarray(settings.init_c, jnp.float32))
    self.threshold_scale = nnx.Param(jnp.ones((), jnp.float32))
    self.init_threshold = settings.init_threshold

  def normalised_distance(self, q_positions, k_positions) -> jax.Array:
    """The MLP's input sign(i − j)·ψ(|i − j|) / ψ(max(i, j, L)): [b, q, k] float32."""
    i = q_positions[:, :, None].astype(jnp.float32)
    j = k_positions[:, None, :].astype(jnp.float32)
    c = jnp.abs(self.c[...])
    psi = lambda x: jnp.log1p(c * x)  # noqa: E731
    threshold = jnp.abs(self.threshold_scale[...] * self.init_threshold)
    return jnp.sign(i - j) * psi(jnp.abs(i - j)) / (
        psi(jnp.maximum(jnp.maximum(i, j), threshold)) + self.EPS)

  def bias(self, q_positions, k_positions):
    x = self.normalised_distance(q_positions, k_positions)[..., None]  # [b, q, k, 1]
    per_head = self.output(jax.nn.relu(self.hidden(x)))  # [b, q, k, h]
    return jnp.moveaxis(per_head, -1, 1)  # [b, h, q, k]


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"alibi": ALiBi, "t5": T5Bias, "kerple": Kerple, "fire": Fire}
