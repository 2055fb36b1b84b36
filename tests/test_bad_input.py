"""Bad input as a new user types it, to train.py, eval.py, sweep.py and compare.py: every case exits
non-zero with one `error:` line naming the bad value (and what is allowed), prints no
traceback and no log line of work begun before it, and writes or changes nothing, in a new
workdir or in a finished run's."""

import functools
import json
import os
import re
import shutil

import pytest

from tests.clirun import ROOT, CliRunner
from tests.support import TINY_FLAGS, fake_run, write_evaluation, write_lm_config
from transformer.data.sources import SOURCES
from transformer.data.tasks.synthetic import SyntheticSource
from transformer.model.feedforward import FFNS
from transformer.model.kernels.registry import KERNELS
from transformer.model.layers import NORMS
from transformer.model.masks import WINDOWS
from transformer.model.positions import POSITIONS
from transformer.model.qk_norm import QK_NORMS
from transformer.model.scores import SCORES
from transformer.run.eval_files import text_paths

CONFIG = os.path.join(ROOT, "configs", "default.py")
ROTARY = "model.position_settings.rotary."
TINY = [*TINY_FLAGS, "--config.train.num_steps=10", "--config.train.checkpoint_every=5"]
TEXT = "train.py", ["--config", os.path.join(ROOT, "configs", "multi30k.py"), "--workdir", "{new}",
                    "--config.data.dir={files}/corpus", "--config.data.train_source=train.en",
                    "--config.data.train_target=train.de", "--config.data.valid_source=train.en",
                    "--config.data.valid_target=train.de", "--config.data.test_source=",
                    "--config.data.vocab_size=32", "--config.data.max_len=16"]
LM = "train.py", ["--config", "{files}/lm.py", "--workdir", "{new}"]  # tiny, on files (SWEEP_LM)
HF = "train.py", ["--config", os.path.join(ROOT, "configs", "wmt14_base.py") + ":hf",
                  "--workdir", "{new}", "--config.data.hf_path=json",
                  "--config.data.dir={files}/hf", "--config.data.train_files=train.jsonl",
                  "--config.data.valid_files=valid.jsonl", "--config.data.vocab_size=32"]
HF_WITHOUT_DATASETS = """
import sys

sys.modules["datasets"] = None  # as if the Hugging Face datasets library were not installed
from configs import wmt14_base

def get_config():
  config = wmt14_base.get_config("hf")
  config.data.update(hf_path="json", dir="{dir}", train_files="train.jsonl",
                     valid_files="valid.jsonl")
  return config
"""
STDLIB_LM = "train.py", ["--config", os.path.join(ROOT, "configs", "lm_extrapolation.py"),
                         "--workdir", "{new}"]
SWEEP = """
from tests.support import make_tiny_config
from transformer.api import axis, product

def get_config():
  return make_tiny_config(**{{"train.num_steps": 10}})

def get_sweep():
  return {sweep}
"""

SWEEP_LM = """
from configs import lm_extrapolation
from tests.support import TINY_CONFIG_MODEL
from transformer.api import axis

def get_config():
  config = lm_extrapolation.get_config()
  config.data.update(corpus="files", dir="{dir}", train_files="train.py", valid_files="valid.py",
                     vocab_size=64, max_len=16, max_factor=2)
  config.model.update(**TINY_CONFIG_MODEL, max_len=64)
  config.train.update(batch_size=8, num_steps=4)
  config.eval.update(num_examples=4, batch_size=4)
  return config

def get_sweep():
  return axis("eval.num_examples", [4, 1000])  # the second variant's windows do not fit
"""


def choices(registry) -> str:
  """How an unknown name's error lists a registry's entries (registry.lookup)."""
  return ", ".join(sorted(registry))


# (id, script, arguments, fragments of the error line). In the arguments, {new} is a
# workdir that does not exist yet, {run} a finished run's workdir, {files} a folder of
# inputs (a file, bad config and sweep files, a small corpus); the others are named in
# the `others` fixture.
TRAIN = "train.py", ["--config", CONFIG, "--workdir", "{new}", *TINY]
CHOMSKY = "train.py", ["--config", os.path.join(ROOT, "configs", "chomsky.py") + ":cpu",
                       "--workdir", "{new}"]
