"""The package's layout holds its architecture: five wings on floors, each importing only
from its own floor and the floors below it (core < data < model < run < study), and no
import circle between modules, function-level imports included; a sub-wing (a package inside
a wing: model/kernels/, data/tasks/, ...) is entered through its __init__; no module so long
that it must hold more than one concept. Every module lives in a wing but the public surface
of config and sweep files (PUBLIC: transformer/api.py), which stands above the wings, free to
import from any of them and imported by none, so that what config files import stays put
while the wings move.
In tests/, no test module imports another: what they share is tests/support.py's."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer"
FLOORS = ("core", "data", "model", "run", "study")  # each may import the ones before it
PUBLIC = ("transformer.api",)  # above every floor (the module docstring)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
  """The transformer modules `path` imports anywhere in its body (a name imported from a
  package is the submodule when one exists by that name)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("transformer")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or \
            (PACKAGE.parent / sub.replace(".", "/")).is_dir()
        out.add(sub if is_module else node.module)
  return out


MODULES = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _wing(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def _floor(module: str) -> int:
  return len(FLOORS) if module in PUBLIC else FLOORS.index(_wing(module))


def test_every_module_lives_in_a_wing():
  loose = [m for m in MODULES if m != "transformer" and m not in PUBLIC
           and _wing(m) not in FLOORS]
  assert not loose, f"modules outside the wings {FLOORS} (and {PUBLIC}): {loose}"
  assert set(PUBLIC) <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_floors(module):
  if module == "transformer":
    assert not MODULES[module]
    return
  floor = _floor(module)
  upward = sorted(m for m in MODULES[module] if m != "transformer" and _floor(m) > floor)
  assert not upward, (f"{module} ({FLOORS[floor]}) imports from a higher floor: {upward}; "
                      f"the floors, lowest first: {' < '.join(FLOORS)} < {', '.join(PUBLIC)}")


def test_no_import_circle():
  graph = {m: {d for d in deps if d in MODULES and d != m} for m, deps in MODULES.items()}
  # a package's __init__ importing its own submodules is how a package exports; not a circle
  graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
  seen, stack, cycles = set(), [], []

  def visit(node):
    if node in stack:
      cycles.append(stack[stack.index(node):] + [node])
      return
    if node in seen:
      return
    seen.add(node)
    stack.append(node)
    for dep in sorted(graph[node]):
      visit(dep)
    stack.pop()

  for module in sorted(graph):
    visit(module)
  assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)



TESTS = PACKAGE.parent / "tests"
# An import of a test module (tests.test_*) written in a string of code that a test runs (a
# subprocess's -c, a config file it writes), in each of the three forms of an import.
CODE_IMPORT = re.compile(r"\b(?:from|import)[ \t]+tests\.(test_\w+)|"
                         r"\bfrom[ \t]+tests[ \t]+import[ \t]+([\w ,]+)")


def _test_modules_imported(text: str) -> set[str]:
  """The test modules (test_*) that code `text` imports: in its code (ast), function-level
  imports included, and in the strings of code it holds."""
  found = set()
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  for match in CODE_IMPORT.finditer(text):
    found |= {f"tests.{n.strip()}" for n in (match[1] or match[2]).split(",")}
  return {m.split(".")[1] for m in found if m.startswith("tests.test_")}


def test_the_check_of_test_module_imports_sees_every_form():
  # {t} for tests: this module's own text imports no test module
  code = ("import json\nfrom {t}.test_a import x\nimport {t}.test_b\n"
          "from {t} import clirun, test_c\nfrom {t}.support import fake_run\n"
          "def f():\n  from {t}.test_d import y\n"
          "CODE = 'import sys; from {t}.test_e import g'\n"
          "FILE = \"\"\"\nfrom {t} import test_f\nfrom {t}.kernel_cases import Case\n\"\"\"\n"
          ).format(t="tests")
  assert _test_modules_imported(code) == {"test_a", "test_b", "test_c", "test_d", "test_e",
                                          "test_f"}


@pytest.mark.parametrize("name", sorted(p.name for p in TESTS.glob("*.py")))
def test_no_test_module_imports_a_test_module(name):
  """Shared helpers live in tests/support.py (and tests/clirun.py, tests/kernel_cases.py):
  a test module imported by another, or by itself in a subprocess, has its module code run
  again there and ties the two files' tests together."""
  imported = _test_modules_imported((TESTS / name).read_text())
  assert not imported, (f"tests/{name} imports test module(s) {sorted(imported)}: move what "
                        "it needs into tests/support.py")


def _packages() -> list[str]:
  return sorted(m for m in MODULES if (PACKAGE.parent / m.replace(".", "/")).is_dir())


SUB_WINGS = [p for p in _packages() if p.count(".") >= 2]


def test_the_sub_wings_are_seen():
  assert {"transformer.model.kernels", "transformer.data.tasks"} <= set(SUB_WINGS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_sub_wing_is_entered_through_its_init(module):
  """A module outside a sub-wing imports the sub-wing's package (what its __init__ exports),
  never one of its modules: what a sub-wing keeps inside can change without the rest
  noticing."""
  inward = sorted(m for m in MODULES[module] for wing in SUB_WINGS
                  if m.startswith(wing + ".") and not (module + ".").startswith(wing + "."))
  assert not inward, (f"{module} imports inside a sub-wing: {inward}; import what it needs "
                      "from the sub-wing's package (its __init__ exports it)")


MAX_LINES = 500  # one concept rarely needs more: a longer module is a smell to look at


def test_no_module_is_over_500_lines():
  """The package's modules, the benchmarks' and the CLIs (train.py, eval.py, sweep.py,
  compare.py)."""
  root = PACKAGE.parent
  paths = [*PACKAGE.rglob("*.py"), *(root / "benchmarks").rglob("*.py"), *root.glob("*.py")]
  assert len(paths) > len(MODULES)
  long = {str(p.relative_to(root)): n for p in paths
          if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines (does each hold one concept?): {long}"
