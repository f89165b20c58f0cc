"""Offline API, as in vLLM::

    from k3serve import LLM, SamplingParams
    llm = LLM(model="kimi-linear-tiny-random", dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8))
    outs[0].token_ids, outs[0].text, outs[0].finish_reason

Prompts are strings (encoded with the Kimi tokenizer) or token-id lists; ``params`` is one
``SamplingParams`` for all prompts or a list with one per prompt. ``n > 1`` runs n sequences per prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine, load_tokenizer
from k3serve.engine.multimodal import ImageInput
from k3serve.engine.outputs import CompletionGroup, RequestOutput
from k3serve.engine.sampling_params import SamplingParams
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
        tok = load_tokenizer() if tokenizer == "auto" else tokenizer
        self.engine = LLMEngine(model, config=EngineConfig(**engine_kwargs), dtype=parse_dtype(dtype),
                                tokenizer=tok, device=device)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

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
        groups: list[tuple[str, list[int], list[str]]] = []
        for prompt, p, imgs in zip(prompts, plist, ilist):
            ids = self._encode(prompt)
            gid = str(next(self._ids))
            sub = [gid if p.n == 1 else f"{gid}-{k}" for k in range(p.n)]
            for rid, k in zip(sub, range(p.n)):
                self.engine.add_request(rid, ids, p.for_sample(k) if p.n > 1 else p, images=imgs)
            groups.append((gid, ids, sub))
        done = self._run_to_completion()
        return [CompletionGroup(gid, ids, [done[r] for r in sub]) for gid, ids, sub in groups]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run_to_completion(self) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            if not outs and self.engine.stats().num_running == 0:
                raise RuntimeError("the engine made no progress (a waiting request cannot be scheduled)")
            done.update((o.request_id, o) for o in outs if o.finished)
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
            if self.engine.tokenizer is None:
                raise ValueError("prompt: string prompts need a tokenizer (k3serve.tokenizer is not available); "
                                 "pass token ids")
            ids = [int(t) for t in self.engine.tokenizer.encode(prompt)]
            bad = [t for t in ids if t >= self.engine.vocab_size]
            if bad:
                raise ValueError(f"prompt: {prompt[:40]!r} encodes to token id {bad[0]}, outside this model's "
                                 f"vocabulary of {self.engine.vocab_size}")
            return ids
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: token-id prompts must be lists of ints")
        return list(prompt)
