"""One-way imports inside the package (DEVELOPERS guide): a module may import its own package and the
packages of lower tiers, never a higher tier or a sibling of its own tier (server and router share a tier
and neither imports the other), and the package graph has no cycle. Every import counts, including
the ones inside functions and under ``TYPE_CHECKING``: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import k3serve

ROOT = Path(k3serve.__file__).parent

# tier of each top-level package under k3serve/ (a module's package is its first name under k3serve)
TIERS: dict[str, int] = {
    "core": 0,
    "tokenizer": 1,
    "chat": 2,
    "ops": 3,
    "layers": 4,
    "models": 5,
    "engine": 6,
    "server": 7, "router": 7,
    # tools on top; they may use one another (cycles are still refused)
    "bench": 8, "verify": 8, "sweep": 8, "plan": 8, "entrypoints": 8, "testing": 8, "cli": 8, "__main__": 8, "__init__": 8,
}
TOP = 8


def _package(module: str) -> str:
    """`k3serve.chat.parsers.k3` -> `chat`; `k3serve` itself (its __init__) -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every k3serve import in one module's source."""
    tree = ast.parse(source)
    here = module.split(".")
    if not is_package:
        here = here[:-1]  # the module's own package, for relative imports
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "k3serve"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "k3serve":
                continue
            if name == "k3serve":  # `from k3serve import server`: the names are the modules
                out += [(node.lineno, f"k3serve.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, name))
    return out


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> ["path:line", ...], for imports across packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = _package(_module_name(path))
        for line, name in _imports(path.read_text(), _module_name(path), path.name == "__init__.py"):
            dst = _package(name)
            if dst != src:
                edges.setdefault((src, dst), []).append(f"{path.relative_to(ROOT.parent)}:{line}")
    return edges


def test_every_package_has_a_tier():
    found = {_package(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert found <= set(TIERS), f"packages with no tier in tests/test_layering.py: {sorted(found - set(TIERS))}"


def test_no_import_goes_up_or_sideways():
    bad = []
    for (src, dst), where in sorted(_edges().items()):
        a, b = TIERS.get(src, TOP), TIERS.get(dst, TOP)
        if b > a or (b == a and a != TOP):
            bad.append(f"{src} (tier {a}) imports {dst} (tier {b}): {', '.join(where)}")
    assert not bad, "imports against the tier order:\n" + "\n".join(bad)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, path + [node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst in _edges():
        graph.setdefault(src, set()).add(dst)
    cycle = _find_cycle(graph)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_relative_lazy_and_package_imports_and_cycles():
    src = ("from . import policy\n"
           "from .. import server as s\n"
           "from ..core.hashing import hash_blocks\n"
           "def f():\n"
           "    from k3serve import server\n"
           "    import k3serve.engine.llm\n"
           "    import json\n")
    got = [name for _, name in _imports(src, "k3serve.router.proxy", is_package=False)]
    assert got == ["k3serve.router", "k3serve.server", "k3serve.core.hashing", "k3serve.server",
                   "k3serve.engine.llm"]
    assert [name for _, name in _imports("from .x import y\n", "k3serve.chat", is_package=True)] == \
        ["k3serve.chat.x"]
    assert [_package(n) for n in got] == ["router", "server", "core", "server", "engine"]
    assert _find_cycle({"bench": {"cli"}, "cli": {"plan"}, "plan": {"bench"}}) == ["bench", "cli", "plan", "bench"]
    assert _find_cycle({"bench": {"cli", "core"}, "cli": {"core"}}) is None
