"""The decoder cast of the generated tasks (data/tasks/casts.py DecoderAnswer, data.cast=decoder):
its rows against a hand-built example; evaluation's greedy, KV-cached answers against oracle
models (right: every metric 1.0; wrong at one answer symbol: the error cascades through the
generated answer as it must, not under teacher forcing); a cast that does not fit the arch
refused naming what fits; and the cast training and evaluating every task of the registry at
tiny size. Every task × cast's rows: tests/test_tasks.py; end to end in configs/chomsky.py:
tests/test_algorithmic.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.support import chomsky_tiny_config
from transformer.core.errors import ConfigError
from transformer.core.vocab import NUM_RESERVED
from transformer.data import Targets
from transformer.data.tasks.algorithmic import AlgorithmicSource
from transformer.data.tasks.casts import CASTS
from transformer.data.tasks.problem import Instance
from transformer.model.sampling import GREEDY, Sampling
from transformer.run import experiment
from transformer.run.config import parse, replace
from transformer.run.restored_run import (RestoredRun, check_decoding, check_sampling,
                                          sentence_predictions)
from transformer.run.evaluator import Evaluator
from transformer.run.step import make_train_step

DECODER = CASTS["decoder"]
TASKS = AlgorithmicSource.Task.registry


# --------------------------------------------------------------------------- rows


def test_rows_are_prompt_separator_answer_scored_on_the_answer():
  task = TASKS["reverse_string"](min_len=1, max_len=3, test_max_len=3)  # symbols 0, 1
  rows = [DECODER.row(task, Instance(np.array([0, 1, 1], np.int32),
                                     np.array([1, 1, 0], np.int32), 3)),
          DECODER.row(task, Instance(np.array([1], np.int32), np.array([1], np.int32), 1))]
  arrays = DECODER.batch(rows, 8)
  assert NUM_RESERVED == 3 and DECODER.separator(task) == 5  # the token after both alphabets'
  assert DECODER.vocab_size(task) == 6 and DECODER.num_classes(task) == 0
  assert DECODER.width(task, range(1, 4)) == 3 + 1 + 3
  expected = {  # 0 1 1 <sep> 1 1 0 | 1 <sep> 1, as tokens (symbol + 3)
      "inputs": [[3, 4, 4, 5, 4, 4, 3, 0], [4, 5, 4, 0, 0, 0, 0, 0]],
      "targets": [[4, 4, 5, 4, 4, 3, 0, 0], [5, 4, 0, 0, 0, 0, 0, 0]],
      "targets_segmentation": [[0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]],
      "inputs_positions": [[0, 1, 2, 3, 4, 5, 6, 0], [0, 1, 2, 0, 0, 0, 0, 0]],
      "inputs_segmentation": [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]]}
  assert arrays.keys() == expected.keys()
  for key, value in expected.items():
    assert arrays[key].tolist() == value, key
  assert DECODER.encode(task, np.array([0, 1, 1])).tolist() == [3, 4, 4, 5]
  assert DECODER.pieces(task, [3, 4, 4, 5]) == ["0", "1", "1", "<sep>"]
  got = [(a.tolist(), p.tolist()) for a, p in DECODER.answers(arrays, arrays["targets"])]
  assert got == [([1, 1, 0], [1, 1, 0]), ([1], [1])]


def test_the_source_declares_prompted_answers():
  exp = experiment.build(parse(chomsky_tiny_config(max_len=4, test_max_len=6)))
  assert exp.source.targets is Targets.PROMPTED_ANSWERS and exp.model.vocab_size == 6
  assert exp.source.max_lengths() == {"task.max_len": 4 + 1 + 4, "task.test_max_len": 13}
  assert exp.source.encode("1 0").tolist() == [4, 3, 5]


# --------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class _Vocab:
  vocab_size: int


class ReverseOracle(nnx.Module):
  """A model of reverse_string under the decoder cast, no parameters: after the separator it
  predicts answer symbol k (input symbol p − 1 − k) if k ≠ `fault` and the token it was fed
  is the right previous one (the separator for k = 0); else the separator, never right. Its
  generated answers are right up to `fault`, then wrong: each error feeds the next. Teacher
  forced, it is wrong only at `fault`."""

  def __init__(self, vocab_size: int, sep: int, fault: int = -1):
    self.cfg, self.sep, self.fault = _Vocab(vocab_size), sep, fault
    self.seen: nnx.Cache | None = nnx.data(None)  # the tokens fed so far, by init_decoding

  def _next(self, seq, t):
    """The token predicted after position t of seq [L] (only seq[:t + 1] is read)."""
    length = seq.shape[0]
    is_sep = (seq == self.sep) & (jnp.arange(length) <= t)
    p = jnp.argmax(is_sep)
    k = t - p
    right = seq[jnp.clip(p - 1 - k, 0, length - 1)]
    fed_right = (k == 0) | (seq[t] == seq[jnp.clip(p - k, 0, length - 1)])
    ok = is_sep.any() & (k >= 0) & (k < p) & fed_right & (k != self.fault)
    return jnp.where(ok, right, self.sep)

  def _logits(self, tokens):
    return 10.0 * jax.nn.one_hot(tokens, self.cfg.vocab_size, dtype=jnp.float32)

  def __call__(self, batch, *, rngs=None):
    seq = batch["inputs"]
    nxt = jax.vmap(lambda s: jax.vmap(lambda t: self._next(s, t))(jnp.arange(s.shape[0])))(seq)
    return self._logits(nxt)

  def init_decoding(self, batch, max_len, repeat=1):
    self.seen = nnx.Cache(jnp.zeros((batch["inputs"].shape[0] * repeat, max_len), jnp.int32))

  def decode_step(self, tokens, index):
    seen = jax.lax.dynamic_update_slice_in_dim(self.seen[...], tokens, index, axis=1)
    self.seen = nnx.Cache(seen)
    return self._logits(jax.vmap(lambda s: self._next(s, index))(seen)[:, None])


def _oracle_run(fault: int) -> RestoredRun:
  """ReverseOracle(fault) as a run of reverse_string (lengths 1..4, tested at 5..6; 14 rows
  a split, in batches of 8, the last padded)."""
  config = chomsky_tiny_config(max_len=4, test_max_len=6)
  config.eval.update(num_examples=14, batch_size=8)
  exp = experiment.build(parse(config))
  oracle = ReverseOracle(exp.model.vocab_size, DECODER.separator(exp.source.task), fault)
  graphdef, params = nnx.split(oracle)
  return RestoredRun("", dataclasses.replace(exp, graphdef=graphdef), [0], params)


def _oracle_results(fault: int):
  """The held-out splits of _oracle_run(fault) and its evaluation."""
  run = _oracle_run(fault)
  splits = run.experiment.source.eval_splits()
  return splits, Evaluator(run.experiment).evaluate(run.params, splits)[0]


def test_an_oracle_scores_one():
  _, results = _oracle_results(fault=-1)
  for name, lengths in (("valid", range(1, 5)), ("test", range(5, 7))):
    metrics = results[name]
    assert metrics["accuracy"] == metrics["exact_match"] == metrics["mean_accuracy"] == 1.0
    assert metrics["accuracy_by_length"] == {n: 1.0 for n in lengths}
    assert metrics["loss"] < 1e-3 and metrics["examples"] == 14


@pytest.mark.parametrize("fault", [0, 1])
def test_answers_are_generated_not_teacher_forced(fault):
  """Wrong at answer symbol `fault`: generated, every later symbol is wrong too (accuracy
  min(fault, n)/n at length n, exact only where n ≤ fault); teacher forced, only symbol
  `fault` is. Fault 0: nothing of the answer is taken from the row (its first symbol is
  generated, not forced)."""
  splits, results = _oracle_results(fault)
  for name, split in splits.items():
    metrics, lengths = results[name], split.lengths
    assert metrics["accuracy_by_length"] == pytest.approx(
        {n: min(fault, n) / n for n in set(lengths)})
    assert metrics["exact_match"] == pytest.approx(np.mean(lengths <= fault))
    assert metrics["accuracy"] == pytest.approx(1 - np.sum(lengths > fault) / np.sum(lengths))


def test_a_sentence_is_answered_by_its_first_symbol():
  assert sentence_predictions(_oracle_run(fault=-1), ["0 1 1", "1 0"]) == [
      "predicted answer begins '1' (--generate N continues it)",
      "predicted answer begins '0' (--generate N continues it)"]


def test_sampling_and_beams_of_generated_answers():
  """Sampling changes the generated answers of the metrics (allowed); beam search is refused
  saying how the answers are made."""
  exp = experiment.build(parse(chomsky_tiny_config()), evaluating=True)
  hot = Sampling(temperature=1.0)
  check_sampling(exp, hot, metrics=True, sentences=False, generate=False)
  with pytest.raises(ConfigError, match="answers are generated for the metrics only"):
    check_sampling(exp, hot, metrics=False, sentences=True, generate=False)
  with pytest.raises(ConfigError, match="held-out answers are generated greedily or sampled"):
    check_decoding(exp, 4, GREEDY)


# --------------------------------------------------------------------------- fit


@pytest.mark.parametrize("cast,arch,fragments", [
    ("decoder", "encoder", ["model.arch='encoder' cannot learn data.source 'algorithmic'",
                            "it needs one of: decoder",
                            "keep model.arch 'encoder' with data.cast slots or token_labels "
                            "(not 'decoder')"]),
    ("decoder", "encoder_decoder", ["it needs one of: decoder",
                                    "with data.cast seq2seq (not 'decoder')"]),
    ("slots", "decoder", ["model.arch='decoder' cannot learn", "it needs one of: encoder;",
                          "keep model.arch 'decoder' with data.cast decoder (not 'slots')"])])
def test_a_cast_that_does_not_fit_the_arch_is_refused(cast, arch, fragments):
  with pytest.raises(ConfigError) as caught:
    experiment.build(parse(chomsky_tiny_config(cast=cast, arch=arch)))
  message = str(caught.value)
  assert "\n" not in message and all(f in message for f in fragments), message


# --------------------------------------------------------------------------- every task


def _tiny(name):
  return TASKS[name](min_len=1, max_len=3, test_max_len=3)


# One model shape for every task (the largest vocabulary, rows padded to the longest), so
# that the train step and evaluation compile once for the registry: more vocabulary and
# more padding than a task needs change none of its tokens, weights or answers.
VOCAB = max(DECODER.vocab_size(_tiny(name)) for name in TASKS)
WIDTH = max(DECODER.width(_tiny(name), range(1, 4)) for name in TASKS)


def _padded(arrays):
  return {k: np.pad(v, ((0, 0), (0, WIDTH - v.shape[1]))) for k, v in arrays.items()}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_decoder_cast_trains_and_evaluates_every_task(name):
  """Two steps of the train step on one batch: the loss is over the answer tokens only and
  falls; then the held-out split's metrics, by length."""
  exp = experiment.build(replace(parse(chomsky_tiny_config(name)), "model.vocab_size", VOCAB))
  step = jax.jit(make_train_step(exp.graphdef, exp.optimizer, exp.schedule,
                                 label_smoothing=0.0, seed=0))
  batch = _padded(next(iter(exp.source.train_batches())))
  inputs, sep = batch["inputs"], DECODER.separator(exp.source.task)
  after_sep = (inputs != 0).sum(1) - (np.argmax(inputs == sep, axis=1) + 1)  # answer tokens
  state, first = step(exp.init(), batch)
  state, second = step(state, batch)
  assert float(first["tokens"]) == after_sep.sum() > 0
  assert float(second["loss"]) < float(first["loss"])
  splits = {k: dataclasses.replace(split, arrays=_padded(split.arrays))
            for k, split in exp.source.eval_splits().items()}
  results, _ = Evaluator(exp).evaluate(state["params"], splits)
  assert list(results) == ["valid"]  # test_max_len = max_len: no test split
  metrics = results["valid"]
  assert list(metrics["accuracy_by_length"]) == [1, 2, 3] and np.isfinite(metrics["loss"])
  rates = [metrics[k] for k in ("accuracy", "exact_match", "mean_accuracy")]
  assert all(0.0 <= v <= 1.0 for v in rates + list(metrics["accuracy_by_length"].values()))
