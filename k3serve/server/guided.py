"""Grammar-constrained sampling in the engine-core process (llguidance), plus OpenAI `logit_bias`.

`GuidedDecoding` keeps one `LLMatcher` per constrained request. At the start of each step it
feeds every matcher the tokens sampled since the last step and starts computing the next-token
masks on a thread pool (llguidance drops the GIL), so the masks are built while the model's
forward pass runs; the masks are applied to the sampling rows' logits just before sampling.

The engine has no logits-processor hook yet, so `GuidedModelRunner` wraps the engine's
`ModelRunner` and its model's `compute_logits` (the first call of a step is the sampling rows).
"""

from __future__ import annotations

import base64
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from k3serve.engine.model_runner import ModelRunner, StepResult
from k3serve.engine.request import Batch, Request

log = logging.getLogger("k3serve.engine")


def kimi_lltokenizer(n_vocab: int, eos: int):
    """llguidance's view of the Kimi vocabulary (about 1.5 s; built once, off the request path)."""
    import llguidance

    from k3serve.tokenizer import kimi

    ranks = {}
    with open(kimi.VOCAB_PATH, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=kimi.special_tokens("k3"),
                                                pattern=kimi.KIMI_PATTERN, eos_token=eos, n_vocab=n_vocab)


class _Guide:
    __slots__ = ("matcher", "consumed", "bias", "failed")

    def __init__(self, matcher, bias: dict[int, float]):
        self.matcher = matcher
        self.consumed = 0
        self.bias = bias
        self.failed = False


class GuidedDecoding:
    def __init__(self, vocab_size: int, eos_token_id: int, *, enabled: bool):
        self.vocab_size = vocab_size
        self._guides: dict[str, _Guide] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="k3serve-mask")
        self._tokenizer = None
        self.load_error: str | None = None
        self._ready = threading.Event()
        self.enabled = enabled
        if enabled:
            threading.Thread(target=self._load, args=(eos_token_id,), daemon=True).start()

    def _load(self, eos: int) -> None:
        try:
            self._tokenizer = kimi_lltokenizer(self.vocab_size, eos)
        except Exception as e:  # noqa: BLE001 - requests needing it get a clear error instead
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("the grammar tokenizer failed to load: %s", self.load_error)
        finally:
            self._ready.set()

    def add(self, request_id: str, grammar: str | None, bias: dict[int, float]) -> None:
        """Raises ValueError when the grammar cannot be used for this model."""
        if grammar is None and not bias:
            return
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        matcher = None
        if grammar is not None:
            if not self.enabled:
                raise ValueError("structured outputs need a model with the Kimi vocabulary (163840 ids)")
            import llguidance

            self._ready.wait()
            if self._tokenizer is None:
                raise ValueError(f"structured outputs are unavailable: the grammar tokenizer failed to load "
                                 f"({self.load_error})")
            matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"grammar: {matcher.get_error()}")
        self._guides[request_id] = _Guide(matcher, bias)

    def remove(self, request_id: str) -> None:
        self._guides.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._guides)

    def start(self, reqs: list[Request]) -> list[tuple[int, _Guide, Future | None]]:
        """Advance matchers and start this step's masks; returns (row, guide, mask future)."""
        jobs = []
        for row, req in enumerate(reqs):
            g = self._guides.get(req.request_id)
            if g is None:
                continue
            fut = None
            if g.matcher is not None and not g.failed:
                new = req.output_token_ids[g.consumed:]
                if new and not g.matcher.consume_tokens(new):
                    log.warning("request %s left its grammar: %s", req.request_id, g.matcher.get_error())
                    g.failed = True
                g.consumed += len(new)
                if not g.failed:
                    fut = self._pool.submit(g.matcher.compute_bitmask)
            jobs.append((row, g, fut))
        return jobs

    def apply(self, logits: torch.Tensor, jobs: list[tuple[int, _Guide, Future | None]]) -> None:
        V = logits.shape[-1]
        for row, g, fut in jobs:
            for tok, b in g.bias.items():
                logits[row, tok] += b
            if fut is None:
                continue
            bits = np.unpackbits(np.frombuffer(fut.result(), dtype=np.uint8), bitorder="little")[:V]
            allowed = torch.from_numpy(bits.astype(bool))
            if allowed.any():  # an empty mask would make every token -inf; leave the row alone then
                logits[row].masked_fill_(~allowed, float("-inf"))


class _MaskingModel:
    """Forwards to the real model; masks the first `compute_logits` of a step (the sampling rows)."""

    def __init__(self, model, runner: GuidedModelRunner):
        self._model = model
        self._runner = runner

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model.compute_logits(hidden)
        jobs, self._runner.jobs = self._runner.jobs, None
        if jobs:
            logits = logits.float().clone() if logits.dtype != torch.float32 else logits
            self._runner.guide.apply(logits, jobs)
        return logits

    def __getattr__(self, name):
        return getattr(self._model, name)


class GuidedModelRunner(ModelRunner):
    def __init__(self, base: ModelRunner, guide: GuidedDecoding):
        super().__init__(_MaskingModel(base.model, self), base.caches, base.device)
        self.guide = guide
        self.jobs: list | None = None

    def run(self, batch: Batch) -> StepResult:
        if len(self.guide):
            sampling = [r for i, r in enumerate(batch.requests) if batch.samples(i)]
            self.jobs = self.guide.start(sampling) or None
        try:
            return super().run(batch)
        finally:
            self.jobs = None
