"""train.init_from: a new run that starts from another run's parameters, not from random
ones; its optimizer state and step start afresh (a fine-tune: e.g. a rotary model trained
at L, trained on at 2L under YaRN's scaling).

The source is a workdir (its newest checkpoint) or one checkpoint of it,
WORKDIR/checkpoints/STEP. It is the new run's identity (core/fields.py: what its
parameters mean), so resuming the new run with another source is refused like any other
identity change; once the new run has a checkpoint it resumes from its own, and the source
is not read again. Before anything is written the source is checked: a training workdir
with a checkpoint, whose parameters have this model's tree and shapes (the first that
differs is named). Fields that change no parameter may differ (a RoPE scaling, the data's
lengths, the positional encoding of a layer without parameters); that they make sense
together is the researcher's call. A source whose tokenizer differs from the new run's gives
its token ids other meanings: train both on the same corpus with the same tokenizer
settings, or give data.tokenizer=SOURCE/spm.model.
"""

import dataclasses
import logging

import jax
import orbax.checkpoint as ocp
from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.run import checkpoint, experiment
from transformer.run import workdir as workdir_lib

log = logging.getLogger("transformer")
FIELD = "config.train.init_from"


@dataclasses.dataclass(frozen=True)
class Source:
  """The checkpoint a run starts from: a workdir and its step."""

  workdir: str
  step: int

  def __str__(self) -> str:
    return f"{self.workdir} (step {self.step})"


def _split(path: str) -> tuple[str, int | None]:
  """(workdir, step) of WORKDIR or WORKDIR/checkpoints/STEP (step None: the newest)."""
  p = epath.Path(storage.absolute(path))
  if p.parent.name == "checkpoints" and p.name.isdigit():
    return str(p.parent.parent), int(p.name)
  return str(p), None


def check(exp: experiment.Experiment, workdir: str) -> Source | None:
  """The source of cfg.train.init_from (None: none), checked as the module docstring says;
  a ConfigError naming the value and what is wrong. Reads only the source's files."""
  given = exp.train.init_from
  if not given:
    return None
  source, step = _split(given)
  named = f"{FIELD}={given!r}"
  if not epath.Path(source).is_dir():
    raise ConfigError(f"{named}: no such directory{workdir_lib.near_name(source)}; give a "
                      "training workdir or one of its checkpoints (WORKDIR/checkpoints/STEP)")
  if storage.absolute(source) == storage.absolute(workdir):
    raise ConfigError(f"{named} is this run's own workdir; give another run's")
  if not (epath.Path(source) / workdir_lib.CONFIG_FILE).exists():
    raise ConfigError(f"{named}: not a training workdir (no {workdir_lib.CONFIG_FILE})")
  steps = checkpoint.steps(source)
  if not steps:
    raise ConfigError(f"{named}: the run there has no checkpoint (train it first)")
  if step is not None and step not in steps:
    raise ConfigError(f"{named}: no checkpoint at step {step}; its steps: {steps}")
  found = Source(source, steps[-1] if step is None else step)
  problem = mismatch(saved_shapes(found), shapes(jax.eval_shape(exp.init)["params"]))
  if problem:
    raise ConfigError(f"{named}: its parameters do not fit this model: {problem}; init_from "
                      "takes a run of the same parameter shapes (fields that change no "
                      "parameter, such as a RoPE scaling, may differ)")
  return found


def shapes(params) -> dict[str, tuple[int, ...]]:
  """{dotted path: shape} of a parameter tree (arrays or their metadata)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
          tuple(leaf.shape) for path, leaf in flat}


def mismatch(theirs: dict[str, tuple], ours: dict[str, tuple]) -> str:
  """The first difference between the source's parameter shapes and this model's ('' if
  none), in this model's order of parameters."""
  for path, shape in ours.items():
    if path not in theirs:
      return f"this model's parameter {path} {list(shape)} is not in its checkpoint"
    if theirs[path] != shape:
      return f"{path} is {list(theirs[path])} there and {list(shape)} here"
  extra = [path for path in theirs if path not in ours]
  return f"its parameter {extra[0]} {list(theirs[extra[0]])} is not in this model" if extra else ""


def saved_shapes(source: Source) -> dict[str, tuple[int, ...]]:
  """The parameters' shapes in the source's checkpoint, from its metadata (no array read)."""
  mngr = ocp.CheckpointManager(
      checkpoint.checkpoint_dir(source.workdir),
      item_handlers={"state": ocp.PyTreeCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(read_only=True, create=False))
  try:
    metadata = mngr.item_metadata(source.step)["state"]
  except Exception as e:  # noqa: BLE001 - orbax raises many types for a damaged checkpoint
    raise ConfigError(f"{FIELD}: the checkpoint at step {source.step} in {source.workdir} "
                      f"does not read ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                      ) from None
  finally:
    mngr.close()
  tree = getattr(metadata, "tree", metadata)
  return shapes(tree["params"])


def initial_state(exp: experiment.Experiment, compiled, source: Source) -> dict:
  """The train state at step 0 with the source's parameters, laid out as `compiled`
  (step.CompiledStep) lays out the state, and the optimizer's initial state for them."""
  shardings = compiled.state_sharding
  abstract = jax.eval_shape(exp.init)["params"]
  _, params = checkpoint.restore_params(source.workdir, abstract, shardings["params"],
                                        source.step, own_log=False)
  fresh = jax.jit(lambda p: {**exp.init(), "params": p, "opt_state": exp.optimizer.init(p)},
                  out_shardings=shardings)
  state = fresh(params)
  log.info("initialised from the parameters of %s; the optimizer state and the step start "
           "afresh", source)
  return state
