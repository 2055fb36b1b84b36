"""The fixed costs of small runs: start-up, compilation and the final evaluation, against the
training itself, with a cold and a warm compilation cache.

  python benchmarks/fixed_costs.py                     # the Quick start's run, a 4-seed sweep
  python benchmarks/fixed_costs.py --what quickstart   # the Quick start alone (README's figures)
  python benchmarks/fixed_costs.py --repo /tmp/before  # the same with another checkout's code
  python benchmarks/fixed_costs.py --smoke             # seconds: does it still run

Runs --repo's train.py and eval.py (the Quick start's command: configs/default.py, then the
evaluation of its workdir) and sweep.py (the default config over --sweep_seeds seeds,
--sweep_steps steps each) as a user does, each in a fresh interpreter with a fresh workdir,
and times each run's phases by the moment each of its log lines arrives:
  start → step   launch (or the sweep's "training NAME" line) to "compiled the train step"
                 (or "loaded" it "from the compilation cache"):
                 imports, config, data, initialisation and the train step's compilation
  training       to the final evaluation's "evaluating step N" line (the evaluations every
                 train.eval_every steps included)
  ms/step        the mean of the "ms/step" figures the run logs, one per train.log_every
                 steps (the steps alone, as the run times them: evaluations left out)
  final eval     to its last "eval SPLIT step N" line
  total          launch to exit (a sweep: the whole sweep, its report included)
The Quick start's two commands are the rows "quickstart train.py" and "quickstart eval.py"
(its total alone).
`cold` runs with an empty compilation cache (an XDG_CACHE_HOME of its own for each of
quickstart and sweep, where the CLIs keep it by default; in a cold sweep, the runs after the
first find the first's programs); `warm` runs the same again on the cache that its cold run
filled. Code
without the persistent cache compiles every time: its warm pass is another cold one. Each
row gives the 1-minute load average when the run started: figures are only comparable at a
low load. Prints figures; asserts nothing.
"""

import os
import re
import subprocess
import sys
import tempfile
import time

from absl import flags

import harness
from transformer.core.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flags.DEFINE_string("repo", ROOT, "The checkout whose train.py and sweep.py are timed.")
flags.DEFINE_list("what", ["quickstart", "sweep"], "quickstart (configs/default.py as the "
                  "Quick start runs it) and/or sweep (seeds of it).")
flags.DEFINE_list("passes", ["cold", "warm"], "cold (empty compilation cache) and/or warm.")
flags.DEFINE_integer("sweep_seeds", 4, "Seeds (runs) of the sweep.")
flags.DEFINE_integer("sweep_steps", 200, "Training steps of each run of the sweep.")
flags.DEFINE_multi_string("flag", [], "A flag added to every run's command (repeatable), "
                          "e.g. --flag=--config.train.num_steps=500.")
harness.define_smoke(what=["quickstart", "sweep"], passes=["cold"], sweep_seeds=1,
                     sweep_steps=5, flag=[
                         "--config.task.max_len=5", "--config.task.longer_max_len=7",
                         "--config.model.d_model=32", "--config.model.d_ff=64",
                         "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
                         "--config.model.num_decoder_layers=1", "--config.train.num_steps=5",
                         "--config.train.log_every=5", "--config.eval.num_examples=16",
                         "--config.eval.batch_size=16"])

SWEEP = """
from configs import default
from transformer.api import axis

def get_config():
  return default.get_config()

def get_sweep():
  return axis("seed", list(range({seeds})))
"""
STEP = re.compile(r"the train step (in|from) ")
MS_PER_STEP = re.compile(r"\| ([\d.]+) ms/step \|")
EVAL_START = re.compile(r"evaluating step (\d+):")
RUN_START = re.compile(r"sweep: run \d+/\d+: training (\S+)")


