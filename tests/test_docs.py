"""The docs cannot drift from the code: every command shown in README.md and docs/*.md parses
(its script, flags, config file and `:arg`, every --config field: tests/docs_check.py, nothing
trained); every repository path they name exists; every table of a registry's choices lists
exactly the registry's entries; every `pip install` extra exists; the README stays short and
its tour names every module and config file.

A failure names the doc file, its line and the command. Commands are found in shell code
blocks (``` or ```sh) and in inline code spans: any `python SCRIPT.py ...` or `python -m
transformer.MODULE ...`, after environment assignments or launchers (srun, taskset, ...),
within `&&` chains and quoted --command strings, with `\\` continuations joined.
"""

import dataclasses
import importlib.util
import pathlib
import re
import shlex
import tomllib

import pytest

from tests.clirun import ROOT, CliRunner

ROOT_PATH = pathlib.Path(ROOT)
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT_PATH)) for p in ROOT_PATH.glob("docs/*.md"))]
README_MAX_LINES = 300
SHELL_FENCES = {"", "sh", "bash", "shell", "console"}
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
PYTHON = re.compile(r"(.*/)?python(3(\.\d+)?)?")
REDIRECTION = re.compile(r"\d?[<>&]+")


@dataclasses.dataclass(frozen=True, order=True)
class Command:
  doc: str  # README.md or docs/NAME.md
  line: int  # where the command starts, 1-based
  script: str  # relative to the repository root: train.py, benchmarks/decoding.py, ...
  args: tuple[str, ...]

  def __str__(self) -> str:
    return f"{self.doc}:{self.line}: python {shlex.join([self.script, *self.args])}"


def _tokens(text: str) -> list[str]:
  lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  return list(lexer)


def _script(words: list[str]) -> str | None:
  """The repository script that `python WORDS...` runs: SCRIPT.py, or the module of
  `-m PACKAGE.MODULE` where it is one of the repository's (not `-m venv`, `-m pytest`)."""
  if words and words[0].endswith(".py"):
    return words[0].removeprefix("./")
  if len(words) > 1 and words[0] == "-m":
    path = words[1].replace(".", "/") + ".py"
    return path if (ROOT_PATH / path).is_file() else None
  return None


def scripts_in(text: str) -> list[tuple[str, list[str]]]:
  """Every (script, args) of `python SCRIPT.py ARGS` or `python -m MODULE ARGS` (a module of
  the repository's) in a shell command line `text`."""
  found, segment = [], []
  for token in [*_tokens(text), ";"]:
    if token not in SEPARATORS:
      segment.append(token)
      continue
    for i, word in enumerate(segment):
      if re.search(r"python\S*\s", word) and ".py" in word:  # a quoted command: --command='...'
        found += [s for _, line in logical_lines(word.splitlines()) for s in scripts_in(line)]
      elif PYTHON.fullmatch(word) and (script := _script(segment[i + 1:])):
        skip = 2 if segment[i + 1] == "-m" else 1
        args = []
        for arg in segment[i + 1 + skip:]:
          if REDIRECTION.fullmatch(arg):
            break
          args.append(arg)
        found.append((script, args))
        break
    segment = []
  return found


def logical_lines(lines: list[str], first: int = 1):
  """(line number, command line) of shell lines: `\\` continuations joined, and a quote left
  open continuing on the next line."""
  text, start = "", None
  for number, line in enumerate(lines, first):
    start = number if start is None else start
    if line.rstrip().endswith("\\"):
      text += line.rstrip()[:-1] + " "
      continue
    text += line
    try:
      shlex.split(text, comments=True)
    except ValueError:  # an open quote
      text += "\n"
      continue
    yield start, text
    text, start = "", None


def commands(doc: str, text: str | None = None) -> list[Command]:
  """Every command of `doc` (a path relative to the root; its `text`, by default read), in
  order."""
  if text is None:
    text = (ROOT_PATH / doc).read_text(encoding="utf-8")
  found, fence, block, outside = [], None, [], []
  for number, line in enumerate(text.splitlines(), 1):
    match = re.match(r"\s*```(\w*)", line)
    if fence is None and not match:
      outside.append(line)
      continue
    outside.append("")  # a line of a code block: no inline spans there
    if match and fence is None:
      fence, block = match[1], []
    elif match:
      if fence in SHELL_FENCES and block:
        found += logical_lines([line for _, line in block], block[0][0])
      fence = None
    else:
      block.append((number, line))
  prose = "\n".join(outside)
  for span in re.finditer(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)", prose):
    if "python" in span[1]:
      found.append((prose.count("\n", 0, span.start()) + 1, span[1].replace("\n", " ")))
  return sorted(Command(doc, number, script, tuple(args))
                for number, line in found for script, args in scripts_in(line))


