"""The processes of one tensor-parallel rank set, started and watched by its rank 0 (the engine core).

World layout of one engine replica: ``tp`` ranks over ``nnodes`` hosts, ``tp / nnodes`` per host, rank r on
host ``r // per_node``. Rank 0 (on host 0) is the engine core; it starts the other ranks of its host as
``python -m k3serve.engine.worker`` children, and ``k3serve serve --node-rank K`` starts host K's ranks.
Under ``torchrun`` (RANK and WORLD_SIZE already set) every rank was started by torchrun and nothing is spawned.

Failure: a watchdog thread on rank 0 polls its worker processes; when one exits unasked, rank 0 reports
``Fatal`` to its client and exits at once (it may be blocked in a collective with the dead rank), and its
other workers die with it (they are its children: ``core/process.py``). Remote ranks are noticed by the
broadcast failing (``RankLost``) or by the gloo timeout.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import msgspec
import zmq

from k3serve.core.process import compute_env, free_port

log = logging.getLogger("k3serve.engine")
WATCH_S = 0.2
EXTERNAL_ENV = ("RANK", "WORLD_SIZE")  # set by torchrun (or any launcher of the same contract)


def launched_externally() -> bool:
    return all(k in os.environ for k in EXTERNAL_ENV)



def host_ranks(tp: int, nnodes: int, node_rank: int) -> range:
    per_node = tp // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_env(rank: int, world: int, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def spawn_workers(spec_json: str, ranks: range, world: int, master_addr: str, master_port: int,
                  leader: int = 0) -> list[subprocess.Popen]:
    """``python -m k3serve.engine.worker SPEC`` for each of ``ranks`` (``leader``, the engine core, excluded),
    children of this process that die with it."""
    procs = []
    for local, rank in enumerate(ranks):
        if rank == leader:
            continue
        env = compute_env({**os.environ, **rank_env(rank, world, local, master_addr, master_port)})
        procs.append(subprocess.Popen([sys.executable, "-m", "k3serve.engine.worker", spec_json],
                                      stdin=subprocess.DEVNULL, env=env))
    return procs


class Watchdog:
    """Rank 0's watch over its local workers: a worker that exits while not stopping ends rank 0 too, after
    one ``Fatal`` to the client (sent on a socket of its own: the main thread's is not thread-safe)."""

    def __init__(self, procs: list[subprocess.Popen], output_addr: str, fatal: bytes | None = None):
        self.procs, self.output_addr = procs, output_addr
        self.stopping = threading.Event()
        self._fatal = fatal
        self._thread = threading.Thread(target=self._run, name="k3serve-rank-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.procs:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self.stopping.wait(WATCH_S):
            dead = [(i + 1, p) for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not self.stopping.is_set():
                rank, p = dead[0]
                why = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                log.error("%s: stopping this rank set", why)
                self._report(why)
                os._exit(1)

    def _report(self, why: str) -> None:
        from k3serve.engine.messages import Fatal, encode

        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 500)
            push.connect(self.output_addr)
            push.send(encode(Fatal(why)), flags=zmq.NOBLOCK)
            push.close()
        except zmq.ZMQError:
            pass
        finally:
            ctx.term()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching and wait for the workers to leave (they were told to); kill what stays."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_ranks(spec):
    """(par, group, watchdog) for the engine core of ``spec`` (a ``CoreSpec``): (None, None, None) with one
    rank; else this host's workers are started and watched, and this process joins the group as rank 0."""
    from k3serve.engine.tp_group import join

    layout = spec.layout()
    if layout.world_size == 1:
        return None, None, None
    workers = []
    if not launched_externally():
        port = spec.master_port or free_port()
        # experts spanning the replicas (layout.dp > 1): one world, this core is its replica's first rank
        first = spec.dp_rank * layout.tp if layout.dp > 1 else 0
        os.environ.update(rank_env(first, layout.world_size, 0, spec.master_addr, port))
        ranks = range(first, first + layout.tp) if layout.dp > 1 else host_ranks(layout.tp, spec.nnodes, 0)
        workers = spawn_workers(msgspec.json.encode(spec).decode(), ranks, layout.world_size, spec.master_addr, port,
                                leader=first)
    watchdog = Watchdog(workers, spec.output_addr).start()
    par, group = join(layout, spec.device)
    return par, group, watchdog
