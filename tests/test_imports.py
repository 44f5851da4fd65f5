"""Imports flow one way: ``pallas_kernels`` never imports ``specroll_jax``, the library never
imports the experiments' app package (``experiments/app``, imported as ``app``), and no module of
the three takes part in an import cycle, counting imports inside functions too (static AST scan);
imports under ``if TYPE_CHECKING:`` never run and are not counted."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> the folder its top level is imported from
PACKAGES = {"specroll_jax": ROOT, "pallas_kernels": ROOT, "app": ROOT / "experiments"}


def _modules() -> dict[str, Path]:
  mods = {}
  for pkg, base in PACKAGES.items():
    for f in (base / pkg).rglob("*.py"):
      parts = f.relative_to(base).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      mods[".".join(parts)] = f
  return mods


def _resolve(name: str, mods) -> str | None:
  """The longest known module that ``name`` (dotted) starts with."""
  parts = name.split(".")
  while parts:
    cand = ".".join(parts)
    if cand in mods:
      return cand
    parts.pop()
  return None


def _type_checking(node: ast.If) -> bool:
  t = node.test
  return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
      isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
  mods = _modules()
  graph = {m: set() for m in mods}
  for mod, path in mods.items():
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and _type_checking(b)
                   for stmt in b.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):  # function bodies included
      if id(node) in typing_only:
        continue
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          anchor = package.split(".")
          anchor = anchor[: len(anchor) - (node.level - 1)]
          base = ".".join(anchor + ([base] if base else []))
        targets = [f"{base}.{a.name}" for a in node.names]
      for t in targets:
        r = _resolve(t, mods)
        if r is not None and r != mod:
          graph[mod].add(r)
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  color, stack = {}, []

  def visit(u):
    color[u] = 1
    stack.append(u)
    for v in sorted(graph.get(u, ())):
      if color.get(v) == 1:
        return stack[stack.index(v):] + [v]
      if v not in color:
        found = visit(v)
        if found:
          return found
    stack.pop()
    color[u] = 2
    return None

  for u in sorted(graph):
    if u not in color:
      found = visit(u)
      if found:
        return found
  return None


def test_cycle_finder_finds_cycles():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_graph_sees_imports_inside_functions():
  g = import_graph()
  assert "specroll_jax.sampling" in g["specroll_jax.rollout"] or \
      "specroll_jax.sampling" in g["specroll_jax.engines.responses"]
  assert len(g) > 20 and sum(map(len, g.values())) > 40


def test_graph_skips_type_checking_imports(tmp_path, monkeypatch):
  """A module naming a higher one's type for annotations only (under ``if TYPE_CHECKING:``) does
  not depend on it, so the two make no cycle."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "low.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "  from pkg.high import Report\n")
  (pkg / "high.py").write_text("from pkg import low\n")
  monkeypatch.setitem(globals(), "PACKAGES", {"pkg": tmp_path})
  g = import_graph()
  assert g["pkg.low"] == set() and "pkg.low" in g["pkg.high"]
  assert find_cycle(g) is None


def test_pallas_kernels_import_nothing_from_the_library():
  g = import_graph()
  bad = {m: sorted(d for d in deps if d.startswith("specroll_jax"))
         for m, deps in g.items() if m.startswith("pallas_kernels")}
  assert not any(bad.values()), bad


def test_library_imports_nothing_from_the_app():
  g = import_graph()
  assert "app.trainer" in g["app.loop"] and "specroll_jax.rollout" in g["app.loop"]
  bad = {m: sorted(d for d in deps if d.split(".")[0] == "app")
         for m, deps in g.items() if not m.startswith("app")}
  assert not any(bad.values()), bad


def test_the_moved_modules_are_gone_from_the_library():
  """The experiments' glue lives in ``experiments/app`` only (no copy left behind to drift)."""
  g = import_graph()
  for name in ("cli", "pipeline", "sft", "traces", "checkpoint", "grpo.loop", "grpo.trainer",
               "models.widen", "data.synthetic", "data.synthetic_templates", "data.tasks"):
    assert f"specroll_jax.{name}" not in g, name
    assert f"app.{name.rpartition('.')[2]}" in g, name


def test_replaced_modules_are_gone():
  """Adaptation is ``SpecRoll``'s (``specroll_jax.specroll``: its state, fold and report modules):
  the old adaptation module and the flat SpecRoll modules are deleted, not kept as shims."""
  g = import_graph()
  for name in ("reports", "specroll_state", "specroll_fold"):
    assert f"specroll_jax.{name}" not in g, name
  import specroll_jax.adaptation as adaptation  # now the folder of what adapts, no state of its own
  assert not hasattr(adaptation, "AdaptationState") and not hasattr(adaptation, "after_rollout")
  for name in ("core", "state", "fold", "programs", "report"):
    assert f"specroll_jax.specroll.{name}" in g, name


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, " -> ".join(cycle)
