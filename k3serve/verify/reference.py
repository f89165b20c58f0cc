"""A reference for fidelity checks: another endpoint (a URL) or a k3serve model run in this process through the
offline ``LLM`` (a checkpoint path or built-in name). Both answer ``greedy(messages, tools, thinking, n)`` with the
greedy tokens as ``Step(token bytes, logprob, {bytes: logprob} of the top alternatives)``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from k3serve.verify.client import Client

TOP = 5


@dataclass(frozen=True)
class Step:
    token: bytes
    logprob: float
    top: dict[bytes, float]


def steps_from_openai(entries: list[dict[str, Any]]) -> list[Step]:
    def key(e: dict[str, Any]) -> bytes:
        return bytes(e["bytes"]) if e.get("bytes") is not None else str(e.get("token", "")).encode()

    return [Step(key(e), float(e["logprob"]), {key(t): float(t["logprob"]) for t in e.get("top_logprobs") or []})
            for e in entries]


class Reference:
    async def greedy(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool,
                     max_tokens: int) -> list[Step]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class URLReference(Reference):
    def __init__(self, url: str, model: str | None, api_key: str | None):
        self.client, self.model = Client(url, api_key=api_key), model

    async def greedy(self, messages, tools, thinking, max_tokens):
        body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
                "top_logprobs": TOP, **({"model": self.model} if self.model else {}),
                **({"tools": tools} if tools else {}),
                **({} if thinking else {"chat_template_kwargs": {"thinking": False}})}
        r = await self.client.chat(body)
        if not r.ok:
            raise RuntimeError(f"the reference answered HTTP {r.status}: {r.error}")
        return steps_from_openai(r.logprobs)

    async def close(self) -> None:
        await self.client.close()


class LocalReference(Reference):
    """A model loaded with ``k3serve.LLM``; prompts rendered with the local K3 format, greedy with logprobs."""

    def __init__(self, model: str):
        from k3serve.engine.llm import LLM
        from k3serve.verify.local import tokenizer

        self.tok = tokenizer()
        self.llm = LLM(model, tokenizer=self.tok, max_num_seqs=4)
        self._lock = asyncio.Lock()

    def _run(self, messages, tools, thinking, max_tokens) -> list[Step]:
        from k3serve.engine.sampling_params import SamplingParams
        from k3serve.verify.local import render_ids

        ids, _ = render_ids(messages, tools=tools, thinking=thinking)
        out = self.llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP))
        seq = out[0].outputs[0]
        piece = lambda t: self.tok.decode_bytes([t])  # noqa: E731
        return [Step(piece(t), lps.get(t, 0.0), {piece(k): v for k, v in lps.items()})
                for t, lps in zip(seq.token_ids, seq.logprobs or [])]

    async def greedy(self, messages, tools, thinking, max_tokens):
        async with self._lock:  # one engine, one request at a time
            return await asyncio.to_thread(self._run, messages, tools, thinking, max_tokens)


def open_reference(spec: str, model: str | None, api_key: str | None) -> Reference:
    if spec.startswith(("http://", "https://")):
        return URLReference(spec, model, api_key)
    return LocalReference(spec)
