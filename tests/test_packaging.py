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
# Imports that may come from an extra: the extra, where and why it is optional, and the distribution that
# provides it (checked against the extra even where it is not installed, as in the CPU venv). The import must
# be lazy or guarded (see the module named).
OPTIONAL = {
    "matplotlib": ("bench", "k3serve/bench/plots.py: only for 'k3serve bench --plot-dir'", "matplotlib"),
    "triton": ("gpu", "k3serve/ops/moe/triton_mxfp4.py: imported by ops/moe only when installed", "triton"),
    "fla": ("gpu", "k3serve/ops/kda/fla.py: imported by ops/kda only when installed", "flash-linear-attention"),
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
        if module in OPTIONAL:
            extra, _, dist = OPTIONAL[module]
            if not (provided or {dist}) & extras.get(extra, set()):
                problems.append(f"{module} is allowed as optional but is not in the [{extra}] extra")
        elif not provided:
            problems.append(f"{module} (imported by {files[0]}) is not installed, so its distribution is unknown")
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


def test_cpu_install_imports_no_gpu_extra():
    """Without the [gpu] extra (triton and fla made unimportable), the package imports, builds its registry
    without the GPU backends, and never imports either module."""
    import subprocess

    code = ("import sys; sys.modules.update(triton=None, fla=None)\n"
            "import k3serve.ops, k3serve.models\n"
            "from k3serve.ops import registry\n"
            "assert 'triton' not in registry.backends('mxfp4_expert_combine')\n"
            "assert 'fla' not in registry.backends('kda_chunk')\n"
            "assert sys.modules['triton'] is None and sys.modules['fla'] is None\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_shipped_eagle3_head_is_package_data():
    """k3-default's eagle3 head (found by ``{"method": "eagle3"}`` without a path) must land in the wheel:
    every file of it matches a ``[tool.setuptools.package-data]`` pattern."""
    import fnmatch

    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["k3serve"]
    head = PACKAGE / "models" / "weights" / "k3-default" / "eagle3"
    files = sorted(p for p in head.iterdir() if p.is_file())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "README.md"}
    for p in files:
        rel = p.relative_to(PACKAGE).as_posix()
        assert any(fnmatch.fnmatch(rel, pat.replace("**/", "*/")) for pat in patterns), rel
