"""Expert-parallel MoE (issue 45): bytes moved per token, latent vs hidden width, and MoE tokens/s per process count.

    python benchmarks/ep_dispatch.py [--ranks 1,2,4] [--tokens 512] [--iters 3]
                                     [--hidden 1024 --latent 512 --inter 256 --experts 32 --topk 4] [--dtype fp32]

One LatentMoE layer (random weights, so routing is near uniform) runs as ``EPSparseMoE`` on 1, 2 and 4 gloo
processes on 127.0.0.1, every rank holding the same ``--tokens`` tokens (as after tensor-parallel attention).
Bytes are what the layer's counters saw cross between processes (dispatch rows + slot ids, combine rows, the
all-gather of the normalised latent chunks), summed over ranks and divided by the tokens; the "hidden" row
is the same layer with its experts at the hidden width (no down-projection), so every exchange is d wide.
"modeled" is ``modeled_bytes`` (uniform routing) for the same layer; the K3 line applies it to ``kimi-k3``'s
config at EP8: per MoE layer and token, each token's row once to each other rank holding one of its experts
(+ 8 bytes of ids per off-rank assignment), k·(R-1)/R rows back, R-1 rows of the gather.
Tokens/s: ``--tokens`` / the slowest rank's median forward time. On a shared CPU box the absolute numbers
are noisy and more processes than cores oversubscribe; the byte counts are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3serve.core.config import ModelConfig
from k3serve.core.distributed import SINGLE, ParallelLayout, init_parallel
from k3serve.layers.moe_ep import EPSparseMoE
from k3serve.models.registry import packaged_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_config(args: argparse.Namespace, latent: bool):
    base = ModelConfig.from_file(packaged_config("k3-tiny")).text
    return dataclasses.replace(base, hidden_size=args.hidden, routed_expert_hidden_size=args.latent if latent else None,
                               latent_moe_use_norm=latent, moe_intermediate_size=args.inter,
                               num_experts=args.experts, num_experts_per_token=args.topk, num_shared_experts=1)


def build(cfg, par, dtype: torch.dtype) -> EPSparseMoE:
    moe = EPSparseMoE(cfg, False, par)
    g = torch.Generator().manual_seed(0)  # the same replicated weights on every rank
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 if p.dim() > 1 else torch.ones(p.shape))
        moe.gate.e_score_correction_bias.zero_()
    return moe.to(dtype).eval()


def measure(args: argparse.Namespace, par) -> dict:
    """Run both widths on this rank; returns its bytes received and per-iteration forward times."""
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = {}
    for name, latent in (("latent", True), ("hidden", False)):
        moe = build(layer_config(args, latent), par, dtype)
        times = []
        with torch.inference_mode():
            moe(x)  # warm-up; its traffic is counted too, so divide by iters + 1 below
            for _ in range(args.iters):
                if par.ep > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                moe(x)
                times.append(time.perf_counter() - t0)
        out[name] = {"traffic": {k: v / (args.iters + 1) for k, v in moe.traffic.items()}, "times": times}
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    par = init_parallel(ParallelLayout(tp=world, ep=world), backend="gloo")
    Path(out_dir, f"{world}-{rank}.json").write_text(json.dumps(measure(args, par)))
    dist.destroy_process_group()


def summarise(results: list[dict], tokens: int) -> dict:
    row = {}
    for name in ("latent", "hidden"):
        per_tok = {k: sum(r[name]["traffic"][k] for r in results) / tokens
                   for k in ("dispatch_bytes", "combine_bytes", "gather_bytes")}
        slowest = [max(ts) for ts in zip(*(r[name]["times"] for r in results))]
        row[name] = {**per_tok, "total": sum(per_tok.values()), "tok_s": tokens / statistics.median(slowest)}
    return row


def modeled_bytes(width: int, elem: int, k: int, experts: int, ranks: int) -> dict:
    """Bytes per token and MoE layer under uniform routing: dispatch sends a token's row once to each other
    rank holding one of its k experts (a rank holds none with probability C(E - E/R, k) / C(E, k)) plus
    8 bytes of ids per off-rank assignment; combine returns k·(R-1)/R rows; the gather sends R-1 rows."""
    row, off = width * elem, (ranks - 1) / ranks
    misses = math.comb(experts - experts // ranks, k) / math.comb(experts, k)
    out = {"dispatch_bytes": (ranks - 1) * (1 - misses) * row + k * off * 8, "combine_bytes": k * off * row,
           "gather_bytes": (ranks - 1) * row}
    return {**out, "total": sum(out.values())}


def k3_line(ranks: int = 8) -> str:
    t = ModelConfig.from_file(packaged_config("kimi-k3")).text
    layers = sum(t.is_moe_layer(i) for i in range(t.num_hidden_layers))
    k, E = t.num_experts_per_token, t.num_experts
    lat = modeled_bytes(t.routed_expert_hidden_size, 2, k, E, ranks)
    hid = modeled_bytes(t.hidden_size, 2, k, E, ranks)
    parts = ", ".join(f"{n} {lat[n + '_bytes'] / 1e3:.1f}" for n in ("dispatch", "combine", "gather"))
    return (f"K3 at EP{ranks} (d={t.hidden_size}, latent={t.routed_expert_hidden_size}, E={E}, k={k}, {layers} MoE "
            f"layers, bf16, uniform routing): latent {lat['total'] / 1e3:.1f} kB/token/layer ({parts}) = "
            f"{lat['total'] * layers / 1e6:.2f} MB/token; hidden {hid['total'] / 1e3:.1f} kB/token/layer = "
            f"{hid['total'] * layers / 1e6:.2f} MB/token; hidden/latent {hid['total'] / lat['total']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="process counts to measure (comma-separated)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per forward, the same on every rank")
    ap.add_argument("--iters", type=int, default=3, help="timed forwards per width")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--inter", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args()
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        sys.exit(f"error: --ranks must be comma-separated integers, got {args.ranks!r}")
    if any(r < 1 or args.experts % r for r in ranks):
        sys.exit(f"error: every process count must be >= 1 and divide --experts ({args.experts})")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in ranks:
            if world == 1:
                torch.set_num_threads(args.threads)
                results = [measure(args, SINGLE)]
            else:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(rank_main, args=(world, port, args, tmp), nprocs=world, join=True)
                results = [json.loads(Path(tmp, f"{world}-{r}.json").read_text()) for r in range(world)]
            rows[world] = summarise(results, args.tokens)
    print(f"layer: d={args.hidden} latent={args.latent} I={args.inter} E={args.experts} k={args.topk} "
          f"{args.dtype}, {args.tokens} tokens, {args.threads} thread(s) per process")
    elem = DTYPES[args.dtype].itemsize
    print("procs | width  | dispatch B/tok | combine B/tok | gather B/tok | total B/tok | modeled B/tok "
          "| hidden/latent | MoE tok/s")
    for world, row in rows.items():
        for name in ("latent", "hidden"):
            r = row[name]
            width = args.latent if name == "latent" else args.hidden
            model = modeled_bytes(width, elem, args.topk, args.experts, world)["total"] if world > 1 else 0
            ratio = row["hidden"]["total"] / row["latent"]["total"] if name == "hidden" and world > 1 else 1.0
            print(f"{world:5d} | {name:6s} | {r['dispatch_bytes']:14.0f} | {r['combine_bytes']:13.0f} | "
                  f"{r['gather_bytes']:12.0f} | {r['total']:11.0f} | {model:13.0f} | {ratio:13.2f} | {r['tok_s']:9.0f}")
    print(k3_line(8))

if __name__ == "__main__":
    main()
