"""Data parallelism across hosts: ``-dp D --nnodes N`` runs D / N engine replicas on each host, every replica's
tensor-parallel ranks inside its own host (e.g. TP8 x DP2 on two 8-GPU hosts: 16 x H200).

    host 0:  k3serve serve MODEL -tp 8 -dp 2 --nnodes 2 --node-rank 0 --data-parallel-address 10.0.0.1
    host 1:  k3serve serve MODEL -tp 8 -dp 2 --nnodes 2 --node-rank 1 --data-parallel-address 10.0.0.1

Host 0 runs the HTTP server and the data-parallel client (``engine/dp_client.py``); its own replicas are
engine-core children as on one host. Host K > 0 starts the engine cores of its replicas (``run_host_replicas``),
and they reach host 0's client over ZMQ/TCP with the same typed msgspec messages as the local IPC sockets
(``RemoteEngineClient`` is the client's side of one such replica).

Addresses: host 0 listens on ``--data-parallel-address`` (default 127.0.0.1: this machine only; across real
hosts give host 0's private address), on two ports per remote replica: PORT + 2i (requests to it) and
PORT + 2i + 1 (its outputs), PORT = ``--data-parallel-rpc-port``, i = 0, 1, ... the remote replicas in replica
order. The messages are not authenticated: keep that port range on a private network.

Liveness, both ways: the core sends a heartbeat each second when idle (``engine/core.py``), and host 0's client
sends a ``Wake`` each second. A TCP disconnect of a remote core (its host or process died) fails its requests at
once (``EngineDead``: HTTP 503 or an error event) and, as a remote replica is never restarted, gives the server
up; so does ``SILENCE_S`` without a word (a host that vanished without closing its connections). A remote core
that hears nothing from host 0 for ``client_timeout_s`` exits, and its host's launcher with it; a graceful stop
of host 0 sends it ``Shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import subprocess
import sys
import time

import msgspec
import zmq

from k3serve.engine.client import EngineClient, EngineDead
from k3serve.engine.messages import Shutdown, encode

log = logging.getLogger("k3serve.engine")
DEFAULT_RPC_PORT = 29550
BEAT_S = 1.0  # host 0 -> remote core heartbeat (a Wake)
SILENCE_S = 30.0  # host 0 gives a remote replica up after this long without a message from it
CLIENT_TIMEOUT_ENV = "K3SERVE_DP_CLIENT_TIMEOUT_S"  # a remote core exits after this long without host 0 (30 s)


def replicas_per_host(dp: int, nnodes: int) -> int:
    if dp % nnodes:
        raise ValueError(f"--data-parallel-size {dp} cannot be spread evenly over --nnodes {nnodes}")
    return dp // nnodes


def host_replicas(dp: int, nnodes: int, node: int) -> range:
    """The data-parallel ranks of the replicas on host ``node``."""
    per = replicas_per_host(dp, nnodes)
    return range(node * per, (node + 1) * per)


def rpc_addrs(address: str, port: int, dp_rank: int, per_host: int) -> tuple[str, str]:
    """(requests, outputs) ZMQ addresses on host 0 of remote replica ``dp_rank`` (not one of host 0's)."""
    i = dp_rank - per_host
    if i < 0:
        raise ValueError(f"replica {dp_rank} runs on host 0: it has no remote address")
    host = f"[{address}]" if ":" in address else address
    return f"tcp://{host}:{port + 2 * i}", f"tcp://{host}:{port + 2 * i + 1}"


class RemoteEngineClient(EngineClient):
    """The client of one engine replica on another host: it binds the replica's two TCP addresses on host 0 and
    waits for the remote core to connect and say ``Ready``; it never starts (nor restarts) a process."""

    def __init__(self, spec_kwargs: dict, addrs: tuple[str, str], *, silence_s: float = SILENCE_S, **kwargs):
        super().__init__(spec_kwargs, **{**kwargs, "max_restarts": 0})
        self.addrs, self.silence_s = addrs, silence_s
        self._monitor = None

    def _addresses(self) -> tuple[str, str]:
        try:
            self._monitor = self._pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError:  # a libzmq without monitors: the silence timeout still notices
            self._monitor = None
        return self.addrs

    def _bind(self, in_addr: str, out_addr: str) -> None:
        try:
            super()._bind(in_addr, out_addr)
        except zmq.ZMQError as e:
            raise EngineDead(f"cannot listen for data-parallel replica {self._spec_kwargs.get('dp_rank')} on "
                             f"{in_addr} / {out_addr}: {e}") from None

    def _spawn(self) -> None:
        pass  # its host's `k3serve serve --node-rank K` started it

    def _check_starting(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise EngineDead(f"data-parallel replica {self._spec_kwargs.get('dp_rank')} did not connect to "
                             f"{self.addrs[0]} within {self.startup_timeout_s:.0f}s (is its host's `k3serve serve "
                             f"--node-rank K` running, with the same --data-parallel-address and -rpc-port?)")

    async def _watch(self) -> None:
        where = f"data-parallel replica {self._spec_kwargs.get('dp_rank')} (on another host)"
        while not self._closed:
            await asyncio.sleep(BEAT_S / 2)
            if self.dead_reason is None:
                self.wake_soon()  # its heartbeat from us: a core that hears nothing leaves (client_timeout_s)
                if await self._disconnected():
                    self._mark_dead(f"{where} disconnected")
                elif time.monotonic() - self.last_heard > self.silence_s:
                    self._mark_dead(f"{where} silent for {self.silence_s:.0f}s")
            if self.dead_reason is not None and not self._closed:
                self.state = "dead"
                log.error("%s; a remote replica is not restarted: giving up", self.dead_reason)
                self.gave_up.set()
                return

    async def _disconnected(self) -> bool:
        if self._monitor is None:
            return False
        gone = False
        while await self._monitor.poll(0):
            frames = await self._monitor.recv_multipart()
            event = struct.unpack("=hi", frames[0][:6])[0]
            gone |= event == zmq.EVENT_DISCONNECTED
        return gone

    async def shutdown(self) -> None:
        if self._closed:
            return
        if self.alive:  # tell the remote core to stop; flushed within a second, or dropped if it is gone
            with contextlib.suppress(zmq.ZMQError):
                zmq.Socket.shadow(self._push.underlying).send(encode(Shutdown()), flags=zmq.NOBLOCK)
            await asyncio.sleep(0.2)
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._pull.disable_monitor()
            self._monitor.close(0)
        await super().shutdown()


def run_host_replicas(spec, node: int) -> int:
    """Host ``node`` > 0 of ``-dp D --nnodes N``: start its replicas' engine cores (each starts its tp ranks),
    connected to host 0; wait until they end. Exit 0 when host 0 stopped them, 1 when one failed (the others
    are stopped then)."""
    from k3serve.core.process import compute_env, supervise

    per = replicas_per_host(spec.dp_replicas, spec.dp_nnodes)
    timeout = float(os.environ.get(CLIENT_TIMEOUT_ENV, SILENCE_S))
    procs, where = [], []
    for d in host_replicas(spec.dp_replicas, spec.dp_nnodes, node):
        in_addr, out_addr = rpc_addrs(spec.dp_address, spec.dp_rpc_port, d, per)
        one = msgspec.structs.replace(spec, input_addr=in_addr, output_addr=out_addr, dp_rank=d,
                                      local_replicas=per, client_timeout_s=timeout)
        procs.append(subprocess.Popen([sys.executable, "-m", "k3serve.engine.core", msgspec.json.encode(one).decode()],
                                      stdin=subprocess.DEVNULL, env=compute_env()))
        where.append(f"{d} ({in_addr.rsplit(':', 1)[1]}/{out_addr.rsplit(':', 1)[1]})")
    print(f"k3serve: host {node} runs data-parallel replicas {', '.join(where)}, each -tp "
          f"{spec.tensor_parallel_size}, reaching host 0 at {spec.dp_address}", flush=True)
    return supervise(procs)
