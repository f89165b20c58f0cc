"""Engine KV events -> router index: after every engine step, the router's view (built only from the
events, through the msgpack wire format) equals the engine's real cache; a full-state snapshot gives
the same view; with no recorder attached nothing is recorded."""

from __future__ import annotations

import msgspec
import pytest
import torch

from k3serve.core.kv_events import BlockStored, EventBatch, SnapshotStored, decode_batch, decode_state
from k3serve.engine import kv_events
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.loader import load_model
from k3serve.router.prefix_index import PrefixIndex
from k3serve.router.sequence import Delivery

_ENC = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def tiny():
    return load_model("kimi-linear-tiny-random", dtype=torch.float32, progress=False)


def _engine(tiny, kv_cache_memory: float) -> LLMEngine:
    model, config = tiny
    return LLMEngine(model, model_config=config, config=EngineConfig(
        kv_cache_memory=kv_cache_memory, max_model_len=256, max_num_seqs=4))


def _view(index: PrefixIndex, replica: int) -> tuple[set[int], set[int]]:
    return set(index._replica_blocks.get(replica, ())), set(index._replica_snaps.get(replica, ()))


def _truth(engine: LLMEngine) -> tuple[set[int], set[int]]:
    return set(engine.blocks.hash_to_block), set(engine.states.snapshot_of)


def _conversations(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 2000, (40,), generator=g).tolist()
    return [system + torch.randint(0, 2000, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_events_track_the_engine_cache_through_evictions(tiny):
    engine = _engine(tiny, 2**20)  # small: blocks and snapshots get evicted
    rec = kv_events.attach(engine)
    index, seq, kinds = PrefixIndex(engine.blocks.block_size), -1, set()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = _conversations(24, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        if i % 3 == 0:  # interleave arrivals with steps
            engine.step()
        while engine.has_unfinished_requests() and (i % 4 == 3 or i == len(prompts) - 1):
            engine.step()
            events = rec.take()
            kinds |= {type(e).__name__ for e in events}
            seq += 1
            wire = _ENC.encode(EventBatch(seq, tuple(events)))
            assert index.apply(2, decode_batch(wire)) is Delivery.APPLY
            assert _view(index, 2) == _truth(engine)
    assert {"BlockStored", "BlockRemoved", "SnapshotStored", "SnapshotRemoved"} <= kinds
    # a resync from the full state alone gives the same view, with depths on block boundaries
    state = kv_events.full_state(engine, rec, seq)
    assert all(d % engine.blocks.block_size == 0 and d > 0 for _, d in state.snapshots)
    fresh = PrefixIndex(engine.blocks.block_size)
    fresh.resync(0, decode_state(_ENC.encode(state)))
    assert _view(fresh, 0) == _truth(engine)
    assert fresh.tracker.expected[0] == seq + 1


def test_stored_runs_are_chained_and_depths_match_hashes(tiny):
    from k3serve.core.hashing import hash_blocks

    engine = _engine(tiny, 8 * 2**20)
    rec = kv_events.attach(engine)
    prompt = list(range(100, 180))  # 5 full blocks of 16
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    events = rec.take()
    hashes = hash_blocks(prompt, 16)
    stored = [e for e in events if isinstance(e, BlockStored)]
    got = [h for e in stored for h in e.block_hashes]
    assert got and got == hashes[:len(got)]
    # a block-aligned prompt is prefilled in two chunks (its end minus one block is a snapshot point too, for an
    # exact repeat): each run after the first names the previous run's last block as its parent
    assert stored[0].parent_hash is None
    assert all(b.parent_hash == a.block_hashes[-1] for a, b in zip(stored, stored[1:]))
    assert all(e.num_tokens == 16 * len(e.block_hashes) for e in stored)
    snaps = {e.block_hash: e.depth for e in events if isinstance(e, SnapshotStored)}
    assert snaps and all(hashes[d // 16 - 1] == h for h, d in snaps.items())
    assert rec.take() == []


def test_no_recorder_no_events(tiny):
    engine = _engine(tiny, 8 * 2**20)
    assert engine.blocks.events is None and engine.states.events is None
    engine.add_request("a", list(range(50)), SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_cached > 0
