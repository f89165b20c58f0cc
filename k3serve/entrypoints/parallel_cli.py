"""The parallel side of ``k3serve serve``: layout flags checked against the model before anything starts, and
the worker-only modes (a host with ``--node-rank K > 0``, or a torchrun rank other than 0).

One engine replica spans ``--tensor-parallel-size`` ranks, ``tp / nnodes`` per host; host 0 runs the HTTP
server and rank 0 (which starts its host's other ranks); host K only starts its ranks and waits.
``--data-parallel-size D`` runs D such replicas behind the one server; with ``--nnodes N`` as well, D / N
replicas per host, each replica's tp ranks within its host (host 0 serves HTTP, host K runs its replicas'
engine cores, which reach host 0 over TCP: engine/dp_hosts.py); with
``--enable-expert-parallel`` as well, the experts spread over all tp * dp ranks (attention data parallel, one
world, the replicas' cores in lockstep: engine/dp_sync.py).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MASTER_PORT = 29500
DEFAULT_RPC_PORT = 29550  # engine/dp_hosts.py (not imported here: the engine pulls in torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    par = p.add_argument_group("parallelism (CPU: gloo; CUDA: nccl, one GPU per rank)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="ranks one engine replica is split over; this command starts them (or torchrun does)")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="must be 1 (not supported yet)")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="engine replicas (each its own scheduler, caches and tp ranks); requests go to the "
                          "least loaded one")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="whole experts per rank instead of every expert split by width: over the tp ranks, or "
                          "with --data-parallel-size D over all tp x D ranks (each replica keeps its own "
                          "attention, scheduler and caches)")
    par.add_argument("--eplb-interval", type=int, default=0,
                     help="with --enable-expert-parallel: re-place the experts by their measured load every N "
                          "forward steps (0, the default: never)")
    par.add_argument("--eplb-redundant-experts", type=int, default=0,
                     help="extra expert slots per MoE layer that EPLB fills with replicas of the hottest experts "
                          "(experts + this must divide evenly over the expert-parallel ranks: tp, or tp x dp)")
    par.add_argument("--tp-reduce", choices=("fast", "ordered"), default="fast",
                     help="how tensor-parallel partial sums are added: fast (the collective backend's order: TP-N "
                          "differs from one process in the last bits) or ordered (gathered and added in rank "
                          "order: TP-N is bit for bit a one-process run with --tp-pieces N; slower)")
    par.add_argument("--tp-pieces", type=int, default=1,
                     help="split every tensor-parallel dimension into N pieces even in one process and add their "
                          "partials in order, the arithmetic of -tp N: with --tp-reduce ordered one process "
                          "reproduces a -tp N server's logits bit for bit, given the same threads per process "
                          "(OMP_NUM_THREADS) and the same batches (a debugging aid; 1 or a multiple of -tp)")
    par.add_argument("--nnodes", type=int, default=1, help="hosts the tp ranks span (tp / nnodes ranks each)")
    par.add_argument("--node-rank", type=int, default=0,
                     help="this host's index; hosts other than 0 run their ranks only (no HTTP)")
    par.add_argument("--master-addr", default=None,
                     help="address of host 0, where the ranks meet (required with --nnodes > 1)")
    par.add_argument("--master-port", type=int, default=None,
                     help=f"port on host 0 where the ranks meet (default: a free port on one host, "
                          f"{DEFAULT_MASTER_PORT} across hosts)")
    par.add_argument("--data-parallel-address", default=None,
                     help="with --data-parallel-size D --nnodes N (D / N replicas per host, tensor parallel within "
                          "each host): host 0's address for the replicas' RPC; host 0 listens there, the other "
                          "hosts connect to it (default: --master-addr, else 127.0.0.1, which listens on this "
                          "machine only; unauthenticated: use a private network)")
    par.add_argument("--data-parallel-rpc-port", type=int, default=None,
                     help="first of the ports host 0 listens on for the other hosts' replicas, two per remote "
                          f"replica (default {DEFAULT_RPC_PORT})")


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def check_parallel(args: argparse.Namespace, model_config) -> dict:
    """The CoreSpec fields of the layout flags; a layout that cannot work is one ValueError naming the flag."""
    from k3serve.core.distributed import Parallel, ParallelLayout
    from k3serve.models.kimi import check_layout

    tp, dp, nnodes = args.tensor_parallel_size, args.data_parallel_size, args.nnodes
    if args.pipeline_parallel_size != 1:
        raise ValueError(f"--pipeline-parallel-size {args.pipeline_parallel_size}: not supported yet")
    for flag, v in (("--tensor-parallel-size", tp), ("--data-parallel-size", dp), ("--nnodes", nnodes)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    if not 0 <= args.node_rank < nnodes:
        raise ValueError(f"--node-rank {args.node_rank}: must be in 0..{nnodes - 1} (--nnodes {nnodes})")
    dp_hosts = nnodes > 1 and dp > 1  # data parallel across hosts: D / N replicas per host, tp within a host
    if dp_hosts and dp % nnodes:
        raise ValueError(f"--data-parallel-size {dp} cannot be spread evenly over --nnodes {nnodes} (each host runs "
                         "the same number of replicas, tensor parallel within the host)")
    if not dp_hosts and tp % nnodes:
        raise ValueError(f"--tensor-parallel-size {tp} cannot be spread evenly over --nnodes {nnodes}")
    lockstep = dp > 1 and args.enable_expert_parallel
    if nnodes > 1 and args.master_addr is None and (lockstep or not dp_hosts):
        raise ValueError("--nnodes > 1 needs --master-addr (the address of host 0, where the ranks meet)")
    rpc_port = args.data_parallel_rpc_port or DEFAULT_RPC_PORT
    if (args.data_parallel_address is not None or args.data_parallel_rpc_port is not None) and not dp_hosts:
        raise ValueError("--data-parallel-address/--data-parallel-rpc-port need --data-parallel-size D and "
                         "--nnodes N > 1 (replicas on several hosts)")
    if dp_hosts and not (0 < rpc_port and rpc_port + 2 * (dp - dp // nnodes) - 1 <= 65535):
        raise ValueError(f"--data-parallel-rpc-port {rpc_port}: the ports {rpc_port}.."
                         f"{rpc_port + 2 * (dp - dp // nnodes) - 1} must lie in 1..65535")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {args.master_port}")
    rank = torchrun_rank()
    if rank is not None and int(os.environ["WORLD_SIZE"]) != tp:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but --tensor-parallel-size is "
                         f"{tp}: the world size must equal it")
    if rank is not None and dp > 1:
        raise ValueError("--data-parallel-size with torchrun: not supported (start one torchrun job per replica)")
    if lockstep and getattr(args, "role", "both") != "both":
        raise ValueError(f"--role {args.role} with --data-parallel-size and --enable-expert-parallel: not "
                         "supported yet")
    if getattr(args, "speculative_config", None) and (tp > 1 or lockstep):
        what = f"--tensor-parallel-size {tp}" if tp > 1 else f"--data-parallel-size {dp} --enable-expert-parallel"
        raise ValueError(f"--speculative-config with {what}: not supported yet (the other ranks would need the "
                         "drafts and the rollback)")
    eplb, redundant = args.eplb_interval, args.eplb_redundant_experts
    if eplb < 0 or redundant < 0:
        raise ValueError("--eplb-interval and --eplb-redundant-experts must be >= 0")
    # EPLB moves experts over the expert-parallel ranks: a replica's tp ranks, or with the experts over the dp
    # replicas all tp x dp ranks (every rank counts the same forwards, dummy steps included: engine/dp_sync.py)
    ep_ranks = tp * dp if lockstep else tp
    if (eplb or redundant) and not (args.enable_expert_parallel and ep_ranks > 1):
        raise ValueError("--eplb-interval/--eplb-redundant-experts need --enable-expert-parallel with "
                         "--tensor-parallel-size > 1 (or --data-parallel-size > 1)")
    if redundant and not eplb:
        raise ValueError("--eplb-redundant-experts needs --eplb-interval > 0 (the replicas are placed by EPLB)")
    experts = model_config.text.num_experts
    if eplb and (experts + redundant) % ep_ranks:
        raise ValueError(f"--eplb-redundant-experts {redundant}: {experts} experts + {redundant} cannot be split "
                         f"evenly over {ep_ranks} ranks")
    # the model's own check (heads, KDA heads, vocabulary, MLP and MoE widths or experts), before any rank starts
    if args.tp_pieces < 1 or args.tp_pieces > 1 and args.tp_pieces % tp:
        raise ValueError(f"--tp-pieces {args.tp_pieces}: must be 1 or a multiple of --tensor-parallel-size {tp}")
    reduce = {"reduce_mode": args.tp_reduce, "pieces": args.tp_pieces}
    layout = (ParallelLayout(tp=tp, ep=tp * dp, dp=dp, **reduce) if lockstep else
              ParallelLayout(tp=tp, ep=tp if args.enable_expert_parallel else 1, **reduce))
    check_layout(model_config, Parallel(layout))
    # plain replicas across hosts are each a world of their own on one host: a free local port each
    port = args.master_port or (DEFAULT_MASTER_PORT if nnodes > 1 and (lockstep or not dp_hosts) else None)
    fields = {"tensor_parallel_size": tp, "expert_parallel": args.enable_expert_parallel,
              "nnodes": 1 if dp_hosts else nnodes, "eplb_interval": eplb, "eplb_redundant_experts": redundant,
              "master_addr": args.master_addr or "127.0.0.1", "master_port": port,
              "tp_reduce": args.tp_reduce, "tp_pieces": args.tp_pieces}
    if dp_hosts:
        fields |= {"dp_replicas": dp, "dp_nnodes": nnodes, "dp_rpc_port": rpc_port,
                   "dp_address": args.data_parallel_address or args.master_addr or "127.0.0.1"}
    return fields | ({"data_parallel_size": dp} if lockstep else {})


def run_ranks_only(config, node_rank: int) -> int:
    """This host's ranks without HTTP: ``--node-rank K > 0`` starts them as children and waits (exit 0 when
    rank 0 stopped them, 1 when one failed: the others are stopped too); a torchrun rank > 0 is one itself."""
    import msgspec

    from k3serve.core.process import supervise
    from k3serve.engine.core import CoreSpec
    from k3serve.engine.ranks import host_ranks, spawn_workers
    from k3serve.engine.worker import run_worker

    spec = CoreSpec(model=config.model, input_addr="", output_addr="", **config.engine)
    if torchrun_rank() is not None:
        return run_worker(spec)
    if spec.dp_nnodes > 1:  # whole replicas on this host, reaching host 0's client over TCP
        from k3serve.engine.dp_hosts import run_host_replicas

        return run_host_replicas(spec, node_rank)
    node = node_rank
    procs = spawn_workers(msgspec.json.encode(spec).decode(), host_ranks(spec.tensor_parallel_size, spec.nnodes, node),
                          spec.tensor_parallel_size, spec.master_addr, spec.master_port)
    print(f"k3serve: host {node} runs tensor-parallel ranks "
          f"{', '.join(str(r) for r in host_ranks(spec.tensor_parallel_size, spec.nnodes, node))}, meeting at "
          f"{spec.master_addr}:{spec.master_port}", flush=True)
    return supervise(procs)
