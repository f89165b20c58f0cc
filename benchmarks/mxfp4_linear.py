"""mxfp4_linear (weight kept packed, dequantised per slab) against a matmul with the weight resident in
float32 / bfloat16, on K3 routed-expert shapes and a few token counts. Prints a markdown table.

    python benchmarks/mxfp4_linear.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3serve.ops.mx import mxfp4_dequantize, mxfp4_linear, mxfp4_quantize

SHAPES = {"w1/w3 [3072, 3584]": (3072, 3584), "w2 [3584, 3072]": (3584, 3072)}


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}, best of {args.repeats}\n")
    print("| weight | tokens | mxfp4 fp32-x ms | fp32 ms | ratio | mxfp4 bf16-x ms | bf16 ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        packed, scale = mxfp4_quantize(torch.randn(n, k) * 0.02)
        w32 = mxfp4_dequantize(packed, scale)
        w16 = w32.bfloat16()
        bits = 8 * (packed.numel() + scale.numel()) / w32.numel()
        for tokens in (1, 8, 64):
            x = torch.randn(tokens, k)
            x16 = x.bfloat16()
            t_mx = best_ms(lambda: mxfp4_linear(x, packed, scale), args.repeats)
            t_32 = best_ms(lambda: x @ w32.t(), args.repeats)
            t_mx16 = best_ms(lambda: mxfp4_linear(x16, packed, scale), args.repeats)
            t_16 = best_ms(lambda: x16 @ w16.t(), args.repeats)
            print(
                f"| {name} | {tokens} | {t_mx:.2f} | {t_32:.2f} | {t_mx / t_32:.1f}x "
                f"| {t_mx16:.2f} | {t_16:.2f} | {t_mx16 / t_16:.1f}x |"
            )
    print(f"\nresident weight: mxfp4 {bits:.2f} bits/param, bf16 16, fp32 32")


if __name__ == "__main__":
    main()
