"""Prefix-cache TTFT: the second turn of a conversation with an 8k-token history, cached vs cold.

Turn 1 prefills an ``--history``-token prompt and decodes ``--turn1-tokens`` tokens; turn 2 sends the whole
conversation plus ``--new-tokens`` new tokens. Cached: turn 2 on the same engine (it resumes from the MLA
blocks and the KDA snapshot that turn 1 left at its last block boundary). Cold: the same turn-2 prompt on the
same engine after ``reset_prefix_cache()``. TTFT = submission to first token, median of ``--repeats``.

    python benchmarks/prefix_cache.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams


def ttft(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and first is None:
                first = time.perf_counter() - start
            if out.finished:
                tokens = out.token_ids
    return first, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-linear-tiny-random")
    ap.add_argument("--history", type=int, default=8192)
    ap.add_argument("--turn1-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    total = args.history + args.turn1_tokens + args.new_tokens
    engine = LLMEngine(args.model, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=2048,
                                                       kv_cache_memory=256 * 2**20, max_model_len=total + 64))
    print(engine.plan.report())
    cached, cold = [], []
    for r in range(args.repeats):
        history = [rng.randrange(2000) for _ in range(args.history)]
        _, out1 = ttft(engine, f"t1-{r}", history, max_tokens=args.turn1_tokens)
        turn2 = history + out1 + [rng.randrange(2000) for _ in range(args.new_tokens)]
        before = engine.stats()
        t_cached, tok_cached = ttft(engine, f"t2-{r}", turn2)
        computed = engine.stats().num_computed_tokens - before.num_computed_tokens
        engine.reset_prefix_cache()
        t_cold, tok_cold = ttft(engine, f"cold-{r}", turn2)
        assert tok_cached == tok_cold, "a prefix-cache hit changed the output"
        cached.append(t_cached)
        cold.append(t_cold)
        print(f"repeat {r}: turn-2 prompt {len(turn2)} tokens, cached TTFT {t_cached * 1e3:.1f} ms "
              f"({computed} tokens computed), cold TTFT {t_cold * 1e3:.1f} ms")
    c, k = statistics.median(cached), statistics.median(cold)
    print(f"\n{args.model}, {args.history}-token history: cached TTFT {c * 1e3:.1f} ms, cold TTFT {k * 1e3:.1f} ms, "
          f"cached/cold = {c / k:.3f}")


if __name__ == "__main__":
    main()
