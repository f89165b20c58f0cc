"""``CaptureCheck``: raise on anything a CUDA graph cannot capture, so CPU tests can prove a forward capturable.

A CUDA graph records device work only: a host read-back (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``,
``.numpy()``, a device-to-host copy) either fails at capture or, worse, is frozen into the graph with the
capture's values; so is an op whose output shape depends on tensor values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``), and a tensor built
from host data during the forward (``torch.tensor(list)``: its values would be baked in at capture).
``torch.cuda.graph`` refuses some of these only on a GPU; this mode refuses all of them on any device:

    with CaptureCheck():
        step()          # HostSyncError naming the op at the first host sync

It is a ``TorchDispatchMode`` (every aten op of the forward passes through it) plus a patch of the
``Tensor`` methods that read data without dispatching (``tolist``, ``numpy``), both undone on exit.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A forward under ``CaptureCheck`` did something a CUDA graph cannot capture."""


# ops that read a value back to the host, or whose output shape depends on tensor values
_REFUSED = {
    aten._local_scalar_dense.default: "reads a value back to the host (.item(), int(t), bool(t))",
    aten.nonzero.default: "has a data-dependent output shape (nonzero / boolean-mask indexing)",
    aten.item.default: "reads a value back to the host (.item(), int(t), bool(t))",
    aten.masked_select.default: "has a data-dependent output shape",
    aten._unique2.default: "has a data-dependent output shape",
    aten.unique_dim.default: "has a data-dependent output shape",
    aten.unique_consecutive.default: "has a data-dependent output shape",
    aten.bincount.default: "has a data-dependent output shape (and syncs for its length)",
    aten.repeat_interleave.Tensor: "has a data-dependent output shape without output_size",
    aten.lift_fresh.default: "builds a tensor from host data during the forward (frozen at capture)",
    aten.equal.default: "compares tensors on the host (torch.equal returns a Python bool)",
    aten.is_nonzero.default: "reads a value back to the host",
}


def _why(func, args, kwargs) -> str | None:
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
        return None
    why = _REFUSED.get(func)
    if why is None and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        # boolean-mask indices select a data-dependent number of elements (a hidden nonzero)
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            why = "indexes with a boolean mask (a data-dependent number of elements)"
    if why is None and func in (aten._to_copy.default, aten.copy_.default):
        # a device-to-host copy: the data of a device tensor lands in host memory
        src = args[1] if func is aten.copy_.default else args[0]
        dst = args[0].device if func is aten.copy_.default else kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
                and torch.device(dst).type == "cpu":
            why = "copies device data to the host"
    return why


class CaptureCheck(TorchDispatchMode):
    """Raises ``HostSyncError`` at the first op a CUDA graph could not capture (see the module docstring)."""

    def __init__(self, what: str = "the captured step"):
        super().__init__()
        self.what = what
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None:
            raise HostSyncError(f"{self.what} is not capture-safe: {func} {why}")
        return func(*args, **kwargs)

    def _refuse(self, name: str):
        what = self.what

        def refused(*_args, **_kwargs):
            raise HostSyncError(f"{what} is not capture-safe: Tensor.{name}() reads tensor data on the host")
        return refused

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._refuse(name))
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        self._saved.clear()
