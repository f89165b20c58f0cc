"""``k3serve serve [MODEL]``: the OpenAI- and Anthropic-compatible HTTP server (vLLM-like flags).

Two processes: this one runs the HTTP server (validation, chat rendering, tokenization,
detokenization, output parsing); the engine core runs in a child process and the two talk typed
messages over ZMQ. With ``--tensor-parallel-size N`` the engine core is rank 0 of N and starts the other
ranks itself; ``--data-parallel-size D`` runs D engine cores (``entrypoints/parallel_cli.py``).

Start-up order: flags are checked (one line and exit 1 on a bad one), the port is taken, the engine
starts (its failure is one line too), and only then "serving on" is printed and HTTP served. SIGTERM,
SIGINT and SIGHUP stop it gracefully, engine included; the engine also dies if this process is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket

from k3serve.core.kv_auth import KEY_ENV as KV_KEY_ENV
from k3serve.core.kv_auth import MIN_SECRET_CHARS
from k3serve.entrypoints import graphs_cli, parallel_cli
from k3serve.entrypoints.generate_cli import DEFAULT_MODEL, add_download_arguments

API_KEY_ENV = "K3SERVE_API_KEY"  # like vLLM's VLLM_API_KEY: a key on the command line is visible to `ps`
ENGINE_GONE = -1  # in `stopped`: the engine died for good (not a signal)
# after the engine died for good the server stays up this long answering 503 (issue 45: new requests get 503,
# not a refused connection, and a load balancer sees /health fail) before it exits
GONE_GRACE_S = 5.0


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '4GiB', '1.5G' -> bytes (argparse type: a bad value is one line)."""
    s = text.strip().lower()
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 536870912, 512MiB, 4GiB)") from None
    if not 2 <= value < 2**63:  # 1 or less would read as a fraction of free memory in the engine
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 2 bytes")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="checkpoint directory, Hugging Face repo id (owner/name) or built-in model name")
    add_download_arguments(p)
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or x-api-key) on /v1 and tokenizer routes; "
                        f"prefer the {API_KEY_ENV} environment variable, which 'ps' does not show "
                        "(the flag wins over it)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the MODEL argument)")
    g.add_argument("--api-contract", choices=["kimi", "openai"], default=None,
                   help="request contract: 'kimi' follows Moonshot's K3 API as Kimi Vendor Verifier checks it "
                        "(fixed sampling parameters), 'openai' accepts the full OpenAI parameter space "
                        "(default: kimi for K3 models, openai otherwise)")
    g.add_argument("--chat-format", default=None,
                   help="override the chat format picked from the model's model_type "
                        "(kimi_k3, kimi_k25, kimi_k2, kimi_k2_thinking)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests held at once; beyond it requests get 429 with Retry-After")
    g.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts whose http(s) image URLs may be fetched (data: URLs are always accepted)")
    g.add_argument("--limit-images", type=int, default=8, help="images per request")
    g.add_argument("--max-image-bytes", type=int, default=20 << 20, help="bytes per image")
    g.add_argument("--max-image-pixels", type=int, default=25_000_000,
                   help="width x height per image, read from the image header before it is decoded; larger "
                        "images get 413")
    lim = p.add_argument_group("request limits (beyond them a request gets 413, before the costly work)")
    lim.add_argument("--max-request-body-bytes", type=int, default=32 << 20,
                     help="bytes of one request body, checked before it is parsed (default 32 MiB)")
    lim.add_argument("--max-messages", type=int, default=10_000, help="messages of one chat request")
    lim.add_argument("--max-prompt-chars", type=int, default=4 << 20,
                     help="characters of text in one request's messages or prompt, counted before tokenizing")
    lim.add_argument("--frontend-workers", type=int, default=2,
                     help="threads that render chats, tokenize and decode images, off the HTTP event loop")
    sup = p.add_argument_group("supervision")
    sup.add_argument("--max-engine-restarts", type=int, default=3,
                     help="when the engine process dies, requests in flight get 503 and a new engine starts "
                          "(empty caches), at most this many times; after that, or with 0, the server exits "
                          "with code 1 for a supervisor (systemd, Kubernetes) to restart it")
    lg = p.add_argument_group("logging")
    lg.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="level of the HTTP server's (uvicorn's) own messages")
    lg.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log",
                    action="store_true", help="no access log line (client, method, path, status, latency) "
                                              "per request")
    lg.add_argument("--disable-log-stats", action="store_true", help="no periodic engine stats line")
    lg.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between engine stats lines (logged only when the engine was busy)")
    r = p.add_argument_group("routing")
    r.add_argument("--kv-events", action="store_true",
                   help="publish KV cache events for a KV-aware router ('k3serve route'); see /kv_events/info")
    r.add_argument("--kv-events-host", default="127.0.0.1",
                   help="address the KV event sockets bind (default loopback: only this machine's router can "
                        "subscribe); any other address needs a key")
    r.add_argument("--kv-events-key-file", default=None, metavar="PATH",
                   help=f"file holding the KV events secret (>= {MIN_SECRET_CHARS} characters; or set "
                        f"{KV_KEY_ENV}): the events are then encrypted, only a router with the same secret may "
                        "subscribe, and block hashes are keyed with it. --replicas makes a random one if none")
    r.add_argument("--replicas", type=int, default=1,
                   help="start N replicas (each a server + engine on a free local port) behind a KV-aware "
                        "router on --host/--port")
    r.add_argument("--router-policy", default="kv",
                   help="with --replicas: the router's policy, as 'k3serve route --policy' (kv, round_robin, "
                        "least_load, session)")
    r.add_argument("--router-weight", type=float, default=None,
                   help="with --replicas, kv policy: cost per prefill block relative to a decode block "
                        "('k3serve route --weight')")
    r.add_argument("--router-cache-weight", type=float, default=None,
                   help="with --replicas, kv policy: cost per block newly written into a replica's cache "
                        "('k3serve route --cache-weight')")
    pd = p.add_argument_group("prefill/decode disaggregation (put 'k3serve route --prefill URL --decode URL' in front)")
    pd.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                    help="both: whole requests; prefill: run each prompt to its first token and hold its caches for a "
                         "decode worker (the response carries kv_transfer_params); decode: also import hand-offs "
                         "(requests with kv_transfer_params) and decode them")
    pd.add_argument("--prefill-replicas", type=int, default=0,
                    help="with --decode-replicas: start this many '--role prefill' replicas and that many "
                         "'--role decode' ones on free local ports, behind a prefill/decode router on --host/--port")
    pd.add_argument("--decode-replicas", type=int, default=0, help="see --prefill-replicas")
    pd.add_argument("--handoff-host", default=None,
                    help="prefill role: address its hand-off sender binds on a free port (default: --host)")
    pd.add_argument("--handoff-timeout", type=float, default=30.0,
                    help="seconds a prefill worker holds a hand-off until the decode side acks it (then frees it), "
                         "and a decode worker waits for a manifest")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    e.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the free device memory (host memory on CPU) for the KV/state caches "
                        "(default: a 256 MiB cache)")
    e.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="size of the KV/state caches in bytes, e.g. 536870912, 512MiB or 4GiB (default: 256MiB); "
                        "without --max-model-len the context is capped to what this holds, with a log line")
    e.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16",
                   help="KV cache precision (fp8 is not supported yet)")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    e.add_argument("--device", default="cpu", help="torch device of the engine")
    e.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                   help="disable prefix caching")
    e.add_argument("--state-cache-interval", type=int, default=0, metavar="TOKENS",
                   help="prefix caching: also keep the KDA state every TOKENS prompt tokens (a multiple of the "
                        "16-token block), so requests sharing only part of a prompt resume mid-prompt; 0, the "
                        "default, keeps it at prompt ends only")
    e.add_argument("--seed", type=int, default=0, help="engine random seed")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; methods: ngram (prompt lookup), '
                        'suffix (suffix decoding over prompt + output and earlier responses), draft_model '
                        '("model": a small checkpoint), eagle3 and eagle_suffix (the eagle3 head, "model": its '
                        'directory, default: the one shipped with the target; eagle_suffix takes the better-scored '
                        'of head and suffix drafts, "min_draft_prob" 0.2, "eagle_max_running" 4); also "rollback" '
                        '(slots | replay) and "max_running" (speculation backs off above this many running '
                        'requests, default 32; 4 for draft_model/eagle3)')
    parallel_cli.add_arguments(p)
    graphs_cli.add_arguments(p)


