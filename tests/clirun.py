"""Runs the CLIs (train.py, eval.py, sweep.py, compare.py) as a user does, fast.

Each run executes SCRIPT as __main__ with the given argv, in a process of its own, and
returns its exit status, stdout and stderr, as `python SCRIPT ARGS` would. The process is
forked from a multiprocessing forkserver that imported JAX and the project once (and
started no JAX backend), so a run costs ~0.1 s instead of a fresh interpreter's ~3 s:
this is what makes a table of dozens of bad inputs affordable in the suite.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ["jax", "flax.nnx", "orbax.checkpoint", "grain", "matplotlib", "transformer.run.cli",
           "transformer.run.training", "transformer.run.restored_run", "transformer.study.sweep",
           "transformer.study.pictures", "transformer.study.compare"]


def _main(script: str, argv: list[str], cwd: str, out: str, err: str,
          env: dict[str, str]) -> None:
  os.environ.update(env)
  for fd, path in ((1, out), (2, err)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  os.chdir(cwd)
  sys.argv = [script, *argv]
  sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` puts the script's folder first
  status = 0
  try:
    runpy.run_path(script, run_name="__main__")
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # noqa: BLE001 - reported like an uncaught exception
    import traceback  # noqa: PLC0415
    traceback.print_exc()
    status = 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


class CliRunner:

  def __init__(self):
    self.context = multiprocessing.get_context("forkserver")
    self.context.set_forkserver_preload(PRELOAD)

  def run(self, script: str, *args: str, cwd: str = ROOT, timeout: float = 120,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs SCRIPT ARGS in `cwd`, with `env` added to the environment."""
    with tempfile.TemporaryDirectory() as tmp:
      out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
      process = self.context.Process(
          target=_main, args=(os.path.join(ROOT, script), list(args), cwd, out, err, env or {}))
      process.start()
      process.join(timeout)
      if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"{script} {' '.join(args)} ran over {timeout} s")
      with open(out) as o, open(err) as e:
        return subprocess.CompletedProcess([script, *args], process.exitcode, o.read(), e.read())
