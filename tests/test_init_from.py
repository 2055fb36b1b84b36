"""train.init_from (transformer/run/init_from.py): a run that starts from another run's
parameters, with a fresh optimizer state at step 0; recorded in its identity; a source
whose parameters do not fit refused before anything is written; resumed exactly."""

import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from transformer.core import fields
from transformer.core.errors import ConfigError
from transformer.run import checkpoint, experiment, init_from
from transformer.run.config import parse
from transformer.run.training import train_and_evaluate
from transformer.run.workdir import read_metrics


def _flat(tree) -> dict:
  """{dotted path: array} of a tree, list indices and their saved string keys alike."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(x)
          for path, x in flat}


def _equal(a, b) -> None:
  a, b = _flat(a), _flat(b)
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def _state(workdir, step):
  """The whole train state saved at `step`: step, params, opt_state."""
  mngr = checkpoint.manager(workdir, read_only=True)
  return mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A tiny run of 20 steps (checkpoints at 10 and 20)."""
  from tests.support import make_tiny_config  # noqa: PLC0415

  workdir = str(tmp_path_factory.mktemp("source") / "run")
  train_and_evaluate(parse(make_tiny_config(**{"train.num_steps": 20})), workdir)
  return workdir


def test_shapes_and_the_first_mismatch():
  ours = {"a.kernel": (2, 3), "b.bias": (3,)}
  assert init_from.mismatch(dict(ours), ours) == ""
  assert init_from.mismatch({"a.kernel": (2, 4), "b.bias": (3,)}, ours) == (
      "a.kernel is [2, 4] there and [2, 3] here")
  assert init_from.mismatch({"a.kernel": (2, 3)}, ours) == (
      "this model's parameter b.bias [3] is not in its checkpoint")
  assert init_from.mismatch({**ours, "c": (1,)}, ours) == (
      "its parameter c [1] is not in this model")
  assert init_from.shapes({"layers": {0: {"w": np.zeros((2, 5))}}}) == {"layers.0.w": (2, 5)}


def test_a_run_starts_from_the_source_parameters_and_a_fresh_optimizer(source, tmp_path,
                                                                        tiny_config):
  """At step 0 the new run holds exactly the source's parameters (its step 10, named as
  WORKDIR/checkpoints/10) and the optimizer's initial state for them; a model of another
  rotary scaling (an execution field) takes them; the source is the run's identity."""
  workdir = str(tmp_path / "finetune")
  given = os.path.join(source, "checkpoints", "10")
  config = tiny_config(**{"train.init_from": given, "train.num_steps": 5,
                          "train.checkpoint_every": 5, "model.position": "rotary"})
  # the source trained with sinusoids: positions without parameters, so the shapes fit
  cfg = parse(config)
  assert cfg.train.init_from == os.path.abspath(given)
  assert fields.identity(cfg)["train.init_from"] == os.path.abspath(given)
  seeded = parse(tiny_config(**{"seed": 2, "train.init_from": "runs/rotary,seed={seed}"}))
  assert seeded.train.init_from == os.path.abspath("runs/rotary,seed=2")  # a sweep's seeds
  exp = experiment.build(cfg)
  src = init_from.check(exp, workdir)
  assert (src.workdir, src.step) == (source, 10)
  from transformer.run.step import compile_step  # noqa: PLC0415

  state = init_from.initial_state(exp, compile_step(exp), src)
  expected = _state(source, 10)
  assert int(state["step"]) == 0 and int(expected["step"]) == 10
  _equal(state["params"], expected["params"])
  fresh = exp.optimizer.init(state["params"])
  _equal(state["opt_state"], fresh)
  counts = [x for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) == 0]
  assert counts and all(int(c) == 0 for c in counts)  # Adam's count: nothing seen yet
  # the source's own optimizer state has moved
  assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(expected["opt_state"]))
  assert optax.tree.norm(fresh) == 0


def test_an_init_from_run_resumes_exactly_and_refuses_another_source(source, tmp_path,
                                                                      tiny_config):
  config = tiny_config(**{"train.init_from": source, "train.num_steps": 20,
                          "model.dropout": 0.1})
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train_and_evaluate(parse(config), straight)
  calls = []
  stopped = train_and_evaluate(parse(config), resumed,
                               should_stop=lambda: calls.append(1) or len(calls) == 8)
  assert stopped == 7
  assert train_and_evaluate(parse(config), resumed) == 20
  a, b = _state(straight, 20), _state(resumed, 20)
  _equal(a, b)
  # it went on from where the source was: its first steps' loss is below the source's own
  # first steps' (from random parameters, the same batches), and its parameters moved on
  first = lambda w: next(r["loss"] for r in read_metrics(w) if r["split"] == "train")  # noqa: E731
  assert first(straight) < first(source) - 0.1
  start = _state(source, 20)["params"]
  assert not all(np.array_equal(x, y) for x, y in
                 zip(jax.tree.leaves(start), jax.tree.leaves(a["params"])))
  for other in ({"train.init_from": os.path.join(source, "checkpoints", "10")}, {}):
    changed = tiny_config(**{"train.num_steps": 20, "model.dropout": 0.1, **other})
    with pytest.raises(ConfigError, match=r"different config.train \(differs in: init_from\)"):
      train_and_evaluate(parse(changed), resumed)


def test_a_source_that_does_not_fit_is_refused(source, tmp_path, tiny_config):
  def refused(**overrides):
    cfg = parse(tiny_config(**overrides))
    with pytest.raises(ConfigError) as e:
      init_from.check(experiment.build(cfg), str(tmp_path / "new"))
    return str(e.value)

  assert refused(**{"train.init_from": source, "model.d_ff": 48}) == (
      f"config.train.init_from={source!r}: its parameters do not fit this model: "
      "decoder.layers.0.ffn.wi.bias is [64] there and [48] here; init_from takes a run of the "
      "same parameter shapes (fields that change no parameter, such as a RoPE scaling, may "
      "differ)")
  assert ("this model's parameter decoder.position.table.embedding [16, 32] is not in its "
          "checkpoint") in refused(**{"train.init_from": source, "model.position": "learned"})
  assert "no checkpoint at step 15; its steps: [10, 20]" in refused(
      **{"train.init_from": os.path.join(source, "checkpoints", "15")})
  assert "no such directory" in refused(**{"train.init_from": str(tmp_path / "nope")})
  assert "not a training workdir (no config.json)" in refused(
      **{"train.init_from": str(tmp_path)})
  (tmp_path / "untrained").mkdir()
  (tmp_path / "untrained" / "config.json").write_text("{}")
  assert "the run there has no checkpoint (train it first)" in refused(
      **{"train.init_from": str(tmp_path / "untrained")})
  assert f"no such directory; did you mean {tmp_path / 'untrained'}?" in refused(
      **{"train.init_from": str(tmp_path / "untrianed")})
  (tmp_path / "new").mkdir()
  assert "is this run's own workdir" in refused(**{"train.init_from": str(tmp_path / "new")})
