"""Two processes on localhost (jax.distributed, CPU collectives) train the same run as one
process: same losses, process 0 writes the metrics, the checkpoint restores in one process.

The launcher holds a global timeout and kills every survivor when one process fails, since
a peer of a dead process blocks forever inside a collective.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from transformer.evaluation import restore_and_evaluate
from transformer.training import train_and_evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"model.dropout": 0.0, "train.num_steps": 20, "train.log_every": 5,
             "train.eval_every": 0, "train.checkpoint_every": 10}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, flags, num_processes=2, timeout=420):
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  procs = [subprocess.Popen(
      [sys.executable, "train.py", "--config", "configs/default.py", "--workdir", workdir,
       f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
       f"--process_id={i}", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(num_processes)]
  deadline = time.time() + timeout
  try:
    while any(p.poll() is None for p in procs):
      failed = [p for p in procs if p.poll() not in (None, 0)]
      assert not failed and time.time() < deadline, "a process failed or the run timed out"
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    outputs = [p.communicate()[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
  return outputs


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]


def test_two_processes_match_one(tmp_path, tiny_config):
  config = tiny_config(**OVERRIDES)
  single = str(tmp_path / "single")
  train_and_evaluate(config, single)

  flat = {f"{section}.{k}": v for section in ("task", "model", "train", "eval")
          for k, v in config[section].to_dict().items() if not isinstance(v, dict)}
  flags = [f"--config.{k}={v}" for k, v in flat.items()]
  multi = str(tmp_path / "multi")
  outputs = _launch(multi, flags)
  assert "step 20/20" in outputs[0] and "step 20/20" not in outputs[1]  # process 0 logs
  np.testing.assert_allclose(_train_losses(multi), _train_losses(single), rtol=1e-5)
  # Saved by both processes, restored here by one.
  step, results, _ = restore_and_evaluate(multi)
  _, expected, _ = restore_and_evaluate(single)
  assert step == 20
  np.testing.assert_allclose(results["valid"]["loss"], expected["valid"]["loss"], rtol=1e-5)
