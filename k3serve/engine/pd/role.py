"""An engine-core process's prefill/decode role: what ``engine/core.py`` calls, in its own message types.

    both      serves whole requests, and imports hand-offs (AddRequest.handoff) like a decode worker
    decode    the same (the router sends it hand-offs; plain requests still work)
    prefill   runs every request to its first token only, then holds its caches for a decode worker; the
              finished Output carries ``handoff`` (this worker's sender address and the request id)
"""

from __future__ import annotations

from k3serve.engine.messages import AddRequest, HandoffSource, Output, to_output
from k3serve.engine.pd.transport import ZmqReceiver, ZmqSender
from k3serve.engine.pd.worker import DecodeSide, PrefillSide

ROLES = ("both", "prefill", "decode")


class PDRole:
    def __init__(self, engine, role: str, *, host: str = "127.0.0.1", timeout_s: float = 30.0):
        if role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        self.engine, self.role = engine, role
        self.prefill = PrefillSide(engine, ZmqSender(host), timeout_s=timeout_s) if role == "prefill" else None
        self.decode = DecodeSide(engine, ZmqReceiver(), timeout_s=timeout_s) if role != "prefill" else None

    @property
    def prefill_only(self) -> bool:
        return self.prefill is not None

    def add(self, msg: AddRequest, images=(), logits_processor=None) -> None:
        """Queue an AddRequest naming a hand-off source, with its images (``ImageInput``) and its fresh logits
        processor (grammar, logit_bias); ValueError when it cannot be imported here."""
        if self.decode is None:
            raise ValueError("handoff: this worker has role prefill and cannot import a hand-off")
        self.decode.add(msg.request_id, msg.prompt_token_ids, msg.params, msg.handoff.address,
                        msg.handoff.request_id, images=images, logits_processor=logits_processor)

    def nack(self, handoff: HandoffSource, error: str) -> None:
        """A hand-off refused before it was queued here (bad request, bad images, grammar): the prefill worker
        frees its slot and blocks now. On a prefill worker there is no receiver; the router nacks."""
        if self.decode is not None:
            self.decode.counters.failures += 1
            self.decode.nack(handoff.address, handoff.request_id, f"the decode side refused the hand-off: {error}")

    def abort(self, request_id: str) -> None:
        if self.decode is not None:
            self.decode.abort(request_id)

    def pump(self) -> list[Output]:
        if self.prefill is not None:
            self.prefill.pump()
            return []
        out = []
        for rid, result in self.decode.pump():
            if isinstance(result, str):
                out.append(Output(rid, [], finished=True, error=result))
            else:
                out.append(to_output(result))
        return out

    def ticket(self, request_id: str) -> HandoffSource | None:
        if self.prefill is None or request_id not in self.engine.scheduler.held:
            return None
        return HandoffSource(self.prefill.sender.address, request_id)

    def sockets(self) -> list:
        if self.prefill is not None:
            return [self.prefill.sender.socket]
        return list(self.decode.receiver.sockets.values())

    def stats(self) -> dict:
        c = (self.prefill or self.decode).counters
        return dict(num_held=len(self.engine.scheduler.held), handoff_transfers=c.transfers,
                    handoff_failures=c.failures, handoff_bytes=c.bytes, handoff_transfer_s=c.transfer_s,
                    handoff_queue_s=c.queue_s, handoff_cached_tokens=c.cached_tokens)

    def close(self) -> None:
        (self.prefill.sender if self.prefill is not None else self.decode.receiver).close()

