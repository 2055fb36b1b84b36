"""Everything to check and measure on a fresh GPU machine, in one run of at most --budget
seconds: the GPU tests, the attention grid, and the train step beside Flax's examples/wmt.

  python benchmarks/gpu.py --out gpu_results --wheels wheels \
      --flax_wmt flax/examples/wmt/models.py            # on a GPU machine, from the checkout
  python benchmarks/gpu.py --smoke --out /tmp/gpu      # any machine: every step, smoke-sized

It needs the image's jax, flax, optax, orbax-checkpoint, etils, sentencepiece, numpy, scipy,
absl, pytest and nothing from the network. What such an image may lack is installed from
--wheels, a folder of wheels brought along, by `pip install --no-index --no-deps --target
OUT/site` and put on the steps' PYTHONPATH with this checkout (nothing is installed into
the image's environment). To fill the folder, on a machine with the network:

  pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --no-deps -d wheels ml-collections grain array-record tensorboardX portpicker

(`--python-version` the image's Python; grain and array-record have cp312 manylinux wheels,
the others are pure Python). --flax_wmt is the path of examples/wmt/models.py in a flax
checkout (git clone https://github.com/google/flax), brought along; without it the Flax steps
say so and are skipped.

Each step runs in its own process with its own timeout, cut to what is left of the budget;
one that fails or times out never stops the next, and one that no time is left for is
reported as not run. In order (the most wanted first):

| step | what | timeout s |
| --- | --- | --- |
| wheels | the wheels of --wheels into OUT/site | 20 |
| tests | tests/test_gpu.py and tests/test_cudnn_mask.py | 100 |
| attention | one self-attention layer, bf16, causal, batch 4, 16 heads × 64: cudnn, xla, pallas × none, ALiBi, T5, KERPLE, FIRE × L 2048, 8192; fwd and fwd+bwd ms, temporaries; cudnn alone against dot_product_attention's own is_causal | 110 |
| attention-hopper | the same layer through `mosaic_gpu` (Mosaic GPU, Hopper and later) beside cudnn: none, ALiBi, T5, FIRE × L 2048, 8192 | 60 |
| train-base | benchmarks/train_step.py, base dims, bf16, `auto`, 128 × (128 + 128) tokens, vocab 32000 | 60 |
| flax-base | benchmarks/flax_wmt_step.py, the same | 50 |
| train-big | train_step.py, big dims (d 1024, 16 heads, ff 4096, 6 + 6), 64 × (512 + 512) tokens | 70 |
| flax-big | flax_wmt_step.py, the same | 60 |
| attention-16k | L 16384: cudnn, pallas × none, ALiBi, head dim 64 | 60 |
| attention-128 | head dim 128 (d 2048, 16 heads), L 2048, 8192: cudnn, xla, pallas × none, ALiBi, FIRE | 60 |

The grid is cut to what compiles and runs in the budget (compile time counts): every
encoding at L 2048 and 8192 with head dim 64, then L 16384 and head dim 128 for the kernels
that hold no L×L array (and xla where its temporaries fit, --max_gib 30). Writes
OUT/results.json (the steps' status and every row) and OUT/results.md (the tables), and
each step's output in OUT/logs/. --smoke runs every step at its smoke size on any backend
(tests/test_benchmarks.py runs it, so the script cannot rot before a GPU is at hand).
"""

import dataclasses
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
from absl import flags

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_string("out", "gpu_results", "Folder for results.json, results.md and logs/.")
flags.DEFINE_string("wheels", None, "Folder of wheels the image lacks (installed offline).")
flags.DEFINE_string("flax_wmt", None, "Path of flax's examples/wmt/models.py.")
flags.DEFINE_integer("budget", 360, "Seconds for all steps together.")
harness.define_smoke()

ATTENTION = ["--dtype=bfloat16", "--causal", "--windows=full", "--block=64", "--max_gib=30"]


