"""The package's layout rules (docs/architecture.md), read from the source: imports only go down.

* nothing under ``dmuon/runtime/`` imports dmuon code outside it (torch and the standard library only);
* nothing in ``dmuon/`` outside ``dmuon/tools/`` imports ``dmuon.tools``, except the three ``python -m``
  entry points that forward to it, and nothing imports those;
* there is no import cycle among dmuon's modules (imports inside functions count: they run too);
* no module (library, tests, scripts) is over 600 lines and no function over 80 lines of code (its docstring
  not counted);
* README's Layout table names every module and nothing that is not there.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"  # the src/ layout: module names are relative to it
PKG = SRC / "dmuon"
#: ``python -m dmuon.X`` keeps its short name through these; each only forwards to dmuon.tools.X.
ENTRY_POINTS = {"dmuon.demo", "dmuon.bench", "dmuon.plan"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The dmuon modules ``name`` imports (anywhere in the file), resolved to module names.

    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module; importing a submodule
    does not count as importing its parent packages (Python runs their ``__init__`` first, but that is
    not an arrow of the design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == "dmuon" or t.startswith("dmuon."))
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_import_resolves_to_a_module(graph):
    known = set(graph)
    unknown = {f"{m} -> {t}" for m, ts in graph.items() for t in ts if t not in known}
    assert not unknown, f"imports of dmuon modules that do not exist: {sorted(unknown)}"


def test_runtime_imports_nothing_above_it(graph):
    bad = {f"{m} -> {t}" for m, ts in graph.items() if m.startswith("dmuon.runtime")
           for t in ts if not t.startswith("dmuon.runtime")}
    assert not bad, f"dmuon/runtime/ must only import torch, the standard library and itself: {sorted(bad)}"
    third_party = set()
    for name, path in _modules().items():
        if not name.startswith("dmuon.runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import) else
                     [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [])
            third_party.update(f"{name} -> {r}" for r in roots if r not in sys.stdlib_module_names and r != "torch")
    assert not third_party, sorted(third_party)


def test_library_never_imports_the_tools(graph):
    bad = {f"{m} -> {t}" for m, ts in graph.items() if not m.startswith("dmuon.tools") and m not in ENTRY_POINTS
           for t in ts if t.startswith("dmuon.tools")}
    assert not bad, f"only dmuon/tools/ and the python -m entry points may import dmuon.tools: {sorted(bad)}"
    for entry in ENTRY_POINTS:
        assert graph[entry] == {"dmuon.tools." + entry.split(".")[1]}, (entry, graph[entry])
        importers = [m for m, ts in graph.items() if entry in ts]
        assert not importers, f"{entry} is an entry point only, yet {importers} import it"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or ``None`` (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(t)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycle(graph):
    # the search finds a cycle where there is one (so a clean result means something) ...
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    # ... and the graph it searches is the real one, arrows and all
    assert "dmuon.runtime.hooks" in graph["dmuon.dedicate"] and sum(map(len, graph.values())) > 50, graph
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return lines


def test_modules_and_functions_stay_small():
    """The library, the tests and the scripts. (The examples are scripts a user reads top to bottom and
    copies from: their ``main`` may run longer.)"""
    long_modules, long_functions = [], []
    files = {**_modules(), **{str(p.relative_to(ROOT)): p for d in ("tests", "scripts") for p in (ROOT / d).glob("*.py")}}
    for name, path in files.items():
        src = path.read_text()
        if len(src.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name} ({len(src.splitlines())} lines)")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
                long_functions.append(f"{name}.{node.name} ({_code_lines(node)} lines)")
    assert not long_modules, f"over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"over {MAX_FUNCTION_LINES} lines of code: {long_functions}"


def test_readme_layout_table_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(dmuon/[\w/]*(?:\.py)?)`", section))
    files = {str(p.relative_to(SRC)) for p in PKG.rglob("*.py")}
    missing = sorted(f for f in files
                     if f not in named and not any(n.endswith("/") and f.startswith(n) for n in named))
    stale = sorted(n for n in named if not (SRC / n).exists())
    assert not missing, f"README's Layout table does not name {missing}"
    assert not stale, f"README's Layout table names paths that do not exist: {stale}"


def _private_members(path: Path, cls: str) -> set[str]:
    """The private names class ``cls`` of ``path`` defines: its ``_methods`` and the ``self._attrs`` it sets."""
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_muon_is_reached_through_its_public_surface():
    """Checkpoints, diagnostics, engines and integrations use ``dmuon.Muon``'s public members (``runtime``,
    ``materialise_state``, ``replace_state``, ``group_fqns``, ...), never a private one: nothing outside
    ``dmuon/optim/muon.py`` reads an attribute named like a private member of ``Muon`` on anything but its
    own ``self`` / ``cls``."""
    home = PKG / "optim" / "muon.py"
    private = _private_members(home, "Muon")
    bad = []
    for name, path in _modules().items():
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{name}:{node.lineno} .{node.attr}")
    assert not bad, f"private members of dmuon.Muon read outside dmuon/optim/muon.py: {bad}"
