"""A report's results: the finished runs of a sweep or of a comparison grouped into
variants (runs that differ only in their seed), each run's final held-out metrics, the
metrics in the table's order with the main one first, and each metric's statistics over a
variant's seeds (transformer/study/stats.py). transformer/study/report.py presents them."""

import dataclasses
import re

from transformer.run.state import STATES, RunState
from transformer.study import stats

# The main metric, the first found: the column after the run counts and the bar chart.
# (test/mean_accuracy: the algorithmic tasks' score, accuracy averaged over the test lengths)
MAIN_METRICS = ("test/mean_accuracy", "valid/bleu", "valid/exact_match", "valid/accuracy")
# The order of the metrics of a split in the table; others follow by name.
KEYS = ("bleu", "chrf", "exact_match", "mean_accuracy", "accuracy", "macro_f1", "perplexity",
        "bits_per_token", "loss")
LOWER_IS_BETTER = ("perplexity", "bits_per_token", "loss")
SPLITS = ("valid", "test", "longer")


def _split_rank(split: str) -> tuple:
  if split in SPLITS:
    return (SPLITS.index(split), 0, "")
  # language models: by length, then plain, passkey (lenW_passkey), sliding
  if match := re.fullmatch(r"len(\d+)(_[a-z]+)?", split):
    return (len(SPLITS), int(match[1]), match[2] or "")
  return (len(SPLITS) + 1, 0, split)


def order_metrics(names: set[str], train_length: int | None) -> tuple[list[str], str | None]:
  """(the `split/key` names in the table's order, the main metric): the main metric first
  (valid BLEU, exact match or accuracy; a language model's perplexity at its training
  length), then split by split (valid, test, longer, then by evaluation length), each
  split's metrics in KEYS' order."""
  main = next((n for n in MAIN_METRICS if n in names), None)
  if main is None:
    perplexities = sorted((n for n in names if n.endswith("/perplexity")),
                          key=lambda n: _split_rank(n.split("/")[0]))
    main = (f"len{train_length}/perplexity" if f"len{train_length}/perplexity" in names
            else next(iter(perplexities), None))

  def rank(name):
    split, key = name.split("/", 1)
    return (name != main, _split_rank(split), KEYS.index(key) if key in KEYS else len(KEYS), key)

  return sorted(names, key=rank), main


def grid(variants) -> tuple[str, dict[str, dict[str, str]]] | None:
  """(the variants' first field, {its value: {the other fields: variant}}) when the first
  field and the others each take several values (e.g. task × encoding); None otherwise."""
  parts = {v: v.split(",", 1) for v in variants}
  if any(len(p) < 2 for p in parts.values()):
    return None
  fields = {p[0].split("=", 1)[0] for p in parts.values()}
  rows: dict[str, dict[str, str]] = {}
  for variant, (first, rest) in parts.items():
    rows.setdefault(first.split("=", 1)[1], {})[rest] = variant
  if len(fields) > 1 or len(rows) < 2 or len({c for r in rows.values() for c in r}) < 2:
    return None
  return fields.pop(), rows


def state_counts(entries) -> dict[str, int]:
  """{state: how many of the entries are in it}, for every one of STATES."""
  return {s: sum(e.state == s for e in entries) for s in STATES}


@dataclasses.dataclass(frozen=True)
class Entry:
  """A run in a report: its name, variant (the runs of a variant differ only in their
  seed), seed, workdir and training steps; its state (run.state.STATES) and, without
  results, why; finished, its final evaluation ({held-out split: record}: its results)."""

  name: str
  variant: str
  seed: int
  workdir: str
  steps: int
  state: str
  note: str = ""
  final: dict[str, dict] | None = dataclasses.field(default=None, compare=False)

  @classmethod
  def of(cls, name: str, variant: str, seed: int, workdir: str, state: RunState) -> "Entry":
    """The entry of the run in `workdir` in `state` (run_state's, at its train.num_steps)."""
    return cls(name, variant, seed, workdir, state.num_steps, state.state, state.note,
               state.final)


@dataclasses.dataclass(frozen=True)
class Results:
  """The final held-out metrics of a report's finished runs: `finals` {variant: {seed:
  {split: metrics}}}, the variants in the entries' order and their seeds ascending; the
  metric names in the table's order and the main one (order_metrics)."""

  entries: list[Entry]
  variants: dict[str, list[Entry]]
  finals: dict[str, dict[int, dict]]
  names: list[str]
  main: str | None

  @classmethod
  def of(cls, entries: list[Entry], train_length: int | None) -> "Results":
    variants: dict[str, list[Entry]] = {}
    for entry in entries:
      variants.setdefault(entry.variant, []).append(entry)
    finals = {v: {e.seed: e.final for e in sorted(es, key=lambda e: e.seed)
                  if e.state == "finished"}
              for v, es in variants.items()}
    names, main = order_metrics({f"{split}/{key}" for runs in finals.values()
                                 for r in runs.values() for split, m in r.items()
                                 for key, value in m.items() if isinstance(value, float)
                                 and key not in ("step", "eval_length")}, train_length)
    return cls(entries, variants, finals, names, main)

  def values(self, variant: str, name: str) -> dict[int, float]:
    """{seed: value} of the metric `split/key` over the variant's finished runs."""
    split, key = name.split("/", 1)
    return {seed: r[split][key] for seed, r in self.finals[variant].items()
            if key in r.get(split, {})}

  def summary(self, variant: str, name: str) -> stats.Summary | None:
    values = self.values(variant, name)
    return stats.summary(list(values.values())) if values else None


def lower_is_better(name: str) -> bool:
  return name.split("/")[1] in LOWER_IS_BETTER
