"""Continuous-batching scheduler: one token budget per step shared by decodes and prefill chunks.

There are no prefill/decode phases (vLLM V1's rule): every request has ``num_computed_tokens`` chasing
``num_tokens``, and each step hands out tokens so that it catches up, within ``max_num_batched_tokens``.
Running requests are served first in FCFS order; when one cannot get the MLA blocks it needs, the most
recently arrived running request is preempted by recompute (its blocks and slot go back, its outputs are
kept and re-fed later). Waiting requests are admitted in FCFS order while a running slot and the blocks of
their first chunk are available (admission by memory), after a prefix-cache match.

With prefix caching on, prefill chunks end on snapshot positions (the block-aligned end of the prompt, the
boundary before it when the prompt ends on one, and every ``state_cache_interval`` tokens) so that the KDA state after the chunk is exactly the state at that
position; decoding requests keep one pending snapshot at their latest block boundary, published when they
leave (the state a follow-up turn of the conversation resumes from).

Prefill/decode disaggregation (``engine/pd``): a ``prefill_only`` request is *held* after its first token
(off the running list, keeping its slot and blocks) until the decode side acknowledges the hand-off; on the
decode side an import is held from its reservation until its manifest arrives. Held requests count against
``max_num_seqs`` like running ones.

With speculative decoding (``speculator`` set), every decode row is a verify row: its last sampled token and
the drafts the speculator proposes (possibly none). The forward's rollback commits the accepted ones;
``update`` then advances the request by 1 + accepted tokens, appends the accepted drafts and the token after
them, and gives back the MLA blocks past the committed tokens. A verify window that reaches a block boundary
snapshots the state there (the rollback copies it at the commit) only if the accepted tokens reach it.
"""

from __future__ import annotations

from collections import deque