def server_config(args: argparse.Namespace):
    from k3serve.server.limits import RequestLimits
    from k3serve.server.media import MediaLimits
    from k3serve.server.state import ServerConfig

    if args.kv_cache_dtype == "fp8":
        raise ValueError("--kv-cache-dtype fp8: not supported yet")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.limit_images < 0 or args.max_image_bytes < 1 or args.max_image_pixels < 1:
        raise ValueError("--limit-images must be >= 0, --max-image-bytes and --max-image-pixels >= 1")
    limits = RequestLimits(max_body_bytes=args.max_request_body_bytes, max_messages=args.max_messages,
                           max_prompt_chars=args.max_prompt_chars, frontend_workers=args.frontend_workers)
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not args.log_stats_interval > 0:
        raise ValueError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
    if args.replicas == 1 and (args.router_policy != "kv" or args.router_weight is not None
                               or args.router_cache_weight is not None):
        raise ValueError("--router-policy/--router-weight/--router-cache-weight need --replicas N > 1 (one "
                         "server has no router)")
    keyed = args.kv_events and kv_events_secret(args) is not None  # before the (perhaps slow) model lookup
    from k3serve.models.registry import resolve_model_path

    path = str(resolve_model_path(args.model, revision=args.revision, download_dir=args.download_dir))
    layout = check_engine_flags(args, path)
    engine = {**layout, "dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": args.prefix_caching,
              "state_cache_interval": args.state_cache_interval,
              "device": args.device, "seed": args.seed,
              "log_stats_interval": 0.0 if args.disable_log_stats else args.log_stats_interval,
              "speculative_config": args.speculative_config, **graphs_cli.check_graphs(args)}
    if args.gpu_memory_utilization is not None and args.kv_cache_memory is not None:
        raise ValueError("--kv-cache-memory and --gpu-memory-utilization: give one of them")
    if args.gpu_memory_utilization is not None:
        engine["kv_cache_memory"] = args.gpu_memory_utilization
    if args.kv_cache_memory is not None:
        engine["kv_cache_memory"] = float(args.kv_cache_memory)
    if args.kv_events:
        engine["kv_events_host"] = args.kv_events_host
        engine["kv_events_keyed"] = keyed
    if not args.handoff_timeout > 0:
        raise ValueError(f"--handoff-timeout must be > 0 seconds, got {args.handoff_timeout}")
    if args.role != "both":
        engine |= {"role": args.role, "handoff_host": args.handoff_host or args.host,
                   "handoff_timeout_s": args.handoff_timeout}
    return ServerConfig(model=path, served_model_names=tuple(args.served_model_name or (args.model,)),
                        api_key=api_key, api_contract=args.api_contract, chat_format=args.chat_format,
                        max_queued_requests=args.max_queued_requests, engine=engine,
                        access_log=not args.disable_access_log, limits=limits,
                        max_engine_restarts=0 if parallel_cli.torchrun_rank() is not None else args.max_engine_restarts,
                        data_parallel_size=args.data_parallel_size,
                        media=MediaLimits(max_images=args.limit_images, max_image_bytes=args.max_image_bytes,
                                          max_pixels=args.max_image_pixels,
                                          allowed_domains=tuple(d.lower() for d in args.allowed_media_domains)))


