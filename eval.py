"""Evaluates a trained run: python eval.py --workdir DIR [--step N] [--output FILE]
[--beam_size K --alpha A | --temperature T [--top_k K] [--top_p P] [--min_p M] [--sample_seed S]]
[--average N] [--source_file F --reference_file R] [--config.FIELD=VALUE ...].

Restores the config saved in DIR and its checkpoint (the latest by default), reports loss,
token accuracy, exact match and (text) sacreBLEU/chrF on every held-out split, and writes
them as JSON, with the detokenized predictions and the references beside it (what
`compare.py --paired_bootstrap` reads). --beam_size 4 --alpha 0.6 decodes as the paper
does (a run that decodes: model.arch=encoder_decoder), and --average 5
averages the last 5 checkpoints' parameters as it does. --source_file/--reference_file
evaluate any parallel text (e.g. a new test set) with the run's vocabulary.

Files: DIR/eval_step_N.json holds the run's own evaluation (one checkpoint, the decoding its
config asks for, as training evaluates); any other is named after what differs, e.g.
DIR/eval_step_N,average=5,beam=4,alpha=0.6.json or eval_step_N,temperature=0.8,seed=1.json
(transformer/run/eval_files.py), and eval.py prints how it decoded. A file that holds
another evaluation is never replaced.

Sampling: --temperature T > 0 samples what is otherwise decoded greedily (the metrics and
the pictures of a run that decodes, --generate): each token is drawn from softmax(logits / T)
restricted in turn to the --top_k most likely tokens, the nucleus of probability --top_p and
the tokens at least --min_p times as likely as the most likely one, renormalised;
--sample_seed S repeats the same draws. Without these flags, the run's config.eval.sampling
and config.eval.sample_seed apply (greedy unless the config sets a temperature; training's
own evaluations decode with them too); a flag replaces its field, and --temperature 0 alone
decodes greedily.

Overrides: --config.FIELD=VALUE evaluates the same parameters with an execution field of the
run's config changed, e.g. a RoPE scaling (transformer/model/positions/rotary.py) for
sequences longer than it was trained on, without retraining and as the same run:
  python eval.py --workdir DIR --config.model.position_settings.rotary.scaling=yarn \\
      --config.model.position_settings.rotary.factor=4 \\
      --config.model.position_settings.rotary.original_length=64
Only fields the evaluation reads and that are not the run's identity (what its parameters
mean: model.d_model, model.position, rotary's base, ...) may be overridden. The metrics go
to DIR/eval_step_N,FIELD=VALUE,....json (each field by its last two names; the JSON records
them whole, under "overrides"), the pictures to DIR/plots,FIELD=VALUE,...: never over the
plain evaluation's.

Pictures: --sentence S (repeatable) prints S's greedy (or sampled) translation and draws
the attention maps (per layer and head; encoder self, decoder self, cross) of S and it, or
for a run that does not decode prints the predicted label(s) (a language model: the next
token) and draws its self-attention; and positions.png the positional encoding, into
--plot_dir (default DIR/plots; the pictures of an earlier draw there are replaced), from the
same parameters as the metrics (--step, --average); --nometrics skips the evaluation.
  python eval.py --workdir DIR --sentence "3 1 4 1 5" --nometrics      # synthetic symbols
  python eval.py --workdir DIR --sentence "A dog runs on the beach."   # text
  python eval.py --workdir DIR --sentence "[MAX 2 9 [MIN 4 7 ] 0 ]" --nometrics  # ListOps
  python eval.py --workdir DIR --sentence "def main(" --generate 40 --nometrics  # an LM
  python eval.py --workdir DIR --sentence "def main(" --generate 40 --nometrics \\
      --temperature 0.8 --top_p 0.95 --sample_seed 1                              # sampled
"""

import os
import sys

from absl import app, flags

from transformer.core.errors import ConfigError, Interrupted
from transformer.core.fields import FieldError
from transformer.core.vocab import EOS_ID
from transformer.model.sampling import Sampling
from transformer.run import cli, experiment
from transformer.run import overrides as overrides_lib
from transformer.run.config import EvalConfig
from transformer.run.eval_files import Decoding
from transformer.run.restored_run import (check_decoding, check_prompts, check_sampling,
                                        chosen_sampling, continue_prompts, evaluate_run,
                                        format_table, output_path, own_decoding, restore_run,
                                        sentence_predictions, splits_of)
