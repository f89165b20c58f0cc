"""Benchmark datasets: random prompts, multi-turn sessions and Mooncake trace replay, all made of token ids.

A request is a list of turns ``(role, token ids)``. It goes out as token ids (``/v1/completions`` accepts a
list of ints as ``prompt``) or as text, one common English word per id (id mod 128): each word below is a
single Kimi BPE token with its leading space (tests/bench checks this), so a text prompt keeps its token
length, and requests that share leading ids share the same leading text, hence the same leading tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

KINDS = ("random", "multiturn", "trace")
TRACE_BLOCK_TOKENS = 512  # tokens per Mooncake hash_id
DEFAULT_OUTPUT_LEN = 128  # synthetic datasets' output tokens when --output-len is not given

WORDS = (
    "the of and to in is was for on that with as by at from his he it an were are which this also be or had "
    "first one their its new after but who not they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made well three year while between american under both "
    "second part area team make game back work just life last high see each long group because before use "
    "music through being film four any same name found several south north did left these public day "
    "government way people series end place since like"
).split()
assert len(WORDS) == 128 and len(set(WORDS)) == 128


@dataclass(frozen=True, slots=True)
class BenchRequest:
    turns: tuple[tuple[str, tuple[int, ...]], ...]  # (role, token ids); the prompt is their concatenation
    output_len: int
    arrival_s: float | None = None  # trace timestamp, relative to the trace's first request
    after: int | None = None  # index of the request this one waits for (the previous turn of its session)

    @property
    def prompt_ids(self) -> list[int]:
        return [t for _, ids in self.turns for t in ids]

    @property
    def prompt_len(self) -> int:
        return sum(len(ids) for _, ids in self.turns)


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    kind: str  # one of KINDS
    num_prompts: int | None = None  # None: 1000 synthetic requests, or the whole trace
    input_len: int = 1024  # new tokens per prompt (per user turn for multiturn)
    output_len: int | None = None  # None: 128, or each trace record's own; a trace's lengths are overridden
    range_ratio: float = 0.0  # lengths uniform in [L(1-r), L(1+r)], as vLLM's random dataset
    prefix_len: int = 0  # one prefix (system prompt) shared by every request / session
    turns: int = 3  # user turns per multiturn session
    trace_path: str | None = None
    trace_block_size: int = TRACE_BLOCK_TOKENS  # < 512 shrinks trace prompts, keeping their sharing structure
    vocab_size: int = 2048  # ids are drawn from [0, vocab_size): ordinary BPE tokens of any Kimi model
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown dataset {self.kind!r}: use random, multiturn or trace:FILE")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0 or self.turns < 1 or self.vocab_size < 1:
            raise ValueError("--prefix-len must be >= 0, --turns and --vocab-size >= 1")
        if not 1 <= self.trace_block_size <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"--trace-block-size must be in [1, {TRACE_BLOCK_TOKENS}], got {self.trace_block_size}")


def parse_dataset(spec: str) -> tuple[str, str | None]:
    """``random`` | ``multiturn`` | ``trace:FILE`` -> (kind, trace path)."""
    kind, _, path = spec.partition(":")
    if kind == "trace":
        if not path:
            raise ValueError("--dataset trace needs a file: trace:FILE")
        return kind, path
    if kind not in KINDS or path:
        raise ValueError(f"unknown dataset {spec!r}: use random, multiturn or trace:FILE")
    return kind, None


def render_text(ids: list[int] | tuple[int, ...]) -> str:
    return "".join(" " + WORDS[i % len(WORDS)] for i in ids)


def build_dataset(cfg: DatasetConfig) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    if cfg.kind == "trace":
        return _trace(cfg)
    n = 1000 if cfg.num_prompts is None else cfg.num_prompts
    if cfg.output_len is None:
        cfg = replace(cfg, output_len=DEFAULT_OUTPUT_LEN)
    prefix = _ids(rng, cfg.prefix_len, cfg.vocab_size)
    if cfg.kind == "random":
        return [BenchRequest(_with_prefix(prefix, ("user", _ids(rng, _length(rng, cfg.input_len, cfg),
                                                                  cfg.vocab_size))), _length(rng, cfg.output_len, cfg))
                for _ in range(n)]
    return _multiturn(cfg, n, prefix, rng)


def _length(rng: np.random.Generator, mean: int, cfg: DatasetConfig) -> int:
    lo, hi = max(1, int(mean * (1 - cfg.range_ratio))), max(1, int(mean * (1 + cfg.range_ratio)))
    return int(rng.integers(lo, hi + 1))


def _ids(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab, n))


def _with_prefix(prefix: tuple[int, ...], turn: tuple[str, tuple[int, ...]]) -> tuple:
    return ((("system", prefix),) if prefix else ()) + (turn,)


def _multiturn(cfg: DatasetConfig, n: int, prefix: tuple[int, ...], rng: np.random.Generator) -> list[BenchRequest]:
    """Sessions of ``cfg.turns`` user turns; turn k+1's prompt is turn k's prompt + an answer + a new question.

    The answer in the history is synthetic (deterministic ids of the requested output length), not what the
    server generated, so every prompt is known up front; the server's prefix cache still sees turn k's whole
    prompt again in turn k+1. Requests are ordered turn by turn across sessions, and each waits for its
    previous turn to finish (``after``), as a user waits for a reply.
    """
    sessions = math.ceil(n / cfg.turns)
    table: dict[tuple[int, int], BenchRequest] = {}
    for s in range(sessions):
        history = _with_prefix(prefix, ("user", _ids(rng, _length(rng, cfg.input_len, cfg), cfg.vocab_size)))
        for t in range(cfg.turns):
            out_len = _length(rng, cfg.output_len, cfg)
            table[t, s] = BenchRequest(history, out_len)
            answer = ("assistant", _ids(rng, out_len, cfg.vocab_size))
            history = history + (answer, ("user", _ids(rng, _length(rng, cfg.input_len, cfg), cfg.vocab_size)))
    order = sorted(table)[:n]  # turn-major: every session's first turn, then every second turn, ...
    index = {key: i for i, key in enumerate(order)}
    return [BenchRequest(table[t, s].turns, table[t, s].output_len, after=index.get((t - 1, s)))
            for t, s in order]


def _trace(cfg: DatasetConfig) -> list[BenchRequest]:
    """Mooncake trace replay: hash_id h -> a fixed block of ids (seeded by (seed, h)), so equal leading
    hash_ids are equal leading tokens. ``trace_block_size`` < 512 scales every block (and the partial last
    one) down by the same factor. ``output_len``, when given, replaces every record's output length."""
    from k3serve.router.trace import load_trace

    records = load_trace(cfg.trace_path or "")  # raises FileNotFoundError / ValueError with the line
    if cfg.num_prompts is not None:
        records = records[: cfg.num_prompts]
    bs, blocks = cfg.trace_block_size, {}
    t0 = records[0].arrival_s
    out = []
    for r in records:
        last = r.input_tokens - TRACE_BLOCK_TOKENS * (len(r.block_ids) - 1)  # 1..512 tokens in the last block
        sizes = [bs] * (len(r.block_ids) - 1) + [max(1, round(last * bs / TRACE_BLOCK_TOKENS))]
        ids: list[int] = []
        for h, size in zip(r.block_ids, sizes):
            if h not in blocks:
                blocks[h] = _ids(np.random.default_rng([cfg.seed, h]), bs, cfg.vocab_size)
            ids.extend(blocks[h][:size])
        out_len = max(1, r.output_tokens) if cfg.output_len is None else cfg.output_len
        out.append(BenchRequest((("user", tuple(ids)),), out_len, arrival_s=r.arrival_s - t0))
    return out
