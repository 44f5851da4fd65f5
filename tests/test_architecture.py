"""The library's shape: its modules import each other without a cycle (every import counts, inside
functions and under ``TYPE_CHECKING`` too, so no module reaches a module above it), the app lives
beside the library, no library module grows past 500 lines, and no deprecated path is kept."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "specroll_jax"
MAX_LINES = 500
# the experiments' glue (CLI helpers, the GSM8K loop, SFT, traces, checkpoints of a run)
APP = ("cli", "pipeline", "sft", "loop", "trainer", "traces", "checkpoint", "widen", "synthetic",
       "evaluation", "draft_quality")


def _modules() -> dict[str, Path]:
  mods = {}
  for f in LIBRARY.rglob("*.py"):
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = f
  return mods


def _imports(name: str, file: Path, mods: dict[str, Path]) -> set[str]:
  """The library modules ``name`` imports anywhere in its text (``from a import b``: the module
  ``a.b`` when it is one, else ``a``)."""
  out = set()
  for node in ast.walk(ast.parse(file.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        out.add(full if full in mods else node.module)
  return {m for m in out if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        found.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return found


def test_no_import_cycle():
  mods = _modules()
  graph = {m: _imports(m, f, mods) for m, f in mods.items()}
  assert _cycles(graph) == []
  # the cycle finder itself finds one
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_kernels_and_the_app_stay_apart():
  """``pallas_kernels`` imports nothing of the library; the library nothing of the app."""
  def imported(file):
    for node in ast.walk(ast.parse(file.read_text())):
      if isinstance(node, ast.ImportFrom):
        yield node.module or ""
      elif isinstance(node, ast.Import):
        yield from (a.name for a in node.names)

  for f in (ROOT / "pallas_kernels").rglob("*.py"):
    assert not [n for n in imported(f) if n.startswith("specroll_jax")], f
  mods = _modules()
  for name, f in mods.items():
    assert not [n for n in imported(f) if n == "app" or n.startswith(("app.", "experiments"))], name
  assert not [n for n in mods if n.split(".")[-1] in APP], "app modules inside the library"


def test_no_module_over_the_limit():
  long = {str(f.relative_to(ROOT)): n for f in LIBRARY.rglob("*.py")
          if (n := len(f.read_text().splitlines())) > MAX_LINES}
  assert long == {}


def test_no_deprecated_surface():
  """A young library removes what it replaces: nothing warns of deprecation, and the one rollout
  function takes no catch-all keywords."""
  import inspect

  from specroll_jax import rollout
  for f in LIBRARY.rglob("*.py"):
    assert "DeprecationWarning" not in f.read_text(), f
  kinds = {p.kind for p in inspect.signature(rollout.generate).parameters.values()}
  assert inspect.Parameter.VAR_KEYWORD not in kinds
