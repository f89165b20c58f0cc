"""``StateRows``: a batch's KDA states are moved to the leading cache rows, and every slot keeps its state."""

from __future__ import annotations

import random

import torch

from k3serve.engine.state_rows import StateRows


def test_arrange_puts_batch_slots_first_and_moves_states_with_them():
    rng = random.Random(0)
    n = 12
    # two tensors of different shapes; slot s starts with state value s in each
    tensors = [torch.arange(n, dtype=torch.float32)[:, None, None].repeat(1, 2, 3), torch.arange(n)[:, None] * 10]
    rows = StateRows(n, tensors)
    for _ in range(200):
        slots = rng.sample(range(n), rng.randint(1, n))
        rows.arrange(slots)
        assert rows.rows(slots) == list(range(len(slots)))
        for s in range(n):
            r = rows.row_of[s]
            assert rows.slot_at[r] == s
            assert torch.all(tensors[0][r] == s) and tensors[1][r, 0] == 10 * s


def test_arrange_moves_nothing_for_an_unchanged_batch(monkeypatch):
    t = torch.arange(6.0)[:, None]
    rows = StateRows(6, [t])
    rows.arrange([3, 1, 4])
    calls = []
    monkeypatch.setattr(t, "index_copy_", lambda *a: calls.append(a))
    rows.arrange([3, 1, 4])
    rows.arrange([3, 1])  # a finished tail: the rest stay where they are
    assert calls == [] and rows.rows([3, 1, 4]) == [0, 1, 2]


def test_no_kda_tensors_keeps_slots_as_rows():
    rows = StateRows(0, [])
    rows.arrange([2, 0])
    assert rows.rows([2, 0]) == [2, 0]
