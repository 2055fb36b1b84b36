"""The workdir of a run: its resolved config, metrics log and (checkpoint.py) checkpoints.

A workdir holds one run. Its identity is what its parameters mean: the identity fields of
its typed config (config.Config, fields.identity; execution fields such as the kernel, the
dtype or where the data lives may differ when a run is resumed or evaluated elsewhere). A
workdir with no checkpoint yet holds no run: a corrected config replaces its config.json.
"""

import difflib
import json

import jax
from etils import epath

from transformer.core import fields, storage
from transformer.core.errors import ConfigError
from transformer.run import config as config_lib

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def flatten(d: dict, prefix: str = "") -> dict:
  """{dotted path: value} of a nested dict (a config as config.to_dict gives it)."""
  out = {}
  for k, v in d.items():
    out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def check_usable(workdir: str) -> None:
  """A ConfigError if `workdir` cannot be a workdir: a file, or not creatable/writable."""
  if epath.Path(workdir).exists() and not epath.Path(workdir).is_dir():
    raise ConfigError(f"--workdir {workdir} is a file, not a directory")
  problem = storage.writable_directory(workdir)
  if problem:
    raise ConfigError(f"--workdir {workdir}: {problem}")


def check_identity(cfg: config_lib.Config, workdir: str, has_checkpoints: bool) -> None:
  """Refuses (ConfigError) a config whose identity differs from the run in `workdir`'s.
  A field missing from the saved config (added to the code since the run began) is compared
  at the value its parse gives it: the default, or the legacy value a field declares, means
  what the run did before the field existed (an old rotary run rotated every dimension, and
  resuming it with model.position_settings.rotary.rotated_fraction=0.5 is another model).
  The refusal names the fields changed: a field that one config reads and the other does not
  (rotary's settings, once model.position is another) follows from a change named there."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not has_checkpoints or not path.exists():
    return
  saved = fields.identity(saved_config(workdir))
  new = fields.identity(cfg)
  changed = ([k for k in saved if k in new and new[k] != saved[k]]
             or [k for k in saved if k not in new])
  if changed:
    section = min((k.split(".")[0] for k in changed), key=config_lib.SECTIONS.index)
    fields_changed = sorted(k.split(".", 1)[1] for k in changed if k.startswith(section + "."))
    raise ConfigError(f"workdir {workdir} holds a run with a different config.{section} "
                      f"(differs in: {', '.join(fields_changed)}); use a new --workdir")


def write_config(cfg: config_lib.Config, workdir: str) -> None:
  """Writes the resolved config (process 0)."""
  if jax.process_index() == 0:
    storage.write(storage.join(workdir, CONFIG_FILE),
                  json.dumps(config_lib.to_dict(cfg), indent=2))


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def near_name(path: str) -> str:
  """'; did you mean FOLDER/NAME?' naming the directory beside `path` (which does not exist)
  whose name is nearest its own, as a mistyped one would be; '' if none is near."""
  parent, name = epath.Path(path).parent, epath.Path(path).name
  try:
    names = [p.name for p in parent.iterdir() if p.is_dir()]
  except OSError:
    return ""
  close = difflib.get_close_matches(name, names, n=1)
  return f"; did you mean {storage.join(str(parent), close[0])}?" if close else ""


def check_is_run(workdir: str) -> None:
  """A ConfigError unless `workdir` is a directory holding a run's config.json, saying what
  it is instead: no such directory (and the nearest name beside it), a file, a directory
  that holds no run."""
  path = epath.Path(workdir)
  if not path.exists():
    raise ConfigError(f"{workdir}: no such directory{near_name(workdir)}")
  if not path.is_dir():
    raise ConfigError(f"{workdir} is a file, not a directory (a run's workdir, as train.py "
                      "writes)")
  if not (path / CONFIG_FILE).exists():
    raise ConfigError(f"{workdir} has no {CONFIG_FILE}: not a training workdir")


def load_config(workdir: str) -> dict:
  """The saved config of the run in `workdir`, as written (saved_config makes it typed); a
  ConfigError naming the file if it is missing (check_is_run), not JSON (cut short,
  garbled) or not a JSON object."""
  check_is_run(workdir)
  path = epath.Path(workdir) / CONFIG_FILE
  damaged = ("the run's saved config is damaged; restore it from a copy, or train into a "
             "new --workdir")
  try:
    raw = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                      f"{e.colno}): {damaged}") from None
  except ValueError as e:  # not UTF-8
    raise ConfigError(f"{path} is not JSON text ({type(e).__name__}): {damaged}") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{path} holds {_JSON_KINDS.get(type(raw), 'a JSON value')}, not a "
                      f"config (an object of sections: {', '.join(config_lib.SECTIONS)}): "
                      f"{damaged}")
  return raw


def saved_config(workdir: str) -> config_lib.Config:
  """The typed config of the run in `workdir` (load_config, config.parse); a ConfigError
  naming the file for a value that does not parse."""
  return _parse_saved(load_config(workdir), workdir)


def _parse_saved(raw: dict, workdir: str) -> config_lib.Config:
  try:
    return config_lib.parse(raw, saved=True)
  except ConfigError as e:
    raise ConfigError(f"{epath.Path(workdir) / CONFIG_FILE} (the run's saved config): "
                      f"{e}") from None


def _metric_lines(workdir: str) -> list[bytes]:
  path = epath.Path(workdir) / METRICS_FILE
  return path.read_bytes().splitlines() if path.exists() else []


def _is_record(record) -> bool:
  """Whether a metrics line's JSON is a record: an object with an integer step and a split."""
  return (isinstance(record, dict) and isinstance(record.get("step"), int)
          and not isinstance(record["step"], bool) and isinstance(record.get("split"), str))


