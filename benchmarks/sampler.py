"""One top-p draw per row: the sort-based reference (``filter_logits_reference``, softmax, ``inverse_cdf``)
against ``draw_top_p`` (pivot rejection, no sort) on one decode step's logits, ``[64, 163840]`` fp32 by
default (the Kimi vocabulary), top-p 0.95 as the kimi contract fixes it.

    python benchmarks/sampler.py                   # CPU, all three logit shapes
    python benchmarks/sampler.py --device cuda     # on a GPU (synchronised timings)

Logits are ``randn * scale``: scale 12 is peaked like a trained model's next-token distribution (the 0.95
nucleus holds a handful of tokens), 3 is broad (thousands), 0.3 is near-flat like an untrained model's
(most of the vocabulary). Each figure is the median of ``--repeats`` calls after one warm-up; every token
``draw_top_p`` draws is checked to lie in the reference's set. The ``greedy argmax`` column is the floor:
what a step costs without sampling.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3serve.engine.sampler import draw_top_p, filter_logits_reference, inverse_cdf


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=163_840)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--scales", type=float, nargs="+", default=[12.0, 3.0, 0.3])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    M, V = args.rows, args.vocab
    top_k = torch.zeros(M, dtype=torch.long, device=dev)
    top_p = torch.full((M,), args.top_p, device=dev)
    min_p = torch.zeros(M, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"[{M}, {V}] fp32 logits, top-p {args.top_p}, {dev}, {torch.get_num_threads()} CPU threads, "
          f"median of {args.repeats} (ms)")
    print(f"{'scale':>6} {'nucleus (median)':>17} {'sort-based':>11} {'draw_top_p':>11} {'speed-up':>9} "
          f"{'greedy argmax':>14}")

    def uniforms(rows: torch.Tensor) -> torch.Tensor:
        return torch.rand(rows.numel(), dtype=torch.float64, device=dev, generator=gen)

    def reference(logits: torch.Tensor) -> torch.Tensor:
        probs = filter_logits_reference(logits, top_k, top_p, min_p).softmax(-1)
        return inverse_cdf(probs, uniforms(torch.arange(M, device=dev)))

    for scale in args.scales:
        logits = torch.randn(M, V, generator=gen, device=dev) * scale
        kept = torch.isfinite(filter_logits_reference(logits, top_k, top_p, min_p))
        probs = logits.softmax(-1)
        assert kept.gather(1, draw_top_p(probs, top_p, min_p, uniforms)[:, None]).all(), "a draw outside the set"
        slow = timed(lambda: reference(logits), args.repeats, dev)
        fast = timed(lambda: draw_top_p(logits.softmax(-1), top_p, min_p, uniforms), args.repeats, dev)
        floor = timed(lambda: logits.argmax(dim=-1), args.repeats, dev)
        print(f"{scale:>6g} {int(kept.sum(-1).median()):>17,} {slow:>11.1f} {fast:>11.1f} {slow / fast:>8.1f}x {floor:>14.1f}")


if __name__ == "__main__":
    main()
