"""``k3serve serve`` CUDA-graph flags: decode steps replayed from graphs captured at startup
(``engine/graph_runner.py``), one per batch-size bucket (1, 2, 4, ..., --cuda-graph-max-batch).

Default: off (eager), until the device check (``benchmarks/gpu_check.sh``, step engine_graphs) has passed on a
real GPU: the graph runner is proven on CPU only (the stand-in under ``CaptureCheck``). ``--enforce-eager`` says
so explicitly; ``--cuda-graphs`` asks for them and refuses, in one line, what they do not support yet: a CPU device,
tensor / data / expert parallelism, --tp-pieces > 1, speculative decoding, a prefill/decode role. Decode steps
wider than --cuda-graph-max-batch rows or with a context over --cuda-graph-max-context tokens, and every
prefill step, run eager.
"""

from __future__ import annotations

import argparse

MAX_BATCH, MAX_CONTEXT = 32, 8192


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CUDA graphs (decode steps replayed from graphs captured at startup)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from CUDA graphs (needs --device cuda, one rank, no speculation; off by "
                        "default until checked on a GPU); refused where not supported")
    m.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs: every step runs eager")
    g.add_argument("--cuda-graph-max-batch", type=int, default=MAX_BATCH, metavar="ROWS",
                   help="largest decode batch replayed from a graph (graphs for 1, 2, 4, ... up to this, capped "
                        "by --max-num-seqs); wider steps run eager")
    g.add_argument("--cuda-graph-max-context", type=int, default=MAX_CONTEXT, metavar="TOKENS",
                   help="longest context a graphed decode step serves (its block tables are this wide; capped by "
                        "--max-model-len); longer ones run eager")


def _unsupported(args: argparse.Namespace) -> str | None:
    """What in ``args`` the graph runner does not support yet, or None."""
    if args.tensor_parallel_size > 1 or args.tp_pieces > 1:
        return "tensor parallelism (-tp / --tp-pieces > 1)"
    if args.data_parallel_size > 1 or args.enable_expert_parallel:
        return "data or expert parallelism (-dp > 1 / --enable-expert-parallel)"
    if args.speculative_config is not None:
        return "speculative decoding (--speculative-config)"
    if args.role != "both":
        return f"--role {args.role}"
    return None


def check_graphs(args: argparse.Namespace) -> dict:
    """The engine fields of the flags (``CoreSpec.cuda_graphs``, ...); a combination they cannot run is one
    ValueError naming the flag."""
    for flag, value, least in (("--cuda-graph-max-batch", args.cuda_graph_max_batch, 1),
                               ("--cuda-graph-max-context", args.cuda_graph_max_context, 2)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    on_cuda = args.device.split(":")[0] == "cuda"
    why = _unsupported(args)
    if args.cuda_graphs:
        if not on_cuda:
            raise ValueError(f"--cuda-graphs: needs --device cuda, got {args.device!r} (CPU steps run eager)")
        if why is not None:
            raise ValueError(f"--cuda-graphs: not supported with {why} yet; use --enforce-eager")
    mode = "on" if args.cuda_graphs else "off"
    return {"cuda_graphs": mode, "cuda_graph_max_batch": args.cuda_graph_max_batch,
            "cuda_graph_max_context": args.cuda_graph_max_context}
