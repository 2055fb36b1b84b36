"""Positional encodings, keyed by config string.

An encoding acts at up to four seams, and the layers call all of them on every encoding:
  * `embed(x, positions)`: added to the scaled token embeddings (sinusoidal, learned);
  * `rotate_queries(x, positions)` and `rotate_keys(x, positions)`: applied to the queries
    and to the keys of every self-attention layer (rotary; xPos, which scales queries up and
    keys down);
  * `bias(q_positions, k_positions)`: added to the attention logits (ALiBi, T5 buckets,
    KERPLE, FIRE); an encoding that adds one declares `biases = True`;
  * `content_bias(q, logits)`: added to the attention logits too, but a function of the
    queries and of the logits before it (CoPE, whose positions count the keys the query
    attends to); an encoding that adds one declares `content_biases = True`, and only the
    kernels declaring `content_bias` (transformer/kernels.py) can add it, since it needs
    each query's whole row of logits.
The base class is the identity at each seam; built without arguments it is the identity
encoding. Every registry entry has one constructor, `(d_model, num_heads, max_len, *, causal,
settings, rngs)` (causal: it serves a decoder, whose keys never follow the query), and its
knobs in its own `Settings` (config.model.position_settings.<name>). An encoding defined
only where keys never follow the query declares `causal_only = True`, and
make_positional_encoding refuses it for a bidirectional (encoder) stack.

Positions are explicit int arrays [batch, length] (0-based within each packed segment),
never inferred from array indices, so packing and cached decoding see the right positions.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.errors import ConfigError
from transformer.fields import AT_LEAST_1, POSITIVE, Range, check, check_ranges
from transformer.layers import Dense
from transformer.registry import NoSettings, lookup, settings_of, settings_sections

ABOVE_1 = Range(1, lo_open=True)


class PositionalEncoding(nnx.Module):
  """No positional information: the identity at every seam."""

  Settings = NoSettings
  biases = False  # bias() is not zero: the attention kernel must add it
  content_biases = False  # content_bias() is not zero: only a kernel declaring content_bias adds it
  causal_only = False  # defined only for causal self-attention: no encoder stack may use it

  def embed(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [b, t, d_model], positions: [b, t] -> [b, t, d_model]."""
    del positions
    return x

  def rotate_queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Queries x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def rotate_keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Keys x: [b, t, h, d], positions: [b, t] -> [b, t, h, d]."""
    del positions
    return x

  def check_length(self, length: int) -> None:
    """Raises ConfigError if sequences of `length` tokens cannot be encoded."""

  def bias(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """-> a logit bias broadcastable to [b, h, tq, tk]."""
    del q_positions, k_positions
    return jnp.zeros((), jnp.float32)

  def content_bias(self, q: jax.Array, logits: jax.Array) -> jax.Array:
    """A logit bias that depends on content, added after bias().

    Args:
      q: the per-head queries as the scorer saw them (rotated), [b, tq, h, d].
      logits: the scorer's logits plus bias(), float32 [b, h, tq, tk], −inf at masked keys.
    Returns:
      a logit bias broadcastable to [b, h, tq, tk].
    """
    del q, logits
    return jnp.zeros((), jnp.float32)


class NoPosition(PositionalEncoding):
  """`none`: the identity encoding, built like every registry entry."""

  def __init__(self, d_model: int, num_heads: int, max_len: int, *, causal: bool = False,
               settings=None, rngs: nnx.Rngs | None = None):
    del d_model, num_heads, max_len, causal, settings, rngs


def sinusoid(positions: jax.Array, dim: int) -> jax.Array:
  """The paper's table: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same).

  Args:
    positions: int or float array of any shape [...].
    dim: even feature size d.
  Returns:
    [..., dim] float32, sin and cos interleaved.
  """
  inv_freq = 10000.0 ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [d/2]
  angles = positions[..., None].astype(jnp.float32) * inv_freq
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, dim)


class Sinusoidal(PositionalEncoding):
  """Fixed sinusoids added to the embeddings ("Attention Is All You Need", 3.5)."""

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    if d_model % 2:
      raise ConfigError(f"sinusoidal positions need an even d_model, got {d_model}")
    self.d_model = d_model

  def embed(self, x, positions):
    return x + sinusoid(positions, self.d_model).astype(x.dtype)


class Learned(PositionalEncoding):
  """A learned absolute embedding per position 0..max_len-1."""

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs):
    self.max_len = max_len
    self.table = nnx.Embed(max_len, d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)

  def check_length(self, length):
    if length > self.max_len:
      raise ConfigError(
          f"sequence length {length} exceeds the learned position table "
          f"(model.max_len={self.max_len}); raise model.max_len or use another position")

  def embed(self, x, positions):
    self.check_length(x.shape[1])
    return x + self.table(positions).astype(x.dtype)


def rotate_half_pairs(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """RoPE (Su et al. 2021): rotates feature pairs (x_i, x_{i+d/2}) by angle p·base^(-2i/d).

  Args:
    x: [b, t, h, d] with d even.
    positions: [b, t].
  Returns:
    [b, t, h, d], so that <rot(q, m), rot(k, n)> depends on m - n only.
  """
  d = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [d/2]
  angles = positions[:, :, None, None].astype(jnp.float32) * inv_freq  # [b, t, 1, d/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Rotary(PositionalEncoding):
  """Rotary position embedding applied to q and k in every self-attention layer."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    base: float = 10000.0  # pair i turns by angle p · base^(-2i/d)

    def __post_init__(self):
      check_ranges(self, base=ABOVE_1)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    head_dim = d_model // num_heads
    if head_dim % 2:
      raise ConfigError(f"rotary positions need an even head dimension, got {head_dim}")
    self.base = (settings or self.Settings()).base

  def rotate_queries(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)

  def rotate_keys(self, x, positions):
    return rotate_half_pairs(x, positions, self.base)


