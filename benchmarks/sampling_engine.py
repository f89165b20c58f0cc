"""Sampling cost through the engine: the same workload greedy and under the kimi contract's top-p 0.95.

k3-default (the full 163,840-id Kimi vocabulary), N requests of a 64-token prompt each generating M tokens
(ignore_eos), all running at once; wall time from submission to the last token. The ratio top-p / greedy is
what sampling adds to a decode step (issue 49: 2.0x with a full-vocabulary sort per row).

    python benchmarks/sampling_engine.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.models.registry import resolve_model_path


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    engine.reset_prefix_cache()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(64)] for _ in range(args.num_requests)]
    engine = LLMEngine(resolve_model_path("k3-default"),
                       config=EngineConfig(max_num_seqs=args.num_requests, max_model_len=1024))
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    top_p = SamplingParams(temperature=1.0, top_p=0.95, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    run(engine, prompts[:2], greedy)  # warm-up
    times: dict[str, list[float]] = {"greedy": [], "top-p 0.95": []}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits both alike
        times["greedy"].append(run(engine, prompts, greedy))
        times["top-p 0.95"].append(run(engine, prompts, top_p))
    best = {k: min(v) for k, v in times.items()}
    for k, v in best.items():
        print(f"{k}: {v:.2f} s (best of {args.rounds})")
    print(f"top-p / greedy: {best['top-p 0.95'] / best['greedy']:.2f}x")


if __name__ == "__main__":
    main()