@dataclasses.dataclass(frozen=True)
class Step:
  """One step: a command (argv after the Python interpreter), its timeout, and the flags
  that size it on a GPU (left out by --smoke, which sizes every benchmark its own way, and
  runs a command that two steps share once)."""

  name: str
  args: tuple[str, ...]
  timeout: int
  sizes: tuple[str, ...] = ()
  needs_flax: bool = False


def steps(out: str, flax_wmt: str | None) -> list[Step]:
  rows = os.path.join(out, "rows.jsonl")
  train = ("benchmarks/train_step.py", "--config.model.dtype=bfloat16",
           "--config.model.attention.kernel=auto", f"--json={rows}")
  flax_step = ("benchmarks/flax_wmt_step.py", "--dtype=bfloat16", f"--json={rows}",
               f"--models={flax_wmt}")
  attention = ("benchmarks/attention_scaling.py", *ATTENTION, f"--json={rows}")
  base = ("--dims=base", "--vocab_size=32000", "--batch_size=128", "--length=128")
  big = ("--dims=big", "--vocab_size=32000", "--batch_size=64", "--length=512")
  return [
      Step("tests", ("-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                     "tests/test_gpu.py", "tests/test_cudnn_mask.py"), 100),
      Step("attention", (*attention, "--raw"), 110,
           ("--kernels=cudnn,xla,pallas", "--positions=none,alibi,t5,kerple,fire",
            "--lengths=2048,8192", "--d_model=1024", "--heads=16", "--batch=4")),
      Step("attention-hopper", attention, 60,
           ("--kernels=cudnn,mosaic_gpu", "--positions=none,alibi,t5,fire",
            "--lengths=2048,8192", "--d_model=1024", "--heads=16", "--batch=4")),
      Step("train-base", train, 60, base),
      Step("flax-base", flax_step, 50, base, needs_flax=True),
      Step("train-big", train, 70, big),
      Step("flax-big", flax_step, 60, big, needs_flax=True),
      Step("attention-16k", attention, 60,
           ("--kernels=cudnn,pallas", "--positions=none,alibi", "--lengths=16384",
            "--d_model=1024", "--heads=16", "--batch=4")),
      Step("attention-128", attention, 60,
           ("--kernels=cudnn,xla,pallas", "--positions=none,alibi,fire",
            "--lengths=2048,8192", "--d_model=2048", "--heads=16", "--batch=4")),
  ]


def run_step(argv: list[str], timeout: float, env: dict, log: str) -> tuple[str, int | None]:
  """(status, exit code) of argv run in ROOT for at most `timeout` seconds, its output in
  `log`; on a timeout its whole process group is killed."""
  with open(log, "w") as out:
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
      code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
      return f"timed out after {timeout:.0f} s", None
  return ("ok" if code == 0 else f"failed (exit {code})"), code


def install_wheels(wheels: str | None, site: str, env: dict, log: str, timeout: float) -> str:
  """The wheels of folder `wheels` installed offline into `site`: the status."""
  found = sorted(glob.glob(os.path.join(wheels, "*.whl"))) if wheels else []
  if not found:
    return f"skipped: no wheels in {wheels!r} (the image must have what they provide)"
  status, _ = run_step([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
                        "--target", site, *found], timeout, env, log)
  return f"{status}: {len(found)} wheels"


def report() -> None:
  f = flags.FLAGS
  smoke, out = f.smoke, os.path.abspath(f.out)
  os.makedirs(os.path.join(out, "logs"), exist_ok=True)
  rows_path = os.path.join(out, "rows.jsonl")
  if os.path.exists(rows_path):
    os.remove(rows_path)  # this run's rows only
  deadline = time.monotonic() + f.budget
  site = os.path.join(out, "site")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT, site, *filter(None, [os.environ.get("PYTHONPATH")])]))
  done, commands = [], {}
  start = time.monotonic()
  status = install_wheels(f.wheels, site, env, os.path.join(out, "logs", "wheels.log"), 20)
  done.append({"step": "wheels", "status": status, "seconds": time.monotonic() - start})
  print(f"{'wheels':>14}  {status}", flush=True)
  for step in steps(out, f.flax_wmt):
    left = deadline - time.monotonic()
    start = time.monotonic()
    if step.needs_flax and not (f.flax_wmt and os.path.isfile(f.flax_wmt)):
      status = (f"skipped: flax's examples/wmt/models.py not found at --flax_wmt="
                f"{f.flax_wmt!r} (bring a flax checkout)")
    elif left < 5:
      status = "not run: out of time (--budget)"
    else:
      argv = [sys.executable, *step.args, *(["--smoke"] if smoke else step.sizes)]
      if smoke and step.name == "tests":  # the GPU tests alone (skipped without a GPU)
        argv = [a for a in argv if a != "tests/test_cudnn_mask.py" and a != "--smoke"]
      if tuple(argv) in commands:  # --smoke: another step's command once its sizes are gone
        status = f"smoke: the command of step {commands[tuple(argv)]}, not repeated"
      else:
        commands[tuple(argv)] = step.name
        status, _ = run_step(argv, min(step.timeout, left), env,
                             os.path.join(out, "logs", f"{step.name}.log"))
    done.append({"step": step.name, "status": status, "seconds": time.monotonic() - start})
    print(f"{step.name:>14}  {status} ({time.monotonic() - start:.0f} s)", flush=True)
  rows = []
  if os.path.exists(rows_path):
    with open(rows_path) as file:
      rows = [json.loads(line) for line in file if line.strip()]
  result = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "smoke": smoke, "budget s": f.budget, "steps": done, "rows": rows}
  with open(os.path.join(out, "results.json"), "w") as file:
    json.dump(result, file, indent=1)
  with open(os.path.join(out, "results.md"), "w") as file:
    file.write(markdown(result))
  print(f"{'results':>14}  {out}/results.json, {out}/results.md")


