"""Split one cache memory budget (``--kv-cache-memory``) into the MLA block pool and the KDA slot pool.

    budget = max_running · kda_bytes_per_slot                       running KDA state + conv slots
           + num_snapshot_slots · kda_bytes_per_slot               prefix-cache snapshots (same pool)
           + num_blocks · block_size · mla_bytes_per_token          MLA latent blocks (the rest)

``num_snapshot_slots = floor(snapshot_fraction · budget / kda_bytes_per_slot)`` when prefix caching is on.
The block pool must hold at least one sequence of ``max_model_len`` tokens, so every request can run alone.
When the user gives no ``max_model_len``, ``fitting_model_len`` caps the model's declared context (1M tokens for
K3) to the longest sequence that budget holds, so a default start never fails on the cache size.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachePlan:
    budget_bytes: int
    num_blocks: int
    block_size: int
    max_running: int
    num_snapshot_slots: int
    mla_bytes_per_token: int
    kda_bytes_per_slot: int

    @property
    def mla_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.mla_bytes_per_token

    @property
    def kda_bytes(self) -> int:
        return (self.max_running + self.num_snapshot_slots) * self.kda_bytes_per_slot

    def report(self) -> str:
        mib = 2**20
        return (f"cache budget {self.budget_bytes / mib:.1f} MiB: MLA {self.num_blocks} blocks x {self.block_size} "
                f"tokens = {self.num_blocks * self.block_size} tokens ({self.mla_bytes / mib:.1f} MiB); KDA "
                f"{self.max_running} running + {self.num_snapshot_slots} snapshot slots x "
                f"{self.kda_bytes_per_slot / 1024:.1f} KiB ({self.kda_bytes / mib:.1f} MiB)")


def available_memory(device: torch.device) -> int:
    """Bytes free for caches on ``device`` (free accelerator memory, or MemAvailable on the host)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_budget(kv_cache_memory: float, device: torch.device) -> int:
    """``kv_cache_memory`` > 1 is a byte count; in (0, 1] it is a fraction of the available memory."""
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory: must be positive, got {kv_cache_memory}")
    if kv_cache_memory > 1:
        return int(kv_cache_memory)
    return int(kv_cache_memory * available_memory(device))


def fitting_model_len(budget_bytes: int, *, mla_bytes_per_token: int, kda_bytes_per_slot: int, block_size: int,
                      max_running: int, declared: int, snapshot_fraction: float) -> int:
    """The default context: ``declared`` (the model's max_position_embeddings), or less when one sequence of it
    does not fit in the blocks left after the running and snapshot KDA slots; whole blocks only. May be below 2
    when the budget is too small for anything, which ``plan_cache`` then reports."""
    if not mla_bytes_per_token:
        return declared
    running = max_running * kda_bytes_per_slot
    snapshots = int(snapshot_fraction * budget_bytes) // kda_bytes_per_slot if kda_bytes_per_slot else 0
    rest = budget_bytes - running - snapshots * kda_bytes_per_slot
    blocks = max(0, rest // (block_size * mla_bytes_per_token))
    return min(declared, blocks * block_size)


def plan_cache(budget_bytes: int, *, mla_bytes_per_token: int, kda_bytes_per_slot: int, block_size: int,
               max_running: int, max_model_len: int, snapshot_fraction: float) -> CachePlan:
    running = max_running * kda_bytes_per_slot
    snapshots = int(snapshot_fraction * budget_bytes) // kda_bytes_per_slot if kda_bytes_per_slot else 0
    min_blocks = -(-max_model_len // block_size)
    rest = budget_bytes - running - snapshots * kda_bytes_per_slot
    num_blocks = rest // (block_size * mla_bytes_per_token) if mla_bytes_per_token else min_blocks
    if num_blocks < min_blocks:
        need = running + snapshots * kda_bytes_per_slot + min_blocks * block_size * mla_bytes_per_token
        raise ValueError(f"kv_cache_memory: {budget_bytes} bytes is too small; {max_running} running KDA slots, "
                         f"{snapshots} snapshot slots and one {max_model_len}-token sequence need {need} bytes "
                         "(lower max_num_seqs or max_model_len, or raise the budget)")
    return CachePlan(budget_bytes, num_blocks, block_size, max_running, snapshots, mla_bytes_per_token,
                     kda_bytes_per_slot)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Largest allocation glibc may serve from its heap instead of a fresh mmap (its M_MMAP_THRESHOLD ceiling on 64-bit).
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS (process-wide).

    By default glibc serves multi-MiB blocks with mmap and trims the top of its heap on free, so the large
    per-step temporaries of a CPU forward (gathered states, chunk terms, expert activations) come back as fresh
    pages that are faulted in and zeroed again every step: about 100-300k page faults per benchmark run on one
    core. With blocks up to 32 MiB taken from the heap and no trimming below 1 GiB, the peak heap stays mapped.
    Returns False where the C library has no ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