from k3serve.engine.block_pool import BlockPool
from k3serve.engine.prefix_cache import PrefixCache, PrefixMatch
from k3serve.engine.request import Batch, Request, RequestStatus
from k3serve.engine.spec.speculator import Speculator
from k3serve.engine.state_pool import StatePool


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, state_cache_interval: int,
                 blocks: BlockPool, states: StatePool, cache: PrefixCache, speculator: Speculator | None = None):
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.interval = state_cache_interval
        self.blocks, self.states, self.cache = blocks, states, cache
        self.block_size = blocks.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # status HELD: hand-offs pinned on the prefill side, imports pending
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_admitted_tokens = 0  # tokens of admitted requests (prefix-cache queries)
        self.num_hit_tokens = 0
        self.num_computed_tokens = 0  # tokens fed to the model, all steps
        self.speculator = speculator
        self.num_spec_rows = 0  # decode rows verified (k = 0 included)
        self.num_draft_tokens = 0  # drafts proposed and verified
        self.num_accepted_tokens = 0  # drafts accepted

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch, budget = Batch(), self.token_budget
        preemptions_before = self.num_preemptions
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            drafts = self._drafts(req, budget)
            n = self._chunk(req, budget) if drafts is None else 1 + len(drafts)
            if not self._make_room(req, n):
                break
            self._schedule(batch, req, n, drafts)
            budget -= n
        while (self.waiting and budget > 0 and self.num_preemptions == preemptions_before
               and self.has_room() and self._admit(batch, self.waiting[0], budget)):
            budget -= batch.num_new_tokens[-1]
        return batch

    def update(self, batch: Batch, sampled: list[int | None], accepted: list[list[int]] | None = None) -> list[int]:
        """Account for a finished forward: advance lengths, cache full blocks, publish snapshots, append the
        sampled tokens (after a verify row's ``accepted`` drafts) and finish the requests that hit a token-level
        stop. Returns the number of tokens appended per row."""
        appended = []
        for src, _ in batch.state_copies:
            self.states.release(src)
        for (_, slot), key in zip(batch.snapshots, batch.snapshot_keys):
            if key is not None:
                self.states.publish(slot, key)
        for i, (req, n, token) in enumerate(zip(batch.requests, batch.num_new_tokens, sampled)):
            drafts = batch.drafts[i]
            if drafts is None:
                new, computed = ([] if token is None else [token]), n
            else:
                new = [*accepted[i], token]
                computed = len(new)  # the row's last token and the accepted drafts are in the caches now
                self.num_spec_rows += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(accepted[i])
                self._settle_snapshot(batch, i, req.num_computed_tokens + computed)
            req.num_computed_tokens += computed
            self.num_computed_tokens += computed
            reason, before = None, req.num_tokens
            for t in new:
                req.token_ids.append(t)
                if req.prefill_only:  # the decode side applies the stop rules to this token
                    continue
                reason = stop_reason(req)
                if reason is not None:
                    break
            appended.append(req.num_tokens - before)
            self.cache.cache_blocks(req)
            if req.prefill_only and new:
                self._hold(req)
            elif reason is not None:
                self.finish(req, reason)
            elif drafts is not None:
                self._trim_blocks(req)
        return appended

    def _settle_snapshot(self, batch: Batch, i: int, end: int) -> None:
        """A verify row's boundary snapshot is the request's pending one only if the window was accepted up to
        the boundary (the model runner copied the state then); a fresh slot is given back otherwise."""
        plan = batch.spec_snapshots.get(i)
        if plan is None:
            return
        slot, at, fresh = plan
        if end >= at:
            batch.requests[i].pending_snapshot = (slot, at)
        elif fresh:
            self.states.free_snapshot(slot)

    def _trim_blocks(self, req: Request) -> None:
        """Give back the blocks past the committed tokens (rejected drafts' latents are dropped with them)."""
        keep = -(-req.num_computed_tokens // self.block_size)
        if len(req.block_ids) > keep:
            self.blocks.release(req.block_ids[keep:])
            del req.block_ids[keep:]

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is RequestStatus.HELD:
            del self.held[req.request_id]
            self._release(req)
        else:
            self.waiting.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        del self.requests[req.request_id]
        if self.speculator is not None:  # seat back to a model drafter, output to suffix's response cache
            self.speculator.finished(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def has_room(self) -> bool:
        """Whether one more request may hold a running slot now."""
        return len(self.running) + len(self.held) < self.max_num_seqs

    def hold_import(self, req: Request) -> None:
        """Track a decode-side import whose slot and blocks the caller has reserved (``req.slot``,
        ``req.block_ids``) until ``resume`` or ``finish``."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self._hold(req)

    def resume(self, req: Request) -> None:
        """A held import whose caches are filled joins the running requests (it decodes from the next step)."""
        del self.held[req.request_id]
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _hold(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        req.status = RequestStatus.HELD
        self.held[req.request_id] = req

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to compute for ``req`` now: what is left, within the budget, ending on a snapshot point."""
        n = min(req.extend_len, budget)
        point = self._next_checkpoint(req)
        return n if point is None else min(n, point - req.num_computed_tokens)

    def _next_checkpoint(self, req: Request) -> int | None:
        c, target = req.num_computed_tokens, req.prefill_target
        if not self.cache.enabled or c >= target:
            return None
        # the block-aligned end serves longer prompts that extend this one; when the prompt itself ends on a
        # boundary, an exact repeat can use only up to target - 1 (a hit leaves one token to sample from), so
        # the boundary before it is a checkpoint too
        points = [target // self.block_size * self.block_size, (target - 1) // self.block_size * self.block_size]
        if self.interval:
            points.append((c // self.interval + 1) * self.interval)
        points = [p for p in points if p > c]
        return min(points) if points else None

    def _make_room(self, req: Request, n: int) -> bool:
        """Preempt from the tail of ``running`` until ``req``'s next ``n`` tokens fit; False if ``req`` itself
        had to go."""
        while self._blocks_needed(req, n) > self.blocks.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _blocks_needed(self, req: Request, n: int) -> int:
        return -(-(req.num_computed_tokens + n) // self.block_size) - len(req.block_ids)

    def _drafts(self, req: Request, budget: int) -> list[int] | None:
        """A decode row's drafts with speculation on (possibly none); None for prefill rows or speculation off."""
        if self.speculator is None or req.num_computed_tokens < req.prefill_target or req.extend_len != 1:
            return None
        k = self.speculator.limit(req, budget, len(self.running))
        drafts = self.speculator.propose(req, k)
        if drafts and self._blocks_needed(req, 1 + len(drafts)) > self.blocks.num_free:
            drafts = []  # drafts never cost a preemption
        return drafts

    def _schedule(self, batch: Batch, req: Request, n: int, drafts: list[int] | None = None) -> None:
        need = self._blocks_needed(req, n)
        if need > 0:
            req.block_ids += self.blocks.allocate(need)
        batch.add(req, n, drafts)
        if drafts is None:
            self._plan_snapshot(batch, req, req.num_computed_tokens + n)
        else:
            self._plan_verify_snapshot(batch, req, req.num_computed_tokens, n)

    def _plan_verify_snapshot(self, batch: Batch, req: Request, start: int, n: int) -> None:
        """A verify window ``[start, start + n)`` reaching a block boundary: a snapshot at the last one, taken at
        the commit if the accepted tokens reach it."""
        end = (start + n) // self.block_size * self.block_size
        if not self.cache.enabled or end <= start:
            return
        fresh = req.pending_snapshot is None
        slot = self.states.allocate_snapshot() if fresh else req.pending_snapshot[0]
        if slot is not None:
            batch.spec_snapshots[len(batch) - 1] = (slot, end, fresh)

    def _plan_snapshot(self, batch: Batch, req: Request, end: int) -> None:
        """Prefill chunk ending on a checkpoint: a new snapshot, published after the step. Decode reaching a
        block boundary: overwrite the request's pending snapshot (published when the request leaves)."""
        if not self.cache.enabled or end % self.block_size:
            return
        if end <= req.prefill_target:
            if end != self._next_checkpoint(req):
                return
            key = self.cache.snapshot_key(req, end)
            if key in self.states.snapshot_of:
                return
            slot = self.states.allocate_snapshot()
            if slot is not None:
                batch.snapshots.append((req.slot, slot))
                batch.snapshot_keys.append(key)
            return
        slot = req.pending_snapshot[0] if req.pending_snapshot else self.states.allocate_snapshot()
        if slot is not None:
            req.pending_snapshot = (slot, end)
            batch.snapshots.append((req.slot, slot))
            batch.snapshot_keys.append(None)

    def _admit(self, batch: Batch, req: Request, budget: int) -> bool:
        # prompt logprobs need the logits of every prompt position, so such requests never hit
        hit = PrefixMatch() if req.wants_prompt_logprobs else self.cache.match(req)
        hit_tokens, hit_blocks = hit.num_tokens, list(hit.blocks)
        newly_held = sum(self.blocks.ref_count[b] == 0 for b in hit_blocks)
        req.num_computed_tokens, req.prefill_target = hit_tokens, req.num_tokens
        n = self._chunk(req, budget)
        if -(-(hit_tokens + n) // self.block_size) - len(hit_blocks) > self.blocks.num_free - newly_held:
            req.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        self.blocks.acquire(hit_blocks)
        req.block_ids, req.num_registered_blocks = hit_blocks, len(hit_blocks)
        req.slot = self.states.allocate_running()
        if hit_tokens:
            self.states.acquire(hit.snapshot_slot)
            batch.state_copies.append((hit.snapshot_slot, req.slot))
        if not req.num_preemptions:
            # usage's cached prompt tokens: a recompute's hit also covers the request's own outputs, so only
            # the first admission says how much of the prompt the cache served (vLLM counts it the same way)
            req.num_prefix_hit_tokens = hit_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.num_admitted_tokens += req.num_tokens
        self.num_hit_tokens += hit_tokens
        self._schedule(batch, req, n)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req.pending_snapshot is not None:
            slot, pos = req.pending_snapshot
            if pos <= req.num_tokens:
                self.states.publish(slot, self.cache.snapshot_key(req, pos))
            else:  # a stop inside an accepted window cut the tokens the snapshot was taken after
                self.states.free_snapshot(slot)
            req.pending_snapshot = None
        self.blocks.release(req.block_ids)
        req.block_ids, req.num_registered_blocks = [], 0
        self.states.free_running(req.slot)
        req.slot = None


def stop_reason(req: Request) -> str | None:
    """Token-level stop after ``req``'s newest token: ``"stop"`` (EOS / stop id), ``"length"`` or None."""
    p, token = req.params, req.token_ids[-1]
    if req.num_output_tokens > p.min_tokens:  # the sampler masks these ids before that
        if not p.ignore_eos and token in req.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= req.max_model_len:
        return "length"
    return None
