"""A trained run restored from its workdir (RestoredRun) and what eval.py does with it: its
held-out metrics written as an evaluation's file (evaluate_run, through the Evaluator of
run/evaluator.py), a language model's continuations, what a family that does not decode
predicts for a sentence, and the checks of eval.py's options against the run, made before
any work; eval.py's table of the metrics."""

import dataclasses
import json
import logging

import jax
import numpy as np
from flax import nnx

from transformer.core import storage
from transformer.core.errors import ConfigError, RunError
from transformer.core.metrics import TABLE, shown
from transformer.core.vocab import PAD_ID
from transformer.data import Targets
from transformer.data.base import Split
from transformer.data.pipeline import pad_batch
from transformer.model.decoding import generate
from transformer.model.families import ARCHS
from transformer.model.sampling import GREEDY, Sampling
from transformer.run import checkpoint, eval_files, experiment, sharding
from transformer.run import overrides as overrides_lib
from transformer.run import workdir as workdir_lib
from transformer.run.config import EvalConfig
from transformer.run.eval_files import Decoding, text_paths
from transformer.run.evaluator import Evaluator, check_split_lengths, generates_answers

log = logging.getLogger("transformer")
KERNEL = "model.attention.kernel"


@dataclasses.dataclass(frozen=True)
class RestoredRun:
  """A trained run restored for evaluation."""

  workdir: str
  experiment: experiment.Experiment  # from the run's config.json, executable on this machine
  steps: list[int]  # the checkpoints whose parameters `params` averages (one: no averaging)
  params: dict
  # {path: value} of the execution fields evaluated otherwise than the run's config says
  # (overrides_lib.apply); the files of its evaluation are named after them (overrides_lib.suffix)
  overrides: dict = dataclasses.field(default_factory=dict)

  @property
  def suffix(self) -> str:
    return overrides_lib.suffix(self.overrides)


def restore_run(workdir: str, step: int | None = None, average: int = 1,
                override: dict[str, str] | None = None, announce: bool = True) -> RestoredRun:
  """The run in `workdir` ready to evaluate, its parameters (only) laid out on this
  process's devices: checkpoint `step`, by default the newest that restores; average > 1:
  the mean parameters of the last `average` checkpoints up to it; `override` ({path:
  text}, eval.py's --config.PATH=VALUE) sets execution fields of its config (overrides_lib.apply:
  a ConfigError, before any work, for one it may not set). The kernel and mesh it was
  trained with need not run here (experiment.build(evaluating=True)); a kernel given in
  `override` must (the files of the evaluation are named after it). `announce`: log the
  kernels chosen at once (else the caller does, once its own checks pass:
  experiment.announce_kernels)."""
  cfg, applied = overrides_lib.apply(workdir_lib.saved_config(workdir), override or {})
  exp = experiment.build(cfg, workdir, evaluating=True, announce=announce,
                         kernel_asked_here=KERNEL in applied)
  abstract = jax.eval_shape(exp.init)["params"]
  shardings = sharding.param_shardings(abstract, exp.param_specs, exp.mesh)
  steps, params = checkpoint.restore_params(workdir, abstract, shardings, step, average)
  exp.source.load(has_checkpoints=True)
  return RestoredRun(workdir, exp, steps, params, applied)


def own_decoding(exp: experiment.Experiment) -> Decoding:
  """The decoding a run's config asks for (greedy, or config.eval.sampling with its seed):
  how training evaluates it, and eval.py's default."""
  sampling, seed = chosen_sampling(exp.eval, {})
  return Decoding(sampling=sampling, seed=seed)


def output_path(run: RestoredRun, output: str | None, decoding: Decoding = Decoding()) -> str:
  """Where the metrics go: `output`, or by default WORKDIR/eval_step_N[,...].json named after
  the overrides, the averaged checkpoints and the decoding where they are not the run's own
  (eval_files.default_path); a ConfigError, before any evaluation, if that directory cannot
  be written or the file holds an evaluation made otherwise (eval_files.check_output)."""
  output = output or eval_files.default_path(run.workdir, run.steps, run.overrides, decoding,
                                             own_decoding(run.experiment))
  eval_files.check_output(output, run.steps, run.overrides, decoding)
  return output


def splits_of(run: RestoredRun, files: tuple[str, str] | None = None) -> dict[str, Split]:
  """The splits an evaluation of `run` scores: its held-out splits, or the (source,
  reference) text `files` instead; read and checked (a ConfigError) before any work."""
  exp = run.experiment
  splits = exp.source.eval_splits() if files is None else exp.source.file_split(*files)
  check_split_lengths(exp, splits)
  return splits


