"""Comparing runs with results from any directories (compare.py): the finished runs, and the
failed ones (shown as failed), grouped into variants by their configs, with the report a
sweep gets (transformer/study/report.py); and the paired bootstrap resampling of
translation runs' BLEU and chrF on the same test set (sacreBLEU).

Runs are seeds of one variant when their whole configs, less the seed, are equal: not only
their identity (fields.identity), which leaves out the training schedule (a learning rate or
step count may change when a run is resumed, but it changes the results a comparison is
about). `ignore` leaves fields out of the grouping, for those that do not change results
(e.g. data.dir on another machine). A variant is named by the fields whose values differ
between the groups.
"""

import json
import logging
from collections.abc import Sequence

import sacrebleu
from etils import epath
from sacrebleu.significance import PairedTest

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.run import config as config_lib
from transformer.run import workdir as workdir_lib
from transformer.run.eval_files import text_paths
from transformer.run.state import STATES, run_state
from transformer.study import report, report_grids, report_plots, stats
from transformer.study.report_tables import cell, markdown, table_csv
from transformer.study.results import Entry, Results, state_counts
from transformer.study.sweep import run_name

log = logging.getLogger("transformer")
TITLE = "# Comparison of "  # how a report.md written here begins (save refuses others')
PLOTS = (*report_plots.PLOTS, *(f"{key}.png" for key in report_grids.declared()))


def _comparable(configs: dict[str, config_lib.Config]) -> None:
  """A ConfigError unless every run has the same data source and task (name)."""
  first, cfg = next(iter(configs.items()))
  for path, other in configs.items():
    for what, get in (("data sources", lambda c: c.data.source),
                      ("tasks", lambda c: getattr(c.task, "name", None))):
      if get(other) != get(cfg):
        raise ConfigError(f"{first} and {path} cannot be compared: they are runs of different "
                          f"{what} ({get(cfg)} and {get(other)})")


def entries(paths: Sequence[str], ignore: Sequence[str] = ()
            ) -> tuple[list[Entry], list[str], config_lib.Config]:
  """(an Entry per run in `paths`, the fields that name the variants, the first run's
  config). Every path must be a run's workdir with its final evaluation or a recorded
  failure (run/state.py), the runs of one data source and task, each run given once (and
  each seed of a variant once: Results.of); else a ConfigError naming the path."""
  if not paths:
    raise ConfigError("no runs given: python compare.py RUN_DIR [RUN_DIR ...]")
  configs, flat, states = {}, {}, {}
  for path in paths:
    if path in configs:
      raise ConfigError(f"{path} is given twice; give each run once")
    cfg = workdir_lib.saved_config(path)  # a ConfigError says what the path is, if not a run
    states[path] = run_state(path, cfg.train.num_steps)
    if states[path].state == "unfinished":
      raise ConfigError(f"{path} has no results: {states[path].note}; compare finished (or "
                        "failed) runs")
    configs[path] = cfg
    flat[path] = workdir_lib.flatten(config_lib.to_dict(cfg))
    del flat[path]["seed"]
  _comparable(configs)
  under = lambda key, field: key == field or key.startswith(field + ".")  # noqa: E731
  for field in ignore:
    if not any(under(k, field) for f in flat.values() for k in f):
      raise ConfigError(f"--ignore {field}: the runs' configs have no field {field!r}")
  for f in flat.values():
    for k in [k for k in f if any(under(k, i) for i in ignore)]:
      del f[k]
  fields = list(dict.fromkeys(k for f in flat.values() for k in f))
  differ = [k for k in fields if len({json.dumps(f.get(k)) for f in flat.values()}) > 1]
  out = []
  for path, cfg in configs.items():
    variant = run_name({k: flat[path].get(k) for k in differ}) if differ else "all runs"
    out.append(Entry.of(path, variant, cfg.seed, path, states[path]))
  return out, differ, next(iter(configs.values()))


