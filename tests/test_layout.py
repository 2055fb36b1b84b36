"""The package's layout holds its architecture: five wings on floors, each importing only
from its own floor and the floors below it (core < data < model < run < study), and no
import circle between modules, function-level imports included."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "transformer"
FLOORS = ("core", "data", "model", "run", "study")  # each may import the ones before it


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


def test_every_module_lives_in_a_wing():
  loose = [m for m in MODULES if m != "transformer" and _wing(m) not in FLOORS]
  assert not loose, f"modules outside the wings {FLOORS}: {loose}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_floors(module):
  if module == "transformer":
    assert not MODULES[module]
    return
  floor = FLOORS.index(_wing(module))
  upward = sorted(m for m in MODULES[module]
                  if m != "transformer" and FLOORS.index(_wing(m)) > floor)
  assert not upward, (f"{module} ({FLOORS[floor]}) imports from a higher floor: {upward}; "
                      f"the floors, lowest first: {' < '.join(FLOORS)}")


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
