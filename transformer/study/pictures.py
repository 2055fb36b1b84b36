"""Pictures of a trained model: attention maps for given sentences and positional-encoding
heatmaps (transformer/study/position_pictures.py), as PNG files (eval.py --sentence ...
--plot_dir DIR).

Attention maps come from a teacher-forced pass over (sentence, the model's greedy
translation of it, or a sampled one: eval.py --temperature) in which every attention layer's
kernel is replaced by one that records the weights, computed by the formula whatever the
run's kernel, and each kind (encoder self, decoder self, cross) is drawn as a grid of
layers × heads with the tokens on the axes. The attention layers themselves know nothing of
pictures.
"""

import functools
import logging
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.core.vocab import BOS_ID, EOS_ID
from transformer.data.base import Split
from transformer.data.pipeline import pad_batch
from transformer.model.attention import MultiHeadAttention
from transformer.model.kernels import attention_weights as formula_weights
from transformer.model.kernels import repeat_heads
from transformer.model.sampling import GREEDY, Sampling
from transformer.model.stack import Stack
from transformer.run.restored_run import RestoredRun, sentence_predictions
from transformer.run.evaluator import Evaluator
from transformer.study.figures import pyplot, save
from transformer.study.position_pictures import draw_positions

KINDS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
         "cross": "decoder-encoder (cross) attention"}
MAX_LABELS = 48  # more tokens than this: no tick labels
_PICTURE = re.compile(rf"attention_\d+_({'|'.join(KINDS)})\.png|positions\.png")
log = logging.getLogger("transformer")


def check_writable(run: RestoredRun, sentences: list[str], plot_dir: str) -> None:
  """A ConfigError, before any work, for a sentence the run cannot encode or a plot_dir
  that cannot be written."""
  for sentence in sentences:
    run.experiment.source.encode(sentence)
  problem = storage.writable_directory(plot_dir)
  if problem:
    raise ConfigError(f"cannot write pictures into {plot_dir}: {problem}; give another "
                      "--plot_dir")


def decode_sentences(run: RestoredRun, sentences: list[str], sampling: Sampling = GREEDY,
                     seed: int = 0) -> list[np.ndarray]:
  """Each sentence's output from a family that decodes, as its evaluation decodes (greedy,
  or drawn as `sampling` says from `seed`): token ids up to and including EOS."""
  exp = run.experiment
  encoded = [exp.source.encode(s) for s in sentences]
  length = max(len(e) for e in encoded)
  split = Split(pad_batch([(e, np.zeros_like(e)) for e in encoded], length))
  evaluator = Evaluator(exp, sampling=sampling, seed=seed)
  predictions = evaluator.predict(run.params, split.arrays, exp.source.decode_length(split))
  return [_until_eos(p) for p in predictions]


def draw(run: RestoredRun, sentences: list[str], plot_dir: str, captions: list[str] | None = None,
         sampling: Sampling = GREEDY, seed: int = 0,
         outputs: list[np.ndarray] | None = None) -> list[str]:
  """Writes into plot_dir the attention maps of `sentences` and positions.png for a run
  restored by restored_run.restore_run, in place of the pictures an earlier draw left there
  (earlier_pictures). A family that does not decode has each sentence's prediction in its
  titles: `captions`, or restored_run.sentence_predictions; one that decodes draws them against
  their `outputs` (decode_sentences: greedy, or drawn as `sampling` says from `seed`, when
  not given). Returns the paths written."""
  exp = run.experiment
  check_writable(run, sentences, plot_dir)  # a bad sentence fails before any writing
  encoded = [exp.source.encode(s) for s in sentences]
  epath.Path(plot_dir).mkdir(parents=True, exist_ok=True)
  earlier = earlier_pictures(plot_dir)
  for path in earlier:
    path.unlink(missing_ok=True)
  if earlier:
    log.info("removed %d pictures of an earlier draw from %s", len(earlier), plot_dir)
  model = nnx.merge(exp.graphdef, run.params)
  paths = []
  if sentences and exp.family.decodes:  # attention from what is decoded to the sentence
    outputs = outputs or decode_sentences(run, sentences, sampling, seed)
    paths += draw_attention(model, exp.source, outputs, sentences, encoded, plot_dir)
  elif sentences:  # one sequence, nothing decoded
    captions = captions or sentence_predictions(run, sentences)
    paths += draw_self_attention(model, exp.source, sentences, encoded, plot_dir, captions)
  length = exp.model.max_len
  if exp.model.random_positions:  # positions are drawn from [0, max_position)
    length = min(length, exp.model.max_position)
  positions = draw_positions(model, length, storage.join(plot_dir, "positions.png"))
  return paths + ([positions] if positions else [])


def earlier_pictures(plot_dir: str) -> list[epath.Path]:
  """The files in plot_dir named as draw names what it writes (attention_I_KIND.png,
  positions.png): another draw's, which would otherwise be taken for this one's (a
  sentence fewer, a stack the model no longer has). Other files are not this code's."""
  folder = epath.Path(plot_dir)
  if not folder.is_dir():
    return []
  return sorted(path for path in folder.iterdir() if _PICTURE.fullmatch(path.name))


def recording_kernel(layer: MultiHeadAttention):
  """A kernel for `layer` that computes the attention weights by the formula
  (reference_attention.attention_weights: every seam of the encoding, whatever the run's
  kernel), sows them on the layer as nnx.Intermediate `weights` [b, h, tq, tk] and returns
  their output, the reference kernel's without dropout (pictures are deterministic)."""

  def kernel(q, k, v, mask, encoding, score, dropout, rngs, normalizer=None):
    del dropout, rngs
    weights = formula_weights(q, k, mask, encoding, score, layer.logit_softcap, normalizer)
    layer.sow(nnx.Intermediate, "weights", weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), repeat_heads(v, q.shape[2]))

  return kernel