CASES = [
    # model
    ("d_model=0", *TRAIN, ["--config.model.d_model=0"], ["config.model.d_model=0", "≥ 1"]),
    ("num_heads=0", *TRAIN, ["--config.model.num_heads=0"], ["config.model.num_heads=0", "≥ 1"]),
    ("heads do not divide", *TRAIN, ["--config.model.num_heads=3"],
     ["num_heads=3", "a divisor of d_model (32)"]),
    ("d_ff=0", *TRAIN, ["--config.model.d_ff=0"], ["config.model.d_ff=0"]),
    ("no encoder layers", *TRAIN, ["--config.model.num_encoder_layers=0"],
     ["num_encoder_layers=0", "≥ 1"]),
    ("dropout 1.5", *TRAIN, ["--config.model.dropout=1.5"], ["model.dropout=1.5", "[0, 1)"]),
    ("dropout negative", *TRAIN, ["--config.model.dropout=-0.1"], ["model.dropout=-0.1"]),
    ("attention dropout 1", *TRAIN, ["--config.model.attention.dropout=1.0"],
     ["model.attention.dropout=1.0", "[0, 1)"]),
    ("local window 0", *TRAIN, ["--config.model.attention.window=local",
                                "--config.model.attention.window_size=0"],
     ["model.attention.window_size=0", "≥ 1"]),
    ("local window -1", *TRAIN, ["--config.model.attention.window=local",
                                 "--config.model.attention.window_size=-1"],
     ["window_size=-1"]),
    ("block_size 0", *TRAIN, ["--config.model.attention.block_size=0"], ["block_size=0"]),
    ("cudnn on cpu", *TRAIN, ["--config.model.attention.kernel=cudnn"],
     ["kernel='cudnn' runs on gpu only", "backend is cpu", "'xla'"]),
    ("fused kernel, additive score", *TRAIN, ["--config.model.attention.kernel=xla",
                                              "--config.model.attention.score=additive"],
     ["'xla' computes dot-product scores only", "'additive'"]),
    ("pallas kernel, additive score", *TRAIN, ["--config.model.attention.kernel=pallas",
                                               "--config.model.attention.score=additive"],
     ["'pallas' computes dot-product scores only", "'additive'", "'reference' or 'blockwise'"]),
    ("mosaic_gpu kernel, a sink", *TRAIN, ["--config.model.attention.kernel=mosaic_gpu",
                                           "--config.model.attention.normalizer=sink"],
     ["attention.kernel 'mosaic_gpu' computes softmax only", "normalizer 'sink'"]),
    ("fused kernel, attention dropout", *TRAIN, ["--config.model.attention.kernel=xla",
                                                 "--config.model.attention.dropout=0.1"],
     ["'xla' has no attention dropout"]),
    ("kv heads do not divide heads", *TRAIN, ["--config.model.num_heads=4",
                                              "--config.model.num_kv_heads=3"],
     ["config.model.num_kv_heads=3", "a divisor of num_heads (4)"]),
    ("kv heads negative", *TRAIN, ["--config.model.num_kv_heads=-1"],
     ["config.model.num_kv_heads=-1", "a divisor of num_heads (2)"]),
    ("unknown qk_norm", *TRAIN, ["--config.model.attention.qk_norm=bogus"],
     ["unknown attention qk_norm 'bogus'", choices(QK_NORMS)]),
    ("logit_softcap negative", *TRAIN, ["--config.model.attention.logit_softcap=-1.0"],
     ["config.model.attention.logit_softcap=-1.0", "≥ 0"]),
    ("fused kernel, logit softcap", *TRAIN, ["--config.model.attention.kernel=xla",
                                             "--config.model.attention.logit_softcap=30.0"],
     ["'xla' cannot soft-cap", "logit_softcap=0 (got 30.0)", "'reference' or 'blockwise'"]),
    ("max_len 0", *TRAIN, ["--config.model.max_len=0"], ["model.max_len=0"]),
    ("learned table shorter than training", *TRAIN,
     ["--config.model.position=learned", "--config.model.max_len=4"],
     ["task.max_len gives sequences of 6 tokens", "model.max_len=4"]),
    ("learned table shorter than longer split", *TRAIN,
     ["--config.model.position=learned", "--config.model.max_len=16",
      "--config.task.longer_max_len=20"], ["task.longer_max_len gives sequences of 21 tokens"]),
    ("random positions past max_position", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.max_position=4"],
     ["task.max_len gives sequences of 6 tokens", "model.max_position=4"]),
    ("random positions without positions", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.position=none"],
     ["random_positions=True", "position 'none'", "takes no positions"]),
    ("random positions, local window", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.attention.window=local"],
     ["random_positions=True", "window='local'"]),
    ("unknown random positions draw", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.random_positions_draw=per_step"],
     ["unknown model random_positions_draw 'per_step'", "per_batch, per_row"]),
    ("random offsets in the pallas kernel", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.position=alibi",
      "--config.model.attention.kernel=pallas"],
     ["attention.kernel 'pallas' evaluates positional biases in-kernel", "position 'alibi'",
      "random_positions_draw=per_batch", "'reference' or 'xla'"]),
    ("alibi offset negative", *TRAIN,
     ["--config.model.position_settings.alibi.bidirectional_offset=-0.5"],
     ["config.model.position_settings.alibi.bidirectional_offset=-0.5", "≥ 0"]),
    ("dtype float16", *TRAIN, ["--config.model.dtype=float16"],
     ["unknown model dtype 'float16'", "bfloat16, float32"]),
    ("norm mid", *TRAIN, ["--config.model.norm=mid"], ["unknown norm 'mid'", "post, pre"]),
    ("unknown norm_type", *TRAIN, ["--config.model.norm_type=batchnorm"],
     ["unknown norm_type 'batchnorm'", choices(NORMS)]),
    ("unknown ffn", *TRAIN, ["--config.model.ffn=tanh"], ["unknown ffn 'tanh'", choices(FFNS)]),
    ("odd d_model, sinusoidal", *TRAIN, ["--config.model.d_model=33",
                                         "--config.model.num_heads=1"], ["even d_model", "33"]),
    ("odd head_dim, rotary", *TRAIN, ["--config.model.position=rotary",
                                      "--config.model.d_model=30"], ["even head dimension", "15"]),
    ("gaussian sigma negative", *TRAIN,
     ["--config.model.attention.score_settings.gaussian.sigma=-1.0"],
     ["config.model.attention.score_settings.gaussian.sigma=-1.0", "≥ 0"]),
    ("unknown position setting", *TRAIN, ["--config.model.position_settings.alibi.foo=1"],
     ["the config has no field 'model.position_settings.alibi.foo'"]),
    ("unknown position settings section", *TRAIN,
     ["--config.model.position_settings.alibii.max_bias=1"],
     ["--config.model.position_settings.alibii", 'Did you mean "alibi"']),
    ("t5 num_buckets too small", *TRAIN, ["--config.model.position_settings.t5.num_buckets=2"],
     ["config.model.position_settings.t5.num_buckets=2", "≥ 4"]),
    ("cosine temperature 0", *TRAIN,
     ["--config.model.attention.score_settings.cosine.init_temperature=0"],
     ["config.model.attention.score_settings.cosine.init_temperature=0.0", "> 0"]),
    ("unknown score", *TRAIN, ["--config.model.attention.score=cosin"],
     ["unknown attention score 'cosin'", choices(SCORES)]),
    ("unknown position", *TRAIN, ["--config.model.position=absolute"],
     ["unknown position 'absolute'", choices(POSITIONS)]),
    ("causal-only position in an encoder", *TRAIN, ["--config.model.position=cope"],
     ["position 'cope' is defined for causal self-attention only",
      "decoder-only configs take it, e.g. python train.py --config configs/lm_extrapolation.py"]),
    ("unknown window", *TRAIN, ["--config.model.attention.window=sliding"],
     ["unknown attention window 'sliding'", choices(WINDOWS)]),
    # layer-wise patterns (transformer/model/layer_pattern.py)
    ("position pattern with an embedding encoding", *TRAIN,
     ["--config.model.position=sinusoidal+rotary"],
     ["config.model.position='sinusoidal+rotary' is not allowed",
      "a pattern of alibi, cope, fire, kerple, none, rotary, t5, xpos joined by '+'",
      "'sinusoidal' adds to the embeddings, once per stack, and cannot vary per layer"]),
    ("position pattern with an unknown entry", *TRAIN, ["--config.model.position=rotary+rotry"],
     ["config.model.position='rotary+rotry' is not allowed", "'rotry' is not among them"]),
    ("position pattern with an empty entry", *TRAIN, ["--config.model.position=rotary++none"],
     ["config.model.position='rotary++none'", "an entry is empty"]),
    ("causal-only position in an encoder's pattern", *TRAIN,
     ["--config.model.position=rotary+cope"],
     ["position 'cope' is defined for causal self-attention only"]),
    ("window pattern with an unknown entry", *TRAIN,
     ["--config.model.attention.window=local+global"],
     ["config.model.attention.window='local+global' is not allowed", f"({choices(WINDOWS)})",
      "'global' is not among them"]),
    ("random positions, a local layer", *TRAIN,
     ["--config.model.random_positions=true", "--config.model.attention.window=full+local"],
     ["random_positions=True", "window='full+local'"]),
    ("unknown kernel", *TRAIN, ["--config.model.attention.kernel=flash"],
     ["unknown attention kernel 'flash'", choices({"auto": None, **KERNELS})]),
    # RoPE's scalings and partial rotation (transformer/model/positions/rotary.py)
    ("rotary scaling unknown", *TRAIN, [f"--config.{ROTARY}scaling=dynamic"],
     [f"config.{ROTARY}scaling='dynamic' is not allowed", "one of: none, linear, ntk, yarn"]),
    ("xpos scaling unknown", *TRAIN, ["--config.model.position_settings.xpos.scaling=pi"],
     ["config.model.position_settings.xpos.scaling='pi'", "none, linear, ntk, yarn"]),
    ("rotary factor below 1", *TRAIN, [f"--config.{ROTARY}scaling=linear",
                                       f"--config.{ROTARY}factor=0.5"],
     [f"config.{ROTARY}factor=0.5 is not allowed", "≥ 1"]),
    ("rotary factor without a scaling", *TRAIN, [f"--config.{ROTARY}factor=4"],
     [f"config.{ROTARY}factor=4.0", "1 with scaling 'none'"]),
    ("yarn without original_length", *TRAIN, [f"--config.{ROTARY}scaling=yarn",
                                              f"--config.{ROTARY}factor=4"],
     [f"config.{ROTARY}original_length=0", "≥ 1 with scaling 'yarn'"]),
    ("original_length negative", *TRAIN, [f"--config.{ROTARY}original_length=-1"],
     [f"config.{ROTARY}original_length=-1", "≥ 0"]),
    ("yarn_alpha 0", *TRAIN, [f"--config.{ROTARY}yarn_alpha=0"],
     [f"config.{ROTARY}yarn_alpha=0.0", "> 0"]),
    ("yarn_beta below yarn_alpha", *TRAIN, [f"--config.{ROTARY}yarn_beta=0.5"],
     [f"config.{ROTARY}yarn_beta=0.5", "> yarn_alpha (1.0)"]),
    ("rotated_fraction 0", *TRAIN, [f"--config.{ROTARY}rotated_fraction=0"],
     [f"config.{ROTARY}rotated_fraction=0.0", "in (0, 1]"]),
    ("rotated_fraction above 1", *TRAIN, [f"--config.{ROTARY}rotated_fraction=1.5"],
     [f"config.{ROTARY}rotated_fraction=1.5", "in (0, 1]"]),
    ("rotated_fraction turning no pair", *TRAIN,
     ["--config.model.position=rotary", f"--config.{ROTARY}rotated_fraction=0.1"],
     ["rotated_fraction=0.1 rotates no pair of the head's 16 dimensions", "at least 0.125"]),
    ("ntk with one rotated pair", *TRAIN,
     ["--config.model.position=rotary", f"--config.{ROTARY}rotated_fraction=0.125",
      f"--config.{ROTARY}scaling=ntk", f"--config.{ROTARY}factor=2"],
     ["scaling 'ntk'", "more than one rotated pair", "D = 2"]),
    ("unknown partial rotation", *TRAIN, [f"--config.{ROTARY}partial=half"],
     [f"config.{ROTARY}partial='half'", "one of: neox, p_rope"]),
    # train.init_from (transformer/run/init_from.py)
    ("init_from of another shape", *TRAIN,
     ["--config.train.init_from={run}", "--config.model.d_ff=48"],
     ["config.train.init_from='{run}': its parameters do not fit this model",
      "decoder.layers.0.ffn.wi.bias is [64] there and [48] here"]),
    ("init_from not a run", *TRAIN, ["--config.train.init_from={files}/corpus"],
     ["config.train.init_from='{files}/corpus': not a training workdir (no config.json)"]),
    ("init_from without a checkpoint", *TRAIN, ["--config.train.init_from={files}/untrained"],
     ["init_from='{files}/untrained': the run there has no checkpoint"]),
    ("init_from missing", *TRAIN, ["--config.train.init_from={files}/nope"],
     ["init_from='{files}/nope': no such directory"]),
    ("init_from no such step", *TRAIN, ["--config.train.init_from={run}/checkpoints/7"],
     ["no checkpoint at step 7; its steps: [5, 10]"]),
    # train
    ("batch_size 0", *TRAIN, ["--config.train.batch_size=0"], ["train.batch_size=0"]),
    ("batch vs accumulation", *TRAIN, ["--config.train.accumulation_steps=3"],
     ["train.batch_size (16) must be a multiple of", "accumulation_steps (3)"]),
    ("num_steps -1", *TRAIN, ["--config.train.num_steps=-1"], ["train.num_steps=-1", "≥ 1"]),
    ("num_steps 0", *TRAIN, ["--config.train.num_steps=0"], ["train.num_steps=0"]),
    ("learning_rate 0", *TRAIN, ["--config.train.learning_rate=0.0"],
     ["train.learning_rate=0.0", "> 0"]),
    ("learning_rate nan", *TRAIN, ["--config.train.learning_rate=nan"], ["learning_rate=nan"]),
    ("warmup_steps 0", *TRAIN, ["--config.train.warmup_steps=0"], ["train.warmup_steps=0"]),
    ("label_smoothing 1", *TRAIN, ["--config.train.label_smoothing=1.0"],
     ["train.label_smoothing=1.0", "[0, 1)"]),
    ("weight_decay negative", *TRAIN, ["--config.train.weight_decay=-1.0"], ["weight_decay=-1.0"]),
    ("grad_clip_norm negative", *TRAIN, ["--config.train.grad_clip_norm=-1.0"],
     ["grad_clip_norm=-1.0"]),
    ("accumulation_steps 0", *TRAIN, ["--config.train.accumulation_steps=0"],
     ["accumulation_steps=0"]),
    ("loss_chunks 0", *TRAIN, ["--config.train.loss_chunks=0"], ["train.loss_chunks=0", "≥ 1"]),
    ("z_loss negative", *TRAIN, ["--config.train.z_loss=-1"], ["train.z_loss=-1", "≥ 0"]),
    ("log_every 0", *TRAIN, ["--config.train.log_every=0"], ["train.log_every=0"]),
    ("eval_every negative", *TRAIN, ["--config.train.eval_every=-1"], ["train.eval_every=-1"]),
    ("checkpoint_every 0", *TRAIN, ["--config.train.checkpoint_every=0"],
     ["train.checkpoint_every=0"]),
    ("keep_checkpoints 0", *TRAIN, ["--config.train.keep_checkpoints=0"],
     ["train.keep_checkpoints=0"]),
    ("eval_examples negative", *TRAIN, ["--config.train.eval_examples=-1"],
     ["train.eval_examples=-1"]),
    ("skip_nonfinite negative", *TRAIN, ["--config.train.skip_nonfinite=-1"],
     ["train.skip_nonfinite=-1"]),
    ("wandb_project with a slash", *TRAIN, ["--config.train.wandb_project=me/ablations"],
     ["config.train.wandb_project='me/ablations'", "a W&B project name", "none of / \\ #"]),
    # eval, task, seed, mesh, data
    ("eval batch_size 0", *TRAIN, ["--config.eval.batch_size=0"], ["config.eval.batch_size=0"]),
    ("eval num_examples 0, synthetic", *TRAIN, ["--config.eval.num_examples=0"],
     ["eval.num_examples=0", "≥ 1 for a synthetic task"]),
    ("min_len > max_len", *TRAIN, ["--config.task.min_len=6"], ["max_len=5", "≥ min_len (6)"]),
    ("min_len 0", *TRAIN, ["--config.task.min_len=0"], ["task.min_len=0"]),
    ("no symbols", *TRAIN, ["--config.task.num_symbols=0"], ["task.num_symbols=0"]),
    ("heldout_modulus 1", *TRAIN, ["--config.task.heldout_modulus=1"],
     ["task.heldout_modulus=1", "≥ 2"]),
    ("string space too small", *TRAIN, ["--config.task.num_symbols=1", "--config.task.max_len=1"],
     ["task: no", "input of copy of lengths 1..1"]),
    ("unknown task", *TRAIN, ["--config.task.name=rev"], ["unknown task 'rev'", choices(SyntheticSource.Task.registry)]),
    ("former task name", *TRAIN, ["--config.task.name=reverse"],
     ["config.task.name='reverse' is the former name of 'reverse_string'",
      "--config.task.name=reverse_string"]),
    ("seed negative", *TRAIN, ["--config.seed=-1"], ["config.seed=-1", "≥ 0"]),
    ("mesh does not fit", *TRAIN, ["--config.mesh.data=3"], ["does not fit 1 devices"]),
    ("mesh axis 0", *TRAIN, ["--config.mesh.tensor=0"], ["does not fit"]),
    ("unknown data source", *TRAIN, ["--config.data.source=csv"],
     ["unknown data source 'csv'", choices(SOURCES)]),
    ("unknown training lengths", *CHOMSKY, ["--config.task.train_lengths=per_step"],
     ["config.task.train_lengths='per_step'", "one of: per_row, per_batch"]),
    ("cast the arch cannot learn", *CHOMSKY, ["--config.data.cast=decoder"],
     ["config.model.arch='encoder' cannot learn data.source 'algorithmic'",
      "it needs one of: decoder", "with data.cast slots or token_labels (not 'decoder')"]),
    # text data
    ("text corpus missing", *TEXT, ["--config.data.train_source=nope.en"],
     ["config.data.train_source: corpus file not found", "nope.en"]),
    ("text vocab too small", *TEXT, ["--config.data.vocab_size=2"],
     ["config.data.vocab_size=2", "≥ 5"]),
    ("text tokenizer type", *TEXT, ["--config.data.tokenizer_type=wordpiece"],
     ["unknown data.tokenizer_type 'wordpiece'", "bpe, char, unigram, word"]),
    ("text max_len 1", *TEXT, ["--config.data.max_len=1"], ["config.data.max_len=1"]),
    ("text learned table shorter than rows", *TEXT, ["--config.model.position=learned",
                                                      "--config.model.max_len=8"],
     ["data.max_len gives sequences of 16 tokens", "model.max_len=8"]),
    # corpus errors: found before anything is written (the tokenizer is trained in memory)
    ("text corpus empty", *TEXT, ["--config.data.train_source=empty.en",
                                  "--config.data.train_target=empty.de"],
     ["empty corpus: no non-empty sentence pair", "empty.en"]),
    ("text corpus of blank lines", *TEXT, ["--config.data.train_source=blank.en",
                                           "--config.data.train_target=blank.de"],
     ["empty corpus: no non-empty sentence pair", "blank.en"]),
    ("text corpus not UTF-8", *TEXT, ["--config.data.train_source=bad.en"],
     ["bad.en:2: not valid UTF-8"]),
    ("text corpus misaligned", *TEXT, ["--config.data.train_target=short.de"],
     ["has more lines than", "short.de", "must align line by line"]),
    ("text valid split empty", *TEXT, ["--config.data.valid_source=empty.en",
                                       "--config.data.valid_target=empty.de"],
     ["empty corpus: no non-empty sentence pair", "empty.en"]),
    ("text valid split not UTF-8", *TEXT, ["--config.data.valid_source=bad.en"],
     ["bad.en:2: not valid UTF-8"]),
    ("text valid split misaligned", *TEXT, ["--config.data.valid_target=short.de"],
     ["has 40 lines but", "short.de has 1", "must align line by line"]),
    ("text vocabulary larger than the corpus allows", *TEXT, [],
     ["sentencepiece training failed", "Vocabulary size too high (32)"]),
    ("lm held-out text too short", *LM, ["--config.data.valid_files=short.py"],
     ["held-out documents (5 characters) give at most", "too few for eval.num_examples=4 "
      "windows of 32 tokens (130 needed)", "lower eval.num_examples"]),
    ("lm held-out text too short, stdlib", *STDLIB_LM, ["--config.eval.num_examples=100000"],
     ["held-out documents", "too few for eval.num_examples=100000 windows of 512 tokens"]),
    ("lm no held-out file", *LM, ["--config.data.valid_files=nope*.py"],
     ["config.data.valid_files='nope*.py': no file matches"]),
    ("lm no training file", *LM, ["--config.data.train_files=nope*.py"],
     ["config.data.train_files='nope*.py': no file matches"]),
    ("lm training text too short", *LM, ["--config.data.train_files=short.py"],
     ["sentencepiece training failed"]),
    ("lm passkey training fraction 1", *LM, ["--config.data.passkey.train_fraction=1"],
     ["config.data.passkey.train_fraction=1.0 is not allowed", "in [0, 1)"]),
    ("lm passkey training row longer than L", *LM,
     ["--config.data.passkey.examples=0", "--config.data.passkey.train_fraction=0.5"],
     ["a passkey training row takes at least", "more than a window of 16",
      "data.passkey.train_fraction=0"]),
    # Hugging Face datasets (data.source=hf, data.corpus=hf): local JSON Lines files
    # files cut short or not UTF-8, read by datasets (and streamed: as rows arrive)
    *((f"hf JSON Lines cut mid-record{streamed}", *HF,
       ["--config.data.train_files=cut.jsonl", f"--config.data.hf_streaming={streaming}"],
       ["cannot read the json files data.train_files='cut.jsonl'", "hf/cut.jsonl",
        "JSON parse error"])
      for streamed, streaming in (("", False), (", streamed", True))),
    *((f"hf CSV not UTF-8{streamed}", *HF,
       ["--config.data.hf_path=csv", "--config.data.train_files=bad.csv",
        "--config.data.valid_files=valid.csv", "--config.data.source_column=en",
        "--config.data.target_column=de", f"--config.data.hf_streaming={streaming}"],
       ["cannot read the csv files data.train_files='bad.csv'", "hf/bad.csv",
        "not UTF-8 text"])
      for streamed, streaming in (("", False), (", streamed", True))),
    ("lm corpus file not UTF-8", *LM, ["--config.data.train_files=latin1.py"],
     ["lm/latin1.py:2: not valid UTF-8"]),
    ("hf unknown column", *HF, ["--config.data.source_column=translation.fr"],
     ["config.data.source_column='translation.fr': no such column",
      "its columns: translation.en, translation.de, id"]),
    ("hf not a text column", *HF, ["--config.data.target_column=id"],
     ["config.data.target_column='id' is not a text column"]),
    ("hf file missing", *HF, ["--config.data.valid_files=nope*.jsonl"],
     ["config.data.valid_files='nope*.jsonl': no file matches"]),
    ("hf hub dataset with local files", *HF, ["--config.data.hf_path=wmt/wmt14"],
     ["config.data.hf_path='wmt/wmt14' is not allowed", "arrow, csv, json, parquet"]),
    ("hf unknown config", *HF, ["--config.data.hf_path={files}/hfhub",
                                "--config.data.train_files=", "--config.data.valid_files="],
     ["config.data.hf_name='de-en'", "BuilderConfig 'de-en' not found", "['default']"]),
    ("hf unknown split", *HF, ["--config.data.hf_path={files}/hfhub", "--config.data.hf_name=",
                               "--config.data.train_files=", "--config.data.valid_files=",
                               "--config.data.valid_split=dev"],
     ["config.data.valid_split='dev'", "'train', 'validation'"]),
    ("hf without the datasets library", "train.py",
     ["--config", "{files}/hf_nodatasets.py", "--workdir", "{new}"], [],
     ["data.source 'hf' needs the Hugging Face datasets library", "pip install -e '.[hf]'"]),
    ("lm hf unknown column", *LM, ["--config.data.corpus=hf", "--config.data.hf_path=json",
                                   "--config.data.train_files=docs.jsonl",
                                   "--config.data.valid_files=docs.jsonl",
                                   "--config.data.text_key=body"],
     ["config.data.text_key='body': no such column", "its columns: text"]),
    # flags, config files, workdirs
    ("misspelt field", *TRAIN, ["--config.model.positon=rotary"],
     ["--config.model.positon", 'Did you mean "position"']),
    ("unknown field", *TRAIN, ["--config.train.foo=3"], ["the config has no field 'train.foo'"]),
    ("not an integer", *TRAIN, ["--config.train.batch_size=many"], ["batch_size", "'many'"]),
    ("float for an integer", *TRAIN, ["--config.train.batch_size=1.5"], ["batch_size", "1.5"]),
    ("positional argument", *TRAIN, ["extra"], ["unexpected arguments: extra"]),
    ("override without --config", "train.py", ["--workdir", "{new}",
                                               "--config.model.position=rotary"], [],
     ["--config.model.position=rotary sets a field of the config", "no --config is given"]),
    ("a field without --config.", *TRAIN, ["--model.position=rotary"],
     ["unknown flag --model.position=rotary", "did you mean --config.model.position=rotary?"]),
    ("eval a field without --config.", "eval.py",
     ["--workdir", "{run}", "--model.attention.kernel=xla"], [],
     ["did you mean --config.model.attention.kernel=xla?"]),
    ("no workdir", "train.py", ["--config", CONFIG], [], ["--workdir"]),
    ("config file missing", "train.py", ["--config", "{files}/nope.py", "--workdir", "{new}"], [],
     ["config file not found", "nope.py"]),
    ("config file syntax error", "train.py", ["--config", "{files}/syntax.py", "--workdir", "{new}"],
     [], ["config file", "syntax.py, line 1"]),
    ("config file raises", "train.py", ["--config", "{files}/raises.py", "--workdir", "{new}"], [],
     ["config file", "raises.py", "RuntimeError: no such dataset"]),
    ("config argument", "train.py", ["--config", CONFIG + ":big", "--workdir", "{new}"], [],
     ["config file", "default.py:big", "get_config() takes 0 positional arguments"]),
    ("workdir is a file", "train.py", ["--config", CONFIG, "--workdir", "{files}/afile", *TINY], [],
     ["is a file, not a directory"]),
    ("workdir under a file", "train.py",
     ["--config", CONFIG, "--workdir", "{files}/afile/run", *TINY], [], ["is a file, not a directory"]),
    ("workdir not writable", "train.py", ["--config", CONFIG, "--workdir", "/proc/sys/run", *TINY],
     [], ["/proc/sys is not writable"]),
    ("workdir not creatable", "train.py", ["--config", CONFIG, "--workdir", "/proc/run", *TINY],
     [], ["cannot create the workdir /proc/run"]),
    ("another model in a run's workdir", "train.py",
     ["--config", CONFIG, "--workdir", "{run}", *TINY], ["--config.model.d_ff=48"],
     ["holds a run with a different config.model", "d_ff"]),
    ("another task in a run's workdir", "train.py",
     ["--config", CONFIG, "--workdir", "{run}", *TINY], ["--config.task.name=reverse_string"],
     ["different config.task (differs in: name)"]),
    ("another init_from in a run's workdir", "train.py",
     ["--config", CONFIG, "--workdir", "{run}", *TINY], ["--config.train.init_from={files}/x"],
     ["holds a run with a different config.train (differs in: init_from)"]),
    ("bad value resuming a run", "train.py",
     ["--config", CONFIG, "--workdir", "{run}", *TINY], ["--config.train.num_steps=-5"],
     ["train.num_steps=-5"]),
    # eval.py
    ("eval beam 0", "eval.py", ["--workdir", "{run}", "--beam_size", "0"], [], ["--beam_size must be at least 1"]),
    ("eval average 0", "eval.py", ["--workdir", "{run}", "--average", "0"], [], ["--average must be at least 1"]),
    ("eval alpha negative", "eval.py", ["--workdir", "{run}", "--alpha", "-1"], [], ["--alpha must be at least 0"]),
    ("eval alpha without beam search", "eval.py", ["--workdir", "{run}", "--alpha", "0.6"], [],
     ["--alpha 0.6 is the length penalty of beam search", "--beam_size > 1"]),
    ("eval no such step", "eval.py", ["--workdir", "{run}", "--step", "7"], [],
     ["no checkpoint at step 7", "steps: [5, 10]"]),
    ("eval too many to average", "eval.py", ["--workdir", "{run}", "--average", "9"], [],
     ["cannot average 9 checkpoints"]),
    ("eval not a workdir", "eval.py", ["--workdir", "{files}/corpus"], [],
     ["corpus has no config.json: not a training workdir"]),
    ("eval a mistyped workdir", "eval.py", ["--workdir", "{files}/untrianed"], [],
     ["{files}/untrianed: no such directory; did you mean {files}/untrained?"]),
    ("eval source without reference", "eval.py", ["--workdir", "{run}", "--source_file", "x.en"], [],
     ["--source_file and --reference_file go together"]),
    ("eval files on a synthetic run", "eval.py",
     ["--workdir", "{run}", "--source_file", "x.en", "--reference_file", "x.de"], [],
     ["needs a text data source", "'synthetic'"]),
    ("eval output not writable", "eval.py", ["--workdir", "{run}", "--output", "/proc/sys/m.json"],
     [], ["cannot write the metrics to /proc/sys/m.json"]),
    ("eval bad sentence", "eval.py", ["--workdir", "{run}", "--sentence", "0 9", "--nometrics",
                                      "--plot_dir", "{new}"], [], ["'0 9'", "0 1 2 3 4 5"]),
    ("eval unknown flag", "eval.py", ["--workdir", "{run}", "--beam", "4"], [], ["beam"]),
    ("eval generate negative", "eval.py",
     ["--workdir", "{lm}", "--sentence", "def f", "--generate", "-5"], [],
     ["--generate=-5", "--generate must be at least 0"]),
    ("eval generate without sentence", "eval.py", ["--workdir", "{lm}", "--generate", "5"], [],
     ["--generate N continues each --sentence: give at least one"]),
    ("eval generate on a translation run", "eval.py",
     ["--workdir", "{run}", "--sentence", "1 2", "--generate", "5"], [],
     ["--generate needs a language model", "'encoder_decoder'"]),
    ("eval beam on a language model", "eval.py", ["--workdir", "{lm}", "--beam_size", "4"], [],
     ["--beam_size 4", "model.arch 'decoder' does not decode", "--generate is greedy",
      "model.arch encoder_decoder"]),
    ("eval beam on a classifier", "eval.py", ["--workdir", "{listops}", "--beam_size", "2"], [],
     ["--beam_size 2", "model.arch 'encoder' does not decode"]),
    # eval.py --config.FIELD=VALUE (transformer/run/overrides.py)
    ("eval override of an identity field", "eval.py",
     ["--workdir", "{run}", "--config.model.d_ff=48"], [],
     ["--config.model.d_ff=48: model.d_ff is part of the run's identity", "trained with 64",
      "execution fields only", "model.attention.kernel"]),
    ("eval override of the passkey training fraction", "eval.py",
     ["--workdir", "{lm}", "--config.data.passkey.train_fraction=0.5"], [],
     ["data.passkey.train_fraction is part of the run's identity"]),
    ("eval override of a section the run does not read", "eval.py",
     ["--workdir", "{run}", f"--config.{ROTARY}scaling=linear"], [],
     [f"--config.{ROTARY}scaling=linear changes nothing",
      f"this run does not read {ROTARY}scaling"]),
    ("eval override misspelt", "eval.py", ["--workdir", "{run}", f"--config.{ROTARY}scalin=yarn"],
     [], [f"the run's config has no field '{ROTARY}scalin'", 'Did you mean "scaling"']),
    ("eval override out of range", "eval.py", ["--workdir", "{run}", "--config.eval.batch_size=0"],
     [], ["config.eval.batch_size=0 is not allowed", "≥ 1"]),
    ("eval override not a number", "eval.py",
     ["--workdir", "{run}", "--config.eval.batch_size=many"], [],
     ["--config.eval.batch_size=many: 'many' is not a valid int"]),
    ("eval override without a value", "eval.py", ["--workdir", "{run}", "--config.eval.batch_size"],
     [], ["give the value as --config.eval.batch_size=VALUE"]),
    ("eval override given twice", "eval.py",
     ["--workdir", "{run}", "--config.eval.batch_size=4", "--config.eval.batch_size=8"], [],
     ["--config.eval.batch_size is given twice ('4' and '8')"]),
    ("eval override of training", "eval.py", ["--workdir", "{run}", "--config.train.num_steps=5"],
     [], ["--config.train.num_steps: an evaluation does not read config.train"]),
    ("eval override of the sampling", "eval.py",
     ["--workdir", "{run}", "--config.eval.sampling.temperature=1"], [],
     ["eval.py's flags set the sampling (--temperature"]),
    ("eval override of a section", "eval.py", ["--workdir", "{run}", "--config.model.attention=x"],
     [], ["--config.model.attention is a section", "kernel"]),
    ("eval override of a kernel this machine cannot run", "eval.py",  # as train.py refuses it
     ["--workdir", "{run}", "--config.model.attention.kernel=cudnn"], [],
     ["model.attention.kernel='cudnn' runs on gpu only", "backend is cpu", "'xla'"]),
    ("config sampling top_p 0", *TRAIN, ["--config.eval.sampling.temperature=1",
                                         "--config.eval.sampling.top_p=0"],
     ["config.eval.sampling.top_p=0", "(0, 1]"]),
    ("config sampling top_k at temperature 0", *TRAIN, ["--config.eval.sampling.top_k=5"],
     ["config.eval.sampling.top_k=5", "temperature > 0"]),
    ("eval temperature negative", "eval.py", ["--workdir", "{run}", "--temperature", "-1"], [],
     ["--temperature=-1.0 is not allowed", "≥ 0"]),
    ("eval top_k negative", "eval.py",
     ["--workdir", "{run}", "--temperature", "1", "--top_k", "-1"], [],
     ["--top_k=-1 is not allowed", "≥ 0"]),
    ("eval top_p 0", "eval.py", ["--workdir", "{run}", "--temperature", "1", "--top_p", "0"], [],
     ["--top_p=0.0 is not allowed", "in (0, 1]"]),
    ("eval top_p above 1", "eval.py",
     ["--workdir", "{run}", "--temperature", "1", "--top_p", "1.5"], [],
     ["--top_p=1.5 is not allowed", "in (0, 1]"]),
    ("eval min_p 1", "eval.py", ["--workdir", "{run}", "--temperature", "1", "--min_p", "1"], [],
     ["--min_p=1.0 is not allowed", "in [0, 1)"]),
    ("eval sample_seed negative", "eval.py",
     ["--workdir", "{run}", "--temperature", "1", "--sample_seed", "-1"], [],
     ["--sample_seed=-1", "--sample_seed must be at least 0"]),
    ("eval top_k at temperature 0", "eval.py", ["--workdir", "{run}", "--top_k", "5"], [],
     ["--top_k=5 is not allowed", "0 (off) at temperature=0", "temperature > 0"]),
    ("eval sample_seed at temperature 0", "eval.py", ["--workdir", "{run}", "--sample_seed", "3"],
     [], ["--sample_seed applies to sampling", "--temperature 0 (greedy)"]),
    ("eval sampling with beam search", "eval.py",
     ["--workdir", "{run}", "--temperature", "0.8", "--beam_size", "4"], [],
     ["--beam_size 4 with sampling (temperature=0.8)", "sample with --beam_size 1"]),
    ("eval sampling a language model's metrics", "eval.py",
     ["--workdir", "{lm}", "--temperature", "0.8"], [],
     ["sampling (temperature=0.8) would change nothing", "model.arch 'decoder' does not decode",
      "samples with --generate"]),
    ("eval sampling a classifier", "eval.py", ["--workdir", "{listops}", "--temperature", "1"],
     [], ["would change nothing", "model.arch 'encoder' does not decode"]),
    ("eval sampling without decoding", "eval.py",
     ["--workdir", "{run}", "--temperature", "1", "--nometrics", "--plot_dir", "{new}"], [],
     ["would change nothing", "nothing is decoded with --nometrics and no --sentence"]),
    ("eval beam without metrics", "eval.py",
     ["--workdir", "{run}", "--beam_size", "4", "--nometrics", "--plot_dir", "{new}"], [],
     ["--beam_size applies to the metrics, which --nometrics skips"]),
    ("eval output without metrics", "eval.py",
     ["--workdir", "{run}", "--output", "{new}/m.json", "--nometrics"], [],
     ["--output applies to the metrics"]),
    ("eval listops unclosed", "eval.py",
     ["--workdir", "{listops}", "--sentence", "[MAX 1 2", "--nometrics", "--plot_dir", "{new}"],
     [], ["ListOps input '[MAX 1 2' is not an expression", "[MAX (piece 1) is not closed"]),
    ("eval listops operator without arguments", "eval.py",
     ["--workdir", "{listops}", "--sentence", "[MIN 3 [MAX ] ]", "--plot_dir", "{new}"], [],
     ["[MAX (piece 3) has no arguments"]),
    ("eval listops bracket closing nothing", "eval.py",
     ["--workdir", "{listops}", "--sentence", "[SM 1 ] ]", "--nometrics"], [],
     ["piece 4 (']') follows the end of the expression"]),
    # a run's saved config.json damaged
    ("eval truncated config.json", "eval.py", ["--workdir", "{truncated}"], [],
     ["truncated/config.json is not valid JSON", "line", "damaged"]),
    ("train truncated config.json", "train.py",
     ["--config", CONFIG, "--workdir", "{truncated}", *TINY], [],
     ["truncated/config.json is not valid JSON", "damaged"]),
    ("eval config.json holding a list", "eval.py", ["--workdir", "{jsonlist}"], [],
     ["jsonlist/config.json holds an array, not a config", "an object of sections"]),
    ("train config.json holding a list", "train.py",
     ["--config", CONFIG, "--workdir", "{jsonlist}", *TINY], [],
     ["jsonlist/config.json holds an array, not a config"]),
    ("eval config.json holding a string", "eval.py", ["--workdir", "{jsonstring}"], [],
     ["jsonstring/config.json holds a string, not a config"]),
    ("eval config.json with a bad value", "eval.py", ["--workdir", "{badvalue}"], [],
     ["badvalue/config.json (the run's saved config)", "config.model.d_model=-32"]),
    ("train config.json with a bad value", "train.py",
     ["--config", CONFIG, "--workdir", "{badvalue}", *TINY], [],
     ["badvalue/config.json (the run's saved config)", "config.model.d_model=-32"]),
    ("show_config of a bad config", "train.py",
     ["--config", CONFIG, "--show_config", "--config.model.dropout=2.0"], [],
     ["config.model.dropout=2.0", "[0, 1)"]),
    # sweep.py
    ("sweep unknown field", "sweep.py", ["--config", "{files}/sweep_field.py", "--sweep_dir", "{new}"],
     [], ["sweep run model.positon=rotary", "no field 'model.positon'"]),
    ("sweep unknown setting", "sweep.py",
     ["--config", "{files}/sweep_setting.py", "--sweep_dir", "{new}"], [],
     ["no field 'model.position_settings.xpos.decay'"]),
    ("sweep wrong type", "sweep.py", ["--config", "{files}/sweep_type.py", "--sweep_dir", "{new}"],
     [], ["sweep override model.d_model='big'", "int"]),
    ("sweep bad value in a later run", "sweep.py",
     ["--config", "{files}/sweep_late.py", "--sweep_dir", "{new}"], [],
     ["sweep run model.dropout=1.5", "config.model.dropout=1.5"]),
    ("sweep worker out of range", "sweep.py",
     ["--config", "{files}/sweep_late.py", "--sweep_dir", "{new}", "--worker", "3",
      "--num_workers", "2"], [], ["--worker=3 is not allowed", "in 0..1 (--num_workers=2)"]),
    ("sweep no workers", "sweep.py", ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}",
                                      "--print_commands", "--num_workers", "0"], [],
     ["--num_workers=0 is not allowed", "≥ 1"]),
    ("sweep negative workers", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--print_commands",
      "--num_workers=-3"], [], ["--num_workers=-3 is not allowed", "≥ 1"]),
    ("sweep printed worker out of range", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--print_commands",
      "--worker", "5", "--num_workers", "2"], [], ["--worker=5 is not allowed", "in 0..1"]),
    ("sweep without config or record", "sweep.py", ["--sweep_dir", "{new}", "--report_only"], [],
     ["--config FILE is required", "sweep.json does not exist"]),
    ("sweep other overrides than recorded", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{files}/recorded", "--report_only",
      "--config.train.num_steps=8"], [],
     ["holds the runs of `--config", "sweep_ok.py --config.train.num_steps=7`",
      "--config.train.num_steps=8 would describe other runs"]),
    ("sweep other overrides than recorded, without --config", "sweep.py",
     ["--sweep_dir", "{files}/recorded", "--report_only", "--config.train.num_steps=8"], [],
     ["holds the runs of `--config", "--config.train.num_steps=8 would describe other runs"]),
    ("sweep override without config or record", "sweep.py",
     ["--sweep_dir", "{new}", "--config.train.num_steps=8"], [],
     ["--config.train.num_steps=8 sets a field of the sweep's config",
      "no --config FILE is given nor recorded"]),
    ("sweep other config than recorded", "sweep.py",
     ["--config", "{files}/sweep_late.py", "--sweep_dir", "{files}/recorded"], [],
     ["recorded in", "--config", "sweep_late.py would describe other runs"]),
    ("sweep damaged record", "sweep.py", ["--sweep_dir", "{files}/badrecord", "--report_only"],
     [], ["badrecord/sweep.json (how the sweep was run) is damaged", "remove it"]),
    ("sweep only all with more", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--only", "all", "--only",
      "seed=0"], [], ["--only all selects every run"]),
    ("sweep coordinator without port", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--coordinator_address",
      "localhost", "--num_processes", "2", "--process_id", "0"], [],
     ["--coordinator_address='localhost' is not allowed", "HOST:PORT"]),
    ("sweep coordinator without process id", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--coordinator_address",
      "127.0.0.1:8476", "--num_processes", "2"], [],
     ["--coordinator_address needs --num_processes N and --process_id I"]),
    ("train process id out of range", *TRAIN,
     ["--coordinator_address", "127.0.0.1:8476", "--num_processes", "2", "--process_id", "2"],
     ["--process_id=2 is not allowed", "in 0..1"]),
    ("train distributed outside a cluster", *TRAIN, ["--distributed"],
     ["--distributed: jax.distributed.initialize failed", "--coordinator_address HOST:PORT"]),
    ("train join timeout 0", *TRAIN, ["--coordinator_address", "127.0.0.1:8476",
                                      "--num_processes", "2", "--process_id", "1",
                                      "--join_timeout", "0"], ["--join_timeout=0", "≥ 1"]),
    ("eval sweep of an identity field", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "model.position_settings.rotary.base=500"], [],
     ["--eval_sweep rotary.base=500 on run model.position=rotary",
      "rotary.base is part of the run's identity", "rotary.scaling"]),
    ("eval sweep of a training field", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "train.learning_rate=1,2"], [], ["an evaluation does not read config.train"]),
    ("eval sweep of a field no run reads", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "model.position_settings.xpos.scaling=linear"], [],
     ["--eval_sweep model.position_settings.xpos.scaling: no run of the sweep reads it",
      "--only"]),
    ("eval sweep without values", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "model.attention.kernel"], [], ["--eval_sweep model.attention.kernel", "FIELD=VALUE"]),
    ("eval sweep with a baseline", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "model.attention.kernel=xla", "--baseline", "model.position=rotary"], [],
     ["--baseline is for the report of the trained runs"]),
    ("eval sweep across hosts", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--eval_sweep",
      "model.attention.kernel=xla", "--distributed"], [],
     ["--eval_sweep evaluates in one process per worker"]),
    ("sweep file without get_sweep", "sweep.py", ["--config", CONFIG, "--sweep_dir", "{new}"], [],
     ["defines no get_sweep()"]),
    ("sweep get_sweep raises", "sweep.py",
     ["--config", "{files}/sweep_raises.py", "--sweep_dir", "{new}"], [],
     ["sweep_raises.py", "get_sweep() raised NameError", "undefined_grid"]),
    ("sweep get_sweep empty", "sweep.py",
     ["--config", "{files}/sweep_empty.py", "--sweep_dir", "{new}"], [],
     ["sweep_empty.py: get_sweep() must return a non-empty list of override dicts",
      "returned an empty list"]),
    ("sweep get_sweep a dict", "sweep.py",
     ["--config", "{files}/sweep_dict.py", "--sweep_dir", "{new}"], [],
     ["sweep_dict.py: get_sweep() must return a non-empty list", "returned a dict"]),
    ("sweep get_sweep items not dicts", "sweep.py",
     ["--config", "{files}/sweep_items.py", "--sweep_dir", "{new}"], [],
     ["sweep_items.py: get_sweep() must return", "item 0 is a str"]),
    ("sweep get_sweep takes no argument", "sweep.py",
     ["--config", "{files}/sweep_arg.py:small", "--sweep_dir", "{new}"], [],
     ["sweep_arg.py:small", "get_sweep() raised TypeError", "0 positional arguments"]),
    ("sweep lists a run twice", "sweep.py",
     ["--config", "{files}/sweep_twice.py", "--sweep_dir", "{new}"], [],
     ["sweep_twice.py: get_sweep() lists the same run twice",
      "item 0 {'model.position': 'rotary', 'seed': 0}",
      "item 2 {'seed': 0, 'model.position': 'rotary'}"]),
    ("sweep --only unknown field", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--only", "model.positon=rotary"],
     [], ["--only model.positon=rotary", "does not vary 'model.positon'",
          "model.position (sinusoidal, rotary)"]),
    ("sweep --only unknown value", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--only", "model.position=alibi"],
     [], ["the sweep has no model.position=alibi", "its values: sinusoidal, rotary"]),
    ("sweep --only without a value", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--only", "model.position"],
     [], ["--only model.position", "FIELD=VALUE"]),
    ("sweep report of a missing sweep dir", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--report_only"], [],
     ["does not exist"]),
    ("sweep lm variant with too short a held-out text", "sweep.py",
     ["--config", "{files}/sweep_lm.py", "--sweep_dir", "{new}"], [],
     ["sweep run eval.num_examples=1000", "held-out documents", "too few"]),
    ("sweep unknown baseline", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--baseline",
      "model.position=alibi"], [], ["--baseline model.position=alibi: no such variant",
                                    "model.position=sinusoidal, model.position=rotary"]),
    ("sweep success without a comparison", "sweep.py",
     ["--config", "{files}/sweep_ok.py", "--sweep_dir", "{new}", "--success",
      "valid/exact_match 0.9"], [], ["--success 'valid/exact_match 0.9'", "METRIC>=VALUE"]),
    # compare.py
    ("compare nothing", "compare.py", [], [], ["no runs given"]),
    ("compare a file", "compare.py", ["{files}/afile"], [], ["afile is a file, not a directory"]),
    ("compare a mistyped run", "compare.py", ["{run}", "{files}/untrianed"], [],
     ["{files}/untrianed: no such directory; did you mean {files}/untrained?"]),
    ("compare a folder that is not a run", "compare.py", ["{run}", "{files}/corpus"], [],
     ["corpus has no config.json: not a training workdir"]),
    ("compare a run without results", "compare.py", ["{run}", "{files}/untrained"], [],
     ["untrained has no results", "no final evaluation (step 40)"]),
    ("compare runs of different sources", "compare.py", ["{run}", "{listops}"], [],
     ["cannot be compared", "different data sources (synthetic and labelled)"]),
    ("compare runs of different tasks", "compare.py", ["{run}", "{files}/reverse"], [],
     ["cannot be compared", "different tasks (copy and reverse_string)"]),
    ("compare a damaged run", "compare.py", ["{run}", "{truncated}"], [],
     ["truncated/config.json is not valid JSON"]),
    ("compare a run twice", "compare.py", ["{run}", "{run}"], [], ["run is given twice"]),
    ("compare a copy of a run", "compare.py", ["{run}", "{copy}"], [],
     ["are the same run (the same config and seed 0)"]),
    ("compare unknown baseline", "compare.py", ["{run}", "--baseline", "rotary"], [],
     ["--baseline rotary: no such variant, nor a FIELD=VALUE of one; the variants are: "
      "all runs"]),
    ("compare success without a comparison", "compare.py",
     ["{run}", "--success", "valid/exact_match=0.9"], [],
     ["--success 'valid/exact_match=0.9'", "METRIC>=VALUE"]),
    ("compare success of a metric no run has", "compare.py",
     ["{run}", "--success", "valid/bleu>=20"], [],
     ["--success valid/bleu>=20: no run reports valid/bleu", "valid/exact_match"]),
    ("compare unknown ignored field", "compare.py", ["{run}", "--ignore", "model.positon"], [],
     ["--ignore model.positon: the runs' configs have no field"]),
    ("compare output over a sweep's report", "compare.py",
     ["{run}", "--output", "{files}/swept"], [], ["--output", "holds another report", "# Sweep"]),
    ("compare output a file", "compare.py", ["{run}", "--output", "{files}/afile"], [],
     ["afile is a file, not a directory"]),
    ("paired bootstrap of different test sets", "compare.py",
     ["--paired_bootstrap", "{files}/eval_a.json", "{files}/eval_b.json"], [],
     ["eval_a.json and", "eval_b.json scored different valid sets"]),
    ("paired bootstrap without references", "compare.py",
     ["--paired_bootstrap", "{files}/eval_a.json", "{files}/eval_old.json"], [],
     ["eval_old.json: the valid split's references", "missing", "evaluate the run again"]),
    ("paired bootstrap of run directories", "compare.py",
     ["--paired_bootstrap", "{run}", "{run}"], [], ["is a directory; give the metrics JSON"]),
    ("paired bootstrap of one evaluation", "compare.py",
     ["--paired_bootstrap", "{files}/eval_a.json"], [], ["two or more evaluations"]),
    # damaged files of a run, as a report, compare.py or a resumed run read them
    *((f"{script} of a run whose metrics hold {what}", script, [*args, "{files}/" + name], [],
       [f"{name}/metrics.jsonl, line 7: ", problem, "remove that line"])
      for script, args in (("compare.py", ["{run}"]),
                           ("train.py", ["--config", CONFIG, *TINY, "--workdir"]))
      for name, what, problem in (
          ("garbage", "bytes that are not UTF-8", "is not UTF-8 text (byte 0)"),
          ("notrecord", "a JSON line without a split", "is not a metrics record"),
          ("emptyobject", "an empty object", "'{}' is not a metrics record"),
          ("nullline", "a null line", "'null' is not a metrics record"),
          ("notjson", "a line of text", "'step 40 loss 0.5' is not JSON"))),
    ("sweep report of a run whose metrics hold garbage", "sweep.py",
     ["--sweep_dir", "{files}/damagedsweep", "--report_only"], [],
     ["model.position=rotary/metrics.jsonl, line 7: is not UTF-8 text"]),
    ("compare a run whose failure record is damaged", "compare.py", ["{run}", "{files}/failing"],
     [], ["failing/failed.json is not a record of a failure", "remove it"]),
    ("paired bootstrap of hypotheses that are not UTF-8", "compare.py",
     ["--paired_bootstrap", "{files}/eval_a.json", "{files}/eval_latin1.json"], [],
     ["eval_latin1.valid.txt is not UTF-8 text"]),
    ("paired bootstrap with a baseline", "compare.py",
     ["--paired_bootstrap", "--baseline", "x", "{files}/eval_a.json", "{files}/eval_b.json"],
     [], ["--baseline is for the report over run directories"]),
]


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  files = tmp_path_factory.mktemp("files")
  (files / "afile").write_text("not a directory\n")
  (files / "syntax.py").write_text("def get_config(:\n")
  (files / "raises.py").write_text("def get_config():\n  raise RuntimeError('no such dataset')\n")
  for name, runs in (("sweep_field", 'axis("model.positon", ["rotary"])'),
                     ("sweep_type", 'axis("model.d_model", ["big"])'),
                     ("sweep_setting", 'axis("model.position_settings.xpos.decay", [2.0])'),
                     ("sweep_late", 'axis("model.dropout", [0.0, 0.1, 1.5])'),
                     ("sweep_ok", 'axis("model.position", ["sinusoidal", "rotary"])'),
                     ("sweep_raises", "undefined_grid()"),
                     ("sweep_empty", "[]"),
                     ("sweep_dict", '{"model.position": ["rotary", "alibi"]}'),
                     ("sweep_items", '["rotary", "alibi"]'),
                     ("sweep_twice", 'product(axis("model.position", ["rotary"]), '
                                     'axis("seed", [0, 1])) + '
                                     '[{"seed": 0, "model.position": "rotary"}]')):
    (files / f"{name}.py").write_text(SWEEP.format(sweep=runs))
  (files / "recorded").mkdir()  # a sweep directory's record (study/sweep_record.py)
  (files / "recorded" / "sweep.json").write_text(json.dumps({
      "config": str(files / "sweep_ok.py"), "overrides": {"train.num_steps": 7}, "only": []}))
  (files / "badrecord").mkdir()
  (files / "badrecord" / "sweep.json").write_text('{"config": "x.py", "overr')
  (files / "sweep_arg.py").write_text(  # get_config takes the :argument, get_sweep does not
      SWEEP.format(sweep='axis("seed", [0])').replace("def get_config():",
                                                      "def get_config(size=''):"))
  (files / "corpus").mkdir()
  for lang in ("en", "de"):
    (files / "corpus" / f"train.{lang}").write_text("a b c\nd e f\n" * 20)
    (files / "corpus" / f"empty.{lang}").write_text("")
    (files / "corpus" / f"blank.{lang}").write_text("\n \n\t\n")
  (files / "corpus" / "bad.en").write_bytes(b"a b c\n\xff d e\n" + b"a b c\n" * 38)
  (files / "corpus" / "short.de").write_text("a b c\n")
  (files / "lm").mkdir()
  for split, n in (("train", 300), ("valid", 60)):
    (files / "lm" / f"{split}.py").write_text("\n".join(
        f"def f{i}(x):\n  return x * {i % 7} + {i % 5}" for i in range(n)))
  (files / "lm" / "short.py").write_text("x = 1")
  (files / "lm" / "docs.jsonl").write_text("".join(
      json.dumps({"text": f"def f{i}(x):\n  return x + {i}"}) + "\n" for i in range(60)))
  for folder, names in (("hf", ("train.jsonl", "valid.jsonl")),
                        ("hfhub", ("train.jsonl", "validation.jsonl"))):
    (files / folder).mkdir()
    for name in names:  # the nested layout of the hub's WMT datasets
      (files / folder / name).write_text("".join(json.dumps(
          {"translation": {"en": f"a b {i}", "de": f"c d {i}"}, "id": i}) + "\n"
          for i in range(40)))
  (files / "hf_nodatasets.py").write_text(HF_WITHOUT_DATASETS.format(dir=files / "hf"))
  for name in ("lm.py", "sweep_lm.py"):  # train.py reads get_config() only
    (files / name).write_text(SWEEP_LM.format(dir=files / "lm"))
  # For compare.py: runs without training, a sweep's report, evaluations of text splits.
  fake_run(files / "untrained", 0.5, final=False)
  fake_run(files / "reverse", 0.5, **{"task.name": "reverse_string"})
  (files / "swept").mkdir()
  (files / "swept" / "report.md").write_text("# Sweep configs/positions.py\n")
  for name, references in (("eval_a", ["a b", "c d"]), ("eval_b", ["a b", "c e"]),
                           ("eval_old", ["a b", "c d"])):
    write_evaluation(files / f"{name}.json", ["a b", "c"], references)
  os.remove(text_paths(str(files / "eval_old.json"), "valid")[1])
  damaged_files(files)
  return files