def evaluate_run(run: RestoredRun, output: str | None = None, beam_size: int = 1, alpha: float = 0.6,
                 files: tuple[str, str] | None = None, should_stop=lambda: False,
                 sampling: Sampling = GREEDY, seed: int = 0,
                 splits: dict[str, Split] | None = None) -> tuple[int, dict, str]:
  """Evaluates every held-out split of a run restored by restore_run, or the (source,
  reference) text `files` instead (`splits`: those of splits_of, read already), and writes
  the metrics as JSON (and, for text, the
  detokenized predictions and the references beside it, one file each per split:
  text_paths). A family that decodes decodes greedily, with beam search (beam_size > 1)
  or as `sampling` says (its draws from `seed`). Returns (step, metrics, metrics path). A
  stop request (`should_stop`) during the evaluation raises Interrupted; nothing is written
  then."""
  exp, step = run.experiment, run.steps[-1]
  check_decoding(exp, beam_size, sampling)
  decoding = Decoding(beam_size, alpha, sampling, seed)
  output = output_path(run, output, decoding)
  splits = splits_of(run, files) if splits is None else splits
  log.info("evaluating step %d of %s: %s", step, run.workdir,
           ", ".join(f"{name} ({len(split)} examples)" for name, split in splits.items()))
  evaluator = Evaluator(exp, beam_size, alpha, sampling, seed)
  results, hypotheses = evaluator.evaluate(run.params, splits, should_stop)
  try:
    for split, lines in hypotheses.items():
      if lines is not None:
        predictions, references = text_paths(output, split)
        storage.write(predictions, "".join(line + "\n" for line in lines))
        storage.write(references, "".join(line + "\n" for line in splits[split].references))
        results[split].update(predictions=predictions, references=references)
    storage.write(output, json.dumps(
        {"step": step, "averaged_steps": run.steps, "workdir": storage.absolute(run.workdir),
         "overrides": run.overrides, **decoding.record(), "splits": results}, indent=2))
  except OSError as e:
    raise RunError(f"cannot write the metrics to {output}: {e.strerror}; the results were: "
                   f"{json.dumps(results)}") from None
  return step, results, output


def check_decoding(exp: experiment.Experiment, beam_size: int,
                   sampling: Sampling = GREEDY) -> None:
  """A ConfigError for beam search (beam_size > 1) on a family that does not decode: its
  held-out splits are scored position by position (nothing is searched), so the option
  would be recorded beside metrics it did not change; and for beam search with sampling,
  which beam search does not do."""
  if beam_size > 1 and not exp.family.decodes:
    decoding = " or ".join(name for name, family in ARCHS.items() if family.decodes)
    greedy = ", and --generate is greedy or sampled" if exp.family.generates else ""
    scored = ("its held-out answers are generated greedily or sampled" if generates_answers(exp)
              else "its held-out splits are scored token by token")
    raise ConfigError(f"--beam_size {beam_size}: this run's model.arch {exp.model.arch!r} does "
                      f"not decode ({scored}{greedy}); beam search is for model.arch {decoding}")
  if beam_size > 1 and not sampling.greedy:
    raise ConfigError(f"--beam_size {beam_size} with sampling ({sampling}): beam search keeps "
                      "the most likely hypotheses and draws nothing; sample with --beam_size 1")


def chosen_sampling(defaults: EvalConfig, overrides: dict, seed: int | None = None,
                    beam_size: int = 1) -> tuple[Sampling, int]:
  """(sampling, seed) of an evaluation: the run's config.eval.sampling with the fields in
  `overrides` ({"temperature": 0.8, ...}, eval.py's flags) in their place, and `seed` or
  config.eval.sample_seed. An override of temperature 0 decodes greedily (the config's
  filters are dropped with it), and so does beam search (beam_size > 1) without overrides:
  the config's sampling is for one beam. A FieldError for a value out of range; a
  ConfigError for a seed given to greedy decoding."""
  greedy = overrides.get("temperature") == 0 or (beam_size > 1 and not overrides and seed is None)
  base = GREEDY if greedy else defaults.sampling
  sampling = dataclasses.replace(base, **overrides)
  if seed is not None and sampling.greedy:
    raise ConfigError("--sample_seed applies to sampling, which --temperature 0 (greedy) does "
                      "not do; give --temperature > 0")
  return sampling, defaults.sample_seed if seed is None else seed


def check_sampling(exp: experiment.Experiment, sampling: Sampling, metrics: bool,
                   sentences: bool, generate: bool) -> None:
  """A ConfigError for sampling (temperature > 0) where nothing eval.py is asked to do
  would sample: it samples the decoding of the metrics and of the pictures' `sentences`
  by a family that decodes, the answers of the metrics where they are generated after
  prompts, and a language model's continuations (`generate`); the held-out splits of the
  other families are scored token by token."""
  if sampling.greedy or generate or (exp.family.decodes and (metrics or sentences)):
    return
  if generates_answers(exp) and metrics:
    return
  if exp.family.decodes:
    why = "nothing is decoded with --nometrics and no --sentence"
  elif generates_answers(exp):
    why = ("answers are generated for the metrics only (--nometrics); continue a --sentence "
           "with --generate")
  else:
    generating = "; a language model samples with --generate" if exp.family.generates else ""
    why = (f"this run's model.arch {exp.model.arch!r} does not decode (its held-out splits "
           f"are scored token by token){generating}")
  raise ConfigError(f"sampling ({sampling}) would change nothing: {why}")


