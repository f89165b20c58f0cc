"""``k3serve serve --replicas N``: N local replicas (each ``k3serve serve`` = HTTP server + engine
process, on a free port of 127.0.0.1, publishing KV events on loopback, keyed with a secret the caller puts
in their environment) behind the KV-aware router.
``k3serve serve --prefill-replicas P --decode-replicas D``: P replicas with ``--role prefill`` and D with
``--role decode`` behind the prefill/decode router (``router/disagg.py``).

A replica that exits while the router runs (its engine gone past its own restarts, a crash, a kill) is
reaped at once and started again on the same port, at most REPLICA_RESTARTS times each; the router
re-admits it by its URL when its /health passes.

The replicas are child processes of this one; they are stopped (SIGTERM, then SIGKILL after 15 s) when
the router exits, however it exits: on SIGTERM, SIGINT or SIGHUP this process stops its replicas first,
and if it is SIGKILLed they get SIGTERM from the kernel (core/process.py), and stop their engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import time

import httpx

from k3serve.core.process import Stopped, child_env, free_port, on_stop_signals, stop_processes
from k3serve.router.proxy import RouterConfig, serve

log = logging.getLogger("k3serve.router")
REPLICA_RESTARTS = 3  # per replica, over the launcher's life
SUPERVISE_INTERVAL_S = 1.0



def start_replica(serve_argv: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k3serve", "serve", *serve_argv, "--host", "127.0.0.1", "--port", str(port),
           "--kv-events"]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=child_env())  # from the main thread


def wait_healthy(procs: list[subprocess.Popen], urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(urls, procs))
    while pending:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"replica {url} exited with code {proc.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    del pending[url]
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas not healthy after {timeout_s:.0f} s: {', '.join(pending)}")
        time.sleep(0.3)


async def supervise(procs: list[subprocess.Popen], argvs: list[list[str]], ports: list[int],
                    restarts: int = REPLICA_RESTARTS, interval_s: float = SUPERVISE_INTERVAL_S) -> None:
    """Reap replicas that exited (no zombies) and start them again, ``restarts`` times each at most.
    Runs on the main thread's event loop: a replica started here still dies with this process."""
    used = [0] * len(procs)
    while True:
        await asyncio.sleep(interval_s)
        for i, p in enumerate(procs):
            if p.returncode is not None or p.poll() is None:  # poll() reaps an exited child
                continue
            if used[i] >= restarts:
                log.error("replica on port %d exited (code %d); its %d restarts are spent: it stays down",
                          ports[i], p.returncode, restarts)
                continue
            used[i] += 1
            log.warning("replica on port %d exited (code %d): restarting it (%d of %d)", ports[i], p.returncode,
                        used[i], restarts)
            procs[i] = start_replica(argvs[i], ports[i])


def serve_replicas(serve_argv: list[str], replicas: int, host: str, port: int, log_level: str = "warning",
                   startup_timeout_s: float = 600.0, kv_events_secret: str | None = None,
                   router: dict | None = None) -> int:
    """Start the replicas, wait until all are healthy, then run the router until it is stopped
    (exit code 0 after SIGTERM/SIGHUP, 130 after SIGINT). The replicas read ``kv_events_secret`` from
    K3SERVE_KV_EVENTS_KEY in the environment they inherit; the router is given it, and ``router``'s
    ``RouterConfig`` fields (policy, weights, snapshot interval)."""

    def route(urls: list[str], beside) -> None:
        cfg = RouterConfig(replicas=tuple(urls), kv_events_secret=kv_events_secret, **(router or {}))
        print(f"k3serve: {replicas} replicas ({', '.join(urls)}) behind a {cfg.policy} router on "
              f"http://{host}:{port}", flush=True)
        serve(cfg, host, port, log_level, beside=beside)

    return _launch([serve_argv] * replicas, route, startup_timeout_s)


def serve_disaggregated(serve_argv: list[str], num_prefill: int, num_decode: int, host: str, port: int,
                        log_level: str = "warning", startup_timeout_s: float = 600.0) -> int:
    """``num_prefill`` prefill and ``num_decode`` decode replicas behind the prefill/decode router."""
    from k3serve.router import disagg

    argvs = [[*serve_argv, "--role", "prefill"]] * num_prefill + [[*serve_argv, "--role", "decode"]] * num_decode

    def route(urls: list[str], beside) -> None:
        cfg = disagg.DisaggConfig(prefill=tuple(urls[:num_prefill]), decode=tuple(urls[num_prefill:]))
        print(f"k3serve: prefill {', '.join(cfg.prefill)} -> decode {', '.join(cfg.decode)} behind a "
              f"prefill/decode router on http://{host}:{port}", flush=True)
        disagg.serve(cfg, host, port, log_level, beside=beside)

    return _launch(argvs, route, startup_timeout_s)


def _launch(argvs: list[list[str]], route, startup_timeout_s: float) -> int:
    ports = [free_port() for _ in argvs]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    # a stop signal raises Stopped wherever we are (starting, waiting, or after uvicorn's graceful
    # shutdown, which re-raises the signal it caught), so the finally below always runs
    with on_stop_signals():
        try:
            procs = [start_replica(a, p) for a, p in zip(argvs, ports)]
            wait_healthy(procs, urls, startup_timeout_s)
            route(urls, lambda: supervise(procs, argvs, ports))
        except RuntimeError as e:
            raise ValueError(str(e)) from None
        except Stopped as e:
            return 130 if e.signum == signal.SIGINT else 0
        finally:
            with on_stop_signals(lambda _s: None):  # a second signal must not cut the clean-up short
                stop_processes(procs, 15)  # graceful: a replica also stops its engine process
    return 0
