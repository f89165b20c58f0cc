"""Per-step costs of speculative decoding at batch 1 on k3-default, in-engine (no server): where a verify step's
time goes. For one tool-calling request (``spec_decode.py``'s workload, seed 5) decoded with each drafter, the
mean per engine step of: the drafter's proposal (``Speculator.propose``), the whole step (forward + verify +
rollback commit), and tokens emitted per step; plus the plain argmax vs ``max(dim=-1).indices`` pick over a
``[T, V]`` logits block (the verify's greedy pick, T = k + 1).

    PYTHONPATH=. python benchmarks/spec_step_cost.py --configs off,suffix,eagle3,eagle_suffix --k 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.spec_decode import workloads  # noqa: E402
from k3serve.chat import K3, ChatOptions  # noqa: E402
from k3serve.engine.config import EngineConfig  # noqa: E402
from k3serve.engine.engine import LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.engine.spec.config import SpeculativeConfig  # noqa: E402
from training.tok import load_tokenizer  # noqa: E402


def pick_cost(T: int, V: int, reps: int = 200) -> tuple[float, float]:
    """(argmax, max().indices) microseconds per call on a random ``[T, V]`` block."""
    x = torch.randn(T, V)
    out = []
    for f in (lambda: x.argmax(dim=-1), lambda: x.max(dim=-1).indices):
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        out.append((time.perf_counter() - t) / reps * 1e6)
    return out[0], out[1]


def run(method: str | None, k: int, prompts: list[list[int]], max_tokens: int) -> dict:
    spec = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=k)
    eng = LLMEngine("k3-default", config=EngineConfig(max_model_len=1024, speculative_config=spec))
    sp = eng.scheduler.speculator
    propose_s = [0.0]
    if sp is not None:  # time the drafter inside the scheduler's call
        inner = sp.propose

        def timed(req, n):
            t = time.perf_counter()
            try:
                return inner(req, n)
            finally:
                propose_s[0] += time.perf_counter() - t

        sp.propose = timed
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    steps, step_s = 0, 0.0
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
        eng.step()  # the prefill: not a decode step
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            step_s += time.perf_counter() - t
            steps += 1
    s = eng.scheduler
    return {"steps": steps, "step_ms": step_s / steps * 1e3, "propose_ms": propose_s[0] / steps * 1e3,
            "accept_len": 1 + s.num_accepted_tokens / s.num_spec_rows if s.num_spec_rows else 1.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="off,suffix,eagle3,eagle_suffix")
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--n", type=int, default=2, help="tool requests, one after another")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    tok = load_tokenizer()
    bodies = workloads(args.n, 5)["tool"]
    prompts = [K3.render(b["messages"], b.get("tools"), ChatOptions(thinking=False, effort=None))
               .encode(tok.encode_segments) for b in bodies]
    prompts = [[int(t) for t in p] for p in prompts]
    print("| config | decode steps | ms / step | drafter ms / step | mean acceptance length | ms / token |")
    print("|---|---|---|---|---|---|")
    for c in args.configs.split(","):
        r = run(None if c == "off" else c, args.k, prompts, args.max_tokens)
        print(f"| {c} | {r['steps']} | {r['step_ms']:.2f} | {r['propose_ms']:.3f} | {r['accept_len']:.2f} | "
              f"{r['step_ms'] / r['accept_len']:.2f} |")
    a, m = pick_cost(args.k + 1, 163840)
    print(f"\ngreedy pick over [{args.k + 1}, 163840]: argmax {a:.0f} us, max(dim=-1).indices {m:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
