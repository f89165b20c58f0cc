"""Grammar-constrained sampling in the engine-core process (llguidance), plus OpenAI `logit_bias`,
as per-request logits processors (`k3serve.engine.logits_processor`).

`GuidedDecoding.processor(grammar, bias)` builds one `Guide` per constrained request, handed to
`LLMEngine.add_request(..., logits_processor=...)`. In each step in which the request samples, the
engine calls `prepare` before the forward pass: the guide feeds its `LLMatcher` the tokens sampled
since the last step and starts computing the next-token mask on a shared thread pool (llguidance
drops the GIL), so the mask is built while the forward runs; `apply` adds the bias and masks the
row just before sampling. Logprobs stay those of the raw model distribution (the engine's rule).

A grammar is never dropped silently: a template that errors or allows no first token is refused when
the request is added (ValueError -> HTTP 400 before any generation); a matcher that gives up later
(a sampled token it rejects, an error state, an empty mask) marks its guide failed, and the engine core
ends that request with an error instead of letting it run on unconstrained (`take_failures`).
"""

from __future__ import annotations

import base64
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

log = logging.getLogger("k3serve.engine")
TEMPLATE_CACHE = 64  # compiled grammars kept for reuse
MIN_VOCAB = 163840  # grammars name the Kimi special ids; smaller vocabularies cannot hold them


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


class Guide:
    """One request's grammar matcher and logit bias (a `LogitsProcessor`)."""

    __slots__ = ("matcher", "consumed", "bias", "failed", "request_id", "_pool", "_mask", "_bias_ids", "_bias_vals",
                 "_failures")

    def __init__(self, matcher, bias: dict[int, float], pool: ThreadPoolExecutor, request_id: str = "",
                 failures: list[tuple[str, str]] | None = None):
        self.matcher = matcher
        self.consumed = 0
        self.bias = bias
        # one index_add per step instead of a tensor index per entry (a Python loop over a large bias
        # held up every other request of the batch)
        self._bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None
        self._bias_vals = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None
        self.failed = False
        self.request_id = request_id
        self._pool = pool
        self._mask: Future | None = None
        self._failures = failures  # shared with GuidedDecoding: (request id, why) of guides that gave up

    def _fail(self, why: str) -> None:
        if self.failed:
            return
        self.failed = True
        log.warning("request %s: the grammar engine gave up: %s", self.request_id, why)
        if self._failures is not None:
            self._failures.append((self.request_id, why))

    def prepare(self, output_token_ids: Sequence[int]) -> None:
        self._mask = None
        if self.matcher is None or self.failed:
            return
        new = output_token_ids[self.consumed:]
        if new and not self.matcher.consume_tokens(list(new)):
            self._fail(self.matcher.get_error() or "a sampled token does not follow the grammar")
            return
        self.consumed += len(new)
        self._mask = self._pool.submit(self.matcher.compute_bitmask)

    def apply(self, logits: torch.Tensor) -> None:
        if self._bias_ids is not None:
            logits.index_add_(0, self._bias_ids, self._bias_vals.to(logits.dtype))
        fut, self._mask = self._mask, None
        if fut is None:
            return
        packed = np.frombuffer(fut.result(), dtype=np.uint8)
        if not packed.any():
            # the matcher gave up (an error state gives an empty mask): every token -inf would break sampling,
            # so the row stays as it is, and the engine core ends the request with an error after this step
            self._fail(self.matcher.get_error() if self.matcher is not None and self.matcher.is_error()
                       else "the grammar allows no next token")
            return
        # one gather of 8 ready-made floats per mask byte, then one add: no data-dependent branches, so the
        # cost is the same ~85 us for every mask (a boolean masked_fill ran 130-730 us per row depending on
        # how irregular the allowed set was: branch misses)
        add = np.take(_BYTE_TO_ADD, packed, axis=0).reshape(-1)[:logits.shape[-1]]
        logits.add_(torch.from_numpy(add))


def _byte_table() -> np.ndarray:
    """[256, 8] float32: entry (b, j) is 0 where bit j of byte b is set (allowed), -inf where it is clear."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits.astype(bool), np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


_BYTE_TO_ADD = _byte_table()


class GuidedDecoding:
    def __init__(self, vocab_size: int, eos_token_id: int, *, enabled: bool):
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="k3serve-mask")
        self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3serve-grammar")
        self._tokenizer = None
        self.load_error: str | None = None
        self._ready = threading.Event()
        self._templates: OrderedDict[str, object] = OrderedDict()  # grammar -> unused matcher, LRU
        self._failures: list[tuple[str, str]] = []  # appended by guides (engine loop), drained by take_failures
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

    def compiled(self, grammar: str | None) -> bool:
        """Whether `processor` can build this request's guide at once: no grammar, or one compiled already
        (a grammar this engine cannot take is refused at once too)."""
        return grammar is None or not self.enabled or grammar in self._templates

    def compile_later(self, grammar: str) -> Future:
        """Compile a fresh grammar on the grammar thread (llguidance drops the GIL while it builds), so the
        engine loop keeps stepping the other requests; hand the result to `processor(template=...)`. One
        thread: fresh grammars wait for each other, never for the batch."""
        return self._compiler.submit(self._compile, grammar)

    def _compile(self, grammar: str):
        import llguidance

        self._ready.wait()
        if self._tokenizer is None:
            raise ValueError(f"structured outputs are unavailable: the grammar tokenizer failed to load "
                             f"({self.load_error})")
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"grammar: {template.get_error()}")
        # the first mask, once per grammar: a schema llguidance gives up on at the start is refused here
        # (400) rather than run unconstrained; the mask is cached, so the copies reuse it
        if not np.frombuffer(template.compute_bitmask(), dtype=np.uint8).any() or template.is_error():
            raise ValueError(f"grammar: the schema cannot be enforced: "
                             f"{template.get_error() or 'it allows no first token'}")
        return template

    def processor(self, grammar: str | None, bias: dict[int, float], request_id: str = "",
                  template=None) -> Guide | None:
        """The request's logits processor (None when it has neither grammar nor bias); ValueError when the
        grammar or bias cannot be used for this model. `template`: the grammar compiled by `compile_later`;
        without it a fresh grammar is compiled here, blocking."""
        if grammar is None and not bias:
            return None
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        matcher = None
        if grammar is not None:
            if not self.enabled:
                raise ValueError("structured outputs need a model with the Kimi vocabulary (163840 ids)")
            if template is None:
                template = self._templates.get(grammar)
            if template is None:
                template = self._compile(grammar)
            self._templates[grammar] = template
            self._templates.move_to_end(grammar)
            if len(self._templates) > TEMPLATE_CACHE:
                self._templates.popitem(last=False)
            # a fresh matcher costs ~1-2 ms on the engine loop, a copy of a pristine one ~2 us; many requests
            # share a grammar (one schema, one tool set)
            matcher = template.deep_copy()
        return Guide(matcher, dict(bias), self._pool, request_id, self._failures)

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of every guide that gave up since the last call."""
        out, self._failures[:] = list(self._failures), []
        return out
