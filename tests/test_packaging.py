"""Every third-party module the package imports at run time is a declared runtime dependency.

A plain ``pip install k3serve`` installs ``[project] dependencies`` only; a module imported from an extra
(or only present because a test or another package pulled it in) fails for the user at first use. The
training tools (k3serve/train) are a separate workflow and are not checked here.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "k3serve"
EXCLUDED = (PACKAGE / "train",)
# Imports that may come from an extra, each with where it is optional and which extra provides it. The
# import must be lazy and fail with a clear message (see the module named).
OPTIONAL = {
    "matplotlib": ("bench", "k3serve/bench/plots.py: only for 'k3serve bench --plot-dir'"),
}
# Maintainer scripts run by hand, never imported by the package.
DEV_SCRIPTS = {
    "k3serve/tokenizer/native/gen_unicode_tables.py": "regenerates the Unicode tables from tiktoken",
}


def _name(requirement: str) -> str:
    return _canonical(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> files importing it, over every import statement (functions included)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(path.is_relative_to(d) for d in EXCLUDED) or rel in DEV_SCRIPTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "k3serve" and top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(rel)
    return found


def test_runtime_imports_are_runtime_dependencies():
    project = _project()
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in project["optional-dependencies"].items()}
    dists = packages_distributions()
    imports = third_party_imports()
    problems = []
    for module, files in sorted(imports.items()):
        provided = {_canonical(d) for d in dists.get(module, [])}
        if not provided:
            problems.append(f"{module} (imported by {files[0]}) is not installed, so its distribution is unknown")
        elif module in OPTIONAL:
            extra, _ = OPTIONAL[module]
            if not provided & extras.get(extra, set()):
                problems.append(f"{module} is allowed as optional but is not in the [{extra}] extra")
        elif not provided & runtime:
            where = [e for e, reqs in extras.items() if provided & reqs]
            problems.append(f"{module} (imported by {files[0]}) comes from {'/'.join(sorted(provided))}, which "
                            f"is not in [project] dependencies" + (f" (only in extras: {', '.join(where)})"
                                                                    if where else ""))
    assert not problems, "\n".join(problems)


def test_allowlists_are_current():
    """An allowlist entry that no longer matches anything would silently excuse a future import."""
    imports = third_party_imports()
    assert all(module in imports for module in OPTIONAL)
    assert all((ROOT / script).is_file() for script in DEV_SCRIPTS)
    # the walk sees imports inside functions (these two are lazy on purpose)
    assert "k3serve/bench/plots.py" in imports["matplotlib"]
    assert "k3serve/entrypoints/serve_cli.py" in imports["uvicorn"]