def read_metrics(workdir: str) -> list[dict]:
  """The records of metrics.jsonl. A line cut short by a killed process (the beginning of
  a record: '{' and no valid JSON) is skipped; any other line that is not a record (bytes
  that are not UTF-8, text or JSON that is not an object with an integer "step" and a
  "split") is a ConfigError naming the file and the line: a damaged log, which no reader
  may take for records or silently drop."""
  path = epath.Path(workdir) / METRICS_FILE
  records = []
  for number, raw in enumerate(_metric_lines(workdir), start=1):
    if not raw.strip():
      continue
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ConfigError(_damaged(path, number, f"is not UTF-8 text (byte {e.start})")) from None
    try:
      record = json.loads(line)
    except ValueError:
      if line.lstrip().startswith("{"):
        continue  # cut short
      raise ConfigError(_damaged(path, number, f"{line[:40]!r} is not JSON")) from None
    if not _is_record(record):
      raise ConfigError(_damaged(path, number, f"{line[:40]!r} is not a metrics record (an "
                                 'object with an integer "step" and a "split")'))
    records.append(record)
  return records


def _damaged(path, number: int, problem: str) -> str:
  return (f"{path}, line {number}: {problem}: the run's metrics log is damaged; remove that "
          "line (or restore the file from a copy)")


SPLITS = "splits"  # in an evaluation's records: the splits evaluated together


def evaluation_records(step: int, results: dict[str, dict]) -> list[dict]:
  """The records of an evaluation at `step` ({split: metrics}), a split each, each naming
  every split of the evaluation (SPLITS), so that readers know the evaluation is recorded
  whole (evaluation)."""
  return [{"step": step, "split": split, **metrics, SPLITS: list(results)}
          for split, metrics in results.items()]


def evaluation(records: list[dict], step: int) -> tuple[dict[str, dict] | None, list[str]]:
  """(the held-out evaluation at `step` in `records`, {split: record}, or None unless it is
  recorded whole; the splits its records name that are missing). Whole: every split that
  its records name (SPLITS) has its record; an evaluation's records are appended in one
  write, and a process killed in that write leaves some of them, or a line cut short,
  which read_metrics skips. Records written before SPLITS existed name none: an
  evaluation of those counts as whole if any split of it is recorded, as it did then."""
  found = {r["split"]: r for r in records if r["step"] == step and r["split"] != "train"}
  named = dict.fromkeys(s for r in found.values() for s in r.get(SPLITS, ()))
  missing = [s for s in named if s not in found]
  return (found if found and not missing else None), missing


def whole(records: list[dict]) -> list[dict]:
  """The records less those of the evaluations not recorded whole (evaluation): a process
  killed in their write did nothing after it (nor gave them to a tracker)."""
  steps = {r["step"] for r in records if r["split"] != "train"}
  cut = {step for step in steps if evaluation(records, step)[0] is None}
  return [r for r in records if r["split"] == "train" or r["step"] not in cut]


def has_evaluation(workdir: str, step: int) -> bool:
  """Whether the run's metrics record a held-out evaluation at `step`, whole (evaluation)."""
  return evaluation(read_metrics(workdir), step)[0] is not None


def append_metrics(workdir: str, *records: dict) -> None:
  """Appends the records in one write (process 0): the records of one evaluation, a split
  each, are written together (a kill during the write may still cut them: evaluation
  tells)."""
  if jax.process_index() == 0:
    storage.append(storage.join(workdir, METRICS_FILE),
                   "".join(json.dumps(record) + "\n" for record in records))


def truncate_metrics(workdir: str, step: int) -> None:
  """Keeps the records up to `step` (process 0) that are whole (less an evaluation cut
  short), and drops lines cut short: a run that goes on from `step` (0: from scratch)
  trains the later steps again, evaluates again where an evaluation is missing, and logs
  them anew, so each step is recorded once."""
  kept = [r for r in whole(read_metrics(workdir)) if r["step"] <= step]  # checked lines
  if jax.process_index() == 0 and len(kept) < len(_metric_lines(workdir)):
    storage.write(storage.join(workdir, METRICS_FILE),
                  "".join(json.dumps(r) + "\n" for r in kept))
