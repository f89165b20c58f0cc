"""Batch -> ``StepInputs`` -> forward (on every tp rank) -> batched sampler (rank 0).

For a ``Batch`` of B requests with ``num_new_tokens[i]`` tokens each (N in all):
  input_ids ``[N]`` (request i's tokens ``cached_lens[i] : cached_lens[i] + num_new_tokens[i]``),
  cu_seqlens ``[B+1]``, state_slots ``[B]``, block_tables ``[B, max_blocks]`` (-1 padded).
KDA slot copies listed by the batch are done before (prefix hits) and after (snapshots) the forward, over
every KDA layer's state and conv tensors. Slots are logical: ``StateRows`` first moves the batch's states to
the leading cache rows, so ``state_slots`` is ``0..B-1`` and the layers update the states in place. Models
with a vision tower also get ``image_embeds [n, d]``, one row per placeholder position of the batch
(``multimodal.ImageEmbedder``). Logits are computed only for rows that sample, plus every prompt position of
requests that asked for prompt logprobs. The logits processors of the sampling rows are prepared before the
forward (their work overlaps it) and applied by the sampler. ``run`` is rank 0's step; a worker rank calls
``execute`` with the inputs rank 0 broadcast (``engine/worker.py``).

Speculative decoding (``rollback`` set; one rank only): the batch's decode rows feed their last token and their
drafts; the KDA layers run them under a ``spec.rollback`` strategy, logits are computed at each of their
positions, ``spec.rejection.verify_drafts`` picks the accepted drafts and the next token, and the rollback
commits the state after the accepted tokens before any snapshot copy reads it.

CUDA graphs (``graphs`` set, a ``graph_runner.GraphRunner``): a plain decode step it accepts replays its
bucket's graph instead of the eager forward (same copies and settle before and after); the rest run eager.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
from torch import nn

from k3serve.core.context import ForwardContext, ModelCaches, forward_context
from k3serve.engine.eplb_schedule import ExpertRebalancer
from k3serve.engine.multimodal import ImageEmbedder
from k3serve.engine.request import Batch
from k3serve.engine.sampler import sample, token_logprobs
from k3serve.engine.spec.rejection import accept_greedy, cut_at_stop, is_plain_greedy, verify_drafts
from k3serve.engine.spec.rollback import STRATEGIES, Rollback
from k3serve.engine.state_rows import StateRows
from k3serve.engine.step_inputs import StepInputs


@dataclass
class StepResult:
    sampled: list[int | None]  # per batch row; None when the request did not reach its last token
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)  # per row, this chunk
    accepted: list[list[int]] = field(default_factory=list)  # per row: accepted drafts, emitted before sampled
    accepted_logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` for a list of Python ints, through the buffer protocol (~7x faster for the
    thousands of ids and block-table entries a step packs)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.long).to(device)


class ModelRunner:
    def __init__(self, model: nn.Module, caches: ModelCaches, device: torch.device | str = "cpu", *,
                 placeholder_id: int | None = None, group=None,
                 rollback: str | type[Rollback] | None = None, eplb: tuple[int, int] = (0, 0),
                 capture_layers: tuple[int, ...] = ()):
        self.model = model
        self.eplb = ExpertRebalancer(model, *eplb)  # (interval, redundant): every rank counts its forwards
        # eagle3 speculation: these layers' hidden states at the sampling positions go to the requests
        self.capture_layers = tuple(capture_layers)
        self.group = group  # a TPGroup when this is rank 0 of several: each step is broadcast before it runs
        # speculative decoding's state rollback strategy (a name in spec.rollback.STRATEGIES, or a class)
        self.rollback = STRATEGIES[rollback] if isinstance(rollback, str) else rollback
        if self.rollback is not None and group is not None:
            raise ValueError("speculative decoding runs on one rank only for now (--tensor-parallel-size 1)")
        self.caches = caches
        self.device = torch.device(device)
        kda = [*caches.kda_state.values(), *caches.kda_conv.values()]
        self.state_rows = StateRows(kda[0].shape[0] if kda else 0, kda)
        # models with a vision tower get image embeddings scattered into their placeholder positions
        vision = placeholder_id is not None and hasattr(model, "vision_tower")
        self.images = ImageEmbedder(model, placeholder_id) if vision else None
        self.graphs = None  # a GraphRunner when decode steps replay captured graphs (set by the engine)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = long_tensor(self.state_rows.rows([s for s, _ in pairs]), self.device)
        dst = long_tensor(self.state_rows.rows([d for _, d in pairs]), self.device)
        for cache in (*self.caches.kda_state.values(), *self.caches.kda_conv.values()):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def inputs(self, batch: Batch, plain: list[int], verify: list[int]) -> StepInputs:
        """The batch as ids (rank 0 only: it reads the requests), for every tp rank to run. Logits rows: the
        last position of each ``plain`` sampling row, then every position of each ``verify`` row."""
        ids: list[int] = []
        for req, start, n, drafts in zip(batch.requests, batch.cached_lens, batch.num_new_tokens, batch.drafts):
            if drafts is None:
                ids += req.token_ids[start:start + n]
            else:
                ids += req.token_ids[start:start + n - len(drafts)]
                ids += drafts
        width = max(len(r.block_ids) for r in batch.requests)
        tables: list[int] = []
        for r in batch.requests:
            tables += r.block_ids
            tables += [-1] * (width - len(r.block_ids))
        cu = [0]
        for n in batch.num_new_tokens:
            cu.append(cu[-1] + n)
        spans = []
        for i, req in enumerate(batch.requests):
            start, n = batch.cached_lens[i], batch.num_new_tokens[i]
            num = min(start + n, req.num_prompt_tokens - 1) - start  # positions whose next token is prompt
            if req.wants_prompt_logprobs and num > 0:
                spans.append((cu[i + 1] - n, num))
        picks = [cu[i + 1] - 1 for i in plain]
        for i in verify:
            picks += range(cu[i + 1] - batch.num_new_tokens[i], cu[i + 1])
        embeds = None
        if self.images is not None:
            embeds = self.images(batch.requests, batch.cached_lens, batch.num_new_tokens)
        return StepInputs(ids, cu, list(batch.cached_lens), [r.slot for r in batch.requests], tables, width,
                          list(batch.state_copies), list(batch.snapshots), picks, spans, embeds)

    def context(self, s: StepInputs, rollback=None) -> ForwardContext:
        # the layout goes to the device once and stays on the host too: nothing reads it back
        rows = self.state_rows.rows(s.slots)
        return ForwardContext(cu_seqlens=long_tensor(s.cu_seqlens, self.device), cached_lens=s.cached_lens,
                              state_slots=long_tensor(rows, self.device),
                              block_tables=long_tensor(s.block_tables, self.device).view(len(s.slots), s.width),
                              caches=self.caches, host_cu_seqlens=s.cu_seqlens, host_state_slots=rows,
                              spec=rollback(rows) if rollback is not None else None,
                              capture=dict.fromkeys(self.capture_layers) if self.capture_layers else None)

    @torch.inference_mode()
    def execute(self, s: StepInputs, rollback=None, settle=None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Run one step on this rank's caches: (logits of ``logit_rows``, logits of each prompt span). Every
        tp rank calls this with the same inputs; only rank 0 uses the logits. Rank 0's ``rollback(rows)``
        makes the step's speculative rollback and ``settle(ctx, logits)`` samples (and commits the rollback)
        before the snapshot copies read the states."""
        self.copy_slots(s.copies_before)
        self.state_rows.arrange(s.slots)
        if rollback is None and self.graphs is not None and self.graphs.accepts(s):
            logits, ctx = self.graphs.run(s, self.state_rows.rows(s.slots))
            return self._finish(s, logits if s.logit_rows else None, [], ctx, settle)
        ctx = self.context(s, rollback)
        with forward_context(ctx):
            input_ids = long_tensor(s.input_ids, self.device)
            if s.image_embeds is None:
                hidden = self.model(input_ids, ctx)
            else:
                hidden = self.model(input_ids, ctx, image_embeds=s.image_embeds.to(self.device))
            logits = self.model.compute_logits(hidden[s.logit_rows]) if s.logit_rows else None
            spans = [self.model.compute_logits(hidden[first:first + num]) for first, num in s.prompt_spans]
        return self._finish(s, logits, spans, ctx, settle)

    def _finish(self, s: StepInputs, logits: torch.Tensor | None, spans: list[torch.Tensor], ctx: ForwardContext,
                settle) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if settle is not None:
            settle(ctx, logits)
        self.copy_slots(s.copies_after)
        self.eplb.after_step()
        return logits, spans

    def _rollback(self, batch: Batch, slots: list[int]) -> Rollback | None:
        rows = batch.spec_rows if self.rollback is not None else []
        if not rows:
            return None
        return self.rollback(self.caches, rows, [batch.num_new_tokens[i] for i in rows], [slots[i] for i in rows])

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepResult:
        rows = [i for i in range(len(batch)) if batch.samples(i)]
        spec = set(batch.spec_rows) if self.rollback is not None else set()
        plain = [i for i in rows if i not in spec]
        for i in rows:  # processors start their work (grammar masks) now, to overlap the forward
            req = batch.requests[i]
            if req.logits_processor is not None:
                req.logits_processor.prepare(req.output_token_ids)
        s = self.inputs(batch, plain, sorted(spec))
        if self.group is not None:
            self.group.send_step(s)
        n = len(batch)
        out = StepResult([None] * n, [None] * n, [], [[] for _ in range(n)], [None] * n)

        def settle(ctx: ForwardContext, logits: torch.Tensor | None) -> None:
            if plain:
                result = sample(logits[:len(plain)], [batch.requests[i] for i in plain])
                for j, i in enumerate(plain):
                    out.sampled[i], out.logprobs[i] = result.tokens[j], result.logprobs[j]
            if ctx.spec is not None:
                self._verify(batch, len(plain), ctx, logits, out)
            if ctx.capture is not None:
                self._keep_features(batch, plain, s.logit_rows, ctx, out)

        _, span_logits = self.execute(s, (lambda slots: self._rollback(batch, slots)) if spec else None, settle)
        out.prompt_logprobs = self._prompt_logprobs(batch, span_logits)
        return out

    def _verify(self, batch: Batch, at: int, ctx: ForwardContext, logits: torch.Tensor, out: StepResult) -> None:
        """The verify rows' accepted drafts and next token (logits rows from ``at`` on), then the commit."""
        first = at
        # one greedy pick over every verify position serves the plain greedy rows (most rows, usually);
        # max(...).indices (the first maximum, as argmax) is ~2.5x faster than argmax on CPU over [k+1, 163840]
        # (benchmarks/spec_step_cost.py)
        targets = logits[at:].max(dim=-1).indices.tolist()
        for i in ctx.spec.rows:
            T, req = batch.num_new_tokens[i], batch.requests[i]
            if is_plain_greedy(req):
                tokens, lps = cut_at_stop(req, accept_greedy(targets[at - first:at - first + T], batch.drafts[i])), None
            else:
                tokens, lps = verify_drafts(logits[at:at + T], req, batch.drafts[i])
            at += T
            out.accepted[i], out.sampled[i] = tokens[:-1], tokens[-1]
            if lps is not None:
                out.accepted_logprobs[i], out.logprobs[i] = lps[:-1], lps[-1]
        # a verify row's boundary snapshot only when its accepted tokens reach the boundary
        index = {i: k for k, i in enumerate(ctx.spec.rows)}
        snaps = [(index[i], pos - batch.cached_lens[i] - 1, self.state_rows.rows([slot])[0])
                 for i, (slot, pos, _) in batch.spec_snapshots.items()
                 if batch.cached_lens[i] + 1 + len(out.accepted[i]) >= pos]
        ctx.spec.commit([len(out.accepted[i]) for i in ctx.spec.rows], snaps)

    def _keep_features(self, batch: Batch, plain: list[int], logit_rows: list[int], ctx: ForwardContext,
                       out: StepResult) -> None:
        """Each sampling row's captured hidden features at the position that produced its sampled token."""
        feats = torch.cat([ctx.capture[i][logit_rows] for i in self.capture_layers], dim=-1).float()
        for j, i in enumerate(plain):
            batch.requests[i].spec_features = (batch.cached_lens[i] + batch.num_new_tokens[i] - 1, feats[j])
        at = len(plain)
        for i in (ctx.spec.rows if ctx.spec is not None else ()):
            a = len(out.accepted[i])
            batch.requests[i].spec_features = (batch.cached_lens[i] + a, feats[at + a])
            at += batch.num_new_tokens[i]

    def _prompt_logprobs(self, batch: Batch, span_logits: list[torch.Tensor]) -> list[list[dict[int, float]] | None]:
        """Logprob of each next prompt token at every prompt position this chunk computed (``inputs`` made
        one span per request that wants them, in batch order)."""
        out: list[list[dict[int, float]] | None] = [None] * len(batch)
        spans = iter(span_logits)
        for i, req in enumerate(batch.requests):
            start, n = batch.cached_lens[i], batch.num_new_tokens[i]
            num = min(start + n, req.num_prompt_tokens - 1) - start
            if not req.wants_prompt_logprobs or num <= 0:
                continue
            targets = req.prompt_token_ids[start + 1:start + 1 + num]
            out[i] = token_logprobs(next(spans), targets, [req.params.prompt_logprobs] * num)
        return out