def check_output(output: str) -> bool:
  """A ConfigError if report.md, report.csv and the plots cannot go into the directory
  `output`: not writable, or holding another tool's report (a sweep's) or plots. Returns
  whether it holds an earlier comparison (which is replaced)."""
  directory = epath.Path(output)
  if directory.exists() and not directory.is_dir():
    raise ConfigError(f"--output {output} is a file, not a directory")
  if problem := storage.writable_directory(output):
    raise ConfigError(f"--output {output}: {problem}")
  md = directory / "report.md"
  if md.exists():
    first = md.read_text().split("\n", 1)[0]
    if not first.startswith(TITLE):
      raise ConfigError(f"--output {output} holds another report ({md}: {first!r:.60}); "
                        "choose another directory")
    return True
  taken = [name for name in ("report.csv", *PLOTS) if (directory / name).exists()]
  if taken:
    raise ConfigError(f"--output {output} already holds {', '.join(taken)}, not from "
                      "compare.py; choose another directory")
  return False


def compare(paths: Sequence[str], output: str | None = None, baseline: str | None = None,
            thresholds: Sequence[stats.Threshold] = (), ignore: Sequence[str] = ()) -> str:
  """The report (markdown) of the runs in `paths` (entries): each variant's statistics over
  its finished seeds, the main metric's spread and success rates (`thresholds`), its
  paired differences against `baseline` (default: the first variant), and the runs it is
  computed from. With `output`, writes report.md, report.csv and the plots there
  (check_output; an earlier comparison there is replaced, its plots with it)."""
  runs, differ, first = entries(paths, ignore)
  report.check_baseline(baseline, list(dict.fromkeys(e.variant for e in runs)))
  replacing = check_output(output) if output else False
  train_length = first.source.train_length(first.data, first.task)
  results = Results.of(runs, train_length)
  report.check_thresholds(thresholds, results)
  baseline = report.default_baseline(results, baseline)
  task = getattr(first.task, "name", None)
  total = state_counts(results.entries)
  header = [f"{TITLE}{len(runs)} runs", "",
            f"- runs: {len(runs)} in {len(results.variants)} variant(s) ("
            + ", ".join(f"{total[s]} {s}" for s in STATES if total[s]) + "), grouped by "
            "their configs less the seed" + (f" and {', '.join(ignore)}" if ignore else ""),
            f"- variants differ in: {', '.join(differ)}" if differ else
            "- one variant: the runs differ only in their seed",
            f"- every run: data.source={first.data.source}"
            + (f", task.name={task}" if task else ""),
            report.steps_line(runs), *report.statistics_lines(results, baseline, thresholds),
            *report.commit_line(), ""]
  md = markdown(results, header, baseline, thresholds)
  md += ("\n## Runs\n\n| run | variant | seed | steps | state |\n|---|---|---|---|---|\n"
         + "".join(f"| {cell(e.workdir)} | {cell(e.variant)} | {e.seed} | {e.steps} | "
                   f"{e.state} |\n" for e in results.entries))
  if output:
    if replacing:
      log.info("replacing the comparison in %s", output)
      for name in PLOTS:
        if (epath.Path(output) / name).exists():
          (epath.Path(output) / name).unlink()
    epath.Path(output).mkdir(parents=True, exist_ok=True)
    report.save(output, md, table_csv(results, baseline, thresholds), results, train_length)
  return md


def _lines(text: str) -> list[str]:
  """The lines of a file of one sentence per line (a sentence may hold any other line
  separator, e.g. U+2028, which str.splitlines would split at)."""
  return text.removesuffix("\n").split("\n") if text else []