def kv_events_secret(args: argparse.Namespace) -> str | None:
    """The KV events secret (key file, else the environment), checked with where the events bind. It is
    left in this process's environment, which is how the engine process (and any replica) receives it."""
    from k3serve.core import kv_auth

    secret = kv_auth.load_secret(args.kv_events_key_file)
    kv_auth.check_exposure(args.kv_events_host, secret)
    if secret is not None:
        kv_auth.KVEventsKey.from_secret(secret)  # no CURVE in this libzmq: one line now, not in the engine
        os.environ[KV_KEY_ENV] = secret
    return secret


def check_engine_flags(args: argparse.Namespace, model_path: str) -> dict:
    """The engine's own checks, run here so bad flags fail in one line before any process starts; returns
    the engine's layout fields (``parallel_cli.check_parallel``)."""
    from k3serve.core.config import ModelConfig
    from k3serve.engine.config import EngineConfig, check_device
    from k3serve.engine.spec.config import SpeculativeConfig

    try:
        EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     max_model_len=args.max_model_len, state_cache_interval=args.state_cache_interval,
                     speculative_config=None if args.speculative_config is None
                     else SpeculativeConfig.parse(args.speculative_config))
        if args.device != "cpu":  # importing torch costs a second or two; cpu is always there
            check_device(args.device)
    except ValueError as e:
        name, _, why = str(e).partition(": ")
        raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name, '')}: {why}") from None
    model_config = ModelConfig.from_file(model_path)
    if args.speculative_config is not None:  # a draft model or head that does not fit: one line, no process
        from k3serve.engine.spec.speculator import check_fits

        text = model_config.text
        try:
            check_fits(SpeculativeConfig.parse(args.speculative_config), text.vocab_size, text.hidden_size,
                       text.num_hidden_layers)
        except ValueError as e:
            why = str(e).removeprefix("speculative_config: ")
            raise ValueError(f"--speculative-config {args.speculative_config}: {why}") from None
    limit = model_config.text.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise ValueError(f"--max-model-len {args.max_model_len}: longer than the model's "
                         f"max_position_embeddings ({limit})")
    return parallel_cli.check_parallel(args, model_config)


