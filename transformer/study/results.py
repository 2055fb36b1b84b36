"""A report's results: the runs of a sweep or of a comparison grouped into variants (runs
that differ only in their seed, each seed once), each finished run's final held-out
metrics, the metrics in the table's order with the main one first, what each metric is
(its declaration: core/metrics.py METRICS), and each metric's
statistics over a variant's seeds (transformer/study/stats.py) and over examples
(transformer/study/bootstrap.py). transformer/study/report.py presents them."""

import dataclasses
import math
import re

from transformer.core.errors import ConfigError
from transformer.core.metrics import AT_TRAINING_LENGTH, METRICS, Metric
from transformer.run.state import STATES, RunState
from transformer.study import bootstrap, stats

SPLITS = ("valid", "test", "longer")
_ORDER = list(METRICS)  # a split's metrics in the table: in METRICS' order, others by name


def declared(name: str) -> Metric:
  """The declaration of the metric `split/key` (stats.UNBOUNDED if none)."""
  return METRICS.get(name.split("/", 1)[1], stats.UNBOUNDED)


def lower_is_better(name: str) -> bool:
  return declared(name).lower_is_better


def _split_rank(split: str) -> tuple:
  if split in SPLITS:
    return (SPLITS.index(split), 0, "")
  # language models: by length, then plain, passkey (lenW_passkey), sliding
  if match := re.fullmatch(r"len(\d+)(_[a-z]+)?", split):
    return (len(SPLITS), int(match[1]), match[2] or "")
  return (len(SPLITS) + 1, 0, split)


def main_metric(names: set[str], train_length: int | None) -> str | None:
  """The report's main metric among the `split/key` names: the first metric of METRICS
  declared `main` on a split the names have (Metric.main); one main at the training length
  (a language model's perplexity) on the shortest evaluation length where the runs lack
  that split."""
  for key, metric in METRICS.items():
    if metric.main and f"{metric.main.format(train_length=train_length)}/{key}" in names:
      return f"{metric.main.format(train_length=train_length)}/{key}"
  for key, metric in METRICS.items():
    if metric.main == AT_TRAINING_LENGTH:
      found = sorted((n for n in names if n.split("/", 1)[1] == key),
                     key=lambda n: _split_rank(n.split("/")[0]))
      if found:
        return found[0]
  return None


def order_metrics(names: set[str], train_length: int | None) -> tuple[list[str], str | None]:
  """(the `split/key` names in the table's order, the main metric): the main metric first
  (main_metric), then split by split (valid, test, longer, then by evaluation length), each
  split's metrics in METRICS' order, any undeclared one after them by name."""
  main = main_metric(names, train_length)

  def rank(name):
    split, key = name.split("/", 1)
    return (name != main, _split_rank(split),
            _ORDER.index(key) if key in _ORDER else len(_ORDER), key)

  return sorted(names, key=rank), main


def grid(variants) -> tuple[str, dict[str, dict[str, str]]] | None:
  """(the variants' first field, {its value: {the other fields: variant}}) when the variants
  form a grid: the first field takes several values, the other fields several combinations,
  and every value meets every combination (e.g. task × encoding); None otherwise."""
  parts = {v: v.split(",", 1) for v in variants}
  if any(len(p) < 2 for p in parts.values()):
    return None
  fields = {p[0].split("=", 1)[0] for p in parts.values()}
  rows: dict[str, dict[str, str]] = {}
  for variant, (first, rest) in parts.items():
    rows.setdefault(first.split("=", 1)[1], {})[rest] = variant
  columns = {c for r in rows.values() for c in r}
  if (len(fields) > 1 or len(rows) < 2 or len(columns) < 2
      or any(len(r) != len(columns) for r in rows.values())):
    return None
  return fields.pop(), rows


def baseline_of(baseline: str | None, variant: str, variants) -> str | None:
  """The variant that `variant` is compared with: `baseline` when it is a variant; when it
  is a FIELD=VALUE of the variants (e.g. model.random_positions=False), the variant equal
  to `variant` but for that field's value (None where there is none)."""
  if baseline is None or baseline in variants:
    return baseline
  field = baseline.split("=", 1)[0]
  parts = variant.split(",")
  if not any(p.split("=", 1)[0] == field for p in parts):
    return None
  match = ",".join(baseline if p.split("=", 1)[0] == field else p for p in parts)
  return match if match in variants else None


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


