"""Every benchmark runs: each benchmarks/*.py in its --smoke mode (its smallest size, seconds),
on the Quick start's kind of run and on a corpus laid out as configs/multi30k.py expects;
and one without what it needs says so in one `error:` line."""

import gzip
import pathlib
import random

import pytest

from tests.clirun import ROOT, CliRunner
from tests.support import TINY_FLAGS

BENCHMARKS = sorted(p.name for p in pathlib.Path(ROOT, "benchmarks").glob("*.py")
                    if 'if __name__ == "__main__":' in p.read_text())


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