def xpos_scale(positions: jax.Array, dim: int, *, gamma: float, scale_base: float) -> jax.Array:
  """xPos's factor ζ_i^(p / scale_base) of feature pair i at position p, with
  ζ_i = (2i/d + γ)/(1 + γ), laid out as rotate_half_pairs pairs features (i and i + d/2).

  Args:
    positions: [b, t] (int or float; may be shifted or negated).
    dim: the even head dimension d.
  Returns:
    [b, t, 1, d] float32.
  """
  zeta = (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim + gamma) / (1.0 + gamma)  # [d/2]
  power = positions[:, :, None, None].astype(jnp.float32) / scale_base  # [b, t, 1, 1]
  scale = jnp.exp(power * jnp.log(zeta))  # [b, t, 1, d/2]
  return jnp.concatenate([scale, scale], axis=-1)


class XPos(Rotary):
  """xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): rotary, with the query
  at position n scaled by ζ_i^((n − o)/scale_base) and the key at m by ζ_i^(−(m − o)/scale_base)
  per feature pair i, so each pair's term of q·k carries ζ_i^((n − m)/scale_base): an
  exponential decay with distance (keys before the query), fastest for the high-frequency
  pairs (ζ_0 = γ/(1 + γ)). The offset o = max_len // 2 cancels in every q·k, so scores
  depend on n − m only; it centres the exponents (as torchscale centres them on the block)
  so that both factors stay finite in float32 for |p − o| up to about 36,000 positions.
  Bidirectional (encoder) the same formula: keys after the query get the inverse factor
  (the paper trains causal models only)."""

  @dataclasses.dataclass(frozen=True)
  class Settings:
    base: float = 10000.0  # the rotary angles', as `rotary`
    scale_base: float = 512.0  # the decay's length scale: ζ^(distance / scale_base)
    gamma: float = 0.4  # ζ_i = (2i/d + γ)/(1 + γ)

    def __post_init__(self):
      check_ranges(self, base=ABOVE_1, scale_base=POSITIVE, gamma=POSITIVE)

  def __init__(self, d_model, num_heads, max_len, *, causal=False, settings=None, rngs=None):
    settings = settings or self.Settings()
    super().__init__(d_model, num_heads, max_len, causal=causal, settings=settings, rngs=rngs)
    self.scale_base, self.gamma, self.offset = settings.scale_base, settings.gamma, max_len // 2

  def _rotate(self, x, positions, sign: float):
    rotated = rotate_half_pairs(x.astype(jnp.float32), positions, self.base)
    scale = xpos_scale(sign * (positions - self.offset), x.shape[-1], gamma=self.gamma,
                       scale_base=self.scale_base)
    return (rotated * scale).astype(x.dtype)

  def rotate_queries(self, x, positions):
    return self._rotate(x, positions, 1.0)

  def rotate_keys(self, x, positions):
    return self._rotate(x, positions, -1.0)


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


