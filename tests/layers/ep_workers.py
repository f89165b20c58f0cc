"""Rank functions for the expert-parallel tests (spawned with torch.multiprocessing, gloo on 127.0.0.1).

They live in their own module so that spawned children can import them by name (the test adds this folder
to sys.path, which spawn hands to the children)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3serve.core.config import ModelConfig
from k3serve.core.distributed import Parallel, ParallelLayout, init_parallel
from k3serve.layers.eplb import plan_placement, split_counts
from k3serve.layers.moe import SparseMoE
from k3serve.layers.moe_ep import EPSparseMoE, ep_state_dict
from k3serve.models.registry import packaged_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes; a failing rank fails the call."""
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def join(rank: int, world: int, port: int, layout: ParallelLayout) -> Parallel:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    return init_parallel(layout, backend="gloo")


def tiny_text(**changes):
    return dataclasses.replace(ModelConfig.from_file(packaged_config("k3-tiny")).text, **changes)


def reference_moe(cfg, mxfp4: bool, dtype: torch.dtype, seed: int, hot: int | None) -> SparseMoE:
    """A single-process MoE with deterministic random weights (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(cfg, mxfp4)
    with torch.no_grad():
        for name, t in list(moe.named_parameters()) + list(moe.named_buffers()):
            if t.dtype == torch.uint8:  # MXFP4 codes anywhere, E8M0 scales near 2^-3
                t.copy_(torch.randint(0, 256, t.shape, generator=g) if "packed" in name
                        else torch.randint(121, 126, t.shape, generator=g))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
        moe.gate.e_score_correction_bias.zero_()
        if hot is not None:  # every token picks this expert
            moe.gate.e_score_correction_bias[hot] = 10.0
    return moe.to(dtype).eval() if dtype != torch.float32 else moe.eval()


CASES = {
    # name: (text config changes, mxfp4, dtype, tokens, hot expert, redundant slots per rank)
    "latent-fp32": ({}, False, torch.float32, 37, None, 0),
    "latent-mxfp4": ({}, True, torch.float32, 37, None, 0),
    "latent-bf16": ({}, False, torch.bfloat16, 21, None, 0),
    "hidden-width": ({"routed_expert_hidden_size": None, "latent_moe_use_norm": False}, False, torch.float32, 19,
                     None, 0),
    "hot-replicated": ({}, False, torch.float32, 40, 5, 1),
    "three-tokens": ({}, False, torch.float32, 3, None, 0),
    "one-token": ({}, True, torch.float32, 1, None, 0),
    # starts on contiguous blocks, then re-places from the router statistics of its first forward
    "hot-rebalanced": ({}, True, torch.float32, 40, 7, 1),
}
REBALANCE = {"hot-rebalanced"}


def moe_cases(rank: int, world: int, port: int, out_dir: str, names: list[str]) -> None:
    par = join(rank, world, port, ParallelLayout(tp=world, ep=world))
    results = {}
    for i, name in enumerate(names):
        changes, mxfp4, dtype, n, hot, redundant = CASES[name]
        cfg = tiny_text(**changes)
        ref = reference_moe(cfg, mxfp4, dtype, seed=i, hot=hot)
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
        placement = None
        if redundant and name not in REBALANCE:  # plan from the load the router produces on this batch
            with torch.no_grad():
                _, ids = ref.gate(x)
            load = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts).tolist()
            placement = plan_placement(load, world, redundant * world)
        ep = EPSparseMoE(cfg, mxfp4, par, placement).to(dtype).eval()
        ep.load_state_dict(ep_state_dict(ref.state_dict(), ep.placement, par.ep_rank))
        with torch.inference_mode():
            want, got = ref(x), ep(x)
        if name in REBALANCE:
            assert torch.equal(got, want)
            ep.rebalance(redundant * world)
            with torch.inference_mode():
                got = ep(x)
        # the EP ranks that served this rank's share of the hot expert's assignments
        with torch.no_grad():
            _, mine = ep.gate(x[sum(split_counts(n, world)[:rank]):][:split_counts(n, world)[rank]])
        flat = mine.reshape(-1)
        served = sorted(set(ep._destinations(flat)[0][flat == hot].tolist())) if hot is not None else []
        results[name] = {"equal": bool(torch.equal(got, want)), "hot_served_by": served,
                         "max_abs": float((got.float() - want.float()).abs().max()) if n else 0.0,
                         "replicas_of_hot": len(ep.placement.replicas[hot]) if hot is not None else 0,
                         "dispatch_bytes": ep.traffic["dispatch_bytes"]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


PROMPTS = [[5, 17, 300, 42, 7, 901, 64], [1000, 3, 3, 3, 512, 77, 12, 1500, 8, 9, 10, 2000]]


def greedy_case(rank: int, world: int, port: int, ckpt: str, out_dir: str, new_tokens: int) -> None:
    """Load the full checkpoint as this rank's part (its experts only) and decode greedily."""
    from k3serve.models.generate import SimpleRunner, greedy_generate
    from k3serve.models.loader import load_model

    torch.set_num_threads(1)  # as the reference: the same GEMM kernels, so the same bits
    # attention is tp-sharded too (TP+EP); "ordered" sums its partials as the pieces reference does
    par = join(rank, world, port, ParallelLayout(tp=world, ep=world, reduce_mode="ordered"))
    model, _ = load_model(ckpt, progress=False, par=par)
    tokens = greedy_generate(model, PROMPTS, new_tokens)
    logits = SimpleRunner(model, max_seqs=2, max_len=32).step(dict(enumerate(PROMPTS)))
    held = sorted({len(m.global_ids) for m in model.modules() if hasattr(m, "global_ids")})
    torch.save({"tokens": tokens, "logits": logits, "experts_held": held}, Path(out_dir, f"greedy{rank}.pt"))
    dist.destroy_process_group()


# attention data parallel: each dp group has its own batch (sizes per dp group; 0 is an idle group that still
# joins every exchange), the experts spread over all tp * dp ranks
DP_CASES = {"latent-fp32": ({}, False, (37, 0)), "latent-mxfp4": ({}, True, (1, 40)),
            "hidden-width": ({"routed_expert_hidden_size": None, "latent_moe_use_norm": False}, False, (19, 26))}


def dp_moe_cases(rank: int, world: int, port: int, out_dir: str, tp: int) -> None:
    par = join(rank, world, port, ParallelLayout(tp=tp, ep=world, dp=world // tp))
    results = {}
    for i, (name, (changes, mxfp4, sizes)) in enumerate(DP_CASES.items()):
        cfg = tiny_text(**changes)
        ref = reference_moe(cfg, mxfp4, torch.float32, seed=i, hot=None)
        n = sizes[par.dp_rank]
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(100 * i + par.dp_rank))
        ep = EPSparseMoE(cfg, mxfp4, par).eval()
        ep.load_state_dict(ep_state_dict(ref.state_dict(), ep.placement, par.ep_rank))
        with torch.inference_mode():
            want, got = ref(x), ep(x)
        results[name] = {"n": n, "equal": bool(torch.equal(got, want)),
                         "max_abs": float((got - want).abs().max()) if n else 0.0,
                         "received": ep.traffic["dispatch_bytes"] > 0}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
