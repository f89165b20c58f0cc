"""The prefill and decode sides as the engine-core loop drives them, over the real ZMQ/TCP transport in one
process (a fake clock for the timeouts): a round trip acks and frees the prefill side; a flipped byte in
transit fails the request; a decode side that never acks, or aborts mid-fetch, leaves both pools full; a
manifest that lands while the decode core is in a step still reaches its client (the benchmark's stall)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from k3serve.engine.core import EngineCore
from k3serve.engine.core_spec import CoreSpec
from k3serve.engine.messages import AddRequest, HandoffSource
from k3serve.engine.pd.transport import Fetch, ZmqReceiver, ZmqSender
from k3serve.engine.pd.worker import DecodeSide, PrefillSide
from k3serve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sides(tiny, pd):
    clock = Clock()
    p, d = pd.make_engine(tiny), pd.make_engine(tiny)
    sender, receiver = ZmqSender(), ZmqReceiver()
    pre = PrefillSide(p, sender, timeout_s=5, clock=clock)
    dec = DecodeSide(d, receiver, timeout_s=5, clock=clock)
    yield pre, dec, clock
    sender.close()
    receiver.close()


def _turn(pre: PrefillSide, dec: DecodeSide, until, rounds: int = 200) -> list:
    """Pump both sides (as two core loops would) until ``until(results)``."""
    results: list = []
    for _ in range(rounds):
        pre.pump()
        results += dec.pump()
        if until(results):
            return results
        time.sleep(0.01)
    raise AssertionError(f"no progress: {results}")


def test_round_trip_acks_and_frees_the_prefill_side(sides, pd):
    pre, dec, _ = sides
    prompt = pd.prompts(1, 40, 40, seed=11)[0]
    pd.prefill(pre.engine, "r", prompt, PARAMS)
    dec.add("r", prompt, PARAMS, pre.sender.address, "r")
    [(rid, first)] = _turn(pre, dec, bool)
    assert rid == "r" and first.delta_token_ids and dec.counters.bytes > 0
    _turn(pre, dec, lambda _: not pre.engine.scheduler.held)
    assert pd.pools_full(pre.engine) and pre.counters.transfers == 1 and pre.counters.failures == 0
    outs = pd.drain(dec.engine, {"r": [first]})["r"]
    assert outs[-1].finished and len(outs[-1].token_ids) == 4


def test_a_byte_flipped_in_transit_fails_the_request(sides, pd, monkeypatch):
    pre, dec, _ = sides
    prompt = pd.prompts(1, 40, 40, seed=12)[0]
    pd.prefill(pre.engine, "r", prompt, PARAMS)
    real = pre.sender.socket.send_multipart

    def flip(frames, *a, **k):  # the last payload (a KDA conv state) loses one bit on the wire
        if len(frames) > 3:
            last = bytearray(frames[-1])
            last[0] ^= 0x10
            frames = [*frames[:-1], bytes(last)]
        return real(frames, *a, **k)

    monkeypatch.setattr(pre.sender.socket, "send_multipart", flip)
    dec.add("r", prompt, PARAMS, pre.sender.address, "r")
    [(rid, error)] = _turn(pre, dec, bool)
    assert isinstance(error, str) and "corrupt (checksum mismatch)" in error
    _turn(pre, dec, lambda _: not pre.engine.scheduler.held)  # the failed ack still frees the prefill side
    assert pd.pools_full(pre.engine) and pd.pools_full(dec.engine)


def test_no_ack_frees_the_prefill_side_on_the_timeout(sides, pd):
    pre, _, clock = sides
    prompt = pd.prompts(1, 40, 40, seed=13)[0]
    pd.prefill(pre.engine, "r", prompt, PARAMS)
    ctx = zmq.Context.instance()
    peer = ctx.socket(zmq.DEALER)  # a decode side that takes the manifest and dies
    peer.connect(pre.sender.address)
    peer.send(msgspec.msgpack.encode(Fetch("r", [], 16)))
    for _ in range(200):
        pre.pump()
        if peer.poll(10):
            break
    assert peer.recv_multipart()[0] == b"m"
    peer.close(0)
    clock.t = 4.0
    pre.pump()
    assert "r" in pre.engine.scheduler.held  # still pinned before the timeout
    clock.t = 6.0
    pre.pump()
    assert pd.pools_full(pre.engine) and pre.counters.failures == 1


def test_abort_while_fetching_frees_both_sides(sides, pd):
    pre, dec, _ = sides
    prompt = pd.prompts(1, 40, 40, seed=14)[0]
    pd.prefill(pre.engine, "r", prompt, PARAMS)
    dec.add("r", prompt, PARAMS, pre.sender.address, "r")
    assert dec.pump() == [] and dec.fetching  # reserved, fetch sent, nothing arrived yet
    dec.abort("r")
    assert pd.pools_full(dec.engine)
    _turn(pre, dec, lambda _: not pre.engine.scheduler.held)
    assert pd.pools_full(pre.engine)


def test_a_manifest_arriving_during_a_step_reaches_the_client(tiny, pd, monkeypatch):
    """The decode core pumps its hand-offs before and after each step. A manifest that arrives during the step
    is imported by the second pump; its first token used to be dropped there, so a max_tokens=1 stream (whose
    only output that is) never ended, and longer ones silently lost their first token."""
    spec = CoreSpec("k3-tiny-random", "", "", role="decode", kv_cache_memory=16 * 2**20, max_model_len=256,
                    max_num_seqs=4, max_num_batched_tokens=16, log_stats_interval=0)
    core = EngineCore(spec)
    sender = ZmqSender()
    pre = PrefillSide(pd.make_engine(tiny), sender, timeout_s=5)
    try:
        prompt = pd.prompts(1, 40, 40, seed=15)[0]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        pd.prefill(pre.engine, "r", prompt, one)
        core.handle(AddRequest("busy", list(range(5, 30)), PARAMS))  # keeps the decode engine stepping
        core.handle(AddRequest("d", prompt, one, handoff=HandoffSource(sender.address, "r")))
        real_step = core.engine.step

        def step_while_the_manifest_lands():  # the prefill side answers the fetch while this step runs
            sockets = core.pd.sockets()
            deadline = time.monotonic() + 30
            while not any(s.poll(0) for s in sockets):
                assert time.monotonic() < deadline, "the prefill side never answered the fetch"
                pre.pump()
                time.sleep(0.01)
            return real_step()

        monkeypatch.setattr(core.engine, "step", step_while_the_manifest_lands)
        outs = [o for o in core.turn() if o.request_id == "d"]
        assert len(outs) == 1 and outs[0].finished and outs[0].error is None and len(outs[0].token_ids) == 1
        assert "d" not in core.engine.scheduler.requests and not core.engine.scheduler.held
    finally:
        sender.close()
        core.pd.close()