COMMANDS = [command for doc in DOCS for command in commands(doc)]


@pytest.fixture(scope="module")
def cli():
  return CliRunner()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.doc}:{c.line}:{c.script}")
def test_command_parses(command, cli):
  result = cli.run("tests/docs_check.py", command.script, *command.args, timeout=300)
  assert result.returncode == 0, f"\n{command}\n  -> {result.stderr.strip()}"


def test_commands_are_found():
  """The extraction itself: a vacuous extraction would pass every doc."""
  sample = """
```sh
XLA_FLAGS=--x=8 python train.py --config configs/default.py \\
    --workdir w --config.seed=1  # a comment's apostrophe: it's fine
python3 -m venv .venv && . .venv/bin/activate && python eval.py --workdir w | tee log
gcloud ssh --command='
  cd x && python sweep.py --config configs/positions.py --sweep_dir "a b"'
#SBATCH --nodes=4
srun python benchmarks/decoding.py --workdir w > out.txt
python -m transformer.study.attention_sinks 'w/*' --split len64
```
Inline: `python compare.py a b --output o` and `--config.model.position=rotary`.
```python
python_is_not_shell = "python train.py"
```
"""
  found = commands("sample.md", sample)
  assert [(c.line, c.script, c.args) for c in found] == [
      (3, "train.py", ("--config", "configs/default.py", "--workdir", "w", "--config.seed=1")),
      (5, "eval.py", ("--workdir", "w")),
      (6, "sweep.py", ("--config", "configs/positions.py", "--sweep_dir", "a b")),
      (9, "benchmarks/decoding.py", ("--workdir", "w")),
      (10, "transformer/study/attention_sinks.py", ("w/*", "--split", "len64")),
      (12, "compare.py", ("a", "b", "--output", "o"))]
  quick_start = {c.script for c in COMMANDS if c.doc == "README.md"}
  assert {"train.py", "eval.py"} <= quick_start, "the README's Quick start commands are not found"


def test_readme_is_short():
  lines = len((ROOT_PATH / "README.md").read_text(encoding="utf-8").splitlines())
  assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): "
                                     "move reference to docs/")


def tour_names(text: str) -> set[str]:
  """The paths that the first column of the README's "Tour of the wings" table names: a
  name not from the root (`translation/text.py`, `chomsky/`) is in the folder of the last one
  from the root before it in its cell."""
  section = text.split("## Tour of the wings", 1)[1].split("\n## ", 1)[0]
  named = set()
  for row in section.splitlines()[2:]:
    folder = ""
    for span in re.findall(r"`([^`]+)`", row.split("|")[1] if row.startswith("|") else ""):
      if re.match(r"(transformer|configs)/", span):
        folder = span if span.endswith("/") else span.rpartition("/")[0] + "/"
        named.add(span.rstrip("/"))
      else:
        named.add((folder + span).rstrip("/"))
  return named


def test_the_tour_names_every_module():
  """Every module of transformer/ and every config file (less __init__.py) is in the README's
  tour, itself or its folder (`transformer/data/tasks/chomsky/`), and every name there exists."""
  named = tour_names((ROOT_PATH / "README.md").read_text(encoding="utf-8"))
  assert {"transformer/data/lm/passkey.py", "transformer/data/tasks/chomsky"} <= named, "tour not parsed"
  missing = sorted(name for name in named if not (ROOT_PATH / name).exists())
  assert not missing, f"README.md's tour of the wings names what does not exist: {missing}"
  modules = sorted(str(p.relative_to(ROOT_PATH)) for pattern in ("transformer/**/*.py",
                                                                   "configs/*.py")
                   for p in ROOT_PATH.glob(pattern) if p.name != "__init__.py")
  unnamed = [m for m in modules
             if not any(m == n or m.startswith(n + "/") for n in named)]
  assert not unnamed, f"README.md's tour of the wings does not name: {', '.join(unnamed)}"


def _spans(doc: str):
  """(line, text) of every inline code span and link target of `doc`."""
  text = (ROOT_PATH / doc).read_text(encoding="utf-8")
  for match in re.finditer(r"`([^`\n]+)`|\]\(([^)\s]+)\)", text):
    yield text.count("\n", 0, match.start()) + 1, match[1] or match[2], match[2] is not None


