"""train.py and eval.py as a user runs them: SIGTERM and resume, eval output and pictures;
parse_flags' one-line errors. (Bad input: tests/test_bad_input.py; faults: tests/test_faults.py.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_module

from tests.clirun import ROOT, CliRunner
from tests.support import TINY_FLAGS
from transformer.run import cli


def _run(script, *args, timeout=180):
  return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def _train_args(workdir, *extra):
  return ["--config", os.path.join(ROOT, "configs", "default.py"), "--workdir", workdir, *extra]


def _assert_one_line_error(result, *fragments):
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def test_sigterm_saves_then_rerun_resumes_and_eval_reports(tmp_path):
  workdir = str(tmp_path / "run")
  args = _train_args(workdir, *TINY_FLAGS, "--config.train.num_steps=100000",
                     "--config.train.checkpoint_every=100000")
  proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until training is under way
      if "step 10/" in line or time.time() > deadline:
        break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert "checkpoint saved" in out
  steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert len(steps) == 1 and steps[0] >= 10
  stopped_at = steps[0]

  resumed = _run("train.py", *_train_args(workdir, *TINY_FLAGS,
                                          f"--config.train.num_steps={stopped_at + 5}"))
  assert resumed.returncode == 0, resumed.stderr
  assert f"resuming from the checkpoint at step {stopped_at}" in resumed.stdout
  assert f"step {stopped_at + 5}/{stopped_at + 5}" in resumed.stdout

  result = _run("eval.py", "--workdir", workdir)
  assert result.returncode == 0, result.stderr
  assert f"step {stopped_at + 5}" in result.stdout and "longer" in result.stdout
  path = os.path.join(workdir, f"eval_step_{stopped_at + 5}.json")
  assert path in result.stdout
  with open(path) as f:
    metrics = json.load(f)
  assert set(metrics["splits"]) == {"valid", "longer"}
  assert 0.0 <= metrics["splits"]["valid"]["exact_match"] <= 1.0
  assert "decoding: greedy (the run's own)" in result.stdout

  # Another decoding (or averaging) must not write over eval_step_N.json without a word.
  plain = open(path).read()
  sampled = _run("eval.py", "--workdir", workdir, "--temperature", "0.5", "--sample_seed", "3",
                 "--average", "2")
  assert sampled.returncode == 0, sampled.stderr
  assert "decoding: sampled (temperature=0.5, seed 3)" in sampled.stdout
  assert f"averaged over steps {stopped_at}, {stopped_at + 5}" in sampled.stdout
  named = os.path.join(workdir, f"eval_step_{stopped_at + 5},average=2,temperature=0.5,"
                                "seed=3.json")
  assert named in sampled.stdout and json.load(open(named))["sampling"]["temperature"] == 0.5
  refused = _run("eval.py", "--workdir", workdir, "--beam_size", "2", "--output", path)
  _assert_one_line_error(refused, f"{path} holds another evaluation (its decoding: greedy "
                         "(this one: beam search, 2 beams")
  assert open(path).read() == plain

  plot_dir = tmp_path / "plots"
  bad = _run("eval.py", "--workdir", workdir, "--sentence", "0 9", "--nometrics",
             "--plot_dir", str(plot_dir))
  _assert_one_line_error(bad, "'0 9'", "0 1 2 3 4 5")
  assert not plot_dir.exists()  # a bad sentence writes nothing
  drawn = _run("eval.py", "--workdir", workdir, "--sentence", "0 1 2", "--sentence", "5 4",
               "--nometrics", "--plot_dir", str(plot_dir))
  assert drawn.returncode == 0, drawn.stderr
  # the decoded output is printed, not only drawn in the pictures' titles
  printed = re.findall(r"--- '(0 1 2|5 4)': decoded \(greedy\) '([^']*)'", drawn.stdout)
  assert [sentence for sentence, _ in printed] == ["0 1 2", "5 4"], drawn.stdout
  expected = {f"attention_{i}_{kind}.png" for i in (0, 1)
              for kind in ("encoder", "decoder", "cross")}
  assert set(os.listdir(plot_dir)) == expected | {"positions.png"}
  for name in expected | {"positions.png"}:
    with open(plot_dir / name, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


BAD_CONFIG = [  # (id, arguments after --workdir, fragments of the error line)
    ("misspelt field", ["--config", "{default}", "--config.model.positon=rotary"],
     ["--config.model.positon", 'Did you mean "position"']),
    ("misspelt section", ["--config", "{default}",
                          "--config.model.position_settings.alibii.max_bias=1"],
     ["no field 'model.position_settings.alibii'", 'Did you mean "alibi"']),
    ("unknown field", ["--config", "{default}", "--config.train.foo=3"],
     ["the config has no field 'train.foo'"]),
    ("not an integer", ["--config", "{default}", "--config.train.batch_size", "many"],
     ["--config.train.batch_size", "'many'", "int"]),
    ("not a float", ["--config", "{default}", "--config.train.learning_rate=fast"],
     ["learning_rate", "'fast'", "float"]),
    ("file missing", ["--config={files}/nope.py"], ["config file not found", "nope.py"]),
    ("syntax error", ["--config", "{files}/syntax.py"], ["config file", "syntax.py, line 1"]),
    ("file raises", ["--config", "{files}/raises.py"],
     ["config file", "raises.py", "RuntimeError: no such dataset"]),
    ("config argument", ["--config", "{default}:big"],
     ["config file", "default.py:big", "TypeError: get_config() takes 0 positional arguments"]),
    ("override without --config", ["--config.model.position=rotary"],
     ["--config.model.position=rotary sets a field of the config", "no --config is given"]),
    ("field without --config.", ["--config", "{default}", "--model.position=rotary"],
     ["unknown flag --model.position=rotary", "did you mean --config.model.position=rotary?"]),
    ("bool field without --config.", ["--config", "{default}", "--nomodel.share_embeddings"],
     ["did you mean --noconfig.model.share_embeddings?"]),
]


@pytest.mark.parametrize("name,args,fragments", BAD_CONFIG, ids=[c[0] for c in BAD_CONFIG])
def test_parse_flags_does_not_read_the_text_of_what_it_catches(monkeypatch, capsys, tmp_path,
                                                               name, args, fragments):
  """The error line is the same when absl and config_flags word their exceptions otherwise
  (here: every one says only 'reworded'), as a later release may."""
  del name
  (tmp_path / "syntax.py").write_text("def get_config(:\n")
  (tmp_path / "raises.py").write_text(
      "def get_config():\n  raise RuntimeError('no such dataset')\n")
  default = os.path.join(ROOT, "configs", "default.py")
  argv = ["train.py", "--workdir", "w", *(a.format(default=default, files=tmp_path) for a in args)]
  fresh = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fresh, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=fresh)
  monkeypatch.setattr(flags, "FLAGS", fresh)

  parse = flags.FlagValues.__call__

  def parse_and_reword(self, *a, **k):
    try:
      return parse(self, *a, **k)
    except Exception as e:  # noqa: BLE001 - the same exception object, with another message
      e.args, e.__cause__, e.__context__ = ("reworded",), None, None
      raise e from None

  def report_error(self):  # a config file that failed to load, found at first use
    raise OSError("reworded")

  monkeypatch.setattr(flags.FlagValues, "__call__", parse_and_reword)
  monkeypatch.setattr(config_flags_module._ErrorConfig, "_ReportError", report_error)
  with pytest.raises(SystemExit) as exited:
    cli.parse_flags(argv)
  assert exited.value.code == 2
  line = capsys.readouterr().err.strip()
  assert line.startswith("error: ") and "\n" not in line and "reworded" not in line, line
  for fragment in fragments:
    assert fragment in line, line


def test_config_error_is_none_for_a_good_config_and_one_line_renders_the_rest():
  default = os.path.join(ROOT, "configs", "default.py")
  assert cli.config_error(["train.py", f"--config={default}", "--config.train.batch_size", "8",
                           "--config.model.position=rotary", "--workdir", "w"]) is None
  assert cli.config_error(["eval.py", "--workdir", "w"]) is None
  assert cli.one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"
  assert cli.one_line(flags.IllegalFlagValueError("--workdir is required")) == (
      "--workdir is required")


# --------------------------------------------------------------------------- help


@pytest.fixture(scope="module")
def cli_runner():
  return CliRunner()


@pytest.mark.parametrize("script", ["train.py", "eval.py", "sweep.py"])
def test_help_exits_0_with_the_flags_and_how_to_set_fields(cli_runner, script):
  result = cli_runner.run(script, "--help")
  assert result.returncode == 0 and not result.stderr, result.stderr
  out = result.stdout
  first_line = open(os.path.join(ROOT, script)).read().split("\n")[0].strip('"')
  assert out.startswith(first_line)
  assert "--workdir" in out or "--sweep_dir" in out
  if script == "eval.py":
    assert "--show_config" not in out  # no --config: the run's config.json is its config
  else:
    assert "--config.SECTION.FIELD=VALUE" in out and "--show_config" in out
    assert "--distributed" in out and "--coordinator_address" in out  # defined in cli.py
  for flag in ("-h", "--helpshort", "-?"):
    assert cli_runner.run(script, flag).stdout == out, flag
  full = cli_runner.run(script, "--helpfull", "--workdir", "w")
  assert full.returncode == 0 and "--verbosity" in full.stdout  # absl's own flags too


def test_show_config_lists_every_field_with_what_it_allows(cli_runner, tmp_path):
  """Every field of the typed config (overrides applied), with the choices of registry
  fields and the ranges of numeric ones, as the registries and checks say."""
  from configs import listops  # noqa: PLC0415
  from transformer.core import fields  # noqa: PLC0415
  from transformer.data.tasks.labelled import LabelledSource  # noqa: PLC0415
  from transformer.data.sources import SOURCES  # noqa: PLC0415
  from transformer.model.families import ARCHS  # noqa: PLC0415
  from transformer.model.positions import POSITIONS  # noqa: PLC0415
  from transformer.model.scores import SCORES  # noqa: PLC0415
  from transformer.run import config as config_lib  # noqa: PLC0415

  result = cli_runner.run("train.py", "--config", os.path.join(ROOT, "configs", "listops.py"),
                          "--config.model.position=rotary", "--show_config", cwd=str(tmp_path))
  assert result.returncode == 0 and not result.stderr, result.stderr
  assert not os.listdir(tmp_path)  # no workdir, nothing written
  lines = result.stdout.splitlines()
  assert "listops.py" in lines[0] and "--config.FIELD=VALUE" in lines[0]
  shown = {}
  for line in lines[1:]:
    path, value, *allowed = line.split(maxsplit=2)
    shown[path] = (value, allowed[0] if allowed else "")
  config = listops.get_config()
  config.model.position = "rotary"
  expected = fields.flat(config_lib.to_dict(config_lib.parse(config)))
  assert list(shown) == list(expected)
  assert all(shown[path][0] == repr(value) for path, value in expected.items()
             if " " not in repr(value))
  choices = lambda registry: "one of: " + ", ".join(sorted(registry))  # noqa: E731
  assert shown["model.position"] == ("'rotary'", choices(POSITIONS))
  assert shown["model.attention.score"][1] == choices(SCORES)
  assert shown["data.source"][1] == choices(SOURCES)
  assert shown["task.name"][1] == choices(LabelledSource.Task.registry)
  assert shown["model.arch"] == ("'encoder'", choices(ARCHS))
  assert shown["train.batch_size"][1] == "≥ 1"
  assert shown["model.dropout"][1] == "in [0, 1)"
  assert shown["task.branch_prob"][1] == "in (0, 1]"
  assert shown["task.max_len"][1] == "≥ min_len (10)"
  assert shown["model.num_heads"][1] == "≥ 1; a divisor of d_model (64)"
  assert shown["seed"][1] == "an integer ≥ 0"
  assert shown["model.share_embeddings"][1] == "true or false"
  assert shown["mesh.data"][1] == ""  # no check: any integer
  # a section's own check of a name says its choices as a registry does
  assert shown["model.position_settings.rotary.scaling"][1] == "one of: none, linear, ntk, yarn"
  assert all(a.startswith("one of: ") for _, a in shown.values() if a.startswith("one of"))


def test_show_config_follows_the_code_not_a_list(monkeypatch):
  """A registry entry added, a section's check changed: described as the code now says."""
  from configs import default  # noqa: PLC0415
  from transformer.core import fields
  from transformer.model.positions import POSITIONS  # noqa: PLC0415
  from transformer.run import config as config_lib  # noqa: PLC0415
  from transformer.run import config_help

  monkeypatch.setitem(POSITIONS, "zz_new", POSITIONS["none"])
  monkeypatch.setattr(config_lib.EvalConfig, "__post_init__", lambda self: fields.check_ranges(
      self, num_examples=fields.Range(3, 999), batch_size=fields.Range(8, lo_open=True)))
  described = {f.path: f.allowed for f in config_help.describe(default.get_config())}
  assert described["model.position"].endswith(", xpos, zz_new")
  assert described["eval.num_examples"] == "in [3, 999]"
  assert described["eval.batch_size"] == "> 8"
