"""Where eval.py's results go, named after how they were obtained, so that no evaluation
replaces another one (a sampled or beam-searched evaluation goes beside the greedy
eval_step_N.json, never over it).

WORKDIR/eval_step_N.json holds the run's own evaluation: its checkpoint at step N, its config
(no overrides) and the decoding its config asks for (greedy, or config.eval.sampling with
config.eval.sample_seed), as training evaluates. Any other evaluation adds to the name what
differs, in this order: the overrides (overrides.suffix: ',rotary.scaling=yarn'), the
averaged checkpoints (',average=5'), and the decoding (',beam=4,alpha=0.6', ',greedy' where
the config samples, or ',temperature=0.8,top_p=0.95,seed=1'). A file found at the path (the
default or --output) that holds an evaluation made otherwise is never replaced: a
ConfigError, before any work.
"""

import dataclasses
import json

from etils import epath

from transformer.core import storage
from transformer.core.errors import ConfigError
from transformer.model.sampling import GREEDY, Sampling
from transformer.run import overrides as overrides_lib


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How an evaluation decodes (a family that decodes or generates answers): greedy or
  sampled as `sampling` says (its draws from `seed`), or beam search when beam_size > 1."""

  beam_size: int = 1
  alpha: float = 0.6
  sampling: Sampling = GREEDY
  seed: int = 0

  def key(self) -> dict:
    """What tells two decodings apart (a greedy one's seed and a beam's sampling do not)."""
    if self.beam_size > 1:
      return {"beam_size": self.beam_size, "alpha": self.alpha}
    if self.sampling.greedy:
      return {"sampling": "greedy"}
    return {"sampling": {**dataclasses.asdict(self.sampling), "seed": self.seed}}

  def record(self) -> dict:
    """The decoding's fields as an evaluation's JSON records them."""
    return {"beam_size": self.beam_size, "alpha": self.alpha,
            "sampling": {**dataclasses.asdict(self.sampling), "seed": self.seed}}

  @classmethod
  def of_record(cls, record: dict) -> "Decoding":
    """The decoding an evaluation's JSON records (fields it lacks at their defaults)."""
    sampling = dict(record.get("sampling") or {})
    seed = sampling.pop("seed", 0)
    return cls(record.get("beam_size", 1), record.get("alpha", 0.6), Sampling(**sampling),
               seed)

  def suffix(self, default: "Decoding") -> str:
    """What a file name adds for this decoding where a run's own is `default`."""
    if self.key() == default.key():
      return ""
    if self.beam_size > 1:
      return f",beam={self.beam_size},alpha={self.alpha}"
    if self.sampling.greedy:
      return ",greedy"
    s = self.sampling
    parts = [f"temperature={s.temperature}", f"top_k={s.top_k}" if s.top_k else "",
             f"top_p={s.top_p}" if s.top_p < 1 else "", f"min_p={s.min_p}" if s.min_p else "",
             f"seed={self.seed}"]
    return "".join(f",{p}" for p in parts if p)

  def __str__(self) -> str:
    if self.beam_size > 1:
      return f"beam search, {self.beam_size} beams, length penalty alpha {self.alpha}"
    return "greedy" if self.sampling.greedy else f"sampled ({self.sampling}, seed {self.seed})"


def default_path(workdir: str, steps: list[int], overrides: dict, decoding: Decoding,
                 default: Decoding) -> str:
  """WORKDIR/eval_step_N[,...].json of an evaluation (module docstring): `steps` the
  checkpoints whose parameters it averages, the last one N; `default` the run's own
  decoding."""
  average = f",average={len(steps)}" if len(steps) > 1 else ""
  return storage.join(workdir, f"eval_step_{steps[-1]}{overrides_lib.suffix(overrides)}"
                               f"{average}{decoding.suffix(default)}.json")


def check_output(output: str, steps: list[int], overrides: dict, decoding: Decoding) -> None:
  """A ConfigError if `output`'s directory cannot be written, or `output` holds an
  evaluation made otherwise: of other checkpoints, under other overrides or decoded
  otherwise (module docstring)."""
  problem = storage.writable_directory(str(epath.Path(storage.absolute(output)).parent))
  if problem:
    raise ConfigError(f"cannot write the metrics to {output}: {problem}; give another path "
                      "with --output")
  record = _record(output)
  if record is None:
    return
  differs = []
  if record.get("averaged_steps", steps) != steps:
    differs.append(f"its checkpoints: steps {record['averaged_steps']} (this one: {steps})")
  theirs = record.get("overrides") or {}
  if theirs != json.loads(json.dumps(overrides)):
    differs.append(f"its overrides: {overrides_lib.describe(theirs)} (this one: "
                   f"{overrides_lib.describe(overrides)})")
  try:
    found = Decoding.of_record(record)
  except (TypeError, ValueError):
    found = None
  if found is None or found.key() != decoding.key():
    differs.append(f"its decoding: {found or 'unknown'} (this one: {decoding})")
  if differs:
    raise ConfigError(f"{output} holds another evaluation ({'; '.join(differs)}), which this "
                      "one would replace; give another --output, or move it away")


def _record(path: str) -> dict | None:
  """The JSON object that eval.py wrote at `path`; None if there is no such file, or it is
  not an evaluation's (nothing of another evaluation to keep)."""
  file = epath.Path(storage.absolute(path))
  try:
    record = json.loads(file.read_text()) if file.exists() else None
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and "splits" in record else None


def text_paths(output: str, split: str) -> tuple[str, str]:
  """(hypotheses, references) of a text split, one line each, beside the metrics `output`:
  the references make the file pair self-contained (compare.py's paired bootstrap checks
  that two evaluations scored the same test set)."""
  stem = output.removesuffix(".json")
  return f"{stem}.{split}.txt", f"{stem}.{split}.references.txt"
