"""Speculative decoding's KDA/conv state rollback, at the layer's level: for random draft lengths and accept
counts, the fast strategy (per-position slots) leaves a pool bit-identical (fp32) to the reference (checkpoint
+ replay through the decode step), and both equal plain decoding of the accepted tokens only. Unused pool rows
are poisoned (NaN) so a strategy that reads or writes the wrong row shows."""

from __future__ import annotations

import pytest
import torch

from k3serve.core.context import ModelCaches
from k3serve.engine.spec.rollback import ReplayRollback, SlotsRollback, run_positions
from k3serve.ops import registry

H, K, W = 2, 8, 4
P = H * K


def _layer(seed: int):
    g = torch.Generator().manual_seed(seed)
    conv_w = torch.randn(3 * P, W, generator=g) * 0.5
    dt_bias, a_log = torch.randn(P, generator=g) * 0.1, torch.randn(H, generator=g) * 0.1
    op = registry.get("kda_decode_step")

    def step(qkv, conv, f, b, state):
        return op(qkv, conv_w, conv, f, dt_bias, a_log, b, state, lower_bound=-5.0)

    return step


def _caches(num_rows: int, seed: int) -> ModelCaches:
    g = torch.Generator().manual_seed(seed)
    return ModelCaches(kda_state={0: torch.randn(num_rows, H, K, K, generator=g)},
                       kda_conv={0: torch.randn(num_rows, 3 * P, W - 1, generator=g)})


def _poison(caches: ModelCaches, rows: list[int]) -> None:
    for t in (caches.kda_state[0], caches.kda_conv[0]):
        mask = torch.ones(t.shape[0], dtype=torch.bool)
        mask[rows] = False
        t[mask] = float("nan")


@pytest.mark.parametrize("seed", range(6))
def test_slots_equal_replay_equal_plain_decode(seed):
    g = torch.Generator().manual_seed(100 + seed)
    R = int(torch.randint(1, 6, (), generator=g))
    lens = torch.randint(1, 9, (R,), generator=g).tolist()  # 1 + k, k = 0..8
    accepted = [int(torch.randint(0, n, (), generator=g)) for n in lens]
    pool_rows = torch.randperm(R + 3, generator=g)[:R].tolist()
    n = sum(lens)
    qkv, f, b = torch.randn(n, 3 * P, generator=g), torch.randn(n, H, K, generator=g), torch.randn(n, H, generator=g)
    step = _layer(seed)
    pools = {}
    for cls in (SlotsRollback, ReplayRollback):
        caches = _caches(R + 3, seed)
        _poison(caches, pool_rows)
        idx = torch.tensor(pool_rows)
        conv, state = caches.kda_conv[0][idx], caches.kda_state[0][idx]
        rb = cls(caches, list(range(R)), lens, pool_rows)
        rb.verify(0, step, qkv, f, b, conv, state)
        caches.kda_conv[0][idx], caches.kda_state[0][idx] = conv, state  # the layer stores the live state
        rb.commit(accepted)
        pools[cls.name] = (caches.kda_conv[0][idx], caches.kda_state[0][idx])
    # plain decoding of the accepted tokens only, one row at a time
    caches = _caches(R + 3, seed)
    starts = [sum(lens[:i]) for i in range(R)]
    for i, r in enumerate(pool_rows):
        conv, state = caches.kda_conv[0][r:r + 1].clone(), caches.kda_state[0][r:r + 1].clone()
        run_positions(step, qkv, f, b, conv, state, [starts[i]], [1 + accepted[i]])
        for name, (pc, ps) in pools.items():
            assert torch.equal(pc[i], conv[0]) and torch.equal(ps[i], state[0]), (name, i)


def test_k0_everywhere_is_plain_decode_and_commit_twice_refused():
    step = _layer(0)
    caches = _caches(3, 0)
    qkv, f, b = torch.randn(3, 3 * P), torch.randn(3, H, K), torch.randn(3, H)
    conv, state = caches.kda_conv[0].clone(), caches.kda_state[0].clone()
    rb = SlotsRollback(caches, [0, 1, 2], [1, 1, 1], [0, 1, 2])
    out = rb.verify(0, step, qkv, f, b, conv, state)
    c2, s2 = caches.kda_conv[0].clone(), caches.kda_state[0].clone()
    ref = step(qkv, c2, f, b, s2)
    assert torch.equal(out, ref) and torch.equal(conv, c2) and torch.equal(state, s2)
    rb.commit([0, 0, 0])
    with pytest.raises(RuntimeError):
        rb.commit([0, 0, 0])
    with pytest.raises(ValueError):
        SlotsRollback(caches, [0], [2], [0]).commit([2])


@pytest.mark.parametrize("seed", range(4))
def test_snapshots_inside_the_accepted_window(seed):
    """A prefix-cache snapshot at a block boundary inside the window is the state after that many tokens."""
    g = torch.Generator().manual_seed(200 + seed)
    R = 3
    lens = torch.randint(2, 9, (R,), generator=g).tolist()
    accepted = [int(torch.randint(0, n, (), generator=g)) for n in lens]
    snaps = [(i, int(torch.randint(0, accepted[i] + 1, (), generator=g)), R + 3 + i) for i in range(R)]
    n = sum(lens)
    qkv, f, b = torch.randn(n, 3 * P, generator=g), torch.randn(n, H, K, generator=g), torch.randn(n, H, generator=g)
    step = _layer(seed)
    pool_rows = [2, 0, 4]
    got = {}
    for cls in (SlotsRollback, ReplayRollback):
        caches = _caches(2 * R + 3, seed)
        idx = torch.tensor(pool_rows)
        conv, state = caches.kda_conv[0][idx], caches.kda_state[0][idx]
        rb = cls(caches, list(range(R)), lens, pool_rows)
        rb.verify(0, step, qkv, f, b, conv, state)
        caches.kda_conv[0][idx], caches.kda_state[0][idx] = conv, state
        rb.commit(accepted, snaps)
        got[cls.name] = (caches.kda_conv[0][R + 3:].clone(), caches.kda_state[0][R + 3:].clone())
    caches = _caches(2 * R + 3, seed)
    starts = [sum(lens[:i]) for i in range(R)]
    for i, j, _ in snaps:
        r = pool_rows[i]
        conv, state = caches.kda_conv[0][r:r + 1].clone(), caches.kda_state[0][r:r + 1].clone()
        run_positions(step, qkv, f, b, conv, state, [starts[i]], [j + 1])
        for name, (pc, ps) in got.items():
            assert torch.equal(pc[i], conv[0]) and torch.equal(ps[i], state[0]), (name, i, j)