from transformer.run.evaluator import generates_answers
from transformer.study import pictures

flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest).")
flags.DEFINE_string("output", None, "Metrics JSON path (default: DIR/eval_step_N.json).")
flags.DEFINE_integer("beam_size", 1, "1: greedy decoding; k > 1: beam search with k beams.")
flags.DEFINE_float("alpha", 0.6, "GNMT length-penalty exponent for beam search.")
flags.DEFINE_integer("average", 1, "Average the parameters of the last N checkpoints (up to "
                     "--step); the paper averages 5.")
flags.DEFINE_string("source_file", None, "Evaluate this source text file (plain or .gz, one "
                    "sentence per line) instead of the config's splits; needs --reference_file.")
flags.DEFINE_string("reference_file", None, "References for --source_file, line by line.")
flags.DEFINE_multi_string("sentence", [], "Draw attention maps for this input (repeatable): "
                          "source text, or for synthetic tasks symbols such as '3 1 4'.")
flags.DEFINE_string("plot_dir", None, "Where pictures go (default DIR/plots); given without "
                    "--sentence, only the positional-encoding heatmap.")
flags.DEFINE_integer("generate", 0, "Language models: continue each --sentence by this many "
                     "tokens (KV-cached, greedy or sampled) and print it.")
flags.DEFINE_float("temperature", 0.0, "0: greedy decoding and generation; T > 0: sample "
                   "each token from softmax(logits / T), filtered by the three below.")
flags.DEFINE_integer("top_k", 0, "Sampling: only among the K most likely tokens; 0: off.")
flags.DEFINE_float("top_p", 1.0, "Sampling: only within the nucleus, the most likely tokens "
                   "whose probability reaches P (the top one always); 1: off.")
flags.DEFINE_float("min_p", 0.0, "Sampling: only tokens at least M times as likely as the "
                   "most likely one; 0: off.")
flags.DEFINE_integer("sample_seed", 0, "Sampling: the seed of the draws.")
flags.DEFINE_bool("metrics", True, "Evaluate the held-out splits; --nometrics only draws.")
cli.define_cache_flag()
flags.mark_flags_as_required(["workdir"])
flags.register_validator("average", lambda n: n >= 1, "--average must be at least 1")
flags.register_validator("beam_size", lambda n: n >= 1, "--beam_size must be at least 1")
flags.register_validator("alpha", lambda a: a >= 0, "--alpha must be at least 0")
flags.register_validator("generate", lambda n: n >= 0, "--generate must be at least 0")
flags.register_validator("sample_seed", lambda n: n >= 0,
                         "--sample_seed must be at least 0")
flags.register_multi_flags_validator(
    ["generate", "sentence"], lambda f: not f["generate"] or f["sentence"],
    "--generate N continues each --sentence: give at least one")
flags.register_multi_flags_validator(
    ["source_file", "reference_file"], lambda f: (f["source_file"] is None) == (
        f["reference_file"] is None), "--source_file and --reference_file go together")


def check_metrics_flags() -> None:
  """A ConfigError for a flag that only the metrics use, given with --nometrics, and for
  --alpha without beam search."""
  f = flags.FLAGS
  given = [f"--{name}" for name in ("output", "beam_size", "alpha", "source_file")
           if f[name].present]
  if given and not f.metrics:
    raise ConfigError(f"{given[0]} applies to the metrics, which --nometrics skips")
  if f["alpha"].present and f.beam_size == 1:
    raise ConfigError(f"--alpha {f.alpha} is the length penalty of beam search, which "
                      "--beam_size 1 (greedy or sampled decoding) does not do; give "
                      "--beam_size > 1")