def timed_lines(command: list[str], env: dict[str, str]) -> tuple[float, list, int]:
  """(its launch time, [(arrival time, line)] of its stdout and stderr, exit status) of a
  command run in --repo."""
  start = time.monotonic()
  process = subprocess.Popen(command, cwd=flags.FLAGS.repo, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  lines = [(time.monotonic(), line.rstrip("\n")) for line in process.stdout]
  return start, lines + [(time.monotonic(), "(exit)")], process.wait()


def run_timed(command: list[str], cache: str) -> tuple[float, list]:
  """timed_lines of `command` with the compilation cache under `cache`; a ConfigError with
  its last lines if it fails."""
  start, lines, status = timed_lines(command, environment(cache))
  if status:
    tail = "\n".join(line for _, line in lines[-15:])
    raise ConfigError(f"{' '.join(command)} exited with status {status}:\n{tail}")
  return start, lines


def phases(start: float, lines: list) -> dict[str, float]:
  """The phases (module docstring) of one run's lines, in seconds (ms/step in ms); a missing
  phase: nan."""
  step = next((t for t, line in lines if STEP.search(line)), None)
  final = [(t, m[1]) for t, line in lines if (m := EVAL_START.search(line))]
  per_step = [float(m[1]) for _, line in lines if (m := MS_PER_STEP.search(line))]
  nan = float("nan")
  if step is None or not final:
    return dict.fromkeys(COLUMNS, nan)
  begun, at = final[-1]
  ended = max((t for t, line in lines if re.search(rf"eval \S+ step {at} \|", line)),
              default=nan)
  return {"start → step": step - start, "training": begun - step,
          "ms/step": sum(per_step) / len(per_step) if per_step else nan,
          "final eval": ended - begun}


COLUMNS = {"start → step": 14, "training": 10, "ms/step": 9, "final eval": 12}  # name: width


def row(name: str, cache_pass: str, values: dict[str, float], total: float, load: float
        ) -> str:
  """A line of the table: the phases in `values` (COLUMNS; those missing left blank)."""
  return (f"{name:<22}{cache_pass:<7}" + "".join(
      f"{values[c]:{w}.1f}" if c in values else " " * w for c, w in COLUMNS.items())
      + f"{total:9.1f}{load:7.2f}")


def pieces(start: float, lines: list) -> list[tuple[str, float, list]]:
  """A sweep's lines cut into its runs: (name, start, lines) each."""
  runs = []
  for t, line in lines:
    if m := RUN_START.search(line):
      runs.append((m[1], t, []))
    elif runs:
      runs[-1][2].append((t, line))
  return runs


def environment(cache_home: str) -> dict[str, str]:
  """The environment of a run: the compilation cache where the CLIs keep it by default,
  under `cache_home`."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  return {**env, "XDG_CACHE_HOME": cache_home, "PYTHONUNBUFFERED": "1"}


def check_repo() -> None:
  for script in ("train.py", "sweep.py"):
    if not os.path.isfile(os.path.join(flags.FLAGS.repo, script)):
      raise ConfigError(f"--repo {flags.FLAGS.repo} has no {script}: give a checkout of this "
                        "project (e.g. git worktree add /tmp/before COMMIT)")
  unknown = sorted(set(flags.FLAGS.what) - {"quickstart", "sweep"})
  if unknown or sorted(set(flags.FLAGS.passes) - {"cold", "warm"}):
    raise ConfigError(f"--what takes quickstart, sweep and --passes cold, warm; got "
                      f"{','.join(flags.FLAGS.what)} and {','.join(flags.FLAGS.passes)}")


def report() -> None:
  f = flags.FLAGS
  check_repo()
  commit = subprocess.run(["git", "-C", f.repo, "log", "-1", "--format=%h"], text=True,
                          capture_output=True).stdout.strip() or "?"
  print(f"code: {f.repo} at {commit}; {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
  print(f"{'run':<22}{'cache':<7}" + "".join(f"{c:>{w}}" for c, w in COLUMNS.items())
        + f"{'total':>9}{'load':>7}")
  with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "seeds.py"), "w") as file:
      file.write(SWEEP.format(seeds=f.sweep_seeds))
    for number, cache_pass in enumerate(f.passes):
      for what in f.what:
        workdir = os.path.join(tmp, f"{what}{number}")
        if what == "quickstart":
          command = [sys.executable, "train.py", "--config", "configs/default.py",
                     "--workdir", workdir]
        else:
          command = [sys.executable, "sweep.py", "--config", os.path.join(tmp, "seeds.py"),
                     "--sweep_dir", workdir, f"--config.train.num_steps={f.sweep_steps}"]
        load = os.getloadavg()[0]
        cache = os.path.join(tmp, f"cache-{what}")
        start, lines = run_timed(command + f.flag, cache)
        runs = (pieces(start, lines) if what == "sweep"
                else [("quickstart train.py", start, lines)])
        for name, begun, own in runs:  # a sweep's run: to its last line (the sweep: below)
          print(row(name, cache_pass, phases(begun, own), own[-1][0] - begun, load))
        if what == "sweep":
          print(row("sweep, whole", cache_pass, {}, lines[-1][0] - start, load))
        else:  # the Quick start's second command
          load = os.getloadavg()[0]
          start, lines = run_timed([sys.executable, "eval.py", "--workdir", workdir], cache)
          print(row("quickstart eval.py", cache_pass, {}, lines[-1][0] - start, load))
        sys.stdout.flush()


if __name__ == "__main__":
  harness.run(report)
