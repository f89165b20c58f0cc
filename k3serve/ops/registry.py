"""A small registry of op backends.

Layers never import a kernel directly: they ask the registry for ``(op, backend)``. Backends are named by the
rule in ``ops/__init__.py``: ``"naive"`` (the spec), ``"torch"`` (the default), ``"cpu"`` (native), ``"train"``
(the trainer's); GPU kernels (for example flash-linear-attention's) register under their own name later
without touching the layers.

    @register("kda_chunk", "torch")
    def chunk_kda(...): ...

    fn = get("kda_chunk")            # the active backend for this op
    fn = get("kda_chunk", "torch")   # a named backend
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_BACKENDS: dict[str, dict[str, Callable[..., Any]]] = {}
_ACTIVE: dict[str, str] = {}
DEFAULT_BACKEND = "torch"


def register(op: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        impls = _BACKENDS.setdefault(op, {})
        if backend in impls and impls[backend] is not fn:
            raise ValueError(f"op {op!r} already has a {backend!r} backend ({impls[backend].__module__})")
        impls[backend] = fn
        return fn

    return wrap


def get(op: str, backend: str | None = None) -> Callable[..., Any]:
    """The implementation of ``op`` for ``backend`` (default: the active one, else ``"torch"``)."""
    impls = _BACKENDS.get(op)
    if not impls:
        raise KeyError(f"no backend registered for op {op!r}; known ops: {sorted(_BACKENDS)}")
    name = backend or _ACTIVE.get(op, DEFAULT_BACKEND)
    if name not in impls:
        raise KeyError(f"op {op!r} has no {name!r} backend; available: {sorted(impls)}")
    return impls[name]


def set_backend(op: str, backend: str) -> None:
    """Make ``backend`` the default for ``op`` (it must already be registered)."""
    get(op, backend)
    _ACTIVE[op] = backend


def active(op: str) -> str:
    """The backend ``get(op)`` returns now."""
    return _ACTIVE.get(op, DEFAULT_BACKEND)


def backends(op: str) -> list[str]:
    return sorted(_BACKENDS.get(op, {}))
