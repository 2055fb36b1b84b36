"""Compares runs: python compare.py RUN_DIR [RUN_DIR ...] [--output DIR].

Groups the runs into variants (runs whose configs differ only in the seed are seeds of one
variant, each seed once, named by the fields that differ between the variants; --ignore
FIELD leaves a field out, e.g. data.dir for runs trained on another machine) and prints
the report a sweep gets: each variant's final held-out metrics over its seeds (mean and
95% Student t interval of the mean, inside the metric's range), the main metric's n,
std, min, max and values per seed, its paired differences against --baseline VARIANT
(default: the first; t interval over seeds, and a paired bootstrap over seeds and
examples where the runs recorded per-example results of the same examples; * where an
interval excludes 0), --success 'METRIC>=VALUE' rates with their Clopper–Pearson
interval, and the runs it was computed from (the report's header states every choice).
--output DIR also writes report.md, report.csv and the plots there (a directory holding
another tool's report is refused; an earlier comparison is replaced). The runs must be
finished or failed (a failed run, e.g. diverged, is shown as failed) and of one data
source and task.

Translation: --paired_bootstrap EVAL.json EVAL.json [...] resamples the sentences of the
evaluations that eval.py wrote (its metrics JSON, with the hypotheses and references
beside it) and gives each system's BLEU and chrF against the first with sacreBLEU's paired
bootstrap p-value; the evaluations must have scored the same references.
  python compare.py sweeps/positions/model.position=rotary,seed=* workdirs/rotary-*
  python compare.py --paired_bootstrap workdirs/a/eval_step_8000.json workdirs/b/eval_step_8000.json
"""

from absl import app, flags

from transformer.core.errors import ConfigError
from transformer.run import cli
from transformer.study import compare, stats

flags.DEFINE_string("output", None, "Also write report.md, report.csv and the plots into "
                    "this directory.")
flags.DEFINE_multi_string("ignore", [], "A config field (or section) left out when grouping "
                          "runs into variants, e.g. data.dir (repeatable).")
flags.DEFINE_bool("paired_bootstrap", False, "The arguments are eval.py's metrics JSON files "
                  "of translation runs: paired bootstrap resampling of BLEU and chrF against "
                  "the first.")
flags.DEFINE_integer("bootstrap_samples", 1000, "Resamples of --paired_bootstrap.")
flags.register_validator("bootstrap_samples", lambda n: n >= 1,
                         "--bootstrap_samples must be at least 1")
cli.define_report_flags()


def main(argv):
  cli.setup_logging()
  f = flags.FLAGS
  with cli.one_line_errors():
    if f.paired_bootstrap:
      given = [f"--{name}" for name in ("output", "ignore", "baseline", "success")
               if f[name].present]
      if given:
        raise ConfigError(f"{given[0]} is for the report over run directories, not for "
                          "--paired_bootstrap (whose baseline is its first file)")
      print(compare.paired_bootstrap(argv[1:], f.bootstrap_samples), end="")
      return
    thresholds = [stats.parse_threshold(spec) for spec in f.success]
    print(compare.compare(argv[1:], f.output, f.baseline, thresholds, f.ignore), end="")
    if f.output:
      print(f"\nreport written to {f.output} (report.md, report.csv and the plots)")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