def run(args: argparse.Namespace) -> int:
    from k3serve.entrypoints import replicas_cli
    from k3serve.server.app import build_app

    if args.prefill_replicas or args.decode_replicas:
        return replicas_cli.run_disaggregated(args)
    if args.replicas != 1:
        return replicas_cli.run_replicas(args)
    config = server_config(args)
    rank = parallel_cli.torchrun_rank()
    if args.node_rank > 0 or rank not in (None, 0):  # this host (or process) runs tp ranks only, no HTTP
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return parallel_cli.run_ranks_only(config, args.node_rank)
    # the server's own warnings (e.g. chat disabled for a small vocabulary) with their level, like the engine's
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock = bind_socket(args.host, args.port)
    app = build_app(config)
    stopped: list[int] = []
    try:
        with sock:
            asyncio.run(_serve(app, args, sock, stopped))
    except asyncio.CancelledError:  # a stop signal while the engine was starting
        pass
    return exit_code(stopped)


def exit_code(stopped: list[int]) -> int:
    """0 after a requested stop (SIGTERM, SIGHUP), 130 after Ctrl-C, as a shell expects; 1 when the
    engine died past --max-engine-restarts."""
    if ENGINE_GONE in stopped:
        return 1
    return 130 if signal.SIGINT in stopped else 0


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken before the engine loads, so a busy port fails in one line at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


async def _serve(app, args: argparse.Namespace, sock: socket.socket, stopped: list[int]) -> None:
    """Start the engine (its failure is one line), say so, then serve HTTP until a stop signal. Any
    exit stops the engine process; SIGTERM, SIGINT and SIGHUP are all graceful."""
    import uvicorn

    from k3serve.core.process import on_stop_signals
    from k3serve.server.app import start_state
    from k3serve.engine.client import EngineDead

    state = app.state.k3
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    server: uvicorn.Server | None = None

    def on_signal(signum: int) -> None:
        stopped.append(signum)
        if server is not None:
            server.handle_exit(signum, None)  # uvicorn's graceful shutdown (it handles only SIGINT/SIGTERM)
        else:
            loop.call_soon_threadsafe(task.cancel)

    with on_stop_signals(on_signal):
        try:
            try:
                await start_state(state)
            except EngineDead as e:
                raise ValueError(str(e)) from None
            config = state.config
            print(f"k3serve: serving {config.names[0]} ({config.model}) on http://{args.host}:{args.port}",
                  flush=True)
            server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                                  timeout_graceful_shutdown=5))

            async def exit_when_engine_gone() -> None:
                await state.client.gave_up.wait()
                stopped.append(ENGINE_GONE)
                await asyncio.sleep(GONE_GRACE_S)
                server.should_exit = True

            watcher = asyncio.create_task(exit_when_engine_gone())
            try:
                await server.serve(sockets=[sock])
            finally:
                watcher.cancel()
        finally:
            if state.client is not None:
                await state.client.shutdown()
