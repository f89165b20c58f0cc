"""Offline API, as in vLLM::

    from k3serve import LLM, SamplingParams
    llm = LLM(model="kimi-linear-tiny-random", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason

Prompts are strings (encoded with the Kimi tokenizer) or token-id lists; ``params`` is one
``SamplingParams`` for all prompts or a list with one per prompt. ``n > 1`` runs n sequences per prompt
(``fan_out``). Text, stop strings and the finish reason come from one ``SequenceDecoder`` per sequence; a
stop string aborts the sequence in the engine at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.detokenizer import SequenceDecoder
from k3serve.engine.engine import LLMEngine, load_tokenizer
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.outputs import CompletionGroup, RequestOutput
from k3serve.engine.sampling_params import SamplingParams, fan_out
from k3serve.engine.stats import EngineStats

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str | Path, *, dtype: str | torch.dtype = "float32", tokenizer: Any | None = "auto",
                 device: str = "cpu", **engine_kwargs: Any):
        fields = EngineConfig.__dataclass_fields__
        unknown = sorted(set(engine_kwargs) - set(fields))
        if unknown:
            raise ValueError(f"{unknown[0]}: not an engine option (known: {', '.join(fields)})")
        self.tokenizer = load_tokenizer() if tokenizer == "auto" else tokenizer
        self.engine = LLMEngine(model, config=EngineConfig(**engine_kwargs), dtype=parse_dtype(dtype),
                                device=device)
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 images: Sequence[Sequence[ImageInput]] | None = None) -> list[CompletionGroup]:
        """``images``: per prompt, the ``ImageInput``s filling its media placeholder spans."""
        prompts = self._as_list(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ilist = [()] * len(prompts) if images is None else list(images)
        if len(ilist) != len(prompts):
            raise ValueError(f"images: got {len(ilist)} image lists for {len(prompts)} prompts")
        if self.tokenizer is None and any(p.stop for p in plist):
            raise ValueError("stop: stop strings need a tokenizer (k3serve.tokenizer is not available)")
        groups: list[tuple[str, list[int], list[str]]] = []
        decoders: dict[str, SequenceDecoder] = {}
        for prompt, p, imgs in zip(prompts, plist, ilist):
            ids = self._encode(prompt)
            gid = str(next(self._ids))
            samples = fan_out(gid, p)
            for rid, sp in samples:
                self.engine.add_request(rid, ids, sp, images=imgs)
                if self.tokenizer is not None:
                    decoders[rid] = self._decoder(sp)
            groups.append((gid, ids, [rid for rid, _ in samples]))
        done = self._run_to_completion(decoders)
        return [CompletionGroup(gid, ids, [done[r] for r in sub]) for gid, ids, sub in groups]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _decoder(self, p: SamplingParams) -> SequenceDecoder:
        tok = self.tokenizer
        skip = frozenset(tok.special_tokens.values()) if p.skip_special_tokens else frozenset()
        return SequenceDecoder(tok.decode_bytes, stop=p.stop, include_stop=p.include_stop_str_in_output,
                               skip_ids=skip, eos_ids=self.engine.eos_token_ids)

    def _run_to_completion(self, decoders: dict[str, SequenceDecoder]) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            if not outs and self.engine.stats().num_running == 0:
                raise RuntimeError("the engine made no progress (a waiting request cannot be scheduled)")
            for o in outs:
                dec = decoders.get(o.request_id)
                if dec is not None:
                    dec.push(o.delta_token_ids, o.finished, o.finish_reason, o.stop_reason)
                    if dec.done and not o.finished:  # a stop string: end the sequence before the next step
                        o = self.engine.abort_request(o.request_id)
                    if o.finished:
                        o = replace(o, text=dec.text, finish_reason=dec.finish_reason, stop_reason=dec.stop_reason)
                if o.finished:
                    done[o.request_id] = o
        return done

    @staticmethod
    def _as_list(prompts: Any) -> list[str | list[int]]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return prompts

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: string prompts need a tokenizer (k3serve.tokenizer is not available); "
                                 "pass token ids")
            ids = [int(t) for t in self.tokenizer.encode(prompt)]
            bad = [t for t in ids if t >= self.engine.vocab_size]
            if bad:
                raise ValueError(f"prompt: {prompt[:40]!r} encodes to token id {bad[0]}, outside this model's "
                                 f"vocabulary of {self.engine.vocab_size}")
            return ids
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: token-id prompts must be lists of ints")
        return list(prompt)
