"""``k3serve route``: the KV-cache-aware router, live or on a trace.

    k3serve route --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8000 [--policy kv]
    k3serve route --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000
    k3serve route simulate --trace FILE --replicas N --policy kv [--cache-blocks 10%] [--json] [--compare]

Replicas should run ``k3serve serve ... --kv-events`` (``k3serve serve --replicas N`` does all of it); if
their events are keyed (``--kv-events-key-file`` / ``K3SERVE_KV_EVENTS_KEY``), the router needs the same secret.
"""

from __future__ import annotations

import argparse
import json
import sys

from k3serve.router.policy import POLICIES, PolicyConfig
from k3serve.router.simulate import SimConfig, SimResult, simulate
from k3serve.router.trace import TraceRequest, load_trace, scale_trace

DEFAULT_CACHE_BLOCKS = "10%"

_TABLE_ROWS = (
    ("hit rate", "hit_rate", "{:.3f}"),
    ("ideal hit rate (1 infinite cache)", "ideal_hit_rate", "{:.3f}"),
    ("hit rate / ideal", None, "{:.3f}"),
    ("requests per replica max/mean", "load_max_over_mean", "{:.3f}"),
    ("prefill tokens per replica max/mean", "prefill_tokens_max_over_mean", "{:.3f}"),
    ("TTFT p50 (s)", "ttft_p50_s", "{:.3f}"),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
    ("TTFT mean (s)", "ttft_mean_s", "{:.3f}"),
    ("simulation wall time (s)", "sim_wall_s", "{:.2f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL (repeat for each); replicas should run 'k3serve serve --kv-events'")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="prefill/decode mode: a prefill worker's base URL ('k3serve serve --role prefill'; "
                             "repeat for each); needs --decode too")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="prefill/decode mode: a decode worker's base URL ('k3serve serve --role decode'; "
                             "repeat for each); the least loaded one continues each request")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=8000, help="port to bind")
    parser.add_argument("--policy", default="kv", help=f"routing policy: {', '.join(POLICIES)} (default kv)")
    parser.add_argument("--session-header", default="x-session-id",
                        help="request header whose value pins a session to a replica (policy 'session')")
    parser.add_argument("--temperature", type=float, default=0.0, help="kv policy: 0 = argmin; > 0 = softmax")
    parser.add_argument("--weight", type=float, default=_default(PolicyConfig, "weight"),
                        help="kv policy: cost per prefill block relative to a decode block (default %(default)s)")
    parser.add_argument("--cache-weight", type=float, default=_default(PolicyConfig, "cache_weight"),
                        help="kv policy: cost per block newly written into a replica's cache (default %(default)s)")
    parser.add_argument("--kv-events-key-file", default=None, metavar="PATH",
                        help="file holding the replicas' KV events secret (or set K3SERVE_KV_EVENTS_KEY): needed "
                             "to subscribe to keyed events and to hash prompts as the replicas do")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="route_command", metavar="SUBCOMMAND")
    p = sub.add_parser("simulate", help="replay a Mooncake-format trace through the routing policies",
                       description="Replay a Mooncake-format trace (timestamps, lengths, 512-token hash_ids) "
                       "through the router's policy code against N simulated replicas.")
    p.add_argument("--trace", required=True, help="Mooncake jsonl trace file")
    p.add_argument("--replicas", type=int, required=True, help="number of replicas")
    p.add_argument("--policy", default="kv", help=f"routing policy: {', '.join(POLICIES)} (default kv)")
    p.add_argument("--compare", action="store_true", help="run every policy and print them side by side")
    # 10%: the size of the acceptance run in benchmarks/RESULTS.md (8 replicas then hold ~80% of the trace's
    # distinct blocks, so the policies, not the cache size, decide the hit rate)
    p.add_argument("--cache-blocks", default=DEFAULT_CACHE_BLOCKS,
                   help="prefix cache per replica in 512-token blocks, or 'P%%' of the trace file's distinct blocks "
                   "(default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = p.add_argument_group("kv policy")
    g.add_argument("--weight", type=float, default=_default(PolicyConfig, "weight"),
                   help="cost per prefill block (queued + uncached) relative to a decode block (default %(default)s)")
    g.add_argument("--cache-weight", type=float, default=_default(PolicyConfig, "cache_weight"),
                   help="cost per block the request newly writes into a replica's cache (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = argmin; > 0 = softmax sampling")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("replica model")
    g.add_argument("--state-cache-interval", type=int, default=_default(SimConfig, "state_interval"),
                   help="KDA snapshot every N blocks, besides prompt ends and branch points; 0 = none "
                   "(default %(default)s = 8k tokens)")
    g.add_argument("--no-branch-snapshots", action="store_true",
                   help="do not snapshot where a prompt leaves a cached prefix")
    g.add_argument("--prefill-tokens-per-s", type=float, default=_default(SimConfig, "prefill_tokens_per_s"))
    g.add_argument("--prefill-overhead-s", type=float, default=_default(SimConfig, "prefill_overhead_s"))
    g.add_argument("--decode-step-s", type=float, default=_default(SimConfig, "decode_step_s"),
                   help="seconds per output token for a lone request (default %(default)s)")
    g.add_argument("--decode-knee", type=float, default=_default(SimConfig, "decode_knee"),
                   help="decode batch at which the per-token time doubles (default %(default)s)")
    g = p.add_argument_group("trace scaling")
    g.add_argument("--repeat", type=int, default=1,
                   help="back-to-back copies of the trace, each with fresh block ids (default 1)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.5 = twice the request rate; default 1)")


def _run_disaggregated(args: argparse.Namespace) -> int:
    from k3serve.router.disagg import DisaggConfig, serve

    if args.replica:
        raise ValueError("--replica: not with --prefill/--decode (a worker has one role there)")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = DisaggConfig(prefill=tuple(args.prefill), decode=tuple(args.decode))
    print(f"k3serve: routing {len(config.prefill)} prefill -> {len(config.decode)} decode workers on "
          f"http://{args.host}:{args.port}", flush=True)
    serve(config, args.host, args.port, args.log_level)
    return 0


def _run_live(args: argparse.Namespace) -> int:
    from k3serve.core.kv_auth import load_secret
    from k3serve.router.proxy import RouterConfig, serve

    if args.prefill or args.decode:
        return _run_disaggregated(args)
    if not args.replica:
        print("k3serve route: give at least one --replica URL (or use 'k3serve route simulate')", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = RouterConfig(replicas=tuple(args.replica), policy=args.policy, session_header=args.session_header,
                          temperature=args.temperature, weight=args.weight, cache_weight=args.cache_weight,
                          kv_events_secret=load_secret(args.kv_events_key_file))
    print(f"k3serve: routing ({config.policy}) over {len(config.replicas)} replicas on "
          f"http://{args.host}:{args.port}", flush=True)
    serve(config, args.host, args.port, args.log_level)
    return 0


def _default(cls: type, name: str) -> object:
    return cls.__dataclass_fields__[name].default


def run(args: argparse.Namespace) -> int:
    if args.route_command is None:
        return _run_live(args)
    policies = list(POLICIES) if args.compare else [args.policy]
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy '{name}'; choose one of {', '.join(POLICIES)}")
    if args.replicas <= 0:
        raise ValueError(f"--replicas must be positive, got {args.replicas}")
    base = load_trace(args.trace)
    requests = scale_trace(base, args.repeat, args.time_scale)
    config = SimConfig(
        replicas=args.replicas,
        cache_blocks=_cache_blocks(args.cache_blocks, base),
        state_interval=args.state_cache_interval,
        branch_snapshots=not args.no_branch_snapshots,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        prefill_overhead_s=args.prefill_overhead_s,
        decode_step_s=args.decode_step_s,
        decode_knee=args.decode_knee,
    )
    policy_config = PolicyConfig(args.weight, args.cache_weight, args.temperature, args.seed)
    results = [simulate(requests, config, name, policy_config) for name in policies]
    if args.json:
        meta = {"trace": args.trace, "cache_blocks": config.cache_blocks, "state_cache_interval":
                config.state_interval, "repeat": args.repeat, "time_scale": args.time_scale}
        rows = [{**meta, **r.to_dict()} for r in results]
        print(json.dumps(rows if args.compare else rows[0], indent=2))
    else:
        print(f"{len(requests)} requests, {config.replicas} replicas, {config.cache_blocks} cache blocks each, "
              f"KDA snapshot interval {config.state_interval} blocks")
        print(_table(results))
    return 0


def _cache_blocks(text: str, trace: list[TraceRequest]) -> int:
    text = text.strip()
    try:
        if text.endswith("%"):
            distinct = len({h for r in trace for h in r.block_ids})
            blocks = round(float(text[:-1]) / 100 * distinct)
        else:
            blocks = int(text)
    except ValueError:
        raise ValueError(f"--cache-blocks must be an int or a percentage like '10%', got {text!r}") from None
    if blocks <= 0:
        raise ValueError(f"--cache-blocks must come to at least one block, got {text!r}")
    return blocks


def _table(results: list[SimResult]) -> str:
    label_w = max(len(label) for label, _, _ in _TABLE_ROWS)
    col_w = max(12, *(len(r.policy) for r in results))
    lines = [" " * label_w + "".join(f"  {r.policy:>{col_w}}" for r in results)]
    for label, key, fmt in _TABLE_ROWS:
        cells = []
        for r in results:
            if key is not None:
                value = getattr(r, key)
            else:
                value = r.hit_rate / r.ideal_hit_rate if r.ideal_hit_rate else float("nan")
            cells.append(f"  {fmt.format(value):>{col_w}}")
        lines.append(f"{label:<{label_w}}" + "".join(cells))
    return "\n".join(lines)
