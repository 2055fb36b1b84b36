"""Relative positions as a logit bias (the `bias` seam): ALiBi, T5's buckets, KERPLE and
FIRE. Each declares its bias as a BiasSpec (one head's bias on a block of positions, from
that head's parameters), which bias() evaluates on whole arrays and the Pallas kernel on
blocks inside the kernel (transformer/model/kernels/pallas/attention.py), so the two cannot drift.
ALiBi, T5 and KERPLE declare `relative`: their bias is a function of the offset k − q alone,
so randomized positions can feed them sampled offsets (positions/randomized.py)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.core.fields import AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, check, check_ranges
from transformer.core.migration import changed
from transformer.model.layers import Dense
from transformer.model.positions.base import BiasSpec, PositionalEncoding


def _distance(q_positions, k_positions) -> jax.Array:
  """|i − j| of broadcastable positions (q [m, 1], k [1, n]): float32 [m, n]."""
  return jnp.abs(q_positions - k_positions).astype(jnp.float32)


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
  """Attention with linear biases: logits − m_h·|i − j| per head, no position embedding.

  A bidirectional (encoder) stack adds m_h·bidirectional_offset to the keys before the
  query: −m_h·(|i − j| − offset·[j < i]). Without it the bias is symmetric, and an encoder
  with ALiBi alone cannot tell a sequence from its reverse (its outputs reverse with the
  input). DeepMind's code for Delétang et al. 2023 and Ruoss et al. 2023 adds 0.5
  (models/positional_encodings.py, compute_alibi_encodings_biases), the default. A causal
  stack never sees keys after the query and adds none."""

  biases = True
  relative = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    max_bias: float = 8.0  # slopes 2^(-max_bias·h/n), h = 1..n: the last head's is 2^-max_bias
    # encoders: m_h·this added to the logits of keys before the query (0: symmetric, the
    # value of runs saved without this field)
    bidirectional_offset: float = changed(0.5, old=0.0)

    def __post_init__(self):
      check_ranges(self, max_bias=POSITIVE, bidirectional_offset=AT_LEAST_0)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    settings = settings or self.Settings()
    self.slopes = tuple(alibi_slopes(num_heads, settings.max_bias))
    self.offset = 0.0 if causal else settings.bidirectional_offset

  def bias_spec(self):
    slopes = jnp.asarray(self.slopes, jnp.float32)[:, None]  # [h, 1]
    return BiasSpec(functools.partial(alibi_bias, offset=self.offset), {"slope": slopes},
                    learned=False)


def alibi_bias(params, q_positions, k_positions, *, offset: float = 0.0):
  """One head's ALiBi bias −m·(|i − j| − offset·[j < i]): params {"slope": (m,)}, positions
  [m, 1] (or [m, n]), [1, n] -> [m, n]."""
  distance = _distance(q_positions, k_positions)
  if offset:  # keys before the query (a select: lowers in every kernel)
    distance = distance - jnp.where(k_positions < q_positions, offset, 0.0)
  return -params["slope"][0] * distance


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
  relative = True

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

  def bias_spec(self):
    fn = functools.partial(t5_bias, bidirectional=self.bidirectional,
                           max_distance=self.max_distance)
    dense = functools.partial(t5_dense_bias, bidirectional=self.bidirectional,
                              max_distance=self.max_distance)
    return BiasSpec(fn, {"table": self.table[...].T}, dense=dense,  # [h, num_buckets]
                    saturates_at=self.max_distance)


def t5_dense_bias(params, q_positions, k_positions, *, bidirectional: bool, max_distance: int):
  """T5's bias over whole arrays: positions broadcastable to [b, tq, tk] -> [b, h, tq, tk],
  a gather."""
  table = params["table"]  # [h, num_buckets]
  buckets = relative_position_bucket(k_positions - q_positions, bidirectional=bidirectional,
                                     num_buckets=table.shape[-1],
                                     max_distance=max_distance)  # [b, q, k]
  return jnp.moveaxis(table.T[buckets], -1, 1)


def t5_bias(params, q_positions, k_positions, *, bidirectional: bool, max_distance: int):
  """One head's T5 bias: params {"table": num_buckets scalars}, positions [m, 1], [1, n] ->
  [m, n]. The table lookup is a sum of selects over the buckets (no gather, which Pallas
  kernels lack)."""
  table = params["table"]
  buckets = relative_position_bucket(k_positions - q_positions, bidirectional=bidirectional,
                                     num_buckets=len(table), max_distance=max_distance)
  bias = jnp.zeros(buckets.shape, jnp.float32)
  for n in range(len(table)):
    bias = bias + jnp.where(buckets == n, table[n], 0.0)
  return bias


class Kerple(PositionalEncoding):
  """KERPLE's logarithmic kernel (Chi et al. 2022): logits − r₁·log(1 + r₂·|i − j|), with
  r₁, r₂ > 0 learned per head. They stay positive as exponentials of learned logs (the
  paper clamps them at 0.01 after each update, an optimizer hook pure model code has not);
  initialised uniformly in [0.01, max_init_r1] and [0.01, max_init_r2], the paper's
  U(0, 2) and U(0, 1) clamped at 0.01."""

  biases = True
  learned_bias = True
  relative = True

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

  def bias_spec(self):
    return BiasSpec(kerple_bias, {"r1": jnp.exp(self.log_r1[...])[:, None],
                                  "r2": jnp.exp(self.log_r2[...])[:, None]},  # [h, 1] each
                    grad=kerple_grad)


def kerple_bias(params, q_positions, k_positions):
  """One head's KERPLE bias −r₁·log(1 + r₂·|i − j|): params {"r1", "r2": (r,)}, positions
  [m, 1], [1, n] -> [m, n]."""
  return -params["r1"][0] * jnp.log1p(params["r2"][0] * _distance(q_positions, k_positions))


def kerple_grad(params, q_positions, k_positions, dbias):
  """The vjp of kerple_bias at dbias [m, n] as two sums over the block: d r₁ = −Σ dbias·
  log(1 + r₂·|i − j|), d r₂ = −r₁·Σ dbias·|i − j| / (1 + r₂·|i − j|): {"r1", "r2": (scalar,)}."""
  r1, r2 = params["r1"][0], params["r2"][0]
  distance = _distance(q_positions, k_positions)
  return {"r1": (-jnp.sum(dbias * jnp.log1p(r2 * distance)),),
          "r2": (-r1 * jnp.sum(dbias * distance / (1.0 + r2 * distance)),)}


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
    return fire_input(jnp.abs(self.c[...]), self._threshold(), q_positions[:, :, None],
                      k_positions[:, None, :])

  def _threshold(self):
    return jnp.abs(self.threshold_scale[...] * self.init_threshold)

  def bias_spec(self):
    h = self.output.out_features
    shared = lambda x: jnp.broadcast_to(jnp.reshape(x, (1, -1)), (h, jnp.size(x)))  # noqa: E731
    return BiasSpec(fire_bias, {
        "c": shared(jnp.abs(self.c[...])), "threshold": shared(self._threshold()),
        "w1": shared(self.hidden.kernel[...]), "b1": shared(self.hidden.bias[...]),
        "w2": self.output.kernel[...].T, "b2": self.output.bias[...][:, None]},
        dense=fire_dense_bias, mlp_input=fire_mlp_input)


def fire_input(c, threshold, q_positions, k_positions) -> jax.Array:
  """FIRE's MLP input sign(i − j)·ψ(|i − j|) / ψ(max(i, j, L)), ψ(x) = log(1 + c·x), for
  broadcastable positions i, j: float32."""
  i, j = q_positions.astype(jnp.float32), k_positions.astype(jnp.float32)
  psi = lambda x: jnp.log1p(c * x)  # noqa: E731
  # sign(i − j) by selects: Mosaic TPU lowers jnp.sign only with a TPU at hand
  sign = jnp.where(i > j, 1.0, jnp.where(i < j, -1.0, 0.0))
  # ψ(max(i, j, L)) as ψ(max(i, L)) where i ≥ j, else ψ(max(j, L)): the same bits, with the
  # logarithms taken on the rows and the columns (m + n per [m, n] block, not m·n)
  norm = jnp.where(i >= j, psi(jnp.maximum(i, threshold)), psi(jnp.maximum(j, threshold)))
  return sign * psi(jnp.abs(i - j)) / (norm + Fire.EPS)


def fire_mlp_input(params, q_positions, k_positions):
  """One head's FIRE MLP input (fire_input) from its parameters "c", "threshold" (1
  scalar each): positions [m, 1], [1, n] -> [m, n]."""
  return fire_input(params["c"][0], params["threshold"][0], q_positions, k_positions)


def fire_bias(params, q_positions, k_positions):
  """One head's FIRE bias f_θ(input): params {"c", "threshold", "b2": 1 scalar; "w1", "b1",
  "w2": width scalars}, positions [m, 1], [1, n] -> [m, n]. The MLP as a sum over its hidden
  units, so no [m, n, width] array; its ReLU as a select (jax.nn.relu is a custom_jvp
  function, which not every kernel lowering takes), with relu's gradient (0 at 0)."""
  x = fire_mlp_input(params, q_positions, k_positions)
  w1, b1, w2 = params["w1"], params["b1"], params["w2"]
  bias = jnp.zeros(x.shape, jnp.float32) + params["b2"][0]
  for u in range(len(w1)):
    hidden = x * w1[u] + b1[u]
    bias = bias + jnp.where(hidden > 0, hidden, 0.0) * w2[u]
  return bias


def fire_dense_bias(params, q_positions, k_positions):
  """FIRE's bias over whole arrays: positions broadcastable to [b, tq, tk] -> [b, h, tq, tk],
  the MLP as matmuls. The shared parameters are read from head 0's row of their broadcast
  (the broadcast's gradient sums into the parameter all the same)."""
  x = fire_input(params["c"][0, 0], params["threshold"][0, 0], q_positions,
                 k_positions)[..., None]  # [b, q, k, 1]
  hidden = jax.nn.relu(x * params["w1"][0] + params["b1"][0])  # [b, q, k, width]
  return jnp.moveaxis(hidden @ params["w2"].T + params["b2"][:, 0], -1, 1)


# The registry entries of this module (positions.POSITIONS).
ENCODINGS = {"alibi": ALiBi, "t5": T5Bias, "kerple": Kerple, "fire": Fire}
