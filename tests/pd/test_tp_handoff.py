"""Prefill/decode hand-offs between different tensor-parallel sizes, as engine-core processes over ZMQ/TCP:
prefill tp2 -> decode tp1 and prefill tp1 -> decode tp2 give the greedy tokens of a single tp-1 `both` engine,
top-20 logprobs within 1e-5, through a chunked prefill (16-token steps), for both KDA flavours (k3-tiny and
kimi-linear-tiny). The prefill side's rank 0 gathers its ranks' KDA rows, the decode side's scatters them
(engine/pd/rank_rows.py, reshard.py); a hand-off carries the full layout, so its checksums still catch one
flipped byte on the way to a tp-2 decode side. Over HTTP: `route` over a tp-2 prefill worker and a tp-1 decode
worker, and over a tp-1 prefill worker and a tp-2 decode worker, answers like a `both` server."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from k3serve.engine.client import EngineClient
from k3serve.engine.messages import HandoffSource
from k3serve.engine.pd.manifest import Manifest
from k3serve.engine.pd.transport import Fetch, ZmqSender
from k3serve.engine.sampling_params import SamplingParams
from tests.pd.cluster import cluster

pytestmark = pytest.mark.slow  # four engines, six processes per model: ~1 min each idle, minutes on a loaded box
ENGINE = {"dtype": "float32", "kv_cache_memory": 16 * 2**20, "max_model_len": 256, "max_num_seqs": 4,
          "max_num_batched_tokens": 16, "log_stats_interval": 0.0}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)
PROMPTS = [list(range(100, 141)), [7, 1999, 3, 500, 42, 42, 11, 900, 1234, 5, 66, 77, 88, 99, 100, 101, 1500, 3,
                                   4, 5, 6]]


async def _collect(stream) -> list:
    return [o async for o in stream]


def _flat(outs: list) -> tuple[list[int], list[dict]]:
    return [t for o in outs for t in o.token_ids], [lp for o in outs for lp in (o.logprobs or [])]


def _same(got, want) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == len(want[0])
    for a, b in zip(got[1], want[1]):
        assert list(a) == list(b) and max(abs(a[k] - b[k]) for k in a) <= 1e-5


async def _wait_for(client: EngineClient, cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond(client.stats):
        assert time.monotonic() < deadline, f"timed out; stats {client.stats}"
        await asyncio.sleep(0.1)


def _fetch_raw(address: str, rid: str) -> list[bytes]:
    """A manifest's frames from a prefill worker, as a decode side would get them (not acked: it times out)."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(address)
        dealer.send(msgspec.msgpack.encode(Fetch(rid, [], 16)))
        assert dealer.poll(60_000)
        frames = dealer.recv_multipart()
        assert frames[0] == b"m", frames
        return frames[1:]
    finally:
        dealer.close(0)
        ctx.term()


def _serve(manifest: Manifest, payloads: list[bytes], stop: threading.Event) -> str:
    """A fake prefill worker answering every fetch with this manifest and these payloads, until ``stop``."""
    sender = ZmqSender()

    def run() -> None:
        try:
            while not stop.is_set():
                for peer, msg in sender.receive():
                    if isinstance(msg, Fetch):
                        sender.send(peer, manifest, payloads)
                time.sleep(0.01)
        finally:
            sender.close()

    threading.Thread(target=run, daemon=True).start()
    return sender.address


