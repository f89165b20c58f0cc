"""Rolling back the KDA recurrent state and short-conv window of rejected draft tokens.

A speculative step feeds every decode row ``T = 1 + k`` tokens (its last sampled token and ``k`` drafts; k may
be 0). The KDA layers hand those rows to the step's ``Rollback`` (``ForwardContext.spec``), which runs them
through the ordinary per-token decode step (``kda_decode_step``), position by position, so each position's
state is exactly the state plain decoding would have. After sampling, ``commit(num_accepted)`` leaves in the
pool the state after ``1 + num_accepted[i]`` tokens of row i. Every decode row goes through this path, k = 0
included: there is no branch that skips a state write or reads a stale slot.

Per KDA layer, for R rows with ``lens[i] = T_i`` tokens packed as ``qkv [n, 3P]``, ``f [n, H, K]``,
``b [n, H]`` (row i's tokens at ``starts[i] : starts[i] + T_i``), states ``conv [R, 3P, W-1]`` and
``state [R, H, K, V]`` fp32:

  * ``ReplayRollback`` (the reference): checkpoint the rows' states before verification and keep the raw
    per-token inputs; commit restores the checkpoint and replays the accepted tokens through the same step.
  * ``SlotsRollback`` (fast): keep the state after each position ``j < T_max - 1`` in a per-position buffer
    ``[R, T_max - 1, ...]`` while verifying; commit copies position ``num_accepted`` into the pool (nothing
    for rows that accepted every draft: the pool already holds their last position).

Both yield bit-identical pools (tests/engine/test_spec_rollback.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3serve.core.context import ModelCaches

# step(qkv [r, 3P], conv [r, 3P, W-1], f [r, H, K], b [r, H], state [r, H, K, V]) -> o [r, H, V]; updates
# conv and state in place (the layer binds its weights to registry "kda_decode_step")
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_positions(step: Step, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, conv: torch.Tensor,
                  state: torch.Tensor, starts: list[int], lens: list[int], out: torch.Tensor | None = None,
                  keep: Callable[[int, list[int], torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """Advance row i's ``conv``/``state`` through its first ``lens[i]`` tokens, one decode step per position
    (rows with fewer tokens drop out), writing outputs to ``out [n, H, V]``; ``keep(j, rows, conv, state)`` sees
    the active rows' states after position j."""
    R = len(lens)
    device = qkv.device
    for j in range(max(lens, default=0)):
        act = [i for i in range(R) if lens[i] > j]
        tok = torch.tensor([starts[i] + j for i in act], device=device)
        if len(act) == R:
            cs, st = conv, state
        else:
            idx = torch.tensor(act, device=device)
            cs, st = conv.index_select(0, idx), state.index_select(0, idx)
        o = step(qkv.index_select(0, tok), cs, f.index_select(0, tok), b.index_select(0, tok), st)
        if out is not None:
            out[tok] = o
        if len(act) < R:
            conv[idx], state[idx] = cs, st
        if keep is not None:
            keep(j, act, cs, st)


