"""KV events are not readable by just anyone (issue 50): they bind loopback by default, a non-loopback
address without a secret is refused at start-up, keyed sockets deliver only to a subscriber holding the
same secret, keyed block hashes differ from unkeyed ones while engine and router still agree, and a router
with the wrong secret says why instead of routing on hashes that cannot match."""

from __future__ import annotations

import argparse
import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest
import zmq

from k3serve.core import kv_auth
from k3serve.core.hashing import hash_block, hash_blocks
from k3serve.core.kv_events import TOPIC, decode_batch, decode_state
from k3serve.engine.kv_events import KVEventPublisher
from k3serve.router.policy import make_policy
from k3serve.router.replicas import ReplicaSet
from k3serve.router.router import Router

SECRET = "correct horse battery staple"
OTHER = "an entirely different secret"


def fake_engine(hash_key: bytes = b"") -> SimpleNamespace:
    return SimpleNamespace(blocks=SimpleNamespace(block_size=16, hash_to_block={}),
                           states=SimpleNamespace(snapshot_of={}), scheduler=SimpleNamespace(cache=SimpleNamespace()),
                           config=SimpleNamespace(hash_key=hash_key))


def publisher(secret: str | None) -> KVEventPublisher:
    key = kv_auth.KVEventsKey.from_secret(secret) if secret else None
    return KVEventPublisher(fake_engine(key.hash_key if key else b""), "127.0.0.1", key)


def store(pub: KVEventPublisher, h: int) -> None:
    pub.engine.blocks.hash_to_block[h] = h
    pub.engine.blocks.events.block_stored(h, None)


# binding --------------------------------------------------------------------------------------------------

def test_default_bind_is_loopback():
    from k3serve.entrypoints.serve_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["m", "--host", "0.0.0.0", "--kv-events"]).kv_events_host == "127.0.0.1"
    pub = publisher(None)
    try:
        assert pub.info.host == "127.0.0.1" and pub.info.server_key is None
    finally:
        pub.close()
    assert kv_auth.is_loopback("localhost") and not kv_auth.is_loopback("0.0.0.0")


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--kv-events", "--kv-events-host", "0.0.0.0"], "not a loopback address"),
    (["serve", "--kv-events", "--kv-events-key-file", "/nonexistent/key"], "cannot read"),
    (["serve", "--replicas", "2", "--kv-events-host", "0.0.0.0"], "publish on 127.0.0.1"),
    (["route", "--replica", "http://127.0.0.1:9", "--kv-events-key-file", "/nonexistent/key"], "cannot read"),
])
def test_exposed_without_key_refused(argv, needle, capsys, monkeypatch):
    from k3serve.cli import main

    monkeypatch.delenv(kv_auth.KEY_ENV, raising=False)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["serve", "--kv-events"], ["route", "--replica", "http://127.0.0.1:9"]])
def test_short_secret_refused(argv, capsys, monkeypatch):
    from k3serve.cli import main

    monkeypatch.setenv(kv_auth.KEY_ENV, "short")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{kv_auth.KEY_ENV}: the KV events key must be at least 16 characters" in err, err
    kv_auth.check_exposure("0.0.0.0", SECRET)  # with a key it may be exposed


def test_publisher_refuses_an_engine_hashing_without_the_key():
    key = kv_auth.KVEventsKey.from_secret(SECRET)
    with pytest.raises(ValueError, match="hash its blocks with the KV events key"):
        KVEventPublisher(fake_engine(b""), "127.0.0.1", key)


# authentication -------------------------------------------------------------------------------------------

def test_only_the_right_key_receives_events():
    pub = publisher(SECRET)
    ctx = zmq.Context()
    subs = {}
    try:
        right = kv_auth.KVEventsKey.from_secret(SECRET)
        public, secret_key = zmq.curve_keypair()
        # a stranger knows the server's public key (/kv_events/info shows it) but not the derived client key:
        # the ZAP handler must turn it away
        stranger = kv_auth.KVEventsKey(b"", right.server_public, b"", public, secret_key)
        for name, key in (("right", right), ("wrong", kv_auth.KVEventsKey.from_secret(OTHER)),
                          ("stranger", stranger), ("none", None)):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            if key is not None:
                kv_auth.make_client(s, key)
            s.setsockopt(zmq.SUBSCRIBE, TOPIC)
            s.connect(f"tcp://127.0.0.1:{pub.info.pub_port}")
            subs[name] = s
        wrong_dealer = ctx.socket(zmq.DEALER)
        wrong_dealer.setsockopt(zmq.LINGER, 0)
        kv_auth.make_client(wrong_dealer, kv_auth.KVEventsKey.from_secret(OTHER))
        wrong_dealer.connect(f"tcp://127.0.0.1:{pub.info.snapshot_port}")
        wrong_dealer.send(b"snapshot", zmq.NOBLOCK)
        got = {name: [] for name in subs}
        deadline = time.monotonic() + 1.5
        h = 0
        while time.monotonic() < deadline:
            h += 1
            store(pub, h)
            pub.pump()
            for name, s in subs.items():
                while s.poll(0):
                    got[name].append(decode_batch(s.recv_multipart()[2]))
            time.sleep(0.02)
        assert got["right"] and any(b.events for b in got["right"])
        assert got["wrong"] == got["stranger"] == got["none"] == []
        assert wrong_dealer.poll(0) == 0  # the state socket does not answer a wrong key either
        right_dealer = ctx.socket(zmq.DEALER)
        right_dealer.setsockopt(zmq.LINGER, 0)
        kv_auth.make_client(right_dealer, kv_auth.KVEventsKey.from_secret(SECRET))
        right_dealer.connect(f"tcp://127.0.0.1:{pub.info.snapshot_port}")
        right_dealer.send(b"snapshot")
        for _ in range(200):
            pub.pump()
            if right_dealer.poll(10):
                break
        assert set(decode_state(right_dealer.recv()).block_hashes) == set(range(1, h + 1))
    finally:
        ctx.destroy(linger=0)
        pub.close()