def check_prompts(exp: experiment.Experiment, prompts: list[str], num_tokens: int
                  ) -> list[np.ndarray]:
  """The prompts' token ids if continue_prompts can continue them by num_tokens (a family
  that generates, prompts the source encodes, a length the positions cover); else a
  ConfigError, before any work."""
  if not exp.family.generates:
    raise ConfigError(f"--generate needs a language model (a family that generates); this "
                      f"run's model.arch is {exp.model.arch!r}")
  if not prompts:
    raise ConfigError(f"--generate {num_tokens} continues each --sentence: give at least one")
  encoded = [exp.source.encode(p) for p in prompts]
  max_len = max(len(e) for e in encoded) + num_tokens
  experiment.check_length(exp.abstract_model, max_len, "--generate")
  return encoded


def continue_prompts(run: RestoredRun, prompts: list[str], num_tokens: int,
                     sampling: Sampling = GREEDY, seed: int = 0) -> list[str]:
  """A language model's KV-cached continuation of each prompt by num_tokens tokens, greedy
  or as `sampling` says (its draws from `seed`), as text (prompt included)."""
  exp = run.experiment
  encoded = check_prompts(exp, prompts, num_tokens)
  lengths = np.array([len(e) for e in encoded], np.int32)
  padded = np.zeros((len(encoded), lengths.max()), np.int32)
  for row, e in enumerate(encoded):
    padded[row, :len(e)] = e
  max_len = int(lengths.max()) + num_tokens
  model = nnx.merge(exp.graphdef, run.params)
  tokens, _ = nnx.jit(generate, static_argnums=(3, 4))(model, padded, lengths, max_len,
                                                       sampling, jax.random.key(seed))
  return [exp.source.detokenize(row[:n + num_tokens])
          for row, n in zip(np.asarray(tokens), lengths)]


def sentence_predictions(run: RestoredRun, sentences: list[str]) -> list[str]:
  """What a family that does not decode predicts for each sentence, as a phrase: the label
  of the sequence (read at its first token), the label of each token, a language model's
  next token after the sentence, or the first symbol of the answer after a prompt (the
  source's targets say which)."""
  exp = run.experiment
  encoded = [exp.source.encode(s) for s in sentences]
  batch = pad_batch([(e, e) for e in encoded], max(len(e) for e in encoded))
  graphdef = exp.graphdef
  logits = jax.jit(lambda params, b: nnx.merge(graphdef, params)(b))(run.params, batch)
  if generates_answers(exp):  # as evaluation generates answers: never PAD
    logits = logits.at[..., PAD_ID].set(-jax.numpy.inf)
  predicted = np.asarray(jax.numpy.argmax(logits, axis=-1))
  phrases = []
  for tokens, labels in zip(encoded, predicted):
    if exp.source.targets is Targets.SEQUENCE_LABELS:
      phrases.append(f"predicted label {labels[0]}")
    elif exp.source.targets is Targets.TOKEN_LABELS:
      pieces = exp.source.pieces(tokens)
      phrases.append("predicted labels " + " ".join(
          f"{piece}:{label}" for piece, label in zip(pieces, labels[:len(tokens)])))
    else:  # Targets.NEXT_TOKENS, PROMPTED_ANSWERS
      following = exp.source.pieces(labels[len(tokens) - 1:len(tokens)])[0]
      phrases.append(f"predicted answer begins {following!r} (--generate N continues it)"
                     if generates_answers(exp) else f"predicted next token {following!r}")
  return phrases


def format_table(results: dict[str, dict]) -> str:
  """eval.py's table of {split: metrics}: a row per split, a column per metric declared
  shown in a table (core/metrics.py METRICS) that some split has, in METRICS' order."""
  columns = [c for c in shown(TABLE) if any(c in m for m in results.values())]
  width = max(10, *(len(name) + 1 for name in results))
  w = {c: max(13, len(c) + 2) for c in columns}
  rows = [f"{'split':<{width}}{'examples':>10}" + "".join(f"{c:>{w[c]}}" for c in columns)]
  for name, m in results.items():
    rows.append(f"{name:<{width}}{m['examples']:>10d}" + "".join(
        f"{m[c]:>{w[c]}.4f}" if c in m else " " * w[c] for c in columns))
  signatures = {m["bleu_signature"] for m in results.values() if "bleu_signature" in m}
  return "\n".join(rows + [f"sacreBLEU signature: {s}" for s in signatures])