def damaged_files(files) -> None:
  """Damaged files: finished runs whose metrics.jsonl ends in a damaged line
  (line 7), a sweep directory holding one, a run's damaged failure record, an evaluation's
  hypotheses not in UTF-8, corpora cut mid-record or not in UTF-8."""
  for name, line in (("garbage", b"\xff\xfe\x00junk"), ("notrecord", b'{"step": 40}'),
                     ("emptyobject", b"{}"), ("nullline", b"null"),
                     ("notjson", b"step 40 loss 0.5")):
    fake_run(files / name, 0.5)
    with open(files / name / "metrics.jsonl", "ab") as f:
      f.write(line + b"\n")
  sweep = files / "damagedsweep"
  (sweep / "model.position=rotary").mkdir(parents=True)
  (sweep / "sweep.json").write_text(json.dumps({"config": str(files / "sweep_ok.py"),
                                                "overrides": {}, "only": []}))
  shutil.copy(files / "garbage" / "metrics.jsonl", sweep / "model.position=rotary")
  fake_run(files / "failing", 0.5, final=False)
  (files / "failing" / "failed.json").write_text("[]")
  write_evaluation(files / "eval_latin1.json", ["a b", "c"], ["a b", "c d"])
  with open(text_paths(str(files / "eval_latin1.json"), "valid")[0], "wb") as f:
    f.write(b"a b\nc\xe9\n")
  rows = "".join(json.dumps({"translation": {"en": f"a b {i}", "de": f"c d {i}"}, "id": i})
                 + "\n" for i in range(40))
  (files / "hf" / "cut.jsonl").write_text(rows[:len(rows) // 2 + 7])
  csv = "en,de\n" + "".join(f"a b {i},c d {i}\n" for i in range(40))
  (files / "hf" / "valid.csv").write_text(csv)
  (files / "hf" / "bad.csv").write_bytes(csv.encode() + b"caf\xe9,x\n" + csv.encode()[6:])
  (files / "lm" / "latin1.py").write_bytes(b"x = 1\ny = 'caf\xe9'\n" * 40)


@pytest.fixture(scope="module")
def run(tmp_path_factory, cli):
  workdir = str(tmp_path_factory.mktemp("trained") / "run")
  result = cli.run("train.py", "--config", CONFIG, "--workdir", workdir, *TINY)
  assert result.returncode == 0, result.stderr
  return workdir


LISTOPS_CONFIG = """
from tests.support import listops_config

def get_config():
  return listops_config(**{"train.num_steps": 5, "train.checkpoint_every": 5,
                           "eval.num_examples": 16})
"""


@pytest.fixture(scope="module")
def others(tmp_path_factory, cli, run):
  """More workdirs, each named by its placeholder: a tiny language model's run (lm) and a
  ListOps classifier's (listops); copies of {run} whose config.json is cut short
  (truncated), a JSON list (jsonlist), a JSON string (jsonstring), or holds a bad value
  (badvalue); and a whole copy of {run} (copy)."""
  root = tmp_path_factory.mktemp("others")
  write_lm_config(root)
  (root / "listops.py").write_text(LISTOPS_CONFIG)
  workdirs = {}
  for name in ("lm", "listops"):
    workdirs[name] = str(root / name)
    result = cli.run("train.py", "--config", str(root / f"{name}.py"), "--workdir", workdirs[name])
    assert result.returncode == 0, result.stderr
  config = open(os.path.join(run, "config.json")).read()
  for name, text in (("truncated", config[:len(config) // 2]), ("jsonlist", "[1, 2]\n"),
                     ("jsonstring", '"model"\n'),
                     ("badvalue", config.replace('"d_model": 32', '"d_model": -32'))):
    shutil.copytree(run, root / name)
    (root / name / "config.json").write_text(text)
    workdirs[name] = str(root / name)
  assert "-32" in open(root / "badvalue" / "config.json").read()
  shutil.copytree(run, root / "copy")  # the same run in another directory
  workdirs["copy"] = str(root / "copy")
  return workdirs


def _snapshot(*roots) -> dict[str, tuple[int, int]]:
  tree = {}
  for root in roots:
    for folder, dirs, names in os.walk(root):
      for name in dirs + names:
        path = os.path.join(folder, name)
        stat = os.lstat(path)
        tree[path] = (stat.st_size if name in names else 0, stat.st_mtime_ns)
      tree[folder] = (0, os.lstat(folder).st_mtime_ns)
  return tree


def test_the_table_has_forty_cases():
  assert len(CASES) >= 40 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("name,script,base,extra,fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input(cli, files, run, others, tmp_path, name, script, base, extra, fragments):
  del name
  new = tmp_path / "new"
  args = [a.format(new=new, run=run, files=files, **others) for a in base + extra]
  places = {"{run}": run, "{files}": str(files)}  # in a fragment: the paths of the arguments
  fragments = [functools.reduce(lambda f, p: f.replace(*p), places.items(), fragment)
               for fragment in fragments]
  _refused(cli, script, args, (tmp_path, run, files, os.path.dirname(others["lm"])), new,
           fragments)


# What a refused command may log before its error line: the data it reads (a long read is
# announced as it begins) and the recorded flags a sweep runs with. Any other line (the
# kernels chosen, say) tells of work that a refusal found before it should not have begun.
BEFORE_A_REFUSAL = re.compile(r"(\d\d:\d\d:\d\d )?(reading |sweep: as recorded in )")


def _refused(cli, script, args, roots, new, fragments, env=None):
  """Runs the script; asserts one `error:` line holding every fragment, a non-zero exit, no
  traceback nor log line of work begun (BEFORE_A_REFUSAL), and nothing written under `roots`
  nor `new` made."""
  before = _snapshot(*roots)
  result = cli.run(script, *args, env=env)
  assert result.returncode != 0, result.stdout[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
  assert "Traceback" not in result.stdout + result.stderr
  said = [line for line in result.stdout.splitlines() if not BEFORE_A_REFUSAL.match(line)]
  assert not said, said
  for fragment in fragments:
    assert fragment in lines[0], lines[0]
  assert not new.exists()
  assert _snapshot(*roots) == before


# A sweep's worker from a SLURM job array's environment (study/sweep_workers.py).
SLURM = [
    ("task id without count", {"SLURM_ARRAY_TASK_ID": "3"},
     ["SLURM_ARRAY_TASK_ID=3 is set but SLURM_ARRAY_TASK_COUNT is not", "--worker I"]),
    ("count not a number", {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "four"},
     ["SLURM_ARRAY_TASK_COUNT='four' is not allowed", "an integer ≥ 1"]),
    ("task id outside the array", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
     ["SLURM_ARRAY_TASK_ID=4 is not one of the 4 task(s) of the job array 0, 1, ..."]),
    ("task id between the steps", {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4",
                                   "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_STEP": "2"},
     ["SLURM_ARRAY_TASK_ID=4 is not one of the 4 task(s) of the job array 1, 3, ..."]),
]


@pytest.mark.parametrize("name,env,fragments", SLURM, ids=[c[0] for c in SLURM])
def test_bad_worker_environment(cli, files, tmp_path, name, env, fragments):
  del name
  new = tmp_path / "new"
  for extra in ([], ["--print_commands"]):
    _refused(cli, "sweep.py", ["--config", str(files / "sweep_ok.py"), "--sweep_dir", str(new),
                               *extra], (tmp_path, files), new, fragments, env)