def markdown(result: dict) -> str:
  """The steps' status, the attention rows and the train-step rows as markdown tables."""
  lines = [f"{result['device']} ({result['backend']}), jax {result['jax']}, {result['date']}"
           f"{' (smoke sizes: not figures)' if result['smoke'] else ''}", "",
           "| step | status | s |", "| --- | --- | ---: |"]
  lines += [f"| {s['step']} | {s['status']} | {s['seconds']:.0f} |" for s in result["steps"]]
  attention = [r for r in result["rows"] if r["benchmark"] == "attention"]
  if attention:
    lines += ["", "| L | head dim | kernel | position | fwd ms | fwd+bwd ms | temporaries GiB (fwd+bwd) |",
              "| ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in attention:
      cells = ("refused", "", "") if "refused" in r else (
          cell(r.get("fwd ms")), cell(r.get("fwd+bwd ms")), cell(r.get("fwd+bwd GiB")))
      own = (f" (dot_product_attention's own: {cell(r['own fwd ms'])} / "
             f"{cell(r['own fwd+bwd ms'])})" if "own fwd ms" in r else "")
      lines.append(f"| {r['length']} | {r['head_dim']} | {r['kernel']}{own} | {r['position']} | "
                   + " | ".join(cells) + " |")
  train = [r for r in result["rows"] if r["benchmark"] == "train_step"]
  if train:
    lines += ["", "| model | dims | tokens | kernel | compile s | ms/step | MFU |",
              "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['dims']} ({r['layers']}+{r['layers']}) | {r['batch']} × "
              f"({r['length']} + {r['length']}), vocab {r['vocab']} | {r.get('kernel', '')}"
              f"{' (cuDNN)' if r.get('cudnn') else ''} | {r['compile s']:.1f} | "
              f"{r['step ms']:.1f} | {100 * r['MFU']:.1f}% |" for r in train]
  return "\n".join(lines) + "\n"


def cell(value) -> str:
  return "skipped" if value is None else f"{value:.3g}"


if __name__ == "__main__":
  harness.run(report)