def _serve_tampered(header: bytes, payloads: list[bytes], stop: threading.Event) -> str:
    """A fake prefill worker answering every fetch with this manifest, its first KDA state flipped by one bit."""
    manifest = msgspec.msgpack.decode(header, type=Manifest)
    i = next(k for k, it in enumerate(manifest.items) if it.name.startswith("kda_state."))
    bad = bytearray(payloads[i])
    bad[len(bad) // 2] ^= 0x10
    return _serve(manifest, [*payloads[:i], bytes(bad), *payloads[i + 1:]], stop)


def _serve_frames(frames: list[bytes], stop: threading.Event) -> str:
    """A fake prefill worker answering every fetch with these frames as they are."""
    return _serve(msgspec.msgpack.decode(frames[0], type=Manifest), frames[1:], stop)


@pytest.mark.parametrize("model", ["k3-tiny-random", "kimi-linear-tiny-random"])
def test_handoff_across_tp_sizes(model: str) -> None:
    async def main():
        base = dict(ENGINE, model=model)
        both = EngineClient(dict(base))  # the reference; it also imports hand-offs (tp2 -> tp1)
        pre2 = EngineClient(dict(base, role="prefill", tensor_parallel_size=2, handoff_timeout_s=20.0))
        pre1 = EngineClient(dict(base, role="prefill", handoff_timeout_s=20.0))
        dec2 = EngineClient(dict(base, role="decode", tensor_parallel_size=2))
        clients = (both, pre2, pre1, dec2)
        try:
            await asyncio.gather(*(c.start() for c in clients))
            for n, prompt in enumerate(PROMPTS):
                want = _flat(await _collect(both.generate(f"ref{n}", prompt, PARAMS)))
                for pre, dec, tag in ((pre2, both, "2to1"), (pre1, dec2, "1to2")):
                    rid = f"{tag}-{n}"
                    first = await _collect(pre.generate(rid, prompt, PARAMS))
                    assert len(first) == 1 and first[0].finished and first[0].handoff is not None
                    got = _flat(await _collect(dec.generate(rid, prompt, PARAMS, handoff=first[0].handoff)))
                    _same(got, want)
            await _wait_for(pre2, lambda s: s.num_held == 0 and s.num_blocks_used == 0
                            and s.handoff_transfers == len(PROMPTS) and s.handoff_failures == 0)
            await _wait_for(dec2, lambda s: s.handoff_transfers == len(PROMPTS) and s.handoff_failures == 0)

            # a tp-2 prefill side's manifest, one bit flipped in transit to a tp-2 decode side: refused
            prompt = PROMPTS[0]
            first = await _collect(pre2.generate("flip", prompt, PARAMS))
            frames = await asyncio.to_thread(_fetch_raw, first[0].handoff.address, "flip")
            stop = threading.Event()
            try:
                fake = _serve_tampered(frames[0], frames[1:], stop)
                with pytest.raises(ValueError, match=r"kda_state\.\d+ is corrupt \(checksum mismatch\)"):
                    await _collect(dec2.generate("flip", prompt, PARAMS, handoff=HandoffSource(fake, "flip")))
                # the untampered frames from the same fetch decode like the reference
                stop.set()
                stop = threading.Event()
                fake = await asyncio.to_thread(_serve_frames, frames, stop)
                got = _flat(await _collect(dec2.generate("clean", prompt, PARAMS,
                                                         handoff=HandoffSource(fake, "flip"))))
                _same(got, _flat(await _collect(both.generate("ref-clean", prompt, PARAMS))))
            finally:
                stop.set()
            await _wait_for(dec2, lambda s: s.num_held == 0 and s.num_blocks_used == 0 and s.handoff_failures == 1)
        finally:
            await asyncio.gather(*(c.shutdown() for c in clients))

    asyncio.run(main())



# over HTTP: `serve --role prefill` -> `route` -> `serve --role decode`, one of them -tp 2, against a `both` server ----

HTTP_ENGINE = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
               "--gpu-memory-utilization", "0.02"]


def _complete(url: str, prompt: list[int]) -> tuple[list[str], list[dict]]:
    import httpx

    body = {"model": "k3-tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 20}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["top_logprobs"]


@pytest.mark.parametrize("tp2", ["prefill", "decode"])
def test_http_handoff_between_tp2_and_tp1(tmp_path, tp2: str) -> None:
    with cluster("k3-tiny-random", HTTP_ENGINE, tmp_path / "servers.log", two_by_two=False, handoff_timeout=20,
                 timeout=300, role_flags={tp2: ["-tp", "2"]}) as urls:
        for prompt in PROMPTS:
            _same(_complete(urls["router"], prompt), _complete(urls["both"], prompt))
