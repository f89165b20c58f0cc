"""``k3serve serve --replicas N`` and ``--prefill-replicas P --decode-replicas D``: one host's replicas, each a
``k3serve serve`` child on a free local port, behind the router this process runs (``router/launch.py``).

The flags are checked once here (``serve_cli.server_config``) before any replica starts; each replica gets the
flags that differ from their defaults (``replica_argv``), and the router its own (``router_options``).
"""

from __future__ import annotations

import argparse
import os

from k3serve.core.kv_auth import KEY_ENV as KV_KEY_ENV
from k3serve.entrypoints.serve_cli import API_KEY_ENV, add_arguments, server_config


def run_replicas(args: argparse.Namespace) -> int:
    from k3serve.core import kv_auth
    from k3serve.router.launch import serve_replicas

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.kv_events_host != "127.0.0.1":
        raise ValueError("--kv-events-host: the replicas of --replicas publish on 127.0.0.1, next to their router")
    server_config(args)  # bad flags fail here, once, not in every replica
    if args.api_key is not None:  # to the replicas through their environment: their argv is visible to `ps`
        os.environ[API_KEY_ENV] = args.api_key
    # keyed even on loopback: other local users must not read the events either
    secret = kv_auth.load_secret(args.kv_events_key_file) or kv_auth.new_secret()
    kv_auth.KVEventsKey.from_secret(secret)
    os.environ[KV_KEY_ENV] = secret
    return serve_replicas(replica_argv(args), args.replicas, args.host, args.port, args.log_level,
                          kv_events_secret=secret, router=router_options(args))


def router_options(args: argparse.Namespace) -> dict:
    """The ``RouterConfig`` fields that ``--router-*`` and ``--state-cache-interval`` set for --replicas (the
    router models where the replicas keep KDA snapshots); checked here, in one line, before anything starts."""
    from k3serve.engine.config import EngineConfig
    from k3serve.router.proxy import RouterConfig

    options = {"policy": args.router_policy,
               "snapshot_interval_blocks": args.state_cache_interval // EngineConfig.block_size}
    if args.router_weight is not None:
        options["weight"] = args.router_weight
    if args.router_cache_weight is not None:
        options["cache_weight"] = args.router_cache_weight
    RouterConfig(replicas=("http://127.0.0.1:1",), **options)  # raises the one-line error
    return options


def run_disaggregated(args: argparse.Namespace) -> int:
    from k3serve.router.launch import serve_disaggregated

    if args.prefill_replicas < 1 or args.decode_replicas < 1:
        raise ValueError(f"--prefill-replicas and --decode-replicas must both be >= 1, got {args.prefill_replicas} "
                         f"and {args.decode_replicas}")
    if args.replicas != 1 or args.role != "both":
        raise ValueError("--prefill-replicas/--decode-replicas: not with --replicas or --role (they set both)")
    server_config(args)  # bad flags fail here, once, not in every replica
    if args.api_key is not None:
        os.environ[API_KEY_ENV] = args.api_key
    return serve_disaggregated(replica_argv(args), args.prefill_replicas, args.decode_replicas, args.host,
                               args.port, args.log_level)


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``args`` that differ from their defaults, as a ``k3serve serve`` argv for one replica
    (without --host/--port/--replicas/--kv-events/--kv-events-host, which the launcher sets, nor --api-key and
    --kv-events-key-file, whose secrets it passes in the replicas' environment)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv: list[str] = []
    for a in parser._actions:
        if a.dest in ("help", "host", "port", "replicas", "kv_events", "kv_events_host", "kv_events_key_file",
                      "api_key", "prefill_replicas", "decode_replicas", "router_policy", "router_weight",
                      "router_cache_weight"):
            continue
        value = getattr(args, a.dest)
        if not a.option_strings:
            argv.append(str(value))
        elif value != a.default:
            if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                argv.append(a.option_strings[0])
            elif isinstance(value, list):
                argv += [a.option_strings[0], *map(str, value)]
            else:
                argv += [a.option_strings[0], str(value)]
    return argv