def _evaluation(path: str) -> dict[str, tuple[list[str], list[str]]]:
  """{split: (hypotheses, references)} of the text splits of an evaluation that eval.py
  wrote (its metrics JSON and the files beside it: eval_files.text_paths)."""
  file = epath.Path(path)
  if file.is_dir():
    found = sorted(p.name for p in file.glob("eval_step_*.json"))
    raise ConfigError(f"{path} is a directory; give the metrics JSON that eval.py wrote"
                      + (f" (there: {', '.join(found)})" if found else
                         " (eval.py --workdir DIR writes DIR/eval_step_N.json)"))
  try:
    splits = json.loads(file.read_text())["splits"]
  except FileNotFoundError:
    raise ConfigError(f"{path} does not exist (give the metrics JSON that eval.py wrote)"
                      ) from None
  except (ValueError, KeyError, TypeError):
    splits = None
  if not isinstance(splits, dict) or not all(isinstance(m, dict) for m in splits.values()):
    raise ConfigError(f"{path} is not the metrics JSON of eval.py (its \"splits\")")
  out = {}
  for split, metrics in splits.items():
    if "predictions" not in metrics:
      continue  # not a text split
    hypotheses, references = text_paths(path, split)
    for what, file in (("hypotheses", hypotheses), ("references", references)):
      if not epath.Path(file).exists():
        raise ConfigError(f"{path}: the {split} split's {what} ({file}) are missing"
                          + (" (eval.py writes them since compare.py exists); evaluate the run "
                             "again" if what == "references" else ""))
    out[split] = tuple(_lines(_text(p)) for p in (hypotheses, references))
  if not out:
    raise ConfigError(f"{path} has no text split (translation hypotheses) to resample")
  return out


def _text(path: str) -> str:
  """A file of sentences as text; a ConfigError naming it if it is not UTF-8."""
  try:
    return epath.Path(path).read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); it is not "
                      "the file eval.py wrote, evaluate the run again") from None


def paired_bootstrap(paths: Sequence[str], samples: int = 1000) -> str:
  """Paired bootstrap resampling (sacreBLEU's PairedTest, Koehn 2004) of the BLEU and chrF
  of two or more evaluations (eval.py's metrics JSON files) against the first, on each text
  split they share: each system's score, its bootstrap mean and 95% interval, the
  difference to the baseline and its p-value (* below 0.05). The same test set is required:
  a split whose references differ between the files is a ConfigError."""
  if len(paths) < 2:
    raise ConfigError("--paired_bootstrap compares two or more evaluations: give the "
                      "baseline's metrics JSON and at least one other")
  systems = {path: _evaluation(path) for path in paths}
  base, *others = paths
  splits = [s for s in systems[base] if all(s in systems[p] for p in others)]
  if not splits:
    raise ConfigError(f"{', '.join(paths)} share no text split")
  lines = [f"# Paired bootstrap resampling against {base}", ""]
  for split in splits:
    references = systems[base][split][1]
    for path in others:
      hypotheses, other_references = systems[path][split]
      if other_references != references:
        raise ConfigError(f"{base} and {path} scored different {split} sets (their "
                          "references differ); paired resampling needs the same test set")
      if len(hypotheses) != len(references):
        raise ConfigError(f"{path}: {len(hypotheses)} {split} hypotheses for "
                          f"{len(references)} references")
    test = PairedTest([(p, systems[p][split][0]) for p in paths],
                      {"BLEU": sacrebleu.BLEU(), "chrF": sacrebleu.CHRF()}, [references],
                      test_type="bs", n_samples=samples)
    signatures, scores = test()
    metrics = [m for m in scores if m != "System"]
    lines += [f"## {split} ({len(references)} sentences, the same references in every file)",
              "", "| system | " + " | ".join(
                  f"{m} | {m} bootstrap mean ± 95% CI | {m} − baseline | p" for m in metrics)
              + " |", "|---" * (1 + 4 * len(metrics)) + "|"]
    for i, path in enumerate(paths):
      cells = []
      for m in metrics:
        result, baseline = scores[m][i], scores[m][0]
        delta = result.score - baseline.score
        marker = " *" if result.p_value is not None and result.p_value < 0.05 else ""
        cells += [f"{result.score:.2f}", f"{result.mean:.2f} ± {result.ci:.2f}",
                  f"{delta:+.2f}{marker}" if i else "",
                  f"{result.p_value:.4f}" if result.p_value is not None else ""]
      lines.append(f"| {cell(path)} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {m} signature: {signatures[m].format()}" for m in metrics] + [""]
  lines.append("p: the paired bootstrap's p-value of the difference to the baseline (sacreBLEU); "
               "* where it is below 0.05.")
  return "\n".join(lines) + "\n"