class Rollback:
    """One speculative step's rollback: built by the model runner for the step's decode rows, read by the KDA
    layers as ``ctx.spec`` during the forward, then committed. ``rows``: batch indices of the decode rows
    (ascending); ``lens``: tokens per row (1 + drafts); ``pool_rows``: their cache rows."""

    name = "base"

    def __init__(self, caches: ModelCaches, rows: list[int], lens: list[int], pool_rows: list[int]):
        self.caches, self.rows, self.lens, self.pool_rows = caches, rows, lens, pool_rows
        self.starts = [sum(lens[:i]) for i in range(len(lens))]
        self.committed = False

    def verify(self, layer: int, step: Step, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
               conv: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Outputs ``[n, H, V]`` of the rows' tokens; leaves ``conv``/``state`` after each row's last token."""
        out = torch.empty(qkv.shape[0], *state.shape[1:-2], state.shape[-1], dtype=torch.float32, device=qkv.device)
        self._start(layer, step, qkv, f, b, conv, state)
        keep = self._keeper(layer)
        run_positions(step, qkv, f, b, conv, state, self.starts, self.lens, out, keep)
        return out

    def commit(self, num_accepted: list[int], snapshots: list[tuple[int, int, int]] = ()) -> None:
        """Leave row i's state after ``1 + num_accepted[i]`` tokens in the pool. ``snapshots``: (row i, position
        j <= num_accepted[i], pool row) copies of row i's state after its token j (a prefix-cache snapshot at a
        block boundary inside the accepted window)."""
        if self.committed:
            raise RuntimeError("a speculative step was committed twice")
        bad = [i for i, (a, n) in enumerate(zip(num_accepted, self.lens)) if not 0 <= a < n]
        if len(num_accepted) != len(self.lens) or bad:
            raise ValueError(f"num_accepted: need one count in [0, lens[i]) per row, got {num_accepted}")
        if any(not 0 <= j <= num_accepted[i] for i, j, _ in snapshots):
            raise ValueError(f"snapshots: positions must lie in the accepted window, got {snapshots}")
        self.committed = True
        self._commit(num_accepted, list(snapshots))

    def _write(self, layer: int, rows: list[int], conv: torch.Tensor, state: torch.Tensor,
               dst_rows: list[int] | None = None) -> None:
        if not rows:
            return
        dst = torch.tensor(dst_rows or [self.pool_rows[i] for i in rows], device=state.device)
        self.caches.kda_conv[layer].index_copy_(0, dst, conv.to(self.caches.kda_conv[layer].dtype))
        self.caches.kda_state[layer].index_copy_(0, dst, state)

    def _start(self, layer, step, qkv, f, b, conv, state) -> None:  # noqa: ANN001
        pass

    def _keeper(self, layer: int):  # noqa: ANN202
        return None

    def _commit(self, num_accepted: list[int], snapshots: list[tuple[int, int, int]]) -> None:
        raise NotImplementedError


class ReplayRollback(Rollback):
    """The reference: checkpoint, then replay the accepted tokens through the decode step on commit."""

    name = "replay"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._saved: dict[int, tuple] = {}  # layer -> (step, qkv, f, b, conv0, state0)

    def _start(self, layer, step, qkv, f, b, conv, state) -> None:  # noqa: ANN001
        self._saved[layer] = (step, qkv.clone(), f.clone(), b.clone(), conv.clone(), state.clone())

    def _commit(self, num_accepted: list[int], snapshots: list[tuple[int, int, int]]) -> None:
        lens = [1 + a for a in num_accepted]
        for layer, (step, qkv, f, b, conv, state) in self._saved.items():
            def keep(j, act, cs, st, layer=layer):  # noqa: ANN001, ANN202
                for i, at, dst in snapshots:
                    if at == j:
                        k = act.index(i)
                        self._write(layer, [i], cs[k:k + 1], st[k:k + 1], [dst])

            run_positions(step, qkv, f, b, conv, state, self.starts, lens, keep=keep if snapshots else None)
            self._write(layer, list(range(len(lens))), conv, state)
        self._saved.clear()


class SlotsRollback(Rollback):
    """Per-position state slots written during verification; commit is a copy of slot ``num_accepted``."""

    name = "slots"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (conv, state) [R, T-1, ...]

    def _keeper(self, layer: int):  # noqa: ANN202
        last = max(self.lens, default=1) - 1
        if last == 0:  # every row has k = 0: the live state is the committed state, nothing to keep
            return None

        def keep(j: int, act: list[int], conv: torch.Tensor, state: torch.Tensor) -> None:
            if j == last:  # only rows with the most tokens reach it: that is their live state
                return
            if layer not in self._slots:
                R = len(self.lens)
                self._slots[layer] = (conv.new_empty(R, last, *conv.shape[1:]),
                                      state.new_empty(R, last, *state.shape[1:]))
            sc, ss = self._slots[layer]
            if len(act) == len(self.lens):
                sc[:, j], ss[:, j] = conv, state
            else:
                idx = torch.tensor(act, device=state.device)
                sc[idx, j], ss[idx, j] = conv, state

        return keep

    def _commit(self, num_accepted: list[int], snapshots: list[tuple[int, int, int]]) -> None:
        for layer in self.caches.kda_state:  # before the commit overwrites a live (last-position) state
            for i, j, dst in snapshots:
                if j == self.lens[i] - 1:
                    src = self.pool_rows[i]
                    conv, state = self.caches.kda_conv[layer], self.caches.kda_state[layer]
                    conv[dst], state[dst] = conv[src], state[src]
                else:
                    sc, ss = self._slots[layer]
                    self._write(layer, [i], sc[i, j][None], ss[i, j][None], [dst])
        rows = [i for i, (a, n) in enumerate(zip(num_accepted, self.lens)) if a < n - 1]
        if not rows:
            self._slots.clear()
            return
        for layer, (sc, ss) in self._slots.items():
            idx = torch.tensor(rows, device=ss.device)
            pos = torch.tensor([num_accepted[i] for i in rows], device=ss.device)
            self._write(layer, rows, sc[idx, pos], ss[idx, pos])
        self._slots.clear()


STRATEGIES: dict[str, type[Rollback]] = {"replay": ReplayRollback, "slots": SlotsRollback}