def sampling_flags(defaults: EvalConfig) -> tuple[Sampling, int, bool]:
  """(sampling, seed, given): restored_run.chosen_sampling of the run's config.eval and the
  sampling flags given on the command line, and whether any was given; a FieldError names
  the flag (`--top_p=0.0 is not allowed; ...`)."""
  f = flags.FLAGS
  given = {name: f[name].value for name in ("temperature", "top_k", "top_p", "min_p")
           if f[name].present}
  seed = f.sample_seed if f["sample_seed"].present else None
  try:
    sampling, seed = chosen_sampling(defaults, given, seed, f.beam_size)
  except FieldError as e:
    raise FieldError(f"--{e.field}", e.value, e.allowed) from None
  return sampling, seed, bool(given) or f["sample_seed"].present


OVERRIDES: dict[str, str] = {}  # the --config.FIELD=VALUE arguments (parse_flags)


def parse_flags(argv: list[str]) -> list[str]:
  """cli.parse_flags of the arguments other than --config.FIELD=VALUE, which go to OVERRIDES
  (checked against the run's config when it is restored)."""
  with cli.one_line_errors():
    found, rest = overrides_lib.split_args(argv)
  OVERRIDES.update(found)
  return cli.parse_flags(rest, takes_overrides=True)


def main(argv):
  cli.no_arguments(argv)
  cli.use_compilation_cache()
  cli.setup_logging()
  f = flags.FLAGS
  files = (f.source_file, f.reference_file) if f.source_file else None
  with cli.StopSignals() as stop, cli.one_line_errors():
    check_metrics_flags()
    # one restore serves metrics and pictures
    run = restore_run(f.workdir, f.step, f.average, OVERRIDES, announce=False)
    exp = run.experiment
    sampling, seed, sampling_given = sampling_flags(exp.eval)
    plot_dir = f.plot_dir or os.path.join(f.workdir, "plots" + run.suffix)
    # Everything the flags ask is checked before the work: nothing fails after it.
    if sampling_given:  # the config's default applies where it can, silently elsewhere
      check_sampling(exp, sampling, f.metrics, bool(f.sentence), bool(f.generate))
    decoding = Decoding(f.beam_size, f.alpha, sampling, seed)
    splits = None
    if f.metrics:
      check_decoding(exp, f.beam_size, sampling)
      output_path(run, f.output, decoding)  # a path that cannot be written, or taken
      splits = splits_of(run, files)
    if f.generate:
      check_prompts(exp, f.sentence, f.generate)
    if f.sentence or f.plot_dir:
      pictures.check_writable(run, f.sentence, plot_dir)
    experiment.announce_kernels(exp)  # the work begins: nothing was said before a refusal
    try:
      if f.metrics:
        step, results, path = evaluate_run(run, f.output, f.beam_size, f.alpha, files, stop,
                                           sampling, seed, splits)
        print(f"step {step}" + (f" (the parameters averaged over steps "
                                 f"{', '.join(map(str, run.steps))})" if len(run.steps) > 1
                                 else ""))
        if run.overrides:
          print(f"overrides: {overrides_lib.describe(run.overrides)}")
        if exp.family.decodes or generates_answers(exp):
          own = " (the run's own)" if decoding.key() == own_decoding(exp).key() else ""
          print(f"decoding: {decoding}{own}")
        print(format_table(results))
        print(f"metrics written to {path}")
      captions = outputs = None
      if f.sentence and exp.family.decodes:  # printed, not only in the pictures' titles
        outputs = pictures.decode_sentences(run, f.sentence, sampling, seed)
        captions = [f"decoded ({decoding.sampling}) "
                    f"{exp.source.detokenize(ids[ids != EOS_ID])!r}" for ids in outputs]
      elif f.sentence:
        captions = sentence_predictions(run, f.sentence)
      for sentence, caption in zip(f.sentence, captions or []):
        print(f"--- {sentence!r}: {caption}")
      for text in (continue_prompts(run, f.sentence, f.generate, sampling, seed)
                   if f.generate else []):
        print(f"--- generated:\n{text}")
      if f.sentence or f.plot_dir:
        paths = pictures.draw(run, f.sentence, plot_dir, captions, sampling, seed, outputs)
        print("\n".join(["pictures written:"] + paths) if paths else "nothing to draw")
    except Interrupted:
      print("stopped by a signal; the metrics were not written", file=sys.stderr)
  if stop.exit_status:
    sys.exit(stop.exit_status)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
