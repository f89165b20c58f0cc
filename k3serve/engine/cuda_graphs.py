"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (1, 2, 4, 8, ...), off by default.

``DecodeGraphs(step, make_inputs, max_batch, device)`` captures ``step(*inputs)`` once per bucket b, with
``inputs = make_inputs(b)`` held as static buffers (tensors whose first dim is the batch). A call with B rows
copies its inputs into the first B rows of the smallest bucket >= B, replays that graph and returns the first B
rows of its (static) output. Rows B.. of the bucket keep whatever their buffers hold: the step must treat them
as scratch rows whose results and state writes are dropped (in-place state buffers are inputs too, so a
padding row writes only its own scratch row). Everything the step reads from the host (shapes, Python ints)
is frozen at capture: the step must not sync (``.item()``, ``.tolist()``, ``bincount`` on CUDA) or branch on
tensor values, which ``torch.cuda.graph`` refuses at capture anyway.

Status: this is the op-level mechanism, checked replay == eager on a GPU for capture-safe decode ops (the KDA
decode step, the Triton MXFP4 expert combine: tests/engine/test_cuda_graphs.py, benchmarks/gpu_check.sh). The
engine's decode path is ``engine/graph_runner.py`` (its forward is the static decode step of
``core.context.StaticDecode``); ``buckets`` and ``check_cuda_graphs`` serve both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def buckets(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself: 1, 2, 4, ..., max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


def check_cuda_graphs(device: str | torch.device) -> None:
    """Refuse CUDA graphs in one line where they cannot run (not a CUDA device, or no GPU here)."""
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"cuda_graphs: needs a CUDA device, got {str(d)!r} (leave CUDA graphs off)")
    if not torch.cuda.is_available():
        raise ValueError("cuda_graphs: no CUDA GPU is available here")


class DecodeGraphs:
    def __init__(self, step: Callable[..., torch.Tensor], make_inputs: Callable[[int], Sequence[torch.Tensor]],
                 max_batch: int, device: str | torch.device, *, warmup: int = 2):
        check_cuda_graphs(device)
        self.step, self.sizes = step, buckets(max_batch)
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        # largest first, so the smaller graphs reuse the memory pool the largest one reserved
        for b in reversed(self.sizes):
            inputs = [t.to(device) for t in make_inputs(b)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up runs compile and autotune outside the capture
                for _ in range(warmup):
                    step(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = step(*inputs)
            pool = graph.pool()
            self.inputs[b], self.outputs[b], self.graphs[b] = inputs, out, graph

    def bucket(self, batch: int) -> int:
        for b in self.sizes:
            if b >= batch:
                return b
        raise ValueError(f"batch of {batch} rows is over the largest captured bucket ({self.sizes[-1]})")

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Replay with ``inputs`` (first dim B <= max_batch each, matching the captured inputs otherwise); the
        first B rows of every static input buffer hold ``inputs`` afterwards (states included)."""
        B = inputs[0].shape[0]
        b = self.bucket(B)
        for static, t in zip(self.inputs[b], inputs):
            static[:B].copy_(t)
        self.graphs[b].replay()
        return self.outputs[b][:B]

    def static_inputs(self, batch: int) -> list[torch.Tensor]:
        """The bucket's input buffers (after a call: their first ``batch`` rows hold its inputs, updated)."""
        return [t[:batch] for t in self.inputs[self.bucket(batch)]]
