"""The layers of every model family (transformer/model/families.py): an encoder layer
(self-attention and feed-forward, each in a residual block), a decoder layer (and
cross-attention), the decoder-only layer (causal self-attention). The model's config is in
model/config.py, residual placement in residual.py, stacks in stack.py, embeddings in
embeddings.py, pooling in pooling.py, the feed-forward layers in feedforward.py.

Pure model code: a frozen ModelConfig in, NNX modules out; no file I/O, no flags. The
pluggable parts (attention score, window, positional encoding, residual placement, norm,
feed-forward layer) are chosen once, in constructors, from their registries.
"""

from flax import nnx

from transformer.core.registry import lookup
from transformer.model.attention import AttentionConfig, MultiHeadAttention
from transformer.model.config import ModelConfig, compute_dtype
from transformer.model.data_biases import outside_causal
from transformer.model.feedforward import FFNS
from transformer.model.positions import PositionalEncoding
from transformer.model.residual import RESIDUALS, PostNorm

# --------------------------------------------------------------------------- residual blocks


def residual_block(cfg: ModelConfig, rngs: nnx.Rngs) -> PostNorm:
  residual = lookup(RESIDUALS, cfg.norm, "norm")
  return residual(cfg.d_model, cfg.dropout, norm=cfg.norm_type, dtype=compute_dtype(cfg),
                  rngs=rngs)


def feed_forward(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The feed-forward layer FFNS[cfg.ffn] of width cfg.d_ff."""
  ffn = lookup(FFNS, cfg.ffn, "ffn")
  return ffn(cfg.d_model, cfg.d_ff, dtype=compute_dtype(cfg), rngs=rngs)


# The identity encoding: cross-attention relates two different sequences' positions.
NO_POSITION = PositionalEncoding()


class EncoderLayer(nnx.Module):

  causal = False  # its self-attention sees keys after the query

  def __init__(self, cfg: ModelConfig, *, encoding: PositionalEncoding | None = None,
               attention: AttentionConfig | None = None, depth: int = 0, rngs: nnx.Rngs):
    """encoding: the one its self-attention will be handed (the stack's, or under a
    layer-wise pattern this layer's entry's); attention: this layer's attention config
    (default cfg.attention; a pattern's stack gives each layer its window); depth: its
    index in the stack."""
    dtype = compute_dtype(cfg)
    attention = attention or cfg.attention
    self.self_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads, attention,
                                             dtype=dtype, num_kv_heads=cfg.num_kv_heads,
                                             encoding=encoding, causal=self.causal,
                                             max_len=cfg.max_len, depth=depth, rngs=rngs)
    self.attention_block = residual_block(cfg, rngs)
    self.ffn = feed_forward(cfg, rngs)
    self.ffn_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class DecoderLayer(EncoderLayer):

  causal = True  # its self-attention never sees keys after the query

  def __init__(self, cfg: ModelConfig, *, encoding: PositionalEncoding | None = None,
               attention: AttentionConfig | None = None, depth: int = 0, rngs: nnx.Rngs):
    super().__init__(cfg, encoding=encoding, attention=attention, depth=depth, rngs=rngs)
    self.cross_attention = MultiHeadAttention(cfg.d_model, cfg.num_heads,
                                              outside_causal(attention or cfg.attention),
                                              dtype=compute_dtype(cfg),
                                              num_kv_heads=cfg.num_kv_heads, cross=True,
                                              max_len=cfg.max_len, depth=depth, rngs=rngs)
    self.cross_block = residual_block(cfg, rngs)

  def __call__(self, x, mask, encoding, rngs, *, encoded, cross_mask):
    attend = lambda y: self.self_attention.self_attend(y, mask, encoding, rngs)  # noqa: E731
    x = self.attention_block(x, attend, rngs)
    cross = lambda y: self.cross_attention.cross_attend(  # noqa: E731
        y, encoded, cross_mask, NO_POSITION, rngs)
    x = self.cross_block(x, cross, rngs)
    return self.ffn_block(x, self.ffn, rngs)


class CausalLayer(EncoderLayer):
  """The decoder-only layer: causal self-attention and the FFN, no cross-attention."""

  causal = True


