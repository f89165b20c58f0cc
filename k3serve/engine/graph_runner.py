"""The engine's decode steps through captured graphs: one static-buffer forward per batch-size bucket, replayed.

``GraphRunner(model, caches, ...)`` keeps, for each bucket ``b`` in ``cuda_graphs.buckets(max_batch)``
(1, 2, 4, ..., max_batch), static device buffers and a static decode ``ForwardContext``
(``core.context.StaticDecode``):
  input_ids ``[b]``, block_tables ``[b, max_blocks]`` (max_blocks = ceil(max_context / block_size)),
  context_lens ``[b]``, slot_mapping ``[b]``, state_slots ``[b]`` -> logits ``[b, vocab]`` fp32
and a graph of ``logits = compute_logits(model(input_ids))`` over them. A step of B plain decode rows (one
token each after a cached context) fills rows ``0..B-1`` and pads rows ``B..b-1`` of the smallest bucket
``b >= B``: a padding row reads and writes only the engine's reserved dummy MLA block and dummy KDA slot, so it
touches no request's cache; its logits are dropped. ``accepts`` sends everything else to the eager path:
more rows than max_batch, a context over max_context, prefill chunks, speculative or captured rows, images,
prompt logprobs.

The graph mechanism is injectable (``mechanism``): ``CudaGraphs`` records real ``torch.cuda.CUDAGraph``s (warm-up
on a side stream, the largest bucket first, one shared memory pool); ``StandinGraphs`` (CPU, tests and
``benchmarks/gpu_check.sh --cpu``) "records" by running the forward once and "replays" by running it again on
the same static buffers, both under ``capture_check.CaptureCheck``: a host sync anywhere in the forward raises,
so a CPU test proves the static decode forward capturable and its padded, bucketed results equal the eager ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from k3serve.core.context import ForwardContext, ModelCaches, StaticDecode, forward_context
from k3serve.engine.capture_check import CaptureCheck
from k3serve.engine.cuda_graphs import buckets
from k3serve.engine.step_inputs import StepInputs


class Graph(Protocol):
    def replay(self) -> None: ...


class StandinGraphs:
    """CPU stand-in for CUDA graphs: capture runs the step once, replay runs it again, both under CaptureCheck."""

    name = "standin"

    class _Graph:
        def __init__(self, step: Callable[[], None], what: str):
            self.step, self.what = step, what

        def replay(self) -> None:
            with CaptureCheck(self.what):
                self.step()

    def capture(self, step: Callable[[], None], what: str) -> Graph:
        graph = self._Graph(step, what)
        graph.replay()  # the "capture": the first run, which must be capture-safe too
        return graph


class CudaGraphs:
    """Real CUDA graphs; buckets share one memory pool (captured largest first)."""

    name = "cuda"

    def __init__(self, warmup: int = 2):
        self.warmup, self.pool = warmup, None

    def capture(self, step: Callable[[], None], what: str) -> Graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs (lazy inits, autotuning) outside the capture
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        self.pool = graph.pool()
        return graph


class _Bucket:
    """Bucket ``b``'s static buffers, its static decode context and its graph."""

    def __init__(self, b: int, max_blocks: int, vocab: int, caches: ModelCaches, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.b = b
        self.input_ids = torch.zeros(b, **long)
        self.block_tables = torch.full((b, max_blocks), -1, **long)
        self.context_lens = torch.ones(b, **long)
        self.slot_mapping = torch.zeros(b, **long)
        self.state_slots = torch.zeros(b, **long)
        self.logits = torch.zeros(b, vocab, dtype=torch.float32, device=device)
        self.ctx = ForwardContext(cu_seqlens=torch.arange(b + 1, **long), cached_lens=[1] * b,
                                  state_slots=self.state_slots, block_tables=self.block_tables, caches=caches,
                                  static=StaticDecode(self.context_lens, self.slot_mapping, max_blocks))
        self.graph: Graph | None = None


class GraphRunner:
    def __init__(self, model: nn.Module, caches: ModelCaches, device: torch.device | str, *, vocab_size: int,
                 dummy_block: int, dummy_row: Callable[[], int], max_batch: int = 32, max_context: int = 8192,
                 mechanism: StandinGraphs | CudaGraphs | None = None):
        """``dummy_row()``: the cache row of the reserved dummy KDA slot now (``StateRows`` moves rows)."""
        if max_context < 1:
            raise ValueError(f"cuda_graph_max_context: must be >= 1, got {max_context}")
        self.model, self.caches, self.device = model, caches, torch.device(device)
        self.dummy_block, self.dummy_row = dummy_block, dummy_row
        self.sizes = buckets(max_batch)
        self.max_batch, self.max_context = max_batch, max_context
        self.block_size = caches.block_size
        self.max_blocks = -(-max_context // self.block_size)
        self.mechanism = mechanism or (CudaGraphs() if self.device.type == "cuda" else StandinGraphs())
        self.buckets = {b: _Bucket(b, self.max_blocks, vocab_size, caches, self.device) for b in self.sizes}
        self.replays = dict.fromkeys(self.sizes, 0)  # replays per bucket (tests and stats)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Record every bucket's graph (largest first: the smaller ones fit in the pool it reserved). Every row
        is a padding row meanwhile: the captures write only the dummy block and slot."""
        for b in reversed(self.sizes):
            self._capture(self.buckets[b])

    @torch.inference_mode()
    def _capture(self, k: _Bucket) -> None:
        self._fill(k, [], [], [], [], 0)

        def step() -> None:
            with forward_context(k.ctx):
                hidden = self.model(k.input_ids, k.ctx)
                k.logits.copy_(self.model.compute_logits(hidden))

        k.graph = self.mechanism.capture(step, f"the decode step of bucket {k.b}")

    def accepts(self, s: StepInputs) -> bool:
        """Whether ``s`` is a plain decode step this runner's graphs cover (see the module docstring)."""
        B = len(s.slots)
        if B == 0 or B > self.max_batch or s.image_embeds is not None or s.prompt_spans:
            return False
        if s.cu_seqlens[-1] != B or s.width > self.max_blocks:  # not one token per row, or a wider table
            return False
        return all(0 < c < self.max_context for c in s.cached_lens)

    def run(self, s: StepInputs, rows: list[int]) -> tuple[torch.Tensor, ForwardContext]:
        """Replay the step (``rows``: the batch's KDA cache rows): (logits of ``s.logit_rows``, the bucket's
        context, whose ``spec`` and ``capture`` are None)."""
        B = len(s.slots)
        k = self.buckets[next(b for b in self.sizes if b >= B)]
        if k.graph is None:
            self._capture(k)
        self._fill(k, s.input_ids, s.cached_lens, s.block_tables, rows, s.width)
        k.graph.replay()
        self.replays[k.b] += 1
        return k.logits[s.logit_rows], k.ctx

    def _fill(self, k: _Bucket, ids: list[int], cached: list[int], tables: list[int], rows: list[int],
              width: int) -> None:
        """Copy a step's layout into bucket ``k``'s buffers: real rows first, then padding rows (token 0 at
        position 0 of the dummy block, in the dummy KDA row)."""
        B, b, bs, mb = len(ids), k.b, self.block_size, self.max_blocks
        pad = b - B
        table = torch.full((b, mb), -1, dtype=torch.long)
        if B:
            table[:B, :width] = torch.tensor(tables, dtype=torch.long).view(B, width)
        table[B:, 0] = self.dummy_block
        slots = [tables[i * width + c // bs] * bs + c % bs for i, c in enumerate(cached)]
        host = torch.tensor([*ids, *[0] * pad,
                             *[c + 1 for c in cached], *[1] * pad,
                             *slots, *[self.dummy_block * bs] * pad,
                             *rows, *[self.dummy_row()] * pad], dtype=torch.long).view(4, b)
        for buf, src in zip((k.input_ids, k.context_lens, k.slot_mapping, k.state_slots), host):
            buf.copy_(src)
        k.block_tables.copy_(table)
