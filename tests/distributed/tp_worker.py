"""What each rank of the TP tests runs (imported by spawned processes, so it lives in its own module)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from k3serve.core.distributed import Parallel, ParallelLayout, init_parallel
from k3serve.models.generate import SimpleRunner, greedy_generate
from k3serve.models.loader import load_model

PROMPTS = [[5, 17, 99, 3, 250, 7, 11, 1500, 64], [42, 8, 1000, 9]]


def run_model(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Logits of a prefill of two prompts, a decode step and a mixed step (one decode row beside a prefill
    chunk) through the model's own caches, and 4 greedy tokens per prompt."""
    runner = SimpleRunner(model, max_seqs=2, max_len=32)
    out = {"prefill": runner.step({0: PROMPTS[0], 1: PROMPTS[1]}),
           "decode": runner.step({0: [3], 1: [4]}),
           "mixed": runner.step({0: [12], 1: [13, 14, 15]}),
           "greedy": torch.tensor(greedy_generate(model, PROMPTS, 4))}
    return out


def reference(path: Path, pieces: int) -> dict[str, torch.Tensor]:
    model, _ = load_model(path, progress=False, par=Parallel(ParallelLayout(tp=1, pieces=pieces)))
    return run_model(model)


def rank_main(rank: int, world: int, port: int, paths: list[str], out_dir: str) -> None:
    """Every tp that divides ``world`` (tp < world as dp groups side by side), both reduce modes; the first
    rank of each dp group saves its results as ``{mode}-tp{tp}-dp{d}-{model index}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # as the references: the same GEMM kernels, so the same bits
    try:
        for tp in (t for t in (2, 4) if world % t == 0):
            for mode in ("ordered", "fast"):
                par = init_parallel(ParallelLayout(tp=tp, dp=world // tp, reduce_mode=mode), backend="gloo")
                for i, path in enumerate(paths):
                    model, _ = load_model(path, progress=False, par=par)
                    result = run_model(model)
                    if par.tp_rank == 0:
                        torch.save(result, Path(out_dir) / f"{mode}-tp{tp}-dp{par.dp_rank}-{i}.pt")
    finally:
        dist.destroy_process_group()
