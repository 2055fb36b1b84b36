"""Every benchmark runs: each benchmarks/*.py in its --smoke mode (its smallest size, seconds),
on the Quick start's kind of run and on a corpus laid out as configs/multi30k.py expects;
and one without what it needs says so in one `error:` line."""

import gzip
import json
import pathlib
import random
import re
import subprocess
import sys
import zipfile

import pytest

from tests.clirun import ROOT, CliRunner
from tests.support import TINY_FLAGS

# gpu.py runs the others: its own test below.
BENCHMARKS = sorted(p.name for p in pathlib.Path(ROOT, "benchmarks").glob("*.py")
                    if 'if __name__ == "__main__":' in p.read_text() and p.name != "gpu.py")


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


@pytest.fixture(scope="module")
def multi30k_like(tmp_path_factory):
  """A directory with every file configs/multi30k.py reads (its own names), holding a few
  hundred generated sentence pairs: Multi30k's layout, not its size."""
  from configs import multi30k  # noqa: PLC0415

  data, directory = multi30k.get_config().data, tmp_path_factory.mktemp("multi30k")
  rng = random.Random(0)
  words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 8)))
           for _ in range(300)]
  for split, n in (("train", 400), ("valid", 40), ("test", 40)):
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(n)]
    for side, text in (("source", lines), ("target", [line.upper() for line in lines])):
      with gzip.open(directory / data[f"{split}_{side}"], "wt", encoding="utf-8") as f:
        f.write("\n".join(text) + "\n")
  return str(directory)


@pytest.fixture(scope="module")
def quickstart_run(cli, tmp_path_factory):
  """A run of the Quick start's config (configs/default.py: splits valid and longer, no
  test), shrunk to train in seconds."""
  workdir = str(tmp_path_factory.mktemp("runs") / "default")
  result = cli.run("train.py", "--config", "configs/default.py", "--workdir", workdir,
                   *TINY_FLAGS, "--config.train.num_steps=5", timeout=300)
  assert result.returncode == 0, result.stderr
  return workdir


# A stand-in for flax's examples/wmt/models.py with its interface (TransformerConfig, and
# Transformer(config)(inputs, targets) -> logits), a few lines of linen: flax's file is
# never copied here, and the benchmark that loads it is tested on this one.
WMT_STAND_IN = """
import dataclasses
from typing import Any
import jax.numpy as jnp
from flax import linen as nn

@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  vocab_size: int
  output_vocab_size: int
  share_embeddings: bool = False
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 2048
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False

class Transformer(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, targets):
    embed = nn.Embed(self.config.vocab_size, self.config.emb_dim)
    x = embed(targets) + embed(inputs).mean(axis=1, keepdims=True)
    x = nn.Dropout(self.config.dropout_rate)(x, deterministic=self.config.deterministic)
    return embed.attend(nn.Dense(self.config.emb_dim, dtype=self.config.dtype)(x))
"""


@pytest.fixture(scope="module")
def wmt_models(tmp_path_factory):
  path = tmp_path_factory.mktemp("wmt") / "models.py"
  path.write_text(WMT_STAND_IN)
  return str(path)


def needs(name, run, corpus, tmp, wmt=None):
  """What benchmark `name` reads, as flags: a trained run, a Multi30k directory, a stand-in
  for flax's examples/wmt/models.py."""
  return {"decoding.py": ["--workdir", run], "flax_wmt_step.py": ["--models", wmt],
          "packers.py": [f"--config.data.dir={corpus}", "--workdir", tmp],
          "packing.py": [f"--config.data.dir={corpus}", "--workdir", tmp],
          "data_scale.py": ["--multi30k", corpus, "--work", tmp]}.get(name, [])


@pytest.mark.parametrize("name", BENCHMARKS)
def test_smoke_mode_runs(name, cli, quickstart_run, multi30k_like, wmt_models, tmp_path):
  result = cli.run(f"benchmarks/{name}", "--smoke",
                   *needs(name, quickstart_run, multi30k_like, str(tmp_path), wmt_models),
                   timeout=300)
  assert result.returncode == 0, f"benchmarks/{name} --smoke: {result.stderr}"
  assert "Traceback" not in result.stderr, result.stderr
  assert result.stdout.strip(), f"benchmarks/{name} --smoke printed no figures"