def check_seeds(entries: list[Entry]) -> None:
  """A ConfigError naming two runs of one variant with the same seed: the same experiment
  twice is no second sample (sweeps and comparisons alike refuse it)."""
  seen: dict[tuple[str, int], Entry] = {}
  for entry in entries:
    if (other := seen.get((entry.variant, entry.seed))) is not None:
      raise ConfigError(f"{other.name} and {entry.name} are the same run (the same config "
                        f"and seed {entry.seed}) of variant {entry.variant}: a repeated seed "
                        "is no second sample; give each run once")
    seen[entry.variant, entry.seed] = entry


def diverged(entry: Entry) -> Entry:
  """The entry, or a failed one if it finished with a metric that is not finite (its
  training diverged without being stopped): its numbers are no result to average."""
  if entry.state != "finished":
    return entry
  bad = next((f"{split}/{key} = {value}" for split, m in entry.final.items()
              for key, value in m.items()
              if isinstance(value, float) and not math.isfinite(value)), None)
  if bad is None:
    return entry
  return dataclasses.replace(entry, state="failed", final=None,
                             note=f"failed: diverged, its final evaluation is not finite ({bad})")


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
  _bootstraps: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def of(cls, entries: list[Entry], train_length: int | None) -> "Results":
    """The Results of `entries` (check_seeds; a run finished with non-finite metrics counts
    as failed: diverged)."""
    check_seeds(entries)
    entries = [diverged(e) for e in entries]
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

  def metric(self, name: str) -> Metric:
    """The declaration of the metric `split/key` (stats.UNBOUNDED if none)."""
    return declared(name)

  def declared(self, name: str) -> bool:
    return name.split("/", 1)[1] in METRICS

  def lower_is_better(self, name: str) -> bool:
    return lower_is_better(name)

  def counts(self, variant: str) -> dict[str, int]:
    return state_counts(self.variants[variant])

  def values(self, variant: str, name: str) -> dict[int, float]:
    """{seed: value} of the metric `split/key` over the variant's finished runs."""
    split, key = name.split("/", 1)
    return {seed: r[split][key] for seed, r in self.finals[variant].items()
            if key in r.get(split, {})}

  def summary(self, variant: str, name: str) -> stats.Summary | None:
    values = self.values(variant, name)
    return stats.summary(list(values.values()), self.metric(name)) if values else None

  def paired(self, baseline: str, variant: str, name: str) -> stats.Paired | None:
    return stats.paired(self.values(baseline, name), self.values(variant, name),
                        self.metric(name))

  def success(self, variant: str, threshold: stats.Threshold) -> stats.Rate:
    """The success rate of the variant's finished runs that report the threshold's metric
    and of its failed runs (which meet no threshold)."""
    return stats.success_rate(list(self.values(variant, threshold.metric).values()),
                              threshold, self.counts(variant)["failed"])

  def parts(self, variant: str, name: str) -> dict[int, bootstrap.Parts | None]:
    """{seed: the per-example Parts of the metric `split/key`, or None} of the variant's
    finished runs."""
    split, key = name.split("/", 1)
    return {seed: bootstrap.parts(r[split], self.metric(name))
            for seed, r in self.finals[variant].items() if key in r.get(split, {})}

  def paired_bootstrap(self, baseline: str, variant: str, name: str
                       ) -> bootstrap.Bootstrap | str:
    """The paired bootstrap over seeds and examples of variant − baseline in the metric
    `split/key`, or why there is none (computed once: the tables ask twice)."""
    key = baseline, variant, name
    if key not in self._bootstraps:
      self._bootstraps[key] = self._paired_bootstrap(baseline, variant, name)
    return self._bootstraps[key]

  def _paired_bootstrap(self, baseline: str, variant: str, name: str):
    if self.metric(name).parts is None:
      return "no per-example form (a corpus-level metric)"
    a, b = self.parts(baseline, name), self.parts(variant, name)
    if why := bootstrap.check(a, b):
      return why
    test = bootstrap.paired_bootstrap(a, b, self.metric(name))
    if test.ci is not None and not all(map(math.isfinite, test.ci)):
      return "undefined in some resamples (a denominator of 0)"
    return test