@functools.partial(jax.jit, static_argnums=0)
def _capture(graphdef, state, batch):
  """The nnx.Intermediate state sown by a pass over `batch` of a copy of the model whose
  attention layers record their weights; the caller's model is never changed."""
  model = nnx.merge(graphdef, state)
  # A recording kernel sows on its layer, which a scan or a remat would run as a copy (what
  # is sown there stays there): the copy runs its layers one by one, as they are.
  model.set_attributes(Stack, scan_layers=False, remat=False)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, MultiHeadAttention):
      module.kernel = recording_kernel(module)
  return nnx.capture(model, nnx.Intermediate)(batch)[1]


def attention_weights(model, batch: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
  """Teacher-forced pass recording every attention layer's weights:
  {"encoder" | "decoder" | "cross": [per layer, [b, h, tq, tk]]}."""
  graphdef, state = nnx.split(model)
  sown = _capture(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()})
  layers = lambda stack, name: [np.asarray(layer[name]["weights"].get_value()[0])  # noqa: E731
                                for _, layer in sorted(sown[stack]["layers"].items())
                                if name in layer]
  kinds = {"encoder": ("encoder", "self_attention"), "decoder": ("decoder", "self_attention"),
           "cross": ("decoder", "cross_attention")}
  weights = {kind: layers(stack, name) for kind, (stack, name) in kinds.items() if stack in sown}
  return {kind: maps for kind, maps in weights.items() if maps}


def _until_eos(ids: np.ndarray) -> np.ndarray:
  ids = np.asarray(ids)
  ends = np.flatnonzero(ids == EOS_ID)
  return ids[:ends[0] + 1] if len(ends) else ids


def draw_attention(model, source, outputs: list[np.ndarray], sentences: list[str],
                   encoded: list[np.ndarray], plot_dir: str) -> list[str]:
  """For each sentence i (token ids `encoded[i]`) and its decoded output (`outputs[i]`:
  decode_sentences), writes attention_{i}_{kind}.png for the three kinds of attention.
  Returns the paths."""
  length = max(len(e) for e in encoded)
  pairs = list(zip(encoded, outputs))
  batch = pad_batch(pairs, max(length, max(len(t) for _, t in pairs)))
  weights = attention_weights(model, batch)
  paths = []
  for i, (src, tgt) in enumerate(pairs):
    decoder_inputs = np.concatenate([[BOS_ID], tgt[:-1]])  # the outputs shifted right
    axes = {"encoder": (src, src), "decoder": (tgt, decoder_inputs), "cross": (tgt, src)}
    for kind, (queries, keys) in axes.items():
      maps = [w[i, :, :len(queries), :len(keys)] for w in weights[kind]]
      path = storage.join(plot_dir, f"attention_{i}_{kind}.png")
      title = (f"{KINDS[kind]}: layers × heads\n{sentences[i]!r} → "
               f"{' '.join(source.pieces(tgt))}")
      _grid(maps, source.pieces(queries), source.pieces(keys), title, path,
            xlabel="key", ylabel="query (output token)" if kind != "encoder" else "query")
      paths.append(path)
  return paths


def draw_self_attention(model, source, sentences: list[str], encoded: list[np.ndarray],
                        plot_dir: str, captions: list[str] | None = None) -> list[str]:
  """For an encoder-only or decoder-only model: attention_{i}_{stack}.png of each sentence
  (a labelled input, or a language model's text) over its own tokens, with its caption
  (what the model predicts) in the title. Returns the paths."""
  length = max(len(e) for e in encoded)
  weights = attention_weights(model, pad_batch([(e, e) for e in encoded], length))
  paths = []
  for i, tokens in enumerate(encoded):
    for kind, per_layer in weights.items():
      maps = [w[i, :, :len(tokens), :len(tokens)] for w in per_layer]
      path = storage.join(plot_dir, f"attention_{i}_{kind}.png")
      caption = f" → {captions[i]}" if captions else ""
      _grid(maps, source.pieces(tokens), source.pieces(tokens),
            f"{KINDS[kind]}: layers × heads\n{sentences[i]!r}{caption}", path, xlabel="key",
            ylabel="query")
      paths.append(path)
  return paths


def _grid(maps: list[np.ndarray], queries: list[str], keys: list[str], title: str,
          path: str, *, xlabel: str, ylabel: str) -> None:
  """maps: per layer [heads, tq, tk]; one image per (layer, head)."""
  plt = pyplot()
  layers, heads = len(maps), maps[0].shape[0]
  size = 1.2 + 0.13 * max(len(queries), len(keys))
  width = max(size * heads, 6.0)
  fig, axes = plt.subplots(layers, heads, figsize=(width, (size + 0.3) * layers + 1.0),
                           squeeze=False)
  labelled = max(len(queries), len(keys)) <= MAX_LABELS
  for layer, per_head in enumerate(maps):
    for h, weights in enumerate(per_head):
      ax = axes[layer, h]
      ax.imshow(weights, vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
      ax.set_title(f"layer {layer} head {h}", fontsize=7)
      ax.set_xticks([]), ax.set_yticks([])
      if labelled and layer == layers - 1:
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=6)
        ax.set_xlabel(xlabel, fontsize=7)
      if labelled and h == 0:
        ax.set_yticks(range(len(queries)), queries, fontsize=6)
        ax.set_ylabel(ylabel, fontsize=7)
  fig.suptitle("\n".join(textwrap.fill(line, int(width * 14)) for line in title.splitlines()),
               fontsize=8)
  fig.tight_layout()
  save(fig, path, dpi=110)
