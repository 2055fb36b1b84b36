"""The attention sink of trained decoders: the mean attention weight each layer puts on the
first token (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks";
Qiu et al. 2025 compare it between gated and plain attention), read from the weights
that pictures.attention_weights records (the formula, whatever the run's kernel).

A layer's first-token mass is the mean over rows, heads and the counted queries of
w[q, 0]; query 0 is left out (under causal attention its one visible key is the first
token itself, whatever the layer does). Uniform causal attention over T tokens gives
(H_T − 1) / (T − 1), H_T the T-th harmonic number: a mass well above it is a sink. The
weights are what the normaliser gives: with a sink logit or sigmoid a row's weights need
not sum to 1, and the mass on the first token is read as it is, not renormalised.

  python -m transformer.study.attention_sinks 'sweeps/normalizers_lm/*seed=*' \\
      --split len64 --split len512 --baseline \\
      model.attention.normalizer=softmax,model.attention.gate=none,model.attention.data_bias=none

prints a table per split: each variant's mass per layer over its seeds and, with
--baseline, its paired difference by seed from the variant with those values.
"""

import glob
import os
import re
from collections.abc import Sequence

import numpy as np
from flax import nnx

from transformer.core.errors import ConfigError
from transformer.core.metrics import Metric
from transformer.run.restored_run import restore_run, splits_of
from transformer.study import stats
from transformer.study.pictures import attention_weights

_SEED = re.compile(r"(^|,)seed=(\d+)(,|$)")
MASS = Metric(low=0.0, high=1.0)  # a weight: its intervals stay in [0, 1]


def first_token_mass(weights: np.ndarray, queries: np.ndarray | None = None) -> float:
  """The mean weight on key 0 of one layer's weights [b, h, tq, tk] over its rows, heads
  and the queries 1..tq−1 that `queries` [b, tq] (bool; None: all) counts."""
  counted = np.ones(weights.shape[:1] + weights.shape[2:3], bool) if queries is None else (
      np.asarray(queries, bool))
  counted = np.broadcast_to(counted[:, None, 1:], weights[:, :, 1:, 0].shape)
  if not counted.any():
    raise ValueError("first_token_mass: no query past the first is counted")
  return float(np.asarray(weights, np.float64)[:, :, 1:, 0][counted].mean())


def uniform_mass(length: int) -> float:
  """The first-token mass of uniform causal attention over `length` ≥ 2 tokens."""
  return float(np.mean([1.0 / (q + 1) for q in range(1, length)]))


def layer_masses(model, batch: dict[str, np.ndarray], stack: str = "decoder") -> list[float]:
  """first_token_mass of each self-attention layer of `stack` on a teacher-forced pass over
  `batch` (its rows' real tokens: inputs_segmentation > 0 where the batch has it)."""
  maps = attention_weights(model, batch)
  if stack not in maps:
    raise ConfigError(f"the model has no {stack!r} self-attention; it has {sorted(maps)}")
  queries = batch.get("inputs_segmentation")
  return [first_token_mass(w, None if queries is None else queries > 0) for w in maps[stack]]


def run_masses(workdir: str, splits: Sequence[str], rows: int) -> dict[str, list[float]]:
  """{split: layer_masses} of the trained run in `workdir` on the first `rows` rows of each
  of its held-out `splits` (e.g. len64)."""
  run = restore_run(workdir, announce=False)
  held_out = splits_of(run)
  missing = [split for split in splits if split not in held_out]
  if missing:
    raise ConfigError(f"{workdir} has no held-out split {missing[0]!r}; it has "
                      f"{sorted(held_out)}")
  model = nnx.merge(run.experiment.graphdef, run.params)
  return {split: layer_masses(model, {k: v[:rows] for k, v in held_out[split].arrays.items()})
          for split in splits}


