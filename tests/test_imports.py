"""No import cycle in megablu/, and the packages layered (issue 16).

1. The import graph of every `import` statement in megablu/ -- function-level (lazy) ones
   included, since a lazy import that closes a loop is still two modules depending on each
   other -- has no cycle.
2. Library packages import only packages below them in LAYERS; command-line modules
   (`*/cli.py`, megablu/cli.py) compose packages and may import any.
3. Every module imports from a fresh megablu (all megablu modules dropped from sys.modules
   before each), so no module works only after another has been imported first.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megablu"
# lowest first: a package may import the ones before it
LAYERS = ["utils", "config", "ops", "model", "memory", "parallel", "data", "checkpoint", "eval", "plan", "train", "hub"]


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the megablu modules it imports anywhere in its body."""
    graph = {}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "megablu":
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph is acyclic."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_no_import_cycle():
    graph = _imports(_modules())
    assert len(graph) > 80
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_planted_cycle():
    graph = _imports(_modules())
    graph["megablu.config.schema"] = graph["megablu.config.schema"] | {"megablu.train.trainer"}
    assert _cycle(graph)[0] == _cycle(graph)[-1]


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_lower_layers():
    graph = _imports(_modules())
    wrong = []
    for mod, deps in graph.items():
        if mod == "megablu.cli" or mod.endswith(".cli"):
            continue
        here = _package(mod)
        assert here in LAYERS or mod == "megablu", f"{mod}: add its package to LAYERS"
        for d in deps:
            there = _package(d)
            if there != here and (here == "" or LAYERS.index(there) > LAYERS.index(here)):
                wrong.append(f"{mod} imports {d}")
    assert not wrong, wrong


def test_every_module_imports_from_a_fresh_megablu():
    code = (
        "import importlib, sys\n"
        "names = sys.argv[1:]\n"
        "bad = []\n"
        "for n in names:\n"
        "    for k in [k for k in sys.modules if k == 'megablu' or k.startswith('megablu.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{n}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    names = sorted(_modules())
    r = subprocess.run(
        [sys.executable, "-c", code, *names],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"},
    )
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