def test_train_step_runs_at_big_widths(cli):
  """--dims big at --smoke: the big model's widths (d 1024, 16 heads, ff 4096) with one
  layer each side, on a smoke-sized batch."""
  result = cli.run("benchmarks/train_step.py", "--dims=big", "--smoke", timeout=300)
  assert result.returncode == 0, result.stderr
  assert "model             big: 29,446,144 params" in result.stdout, result.stdout


def tiny_wheel(folder: pathlib.Path) -> None:
  """A wheel of one pure-Python module, `gpu_wheel_probe`, made by hand (no network)."""
  info = "gpu_wheel_probe-0.1.dist-info"
  files = {"gpu_wheel_probe.py": "VALUE = 7\n",
           f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-wheel-probe\nVersion: 0.1\n",
           f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                            "Tag: py3-none-any\n"}
  files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
  with zipfile.ZipFile(folder / "gpu_wheel_probe-0.1-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
      wheel.writestr(name, text)


def test_the_gpu_script_runs_every_step_in_its_smoke_mode(cli, wmt_models, tmp_path):
  """benchmarks/gpu.py --smoke: the wheels installed offline, every step run (the GPU tests
  skipped here) or its command shared with an earlier step, none failed; one JSON and one
  markdown table with the attention rows and both train steps'."""
  wheels, out = tmp_path / "wheels", tmp_path / "out"
  wheels.mkdir()
  tiny_wheel(wheels)
  result = cli.run("benchmarks/gpu.py", "--smoke", "--out", str(out), "--wheels", str(wheels),
                   "--flax_wmt", wmt_models, timeout=600)
  assert result.returncode == 0, result.stderr
  assert (out / "site" / "gpu_wheel_probe.py").read_text() == "VALUE = 7\n"
  report = json.loads((out / "results.json").read_text())
  statuses = {s["step"]: s["status"] for s in report["steps"]}
  assert statuses["wheels"] == "ok: 1 wheels", statuses
  assert all(re.match(r"ok|smoke: the command of step", status)
             for status in statuses.values()), statuses
  assert {"tests", "attention", "train-base", "flax-base", "train-big", "flax-big",
          "attention-16k", "attention-128", "attention-hopper"} <= statuses.keys()
  models = {r["model"] for r in report["rows"] if r["benchmark"] == "train_step"}
  assert models == {"this project", "flax examples/wmt"}
  assert any(r["benchmark"] == "attention" and "fwd ms" in r for r in report["rows"])
  table = (out / "results.md").read_text()
  assert "| flax examples/wmt |" in table and "| attention |" in table


def test_the_gpu_script_sizes_name_its_benchmarks_flags():
  """The flags that size a step on a GPU (which --smoke leaves out) are its script's."""
  listing = subprocess.run(
      [sys.executable, "-c", "import json, sys; sys.path.insert(0, 'benchmarks'); import gpu; "
       "print(json.dumps([(s.name, s.args, s.sizes) for s in gpu.steps('out', None)]))"],
      cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
  for name, args, sizes in json.loads(listing.stdout):
    source = pathlib.Path(ROOT, args[0]).read_text() if args[0].endswith(".py") else ""
    for size in sizes:
      flag = size.removeprefix("--").split("=")[0]
      assert re.search(rf'DEFINE_\w+\("{flag}"', source), (name, flag)
  assert sum(len(sizes) for _, _, sizes in json.loads(listing.stdout)) > 20


@pytest.mark.parametrize("name,args,fragment", [
    ("decoding.py", ["--workdir", "{run}", "--split", "test"],
     "has the held-out splits valid, longer"),
    ("packers.py", ["--config.data.dir={tmp}/none", "--workdir", "{tmp}/work"],
     "corpus file not found"),
    ("packing.py", ["--config.data.dir={tmp}/none", "--workdir", "{tmp}/work"],
     "corpus file not found"),
    ("data_scale.py", ["--multi30k", "{tmp}/none", "--work", "{tmp}/work"], "Multi30k not found"),
    ("fixed_costs.py", ["--repo", "{tmp}/work"], "has no train.py: give a checkout"),
    ("flax_wmt_step.py", ["--models", "{tmp}/none.py"], "examples/wmt/models.py not found"),
])
def test_without_what_it_needs_one_error_line(name, args, fragment, cli, quickstart_run,
                                              tmp_path):
  args = [arg.format(run=quickstart_run, tmp=tmp_path) for arg in args]
  result = cli.run(f"benchmarks/{name}", "--smoke", *args, timeout=300)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
  assert not (tmp_path / "work").exists(), "a benchmark that cannot run wrote its workdir"
