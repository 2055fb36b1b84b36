"""The model's config: `config.model` as a frozen dataclass (ModelConfig) and the compute
dtypes. Every model module takes a ModelConfig (or the fields it needs); its __post_init__
checks each choice against its registry."""

import dataclasses

import jax.numpy as jnp

from transformer.core.fields import (AT_LEAST_1, FRACTION, USED_IF, check, check_ranges, derived,
                                     execution)
from transformer.core.migration import changed
from transformer.core.registry import lookup
from transformer.model import layer_pattern
from transformer.model.attention import AttentionConfig
from transformer.model.feedforward import FFNS
from transformer.model.layers import NORMS
from transformer.model.pooling import POOLINGS
from transformer.model.positions import (PositionSettings, check_position,
                                         check_random_positions)
from transformer.model.residual import RESIDUALS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """config.model; vocab_size and num_classes are set from the data source."""

  vocab_size: int = derived()
  d_model: int = 512
  num_heads: int = 8
  # key/value heads: 0 = num_heads (multi-head), 1 = multi-query, else a divisor of num_heads
  # (grouped-query attention: query head i reads kv head i // (num_heads / num_kv_heads))
  num_kv_heads: int = 0
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout: float = 0.1  # on embeddings+positions and on every sublayer output
  # a key of positions.POSITIONS, or a layer-wise pattern of them joined by '+', cycled
  # over each stack's layers (`rotary+rotary+rotary+none`: model/layer_pattern.py)
  position: str = "sinusoidal"
  max_len: int = 512  # longest sequence the `learned` table covers
  # Randomized positions (Ruoss et al. 2023; positions/randomized.py): each sequence's
  # positions a sorted random sample of [0, max_position), in training and evaluation alike.
  random_positions: bool = False
  max_position: int = 2048  # random_positions: the range drawn from (and the learned table's rows)
  # random_positions: a key of positions/randomized.py's DRAWS, how they are drawn:
  # per_batch (Ruoss et al.'s code: per batch, per layer, relative encodings at sampled
  # offsets) or per_row (what runs saved without this field drew)
  random_positions_draw: str = changed("per_batch", old="per_row",
                                       metadata={USED_IF: "random_positions"})
  norm: str = "post"  # a key of RESIDUALS: LayerNorm(x + f(x)) or x + f(LayerNorm(x))
  norm_type: str = "layernorm"  # a key of layers.NORMS: every norm of the model
  ffn: str = "relu"  # a key of feedforward.FFNS; d_ff is every variant's hidden width
  share_embeddings: bool = True  # one matrix for source, target and pre-softmax projection
  # a key of DTYPES: the computation's; parameters are always float32
  dtype: str = execution("float32")
  remat: bool = execution(False)  # recompute each layer's activations in the backward pass
  scan_layers: bool = execution(False)  # each stack's layers as one lax.scan: compiled once
  attention: AttentionConfig = AttentionConfig()
  # Each encoding's own knobs (`position_settings.alibi.max_bias`, ...): every section is
  # checked, the chosen encodings' are used (and are the run's identity).
  position_settings: PositionSettings = dataclasses.field(
      default_factory=PositionSettings, metadata={"chosen_by": "positions"})
  arch: str = "encoder_decoder"  # a key of families.ARCHS: encoder_decoder | encoder | decoder
  pooling: str = "none"  # a key of POOLINGS (encoder): none (a label per token) | cls | mean
  num_classes: int = derived(0)  # outputs of the encoder's head

  def __post_init__(self):
    check_ranges(self, vocab_size=AT_LEAST_1, d_model=AT_LEAST_1, num_heads=AT_LEAST_1,
                 d_ff=AT_LEAST_1, num_encoder_layers=AT_LEAST_1, num_decoder_layers=AT_LEAST_1,
                 dropout=FRACTION, max_len=AT_LEAST_1, max_position=AT_LEAST_1)
    check(self.d_model % self.num_heads == 0, "num_heads", self.num_heads,
          f"a divisor of d_model ({self.d_model})")
    check(self.num_kv_heads >= 0 and self.num_heads % (self.num_kv_heads or self.num_heads) == 0,
          "num_kv_heads", self.num_kv_heads,
          f"0 (= num_heads) or a divisor of num_heads ({self.num_heads})")
    if self.num_kv_heads == 0:  # one spelling of multi-head attention: the run's identity
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    check_random_positions(self, check_position(self.position))
    lookup(RESIDUALS, self.norm, "norm")
    lookup(NORMS, self.norm_type, "norm_type")
    lookup(FFNS, self.ffn, "ffn")
    lookup(DTYPES, self.dtype, "model dtype")
    lookup(POOLINGS, self.pooling, "model pooling")

  @property
  def positions(self) -> tuple[str, ...]:
    """The encodings `position` names, each once, in the order it first names them."""
    return tuple(dict.fromkeys(layer_pattern.entries(self.position)))

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

def compute_dtype(cfg: ModelConfig):
  return lookup(DTYPES, cfg.dtype, "model dtype")
