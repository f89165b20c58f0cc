"""The naming rule of ``k3serve/ops/__init__.py``: every serving op has a "torch" form and a "naive" spec, each
backend comes from the file its name says, no op is registered from ``layers/``, and each native kernel sits
beside its op and is listed in setup.py."""

from __future__ import annotations

import ast
from pathlib import Path

import k3serve.ops
from k3serve.ops import registry

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "k3serve" / "ops"


def _serving_backends() -> dict[str, dict[str, str]]:
    """``{op: {backend: defining module}}`` for what importing ``k3serve.ops`` registers (the trainer's
    "train" forms, registered from ``training/``, left out)."""
    assert k3serve.ops.registry is registry
    return {op: {b: r.fn.__module__ for b, r in impls.items() if not r.fn.__module__.startswith("training")}
            for op, impls in registry._BACKENDS.items()}


def test_every_op_has_a_torch_form_and_a_naive_spec():
    missing = [(op, b) for op, impls in _serving_backends().items() for b in ("torch", "naive") if b not in impls]
    assert missing == []


def test_each_backend_comes_from_the_file_it_names():
    wrong = []
    for op, impls in _serving_backends().items():
        for backend, module in impls.items():
            parts = module.split(".")
            ok = parts[:2] == ["k3serve", "ops"] and len(parts) == 4
            if backend in ("naive", "cpu"):
                ok = ok and parts[-1] == backend
            else:
                ok = ok and parts[-1] not in ("naive", "cpu")
            if not ok:
                wrong.append(f"{op}/{backend}: {module}")
    assert wrong == []


def test_layers_register_no_op():
    found = []
    for path in sorted((ROOT / "k3serve" / "layers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "register":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Name) and node.id == "register":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_native_kernels_sit_beside_their_ops_and_are_built():
    setup = (ROOT / "setup.py").read_text()
    sources = sorted(p.relative_to(ROOT).as_posix() for p in OPS.rglob("*") if p.suffix in (".h", ".cpp"))
    assert sources, "no native sources under k3serve/ops"
    for src in sources:
        assert src in setup, f"{src} is not listed in setup.py (sources or depends)"
        parts = Path(src).parts  # k3serve/ops/<op or native>/[native/]<file>
        assert parts[2] == "native" or (parts[3] == "native" and (OPS / parts[2] / "__init__.py").exists()), src
