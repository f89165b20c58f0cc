"""``LLMEngine``: the synchronous engine core. ``step()`` = schedule a batch, run it, account for it, emit.

Construction loads the model, sizes the MLA block pool and the KDA slot pool from one cache budget (the
split is logged), and wires scheduler, prefix cache and model runner. Split over tensor-parallel ranks, every
rank builds the same engine (with ``par``, its place, and ``group``, the step channel): the ranks agree on the
smallest cache plan, rank 0 schedules and broadcasts each step, the others only execute (``engine/worker.py``).
One MLA block and one KDA slot beyond the pools are the dummy step's (``dummy_step``). The engine handles token ids only:
text (and stop strings) are its clients' job, through ``engine/detokenizer.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3serve.core.config import ModelConfig
from k3serve.core.distributed import SINGLE, Parallel
from k3serve.engine.block_pool import BlockPool
from k3serve.engine.config import EngineConfig, check_device
from k3serve.engine.logits_processor import LogitsProcessor
from k3serve.engine.memory import CachePlan, fitting_model_len, keep_freed_memory, plan_cache, resolve_budget
from k3serve.engine.model_runner import ModelRunner, StepResult
from k3serve.engine.multimodal import ImageInput, check_images
from k3serve.engine.outputs import RequestOutput
from k3serve.engine.prefix_cache import HybridPrefixCache, NoPrefixCache
from k3serve.engine.request import Batch, Request, RequestStatus
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.spec.speculator import Speculator, Target
from k3serve.engine.state_pool import StatePool
from k3serve.engine.step_inputs import StepInputs
from k3serve.engine.tp_group import TPGroup
from k3serve.engine.stats import EngineStats
from k3serve.models.cache import allocate_caches, cache_spec
from k3serve.ops import registry

HELD = RequestStatus.HELD

log = logging.getLogger("k3serve.engine")


def load_tokenizer() -> Any | None:
    """The Kimi tokenizer if ``k3serve.tokenizer`` is importable (its C++ extension is built), else None."""
    try:
        from k3serve.tokenizer import Tokenizer
    except ImportError:
        return None
    return Tokenizer.kimi()


class LLMEngine:
    def __init__(self, model: str | Path | nn.Module, *, config: EngineConfig | None = None,
                 dtype: torch.dtype = torch.float32, model_config: ModelConfig | None = None,
                 device: str = "cpu", par: Parallel = SINGLE, group: TPGroup | None = None):
        """``par``: this rank's place when the model is split over several processes; ``group``: the tp
        group's step channel (rank 0 broadcasts every step on it; a worker's engine only executes)."""
        check_device(device)
        from k3serve.models.loader import load_model, place_model

        model_dir = None if isinstance(model, nn.Module) else model  # a shipped eagle3 head lives there
        if isinstance(model, nn.Module):
            if model_config is None:
                raise ValueError("model_config: required when passing a model object")
            place_model(model, device, dtype)  # in place, like nn.Module.to: the engine runs where its caches are
        else:
            model, model_config = load_model(model, dtype=dtype, progress=False, device=device, par=par)
        registry.post_load(model)  # backends that read weights in their own layout convert them now
        self.config = config = config or EngineConfig()
        if config.retain_freed_memory and torch.device(device).type == "cpu":
            keep_freed_memory()  # process-wide: no page faults on every step's large temporaries
        self.model_config = model_config
        self.par = par  # this rank's place: a hand-off reshards its KDA rows by par.tp (engine/pd/reshard.py)
        text = model_config.text
        self.vocab_size = text.vocab_size
        self.eos_token_ids = tuple(text.eos_token_id)
        declared = text.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > declared:
            raise ValueError(f"max_model_len: {config.max_model_len} is longer than the model's "
                             f"max_position_embeddings ({declared})")
        spec = cache_spec(model, dtype)
        budget = resolve_budget(config.kv_cache_memory, torch.device(device))
        sizes = dict(mla_bytes_per_token=spec.mla_bytes_per_token, kda_bytes_per_slot=spec.kda_bytes_per_slot,
                     block_size=config.block_size, max_running=config.max_num_seqs,
                     snapshot_fraction=config.snapshot_memory_fraction if config.enable_prefix_caching else 0.0)
        self.max_model_len = config.max_model_len
        if self.max_model_len is None:
            # a checkpoint declaring 1M tokens must start with default options: cap to what the cache holds
            fits = fitting_model_len(budget, declared=declared, **sizes)
            self.max_model_len = max(fits, min(declared, config.block_size))  # too small: plan_cache says so
            if self.max_model_len < declared:
                log.warning(f"max_model_len: {self.max_model_len} tokens, not the model's {declared}: that is what "
                            f"a {budget / 2**20:.1f} MiB cache holds for one sequence beside {config.max_num_seqs} "
                            "running slots (more: raise --kv-cache-memory / --gpu-memory-utilization, lower "
                            "--max-num-seqs)")
        self.plan: CachePlan = plan_cache(budget, max_model_len=self.max_model_len, **sizes)
        if group is not None:  # every rank must number the same blocks and slots: the smallest plan wins
            self.plan = agree_plan(self.plan, group)
        log.info(self.plan.report())
        num_slots = config.max_num_seqs + self.plan.num_snapshot_slots
        # one block and one slot beyond what the pools hand out: the dummy step's, so it writes nobody's cache
        self.dummy_block, self.dummy_slot = self.plan.num_blocks, num_slots
        caches = allocate_caches(spec, num_blocks=self.plan.num_blocks + 1, block_size=config.block_size,
                                 num_slots=num_slots + 1, device=device)
        self.blocks = BlockPool(self.plan.num_blocks, config.block_size)
        self.states = StatePool(config.max_num_seqs, self.plan.num_snapshot_slots)
        cache = HybridPrefixCache(self.blocks, self.states, config.hash_key) if config.enable_prefix_caching else NoPrefixCache()
        speculative = config.speculative_config
        speculator = None
        if speculative is not None:
            speculator = Speculator(speculative, Target(model, self.vocab_size, self.max_model_len, dtype, device,
                                                        config.max_num_seqs, model_dir))
        self.scheduler = Scheduler(max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   state_cache_interval=config.state_cache_interval,
                                   blocks=self.blocks, states=self.states, cache=cache, speculator=speculator)
        self.runner = ModelRunner(model, caches, device, placeholder_id=model_config.media_placeholder_token_id,
                                  group=group if group is not None and group.is_leader else None,
                                  rollback=None if speculative is None else speculative.rollback,
                                  eplb=(self.config.eplb_interval, self.config.eplb_redundant_experts),
                                  capture_layers=speculator.capture_layers if speculator is not None else ())
        if config.cuda_graphs != "off":
            self.runner.graphs = self._graph_runner(model, caches, device, par, group)
        self._arrivals = 0
        self.num_steps = 0
        self.num_dummy_steps = 0
        self.num_generated_tokens = 0

    def _graph_runner(self, model: nn.Module, caches, device: str, par: Parallel, group: TPGroup | None):
        """Decode steps through captured graphs (``engine/graph_runner.py``), every bucket captured now; one-line
        refusals for what they do not support."""
        from k3serve.engine.cuda_graphs import check_cuda_graphs
        from k3serve.engine.graph_runner import CudaGraphs, GraphRunner, StandinGraphs

        config = self.config
        if config.cuda_graphs == "on":
            check_cuda_graphs(device)
        if par.sharded or par.ep > 1 or group is not None:
            raise ValueError("cuda_graphs: not supported with tensor, piece or expert parallelism yet (-tp/-ep/"
                             "--tp-pieces > 1): run eager (--enforce-eager)")
        graphs = GraphRunner(model, caches, device, vocab_size=self.vocab_size, dummy_block=self.dummy_block,
                             dummy_row=lambda: self.runner.state_rows.rows([self.dummy_slot])[0],
                             max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs),
                             max_context=min(config.cuda_graph_max_context, self.max_model_len),
                             mechanism=CudaGraphs() if config.cuda_graphs == "on" else StandinGraphs())
        graphs.capture_all()
        return graphs

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that produced tokens or finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.run(batch)
        appended = self.scheduler.update(batch, result.sampled, result.accepted)
        self.num_steps += 1
        return self._process(batch, result, appended)

    def step_or_dummy(self) -> list[RequestOutput]:
        """``step``, or ``dummy_step`` when nothing was scheduled: exactly one forward either way (data-parallel
        cores whose experts are shared step in lockstep: engine/dp_sync.py)."""
        steps = self.num_steps
        outputs = self.step()
        if self.num_steps == steps:
            self.dummy_step()
        return outputs

    def dummy_step(self) -> None:
        """A one-token forward that belongs to no request (an idle data-parallel rank keeps in step with the
        others' collectives): it reads and writes only the reserved dummy block and slot, and samples nothing."""
        s = dummy_inputs(self.dummy_block, self.dummy_slot, self.eos_token_ids[0] if self.eos_token_ids else 0)
        if self.runner.group is not None:
            self.runner.group.send_step(s)
        self.runner.execute(s)
        self.num_dummy_steps += 1

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    images: Sequence[ImageInput] = (), logits_processor: LogitsProcessor | None = None,
                    prefill_only: bool = False) -> Request:
        """Queue a request. ``images`` fill spans of media placeholder ids in the prompt (models with a vision
        tower only); ``logits_processor`` edits this request's logits before each sampling step;
        ``prefill_only`` (prefill role) stops after the first token and holds the caches for ``engine/pd``."""
        self.validate_prompt(prompt_token_ids, params)
        if prefill_only and params.prompt_logprobs is not None:  # the hand-off does not carry them
            raise ValueError("prompt_logprobs: not supported with prefill/decode disaggregation yet")
        if logits_processor is not None and not isinstance(logits_processor, LogitsProcessor):
            raise ValueError("logits_processor: must have prepare(output_token_ids) and apply(logits) methods")
        checked = check_images(images, prompt_token_ids, self.model_config)
        if checked and self.runner.images is None:
            raise ValueError("images: this model object has no vision tower (embed_images)")
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, arrival=self._arrivals, images=checked,
                      logits_processor=logits_processor, prefill_only=prefill_only)
        self._arrivals += 1
        self.scheduler.add(req)
        return req

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]!r} is outside the model vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room in max_model_len="
                             f"{self.max_model_len}")
        if params.n != 1:
            raise ValueError("n: the engine core runs one sequence per request; expand n before adding")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return None if req is None else self._output(req, [])

    @property
    def supports_images(self) -> bool:
        return self.runner.images is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_blocks=self.blocks.num_blocks,
            num_blocks_used=self.blocks.num_used, num_blocks_cached=self.blocks.num_cached,
            num_snapshot_slots=self.states.num_snapshot_slots, num_snapshots=self.states.num_snapshots,
            num_admitted_tokens=s.num_admitted_tokens, num_prefix_hit_tokens=s.num_hit_tokens,
            num_computed_tokens=s.num_computed_tokens, num_generated_tokens=self.num_generated_tokens,
            num_preemptions=s.num_preemptions, num_steps=self.num_steps, num_spec_rows=s.num_spec_rows,
            num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            num_expert_replicas=self.runner.eplb.num_replicas, num_dummy_steps=self.num_dummy_steps)

    def reset_prefix_cache(self) -> None:
        self.blocks.clear_cache()
        self.states.clear_cache()

    def _process(self, batch: Batch, result: StepResult, appended: list[int]) -> list[RequestOutput]:
        outputs = []
        for i, req in enumerate(batch.requests):
            if req.wants_prompt_logprobs:
                record_prompt_logprobs(req, batch.cached_lens[i], result.prompt_logprobs[i] or [])
            if result.sampled[i] is None:
                continue
            n = appended[i]  # a verify row emits its accepted drafts first; a stop may cut them short
            self.num_generated_tokens += n
            if result.logprobs[i] is not None:
                req.logprobs += [*(result.accepted_logprobs[i] or []), result.logprobs[i]][:n]
            outputs.append(self._output(req, req.token_ids[req.num_tokens - n:]))
        return outputs

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=req.output_token_ids,
            delta_token_ids=new_tokens, finished=req.is_finished or req.prefill_only and req.status is HELD,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.wants_prompt_logprobs else None,
            num_cached_tokens=req.num_prefix_hit_tokens)


def record_prompt_logprobs(req: Request, start: int, chunk: list[dict[int, float]]) -> None:
    """Entry ``p`` is the logprob of prompt token ``p`` (None for the first); a recompute after preemption
    produces positions already recorded, which are skipped."""
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
    for k, lp in enumerate(chunk):
        if start + 1 + k == len(req.prompt_logprobs):
            req.prompt_logprobs.append(lp)


def agree_plan(plan: CachePlan, group: TPGroup) -> CachePlan:
    import dataclasses

    num_blocks, num_snapshot_slots = group.agree_min([plan.num_blocks, plan.num_snapshot_slots])
    return dataclasses.replace(plan, num_blocks=num_blocks, num_snapshot_slots=num_snapshot_slots)


def dummy_inputs(block: int, slot: int, token: int) -> StepInputs:
    """One fresh token at position 0 in the reserved block and slot; no copies, no logits."""
    return StepInputs([token], [0, 1], [0], [slot], [block], 1)
