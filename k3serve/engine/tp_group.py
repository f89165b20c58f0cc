"""The step channel of one tensor-parallel group: rank 0 (the engine core) broadcasts, workers receive.

Every tp rank must run the same forward with the same inputs in the same order (the layers' collectives
pair up across ranks), so rank 0 broadcasts each step's ``StepInputs`` before running it, and the idle
heartbeat (``NOOP``) and ``SHUTDOWN`` travel the same way. The channel is a gloo group over the tp ranks
(CPU tensors, also when the model's own collectives run on NCCL), as vLLM and SGLang do for metadata.

A rank that is gone makes a broadcast fail (gloo sees the closed connection, or the group's timeout ends
the wait): that surfaces as ``RankLost``, which the engine core never treats as one failed step.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from k3serve.core.distributed import Parallel, ParallelLayout, init_parallel
from k3serve.engine.step_inputs import (
    NOOP,
    ROWS_IN,
    ROWS_OUT,
    SHUTDOWN,
    HEADER_LEN,
    StepInputs,
    embeds_shape,
    header,
    pack,
    payload_len,
    unpack,
)

TIMEOUT_ENV = "K3SERVE_DIST_TIMEOUT_S"  # how long a rank waits in one collective (rank 0 beats every second)


class RankLost(RuntimeError):
    """Another rank of the group is gone: this rank set cannot step any more."""


def dist_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "300")))


def join(layout: ParallelLayout, device: str = "cpu") -> tuple[Parallel, "TPGroup | None"]:
    """Join the process group described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
    set by our launcher or by torchrun) and build this rank's groups; (SINGLE-like, None) for one rank. The
    model's collectives run on NCCL when the engine runs on CUDA, else on gloo."""
    if layout.world_size == 1:
        return Parallel(layout), None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=dist_timeout())
    par = init_parallel(layout)
    group = None
    for d in range(layout.dp):  # every rank creates every group, in the same order
        ranks = list(range(d * layout.tp, (d + 1) * layout.tp))
        g = dist.new_group(ranks, backend="gloo", timeout=dist_timeout())
        if par.rank in ranks:
            group = TPGroup(g, leader=ranks[0], is_leader=par.rank == ranks[0])
    if layout.lockstep:  # the engine cores' own reduction (engine/dp_sync.py)
        from k3serve.engine.dp_sync import DPSync

        g = dist.new_group([d * layout.tp for d in range(layout.dp)], backend="gloo", timeout=dist_timeout())
        if group.is_leader:
            group.dp_sync = DPSync(g)
    return par, group


class TPGroup:
    def __init__(self, group, *, leader: int, is_leader: bool):
        self.group, self.leader, self.is_leader = group, leader, is_leader
        self.dp_sync = None  # an engine core whose forwards share MoE collectives with other cores: DPSync

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        try:
            dist.broadcast(t, src=self.leader, group=self.group)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise RankLost(f"a tensor-parallel rank is gone: {e}".splitlines()[0]) from e
        return t

    # rank 0 -------------------------------------------------------------------------------------

    def send_step(self, s: StepInputs) -> None:
        h, payload = pack(s)
        self._bcast(h)
        self._bcast(payload)
        if s.image_embeds is not None:
            self._bcast(s.image_embeds.detach().to("cpu").contiguous())

    def send_noop(self) -> None:
        self._bcast(header(NOOP))

    def send_shutdown(self) -> None:
        self._bcast(header(SHUTDOWN))

    # workers ------------------------------------------------------------------------------------

    def recv(self) -> tuple[int, StepInputs | torch.Tensor | None]:
        """(kind, inputs): inputs for STEP, the header for ROWS_OUT / ROWS_IN (engine/pd/rank_rows.py)."""
        h = self._bcast(torch.empty(HEADER_LEN, dtype=torch.long))
        kind = int(h[0])
        if kind in (NOOP, SHUTDOWN):
            return kind, None
        if kind in (ROWS_OUT, ROWS_IN):
            return kind, h
        payload = self._bcast(torch.empty(payload_len(h), dtype=torch.long))
        shape = embeds_shape(h)
        embeds = None if shape is None else self._bcast(torch.empty(shape[0], dtype=shape[1]))
        return kind, unpack(h, payload, embeds)

    # all ranks ----------------------------------------------------------------------------------

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` from rank 0 (filled in place on the workers)."""
        return self._bcast(t)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape and dtype on all), in rank order, on rank 0; None on the workers."""
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))] if self.is_leader else None
        try:
            dist.gather(t, parts, dst=self.leader, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"a tensor-parallel rank is gone: {e}".splitlines()[0]) from e
        return parts

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank r receives ``parts[r]`` (given on rank 0 only) into ``out``."""
        try:
            dist.scatter(out, parts if self.is_leader else None, src=self.leader, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"a tensor-parallel rank is gone: {e}".splitlines()[0]) from e
        return out

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum over the group (cache sizes: every rank must allocate the same)."""
        t = torch.tensor(values, dtype=torch.long)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        except RuntimeError as e:
            raise RankLost(f"a tensor-parallel rank is gone: {e}".splitlines()[0]) from e
        return t.tolist()