def _anchors(path: pathlib.Path) -> set[str]:
  """The anchors GitHub gives the headings of a markdown file."""
  return {re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
          for match in re.finditer(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.MULTILINE)}


def test_named_paths_exist():
  """Every repository path a doc names in code (`transformer/model/attention.py`,
  `configs/chomsky.py:cpu`, `transformer/model/decoding.py:generate`) and every relative link
  (with its #heading) exists; a `.py:NAME` names something the file defines."""
  wrong = []
  for doc in DOCS:
    for line, span, is_link in _spans(doc):
      if is_link:
        if re.match(r"[a-z]+:", span):
          continue
        path, _, anchor = span.partition("#")
        target = (ROOT_PATH / doc).parent / path if path else ROOT_PATH / doc
        if anchor and target.is_file() and anchor not in _anchors(target):
          wrong.append(f"{doc}:{line}: {span}: {path or doc} has no heading #{anchor}")
          continue
      elif re.fullmatch(r"(transformer|configs|benchmarks|tests|docs)/[\w./-]*(:\w+)?", span):
        path, _, name = span.partition(":")
        target = ROOT_PATH / path
        if name and path.startswith("transformer/") and target.is_file() and not re.search(
            rf"^\s*(def|class) {name}\b|^{name}\s*=", target.read_text(), re.MULTILINE):
          wrong.append(f"{doc}:{line}: {span}: {path} defines no {name}")
          continue
      else:
        continue
      if not target.exists():
        wrong.append(f"{doc}:{line}: {span}: no such file")
  assert not wrong, "\n".join(wrong)


def test_pip_extras_exist():
  with open(ROOT_PATH / "pyproject.toml", "rb") as f:
    extras = set(tomllib.load(f)["project"]["optional-dependencies"])
  wrong = []
  for doc in DOCS:
    text = (ROOT_PATH / doc).read_text(encoding="utf-8")
    for match in re.finditer(r"pip install -e ['\"]?\.\[([^\]]+)\]", text):
      line = text.count("\n", 0, match.start()) + 1
      wrong += [f"{doc}:{line}: extra {name!r} (pyproject.toml has: {', '.join(sorted(extras))})"
                for name in match[1].split(",") if name.strip() not in extras]
  assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------- registry tables
# A table of a registry's choices follows the marker <!-- choices: FIELD [in CONFIG[:ARG]] -->
# (CONFIG default: configs/default.py); the backticked names in its first column must be
# exactly what FIELD allows (train.py --show_config's "one of: ..."), so a new entry in a
# registry fails here until a doc describes it, and a removed one until the doc forgets it.


def choice_tables():
  for doc in DOCS:
    lines = (ROOT_PATH / doc).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
      if match := re.match(r"\s*<!-- choices: ([\w.]+)(?: in (\S+))? -->", line):
        rows = []
        for row in lines[number:]:
          if not row.strip() and not rows:
            continue
          if not row.lstrip().startswith("|"):
            break
          rows.append(row)
        names = [name for row in rows[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])]
        yield pytest.param(doc, number, match[1], match[2] or "configs/default.py", names,
                           id=f"{doc}:{number}:{match[1]}")


def allowed_choices(config_path: str, field: str) -> list[str]:
  from transformer.run import config_help  # noqa: PLC0415

  path, _, arg = config_path.partition(":")
  spec = importlib.util.spec_from_file_location("docs_config", ROOT_PATH / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  described = {f.path: f.allowed for f in config_help.describe(module.get_config(*[arg] if arg
                                                                                 else []))}
  match = re.match(r"one of:? (.+)", described.get(field, ""))
  assert match, f"{config_path} has no field {field} with registry choices"
  return match[1].split(", ")


@pytest.mark.parametrize("doc,line,field,config_path,names", list(choice_tables()))
def test_choice_table_lists_the_registry(doc, line, field, config_path, names):
  allowed = allowed_choices(config_path, field)
  missing, extra = sorted(set(allowed) - set(names)), sorted(set(names) - set(allowed))
  assert not missing and not extra and len(names) == len(set(names)), (
      f"{doc}:{line}: the table of {field} ({config_path}) lists {', '.join(names)}; the "
      f"registry has {', '.join(allowed)} (not in the doc: {', '.join(missing) or '-'}; not in "
      f"the registry: {', '.join(extra) or '-'})")


def test_choice_tables_are_found():
  assert len(list(choice_tables())) >= 5, "the docs' registry tables lost their markers"