def variant_and_seed(workdir: str) -> tuple[str, int]:
  """A sweep run's variant (its directory name without the seed) and seed."""
  name = os.path.basename(os.path.normpath(workdir))
  match = _SEED.search(name)
  if not match:
    raise ConfigError(f"{workdir}: no seed=N in the run's name")
  return _SEED.sub(lambda m: "," if m[1] and m[3] else "", name, count=1), int(match[2])


def baseline_of(baseline: str, variant: str) -> str:
  """The variant `variant` with the FIELD=VALUE of `baseline` (comma-separated) put in place
  of its own values of those fields."""
  values = dict(part.split("=", 1) for part in baseline.split(","))
  return ",".join(f"{k}={values.get(k, v)}" for k, v in
                  (part.split("=", 1) for part in variant.split(",")))


def _cell(summary) -> str:
  if summary.ci is None:
    return f"{summary.mean:.3f}"
  return f"{summary.mean:.3f} [{summary.ci[0]:.3f}, {summary.ci[1]:.3f}]"


def _difference(p: stats.Paired | None) -> str:
  if p is None:
    return "-"
  if p.ci is None:
    return f"{p.mean:+.3f}"
  star = "*" if p.excludes_zero else ""
  return f"{p.mean:+.3f} [{p.ci[0]:+.3f}, {p.ci[1]:+.3f}]{star}"


def table(masses: dict[str, dict[int, list[float]]], baseline: str | None = None) -> str:
  """A markdown table of `masses` ({variant: {seed: per-layer mass}}): each layer's mean
  [95% t interval over seeds], and with `baseline` (FIELD=VALUE,...) each variant's paired
  difference by seed from its baseline_of (`*`: the interval excludes 0)."""
  layers = max(len(m) for seeds in masses.values() for m in seeds.values())
  head = [f"layer {i + 1}" for i in range(layers)]
  if baseline:
    head += [f"Δ layer {i + 1}" for i in range(layers)]
  lines = ["| variant | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
  for variant, seeds in masses.items():
    cells = [_cell(stats.summary([m[i] for m in seeds.values()], MASS)) for i in range(layers)]
    if baseline:
      other = masses.get(baseline_of(baseline, variant))
      cells += ["-" if other is None or other is seeds else _difference(stats.paired(
          {s: m[i] for s, m in other.items()}, {s: m[i] for s, m in seeds.items()}, MASS))
                for i in range(layers)]
    lines.append(f"| {variant} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def sweep_masses(patterns: Sequence[str], splits: Sequence[str], rows: int
                 ) -> dict[str, dict[str, dict[int, list[float]]]]:
  """{split: {variant: {seed: per-layer mass}}} of the runs matching the glob `patterns`."""
  workdirs = sorted({w for p in patterns for w in glob.glob(p) if os.path.isdir(w)})
  if not workdirs:
    raise ConfigError(f"no run directory matches {' '.join(patterns)}")
  masses = {split: {} for split in splits}
  for workdir in workdirs:
    variant, seed = variant_and_seed(workdir)
    for split, layers in run_masses(workdir, splits, rows).items():
      masses[split].setdefault(variant, {})[seed] = layers
  return masses


def main(argv: Sequence[str]) -> None:
  from absl import flags  # the command line's, parsed by app.run
  from transformer.run import cli
  with cli.one_line_errors():
    if flags.FLAGS.rows < 1:
      raise ConfigError(f"--rows {flags.FLAGS.rows}: give 1 or more")
    masses = sweep_masses(argv[1:], flags.FLAGS.split, flags.FLAGS.rows)
  for split, table_masses in masses.items():
    print(f"first-token attention mass, {split} ({flags.FLAGS.rows} rows):")
    print(table(table_masses, flags.FLAGS.baseline))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_multi_string("split", ["len64"], "A held-out split (repeatable).")
  flags.DEFINE_integer("rows", 16, "Rows of each split read.")
  flags.DEFINE_string("baseline", None, "FIELD=VALUE,...: each variant's paired differences "
                      "against the variant with those values.")
  app.run(main)
