"""ReplicaSet against a real KVEventPublisher (ZMQ on 127.0.0.1) over a fake engine's pools, with the HTTP
side mocked: admission loads the full state, events keep the index in step, a lost batch triggers a
resync that converges, a replica that stops answering is removed and re-admitted; and
``k3serve serve --replicas`` builds each replica's argv from the non-default flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
from types import SimpleNamespace

import httpx
import pytest

from k3serve.engine.kv_events import KVEventPublisher
from k3serve.router.policy import make_policy
from k3serve.router.replicas import ReplicaSet
from k3serve.router.router import Router


def fake_engine() -> SimpleNamespace:
    blocks = SimpleNamespace(block_size=16, hash_to_block={})
    states = SimpleNamespace(snapshot_of={})
    return SimpleNamespace(blocks=blocks, states=states, scheduler=SimpleNamespace(cache=SimpleNamespace()),
                           config=SimpleNamespace(hash_key=b""))


class FakeReplica:
    """The engine side: pools we edit by hand, hooks fired like the real pools fire them."""

    def __init__(self) -> None:
        self.engine = fake_engine()
        self.pub = KVEventPublisher(self.engine, "127.0.0.1")
        self.up = True

    def store(self, *hashes: int, parent: int | None = None) -> None:
        for h in hashes:
            self.engine.blocks.hash_to_block[h] = len(self.engine.blocks.hash_to_block)
            self.engine.blocks.events.block_stored(h, parent)
            parent = h

    def remove(self, h: int) -> None:
        del self.engine.blocks.hash_to_block[h]
        self.engine.blocks.events.block_removed(h)

    def snapshot(self, h: int, depth: int) -> None:
        self.engine.states.snapshot_of[h] = 0
        self.engine.scheduler.cache.events.note_snapshot_depth(h, depth)
        self.engine.states.events.snapshot_stored(h)

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            if not self.up:
                raise httpx.ConnectError("refused", request=request)
            if request.url.path == "/health":
                return httpx.Response(200)
            info = self.pub.info
            return httpx.Response(200, json={"enabled": True, "block_size": info.block_size,
                                             "pub_port": info.pub_port, "snapshot_port": info.snapshot_port})
        return httpx.MockTransport(handle)


async def pump_until(fake: FakeReplica, cond, timeout: float = 5.0) -> None:
    """Run the engine loop's side (publish, answer state requests) until ``cond()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        fake.pub.pump()
        await asyncio.sleep(0.01)
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")


def view(router: Router) -> set[int]:
    return set(router.index._replica_blocks.get(0, ()))


def test_admit_follow_gap_resync_and_readmit(caplog):
    caplog.set_level(logging.DEBUG, logger="k3serve")

    async def main() -> None:
        fake = FakeReplica()
        fake.store(1, 2, 3)  # cached before the router ever connects
        fake.snapshot(3, 48)
        router = Router(make_policy("kv"), 1, 16)
        client = httpx.AsyncClient(transport=fake.transport())
        rs = ReplicaSet(["http://127.0.0.1:1"], router, client, health_interval_s=0.05)
        try:
            start = asyncio.create_task(rs.start())
            await pump_until(fake, start.done)
            await start
            assert rs.routable() == [0] and view(router) == {1, 2, 3}
            assert router.index.match([1, 2, 3]) == {0: 3}
            # live events
            fake.store(4, parent=3)
            fake.remove(1)
            await pump_until(fake, lambda: view(router) == {2, 3, 4})
            # a lost batch: the next one shows a gap, the router resyncs and catches up
            resyncs = rs.replicas[0].resyncs
            fake.store(5, parent=4)
            fake.pub.recorder.take()
            fake.pub.seq += 1  # published into the void
            fake.store(6, parent=5)
            await pump_until(fake, lambda: rs.replicas[0].resyncs > resyncs and view(router) == {2, 3, 4, 5, 6})
            assert not router.index.is_stale(0)
            # it stops answering: removed, its index dropped; back: re-admitted with a fresh resync
            fake.up = False
            await pump_until(fake, lambda: rs.routable() == [])
            assert view(router) == set() and rs.replicas[0].down_reason.startswith("health check failed")
            fake.up = True
            await pump_until(fake, lambda: rs.routable() == [0])
            assert view(router) == {2, 3, 4, 5, 6}
        finally:
            await rs.stop()
            await client.aclose()
            fake.pub.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    # routine (re-)admission is INFO, not a warning; losing a replica is
    levels = {r.getMessage().split(": ")[0].split(") ")[-1]: r.levelno for r in caplog.records
              if r.getMessage().startswith("replica 0 ")}
    assert levels == {"admitted": logging.INFO, "removed": logging.WARNING}, levels


def test_replica_argv_keeps_only_changed_flags():
    from k3serve.entrypoints.replicas_cli import replica_argv, router_options
    from k3serve.entrypoints.serve_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["some-model", "--replicas", "3", "--port", "9000", "--max-num-seqs", "4", "--kv-events",
                         "--api-key", "secret", "--kv-events-host", "0.0.0.0", "--kv-events-key-file", "/k",
                         "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--state-cache-interval", "32",
                         "--router-policy", "least_load", "--router-weight", "1.5"])
    # the router's flags stay with the router; the snapshot interval goes to the replicas and to the router
    assert replica_argv(args) == ["some-model", "--served-model-name", "a", "b", "--max-num-seqs", "4",
                                  "--no-enable-prefix-caching", "--state-cache-interval", "32"]
    assert router_options(args) == {"policy": "least_load", "snapshot_interval_blocks": 2, "weight": 1.5}


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "0"], "--replicas"),
    (["--router-policy", "least_load"], "need --replicas N > 1"),
    (["--replicas", "2", "--router-policy", "nope"], "--policy must be one of"),
    (["--state-cache-interval", "24"], "--state-cache-interval 24: must be a non-negative multiple"),
])
def test_serve_replicas_bad_count(argv, needle, capsys):
    from k3serve.cli import main

    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
