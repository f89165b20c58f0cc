"""A small registry of op backends, dispatched per call.

Layers never import a kernel directly: they ask the registry for an op. Backends are named by the rule in
``ops/__init__.py``: ``"naive"`` (the spec), ``"torch"`` (the default), ``"cpu"`` (native), ``"train"``
(the trainer's); GPU kernels (for example flash-linear-attention's) register under their own name with a
higher priority and an ``accepts`` predicate, without touching the layers.

    @register("kda_chunk", "torch", priority=0)
    def chunk_kda(...): ...

    fn = get("kda_chunk")            # dispatches each call (see below)
    fn = get("kda_chunk", "torch")   # a named backend, always
    with use("kda_chunk", "naive"):  # force one backend for every call (tests, the trainer)
        ...

Dispatch: a call goes to the highest-priority backend whose ``accepts(*args, **kwargs)`` is true for that
call's inputs (device type, dtype, shapes); a backend without a predicate accepts everything. Backends
registered with ``priority=None`` (alternatives such as ``"bucketed"``, ``"train"``) are used only when named
or forced. A forced backend (``set_backend``/``use``) wins over dispatch. When the top candidate accepts
everything, ``get`` returns its function itself: no per-call cost on the ops that have one form.

``post_load(model)`` runs, once after weights are loaded and placed, each backend's weight-layout hook
(``register_post_load``): a backend that wants its weights in another layout converts them there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

DEFAULT_BACKEND = "torch"
# used by backends registered without a priority: the spec is the last resort, the torch form the default
_DEFAULT_PRIORITY = {"naive": -100, "torch": 0}


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., Any]
    priority: int | None  # None: only when named or forced
    accepts: Callable[..., bool] | None  # None: every input


_BACKENDS: dict[str, dict[str, Backend]] = {}
_FORCED: dict[str, str] = {}
_DISPATCH: dict[str, Callable[..., Any]] = {}  # get(op)'s answer, rebuilt when the op's backends change
_POST_LOAD: list[tuple[str, Callable[[Any], None]]] = []


def register(op: str, backend: str, *, priority: int | None | str = "default",
             accepts: Callable[..., bool] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make ``fn`` the ``backend`` implementation of ``op``. ``priority`` defaults to -100 for
    ``"naive"``, 0 for ``"torch"`` and None (named/forced only) for any other name."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        impls = _BACKENDS.setdefault(op, {})
        if backend in impls and impls[backend].fn is not fn:
            raise ValueError(f"op {op!r} already has a {backend!r} backend ({impls[backend].fn.__module__})")
        prio = _DEFAULT_PRIORITY.get(backend) if priority == "default" else priority
        impls[backend] = Backend(backend, fn, prio, accepts)
        _DISPATCH.pop(op, None)
        return fn

    return wrap


def _impls(op: str) -> dict[str, Backend]:
    impls = _BACKENDS.get(op)
    if not impls:
        raise KeyError(f"no backend registered for op {op!r}; known ops: {sorted(_BACKENDS)}")
    return impls


def _named(op: str, name: str) -> Backend:
    impls = _impls(op)
    if name not in impls:
        raise KeyError(f"op {op!r} has no {name!r} backend; available: {sorted(impls)}")
    return impls[name]


def candidates(op: str) -> list[Backend]:
    """The backends dispatch tries for ``op``, in order (highest priority first), up to the first that
    accepts every input."""
    ranked = sorted((b for b in _impls(op).values() if b.priority is not None), key=lambda b: -b.priority)
    out = []
    for b in ranked:
        out.append(b)
        if b.accepts is None:
            break
    return out


def pick(op: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """The function that a call of ``op`` with these arguments runs."""
    forced = _FORCED.get(op)
    if forced is not None:
        return _named(op, forced).fn
    for b in candidates(op):
        if b.accepts is None or b.accepts(*args, **kwargs):
            return b.fn
    raise TypeError(f"op {op!r}: no backend accepts these inputs (tried {[b.name for b in candidates(op)]})")


def _dispatcher(op: str) -> Callable[..., Any]:
    cands = candidates(op)
    if not cands:
        raise KeyError(f"op {op!r} has no backend that dispatch may pick; available: {sorted(_impls(op))}")
    if cands[0].accepts is None:
        return cands[0].fn

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        for b in cands:
            if b.accepts is None or b.accepts(*args, **kwargs):
                return b.fn(*args, **kwargs)
        raise TypeError(f"op {op!r}: no backend accepts these inputs (tried {[b.name for b in cands]})")

    dispatch.__name__ = dispatch.__qualname__ = f"dispatch_{op}"
    return dispatch


def get(op: str, backend: str | None = None) -> Callable[..., Any]:
    """The ``backend`` implementation of ``op``; without a name, the forced one if any, else a function that
    dispatches each call by its inputs (the top backend itself when it accepts everything)."""
    if backend is not None:
        return _named(op, backend).fn
    forced = _FORCED.get(op)
    if forced is not None:
        return _named(op, forced).fn
    fn = _DISPATCH.get(op)
    if fn is None:
        fn = _DISPATCH[op] = _dispatcher(op)
    return fn


def set_backend(op: str, backend: str | None) -> None:
    """Force ``backend`` (it must be registered) for every call of ``op``; None goes back to dispatch."""
    if backend is None:
        _FORCED.pop(op, None)
        return
    _named(op, backend)
    _FORCED[op] = backend


def forced(op: str) -> str | None:
    return _FORCED.get(op)


@contextmanager
def use(op: str, backend: str | None) -> Iterator[None]:
    """Force ``backend`` for ``op`` inside the block, then restore what was there."""
    before = _FORCED.get(op)
    set_backend(op, backend)
    try:
        yield
    finally:
        set_backend(op, before)


def active(op: str) -> str:
    """The backend tried first for ``op``: the forced one, else the highest-priority one."""
    return _FORCED.get(op) or candidates(op)[0].name


def backends(op: str) -> list[str]:
    return sorted(_BACKENDS.get(op, {}))


def register_post_load(backend: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(model)`` in ``post_load``: converts the weights ``backend`` reads into its layout."""
    if all(h is not hook for _, h in _POST_LOAD):
        _POST_LOAD.append((backend, hook))


def post_load(model: Any) -> None:
    """Every backend's weight-layout hook, in registration order; after loading and placement, before serving."""
    for _, hook in _POST_LOAD:
        hook(model)