# hashing --------------------------------------------------------------------------------------------------

def test_keyed_hashes():
    ids = list(range(100))
    key = kv_auth.KVEventsKey.from_secret(SECRET).hash_key
    plain, keyed = hash_blocks(ids, 16), hash_blocks(ids, 16, key=key)
    assert hash_blocks(ids, 16, key=b"") == plain  # the empty key is the old, unkeyed hash
    assert len(keyed) == len(plain) == 6 and not set(keyed) & set(plain)
    assert hash_blocks(ids, 16, key=kv_auth.KVEventsKey.from_secret(OTHER).hash_key) != keyed
    assert hash_block(keyed[0], ids[16:32], key=key) == keyed[1]  # one block at a time agrees
    assert len(key) == 32 and key == kv_auth.KVEventsKey.from_secret(SECRET + "\n").hash_key  # file newline
    with pytest.raises(ValueError):
        hash_blocks(ids, 16, key=b"x" * 65)


def test_engine_and_router_hash_alike_with_the_key():
    torch = pytest.importorskip("torch")
    from k3serve.core.kv_events import BlockStored
    from k3serve.engine import kv_events
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.sampling_params import SamplingParams
    from k3serve.models.loader import load_model

    key = kv_auth.KVEventsKey.from_secret(SECRET).hash_key
    model, config = load_model("kimi-linear-tiny-random", dtype=torch.float32, progress=False)
    engine = LLMEngine(model, model_config=config, config=EngineConfig(
        kv_cache_memory=8 * 2**20, max_model_len=256, max_num_seqs=4, hash_key=key))
    rec = kv_events.attach(engine)
    prompt = list(range(100, 180))
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    stored = [h for e in rec.take() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored and stored == hash_blocks(prompt, 16, key=key)[:len(stored)]
    router = Router(make_policy("kv"), 1, 16)
    router.resync(0, kv_events.full_state(engine, rec, 0))
    assert router.index.match(hash_blocks(prompt, 16, key=key)) == {0: len(stored)}
    assert router.index.match(hash_blocks(prompt, 16)) == {}  # an unkeyed router finds nothing


# the router's side ----------------------------------------------------------------------------------------

def _admit(pub: KVEventPublisher, router_secret: str | None) -> SimpleNamespace:
    """Admit one replica (this publisher, HTTP mocked) into a ReplicaSet holding ``router_secret``."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        i = pub.info
        return httpx.Response(200, json={"enabled": True, "block_size": i.block_size, "pub_port": i.pub_port,
                                         "snapshot_port": i.snapshot_port, "host": i.host,
                                         "server_key": i.server_key})

    async def main() -> SimpleNamespace:
        router = Router(make_policy("kv"), 1, 16)
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        key = kv_auth.KVEventsKey.from_secret(router_secret) if router_secret else None
        rs = ReplicaSet(["http://127.0.0.1:1"], router, client, health_interval_s=60, kv_key=key)
        try:
            start = asyncio.create_task(rs.start())
            while not start.done():
                pub.pump()
                await asyncio.sleep(0.01)
            await start
            rep = rs.replicas[0]
            return SimpleNamespace(healthy=rep.healthy, events=rep.events, note=rep.events_note,
                                   blocks=set(router.index._replica_blocks.get(0, ())))
        finally:
            await rs.stop()
            await client.aclose()

    return asyncio.run(asyncio.wait_for(main(), 20))


@pytest.mark.parametrize("replica, router, note", [
    (SECRET, SECRET, None),
    (SECRET, OTHER, "key mismatch"),
    (SECRET, None, "this router has no key"),
    (None, SECRET, "unkeyed KV events"),
])
def test_router_admission_by_key(replica, router, note):
    pub = publisher(replica)
    try:
        store(pub, 7)
        got = _admit(pub, router)
    finally:
        pub.close()
    assert got.healthy  # a key problem costs the cache view, not the replica
    if note is None:
        assert got.events and got.note is None and got.blocks == {7}
    else:
        assert not got.events and note in got.note and got.blocks == set()
