"""The small typed messages of a hand-off (msgspec, torch-free: the router sends ``Ack`` too), and ``Nacker``,
which tells a prefill worker to free a hand-off nobody will fetch.

    receiver -> sender   Fetch(request_id, held_hashes, block_size)
    sender -> receiver   Refusal(request_id, error)                (or a manifest: engine/pd/transport.py)
    anyone   -> sender   Ack(request_id, ok, error)                "release it now"

A negative ack (a nack) comes from the decode worker when it refuses a hand-off before fetching it (bad
request, no room within its timeout, aborted) or gives up on it, and from the router when the decode side
answers with an error or fails; without it the prefill worker would pin the request's slot and blocks until
its ``--handoff-timeout``. An ack for a request the sender no longer holds is ignored, so sending one twice is
harmless.
"""

from __future__ import annotations

import msgspec
import zmq


class Fetch(msgspec.Struct, tag="fetch", frozen=True):
    request_id: str
    held_hashes: list[int]  # chain hashes of the leading blocks the receiver already holds
    block_size: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    request_id: str
    ok: bool
    error: str | None = None


class Refusal(msgspec.Struct, tag="refusal", frozen=True):
    request_id: str
    error: str


encoder = msgspec.msgpack.Encoder()
to_sender = msgspec.msgpack.Decoder(Fetch | Ack)
refusal = msgspec.msgpack.Decoder(Refusal)


class Nacker:
    """Negative acks to prefill workers by their sender address (one DEALER socket each, kept open: a message
    queued on a socket that is closed at once may never leave). Sends never block; a worker that is gone just
    never hears it (its own timeout frees the hand-off)."""

    def __init__(self, ctx: zmq.Context | None = None, max_sockets: int = 256):
        self._ctx = ctx or zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self.max_sockets = max_sockets

    def nack(self, address: str, request_id: str, error: str) -> bool:
        """Queue ``Ack(request_id, False, error)`` for ``address``; False when it could not be queued."""
        if not isinstance(address, str) or not address.startswith("tcp://"):
            return False
        try:
            s = self._sockets.get(address)
            if s is None:
                if len(self._sockets) >= self.max_sockets:  # stale workers' sockets: drop the oldest
                    self._sockets.pop(next(iter(self._sockets))).close(0)
                s = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 1000)
                s.setsockopt(zmq.SNDHWM, 1000)
                s.connect(address)
                self._sockets[address] = s
            s.send(encoder.encode(Ack(request_id, False, error)), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        for s in self._sockets.values():
            s.close()
        self._sockets.clear()
