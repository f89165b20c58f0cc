"""How hand-off manifests travel: one interface (``Sender`` on the prefill side, ``Receiver`` on the decode
side), one implementation over ZMQ/TCP.

Protocol (ask, then send; the receiver drives):

    receiver -> sender   Fetch(request_id, held_hashes, block_size)   "send me this request, I hold these blocks"
    sender -> receiver   [Manifest header, payload_0, ..., payload_n]  or  [Refusal]
    receiver -> sender   Ack(request_id, ok, error)                   "imported (or gave up): release it"

The sender pins the request's slot and blocks from its first token until the ack, or a timeout
(``worker.PrefillSide``). Payloads go as separate ZMQ frames (no copy into one buffer). Neither NIXL nor the
Mooncake transfer engine runs on the CPU-only machines this was built on (the Mooncake wheel needs
``libibverbs``; NIXL's wheels are CUDA builds), so ZMQ/TCP is the only implementation; an RDMA one would
implement the same two classes. The small messages (and the router's ``Nacker``) are in ``engine/pd/wire.py``.
"""

from __future__ import annotations

import msgspec
import zmq

from k3serve.engine.pd.manifest import Manifest
from k3serve.engine.pd.wire import Ack, Fetch, Refusal, encoder as _enc, refusal as _refusal, to_sender as _to_sender

__all__ = ["Ack", "Fetch", "Receiver", "Refusal", "Sender", "ZmqReceiver", "ZmqSender"]
_manifest = msgspec.msgpack.Decoder(Manifest)


class Sender:
    """Prefill side: answers fetches with manifests, hears acks. ``address`` is what receivers connect to."""

    address: str

    def receive(self) -> list[tuple[bytes, Fetch | Ack]]:
        """Pending (peer, message) pairs, without waiting."""
        raise NotImplementedError

    def send(self, peer: bytes, manifest: Manifest, payloads: list[bytes]) -> int:
        """Send a manifest and its payloads to ``peer``; returns the bytes sent."""
        raise NotImplementedError

    def refuse(self, peer: bytes, request_id: str, error: str) -> None:
        raise NotImplementedError


class Receiver:
    """Decode side: fetches from senders by address, acknowledges."""

    def fetch(self, address: str, msg: Fetch) -> None:
        raise NotImplementedError

    def ack(self, address: str, msg: Ack) -> None:
        raise NotImplementedError

    def receive(self) -> list[tuple[str, Manifest | Refusal, list[bytes]]]:
        """Arrived (sender address, manifest or refusal, payloads), without waiting. A reply that does not
        decode becomes a ``Refusal`` for the request named in it, or is dropped (its fetch then times out)."""
        raise NotImplementedError


class ZmqSender(Sender):
    def __init__(self, host: str = "127.0.0.1", ctx: zmq.Context | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    def receive(self) -> list[tuple[bytes, Fetch | Ack]]:
        out = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                continue
            try:
                out.append((frames[0], _to_sender.decode(frames[1])))
            except msgspec.ValidationError:  # a malformed peer message is dropped; the peer times out
                continue

    def send(self, peer: bytes, manifest: Manifest, payloads: list[bytes]) -> int:
        header = _enc.encode(manifest)
        self.socket.send_multipart([peer, b"m", header, *payloads], copy=False)
        return len(header) + sum(len(p) for p in payloads)

    def refuse(self, peer: bytes, request_id: str, error: str) -> None:
        self.socket.send_multipart([peer, b"r", _enc.encode(Refusal(request_id, error))])

    def close(self) -> None:
        self.socket.close(0)


class ZmqReceiver(Receiver):
    def __init__(self, ctx: zmq.Context | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}  # sender address -> DEALER

    def _socket(self, address: str) -> zmq.Socket:
        s = self.sockets.get(address)
        if s is None:
            s = self.sockets[address] = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
        return s

    def fetch(self, address: str, msg: Fetch) -> None:
        self._socket(address).send(_enc.encode(msg))

    def ack(self, address: str, msg: Ack) -> None:
        self._socket(address).send(_enc.encode(msg), zmq.NOBLOCK)

    def receive(self) -> list[tuple[str, Manifest | Refusal, list[bytes]]]:
        out = []
        for address, s in self.sockets.items():
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                kind = frames[0].bytes if frames else b""
                try:
                    if kind == b"m" and len(frames) >= 2:
                        out.append((address, _manifest.decode(frames[1].buffer), [f.buffer for f in frames[2:]]))
                    elif kind == b"r" and len(frames) == 2:
                        out.append((address, _refusal.decode(frames[1].buffer), []))
                except msgspec.ValidationError:
                    continue
        return out

    def close(self) -> None:
        for s in self.sockets.values():
            s.close(0)
