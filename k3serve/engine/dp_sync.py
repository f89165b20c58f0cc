"""Lockstep of the data-parallel engine cores when the experts span them (``ParallelLayout.lockstep``).

With ``-dp D -tp T --enable-expert-parallel`` the D engine cores (world ranks 0, T, 2T, ...) each schedule
their own requests, but every forward's MoE layers exchange tokens over all D*T ranks: a core that skips a
forward while another runs one leaves that one waiting in an all_to_all forever. So while any core has work,
every core runs one forward per iteration: its own batch, or ``LLMEngine.dummy_step`` (one token in the
reserved dummy block and slot, touching no request's KDA state, conv rows or MLA blocks).

The protocol, per iteration of every core's loop (``engine/core.py``):

  1. wait for client messages: 0 ms when the last reduction said "busy", else up to the 1 s heartbeat;
  2. take the messages in (new requests, aborts; a ``Wake`` carries nothing);
  3. ``any_work``: all-reduce (sum) of ``has_unfinished_requests()`` over the D cores (a gloo group of the
     leaders only);
  4. if the sum is > 0: one forward: ``engine.step()``, or ``dummy_step()`` when nothing was scheduled.

Why it cannot deadlock: every core runs exactly one ``any_work`` per iteration, and after it a forward if and
only if the reduced sum is > 0. The sum is the same number on every core, so the k-th iteration makes the same
collectives, in the same order, on every rank of the world (the tp workers run what their leader broadcasts).
Collectives therefore always pair up; what remains is progress: between two collectives a core only waits in
step 1, which is bounded by the heartbeat (a core that got a request reaches step 3 at once and waits there at
most one heartbeat for the others). To cut that wait the client (``engine/dp_client.py``) sends ``Wake`` to
every other core whenever it hands a request to one, so the idle cores leave step 1 within milliseconds.
Requests arriving mid-wave, aborts, preemption, prefix hits and a core finishing early only change what step 4
runs on one core (its batch or a dummy), never whether it runs. This is vLLM's "DP wave" idea without its wave
numbers: those exist because vLLM's idle engines stop taking part; here an idle core keeps doing one tiny
all-reduce per heartbeat, so there is no start-of-wave race to order.

A rank that dies makes the next collective fail (``RankLost``) or time out (``K3SERVE_DIST_TIMEOUT_S``); the
world cannot re-form around one replica, so the client gives the whole server up (no per-replica restart).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DPSync:
    """The leaders' reduction (``group``: a gloo group of the D engine cores)."""

    def __init__(self, group):
        self.group = group

    def any_work(self, has_work: bool) -> bool:
        """Whether any core has unfinished requests; every core must call this once per loop iteration."""
        from k3serve.engine.tp_group import RankLost

        t = torch.tensor([int(has_work)], dtype=torch.long)
        try:
            dist.all_reduce(t, group=self.group)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise RankLost(f"a data-parallel engine core is gone: {e}".splitlines()[0]) from e
        return int(t) > 0
