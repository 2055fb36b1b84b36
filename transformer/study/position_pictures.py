"""Pictures of a model's positional encodings: what each encoding does at each of its seams
(the vector it adds, its rotation, its logit bias) over positions 0..L-1, as heatmaps in
positions.png (pictures.draw writes it beside the attention maps)."""

import jax.numpy as jnp
import numpy as np

from transformer.model.positions import PositionalEncoding
from transformer.study.figures import pyplot, save


def position_panels(encoding: PositionalEncoding, length: int, d_model: int,
                    num_heads: int) -> list[tuple[str, np.ndarray]]:
  """What an encoding does at each of its seams, over positions 0..length-1, as titled
  [rows, columns] arrays; empty for the identity (`none`)."""
  positions = jnp.arange(length, dtype=jnp.int32)[None]
  panels = []
  added = np.asarray(encoding.embed(jnp.zeros((1, length, d_model)), positions)[0])
  if np.any(added):
    panels += [("embed: vector added at position p [p, feature]", added),
               ("cosine similarity of those vectors [p, p']", _cosine(added))]
  head_dim = d_model // num_heads
  ones = jnp.ones((1, length, 1, head_dim))
  queries = np.asarray(encoding.rotate_queries(ones, positions)[0, :, 0])
  keys = np.asarray(encoding.rotate_keys(ones, positions)[0, :, 0])
  if not (np.allclose(queries, 1.0) and np.allclose(keys, 1.0)):
    panels += [("rotate: a query of ones at p [p, feature]", queries),
               ("⟨rot_q(1, p), rot_k(1, p')⟩ / d [p, p']", queries @ keys.T / head_dim)]
  bias = np.asarray(jnp.broadcast_to(encoding.bias(positions, positions),
                                     (1, num_heads, length, length))[0])
  if np.any(bias):
    panels += [(f"bias head {h} [query, key]", bias[h]) for h in range(num_heads)]
  return panels


def _cosine(x: np.ndarray) -> np.ndarray:
  unit = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
  return unit @ unit.T


def draw_positions(model, length: int, path: str) -> str | None:
  """positions.png: each stack's position panels (encoder, decoder; under a layer-wise
  pattern a row per entry); None for `none`."""
  cfg = model.cfg
  rows = [(name if len(stack.encodings()) == 1 else f"{name} {entry}",
           position_panels(encoding, length, cfg.d_model, cfg.num_heads))
          for name, stack in model.stacks().items()
          for entry, encoding in stack.encodings().items()]
  rows = [(name, panels) for name, panels in rows if panels]
  if not rows:
    return None
  plt = pyplot()
  columns = max(len(panels) for _, panels in rows)
  fig, axes = plt.subplots(len(rows), columns, figsize=(3.6 * columns, 3.4 * len(rows)),
                           squeeze=False)
  for r, (name, panels) in enumerate(rows):
    for c in range(columns):
      ax = axes[r, c]
      if c >= len(panels):
        ax.axis("off")
        continue
      title, values = panels[c]
      image = ax.imshow(values, aspect="auto", cmap="RdBu_r", interpolation="nearest")
      fig.colorbar(image, ax=ax, fraction=0.046)
      ax.set_title(f"{name} {title}", fontsize=7)
  fig.suptitle(f"position '{cfg.position}', positions 0..{length - 1}")
  fig.tight_layout()
  save(fig, path, dpi=110)
  return path