class CoPE(PositionalEncoding):
  """CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's
  Important"): positions that count what the query attends to, not tokens. Query i gates
  each key t by g_it = σ(logit_it), its attention logit (0 at masked keys, whose logit is
  −inf), and measures the position of key j as the gates from j to i,
  p_ij = Σ_{t=j..i} g_it, capped at max_positions − 1. The logit of (i, j) gains q_i·e[p_ij],
  with e learned for the integer positions 0..max_positions−1 and interpolated linearly
  between e[⌊p⌋] and e[⌈p⌉]; as in the paper, q_i·e[n] is computed once per integer n and
  the interpolation mixes those dot products (the same value, far less work).

  Per head, from one table E [head_dim, max_positions] that the heads share, as in the
  paper, and that the layers of the stack share, as those of T5, KERPLE and FIRE do (the
  paper has a table per layer: the seams do not say which layer calls them). E starts at
  zero, the paper's initialisation, so a new model attends as with no positions and learns
  what to count. The gates use the layer's scorer's logits (q·k/√d for scaled_dot), and
  q·e is added unscaled, as in the paper's listing (the authors' released code scales the
  sum q·k + q·e by 1/√d instead).

  Causal only: the paper defines p_ij for keys at or before the query (a decoder's); a
  bidirectional stack's keys after the query would get no position. The bias needs each
  query's whole row of logits, which only the kernels declaring content_bias have.
  Positions are capped, so no sequence is too long for it."""

  content_biases = True
  causal_only = True

  @dataclasses.dataclass(frozen=True)
  class Settings:
    # Positions told apart: counts 0..63 of whatever the gates count (tokens, words,
    # sentences), beyond which all share E's last row. Small, as the paper's cap is in its
    # experiments: a query rarely needs to count far, and the cap bounds the product q·E
    # [b, h, t, max_positions] every layer computes.
    max_positions: int = 64

    def __post_init__(self):
      check_ranges(self, max_positions=Range(2))

  def __init__(self, d_model, num_heads, max_len, *, causal=True, settings=None, rngs=None):
    del max_len, causal, rngs  # make_positional_encoding refuses causal=False (causal_only)
    self.max_positions = (settings or self.Settings()).max_positions
    self.table = nnx.Param(jnp.zeros((d_model // num_heads, self.max_positions), jnp.float32))

  def positions(self, logits: jax.Array) -> jax.Array:
    """p_ij = min(Σ_{t ≥ j} σ(logit_it), max_positions − 1): [b, h, tq, tk] float32. The
    sum runs over every key from j on; those after the query are masked (gate 0)."""
    gates = jax.nn.sigmoid(logits)
    return jnp.minimum(jax.lax.cumsum(gates, axis=3, reverse=True), self.max_positions - 1)

  def content_bias(self, q, logits):
    p = self.positions(logits)
    per_position = jnp.einsum("bqhd,dn->bhqn", q.astype(jnp.float32), self.table[...])
    at = lambda n: jnp.take_along_axis(per_position, n.astype(jnp.int32), axis=3)  # noqa: E731
    below = jnp.floor(p)
    above_weight = p - below  # the gradient reaches p (and the gates) through this weight
    return above_weight * at(jnp.ceil(p)) + (1.0 - above_weight) * at(below)


POSITIONS: dict[str, type[PositionalEncoding]] = {
    "none": NoPosition,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "rotary": Rotary,
    "alibi": ALiBi,
    "t5": T5Bias,
    "xpos": XPos,
    "kerple": Kerple,
    "fire": Fire,
    "cope": CoPE,
}

# config.model.position_settings: a section per encoding with settings.
PositionSettings = settings_sections(POSITIONS, "PositionSettings")


def make_positional_encoding(name: str, d_model: int, num_heads: int, max_len: int, *,
                             causal: bool = False, settings=None,
                             rngs: nnx.Rngs | None) -> PositionalEncoding:
  """The encoding `name` with its section of `settings` (a PositionSettings; None: defaults),
  for a causal (decoder) or bidirectional (encoder) stack: a ConfigError if the encoding is
  defined for causal self-attention only and the stack is bidirectional."""
  cls = lookup(POSITIONS, name, "position")
  if cls.causal_only and not causal:
    raise ConfigError(
        f"position {name!r} is defined for causal self-attention only (decoder stacks; keys "
        "never after the query), and this model has a bidirectional (encoder) stack: use "
        "model.arch=decoder or another position")
  return cls(d_model, num_heads, max_len, causal=causal,
             settings=settings_of(settings, POSITIONS, name), rngs=rngs)
