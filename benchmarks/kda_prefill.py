"""KDA prefill: chunked WY form (`chunk_kda`) vs the token recurrence (`naive_recurrent_kda`) on CPU.

    python benchmarks/kda_prefill.py [--T 8192] [--heads 4] [--dim 64] [--threads 1] [--gate mild|strong]
    python benchmarks/kda_prefill.py --train --T 2000 --dim 32 --gate strong

With ``--train``: the differentiable training form (`training/kda_autograd.py`), forward + backward, with its
in-chunk terms by 16-token sub-blocks against the pairwise ``[C, C, K]`` form it used before whenever a
chunk could decay by more than exp(160) (any gate below -2.5 at C = 64); outputs and gradients are compared
first.

Gates: "mild" = K3's formula -5 sigmoid(exp(A_log) (f + dt_bias)) at init-time parameter ranges; "strong" =
-5 sigmoid(3 f + 1), pushed hard towards the -5 bound. Each time is the best of --repeat runs; the outputs are
compared before any figure is printed (no timing on a red gate).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from k3serve.ops.kda import chunk_kda, naive_recurrent_kda

Out = TypeVar("Out")


def best_of(n: int, fn: Callable[[], Out]) -> tuple[float, Out]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="K = V = head dim")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gate", choices=["mild", "strong"], default="mild")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--train", action="store_true", help="time the training form's forward + backward instead")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, H, D = a.T, a.heads, a.dim
    q, k = (F.normalize(torch.randn(1, T, H, D), dim=-1) for _ in range(2))
    v, f, beta = torch.randn(1, T, H, D), torch.randn(1, T, H, D), torch.sigmoid(torch.randn(1, T, H))
    if a.gate == "mild":
        a_log, dt = torch.log(torch.empty(H, 1).uniform_(1, 16)), torch.exp(torch.empty(H, D).uniform_(-6.9, -2.3))
        g = -5 * torch.sigmoid(a_log.exp() * (f + dt + torch.log(-torch.expm1(-dt))))
    else:
        g = -5 * torch.sigmoid(3 * f + 1)
    print(f"T={T} H={H} K=V={D} chunk={a.chunk_size} gate={a.gate} threads={torch.get_num_threads()} fp32")
    if a.train:
        return train_form(a, q, k, v, g, beta)
    t_naive, (o_ref, s_ref) = best_of(a.repeat, lambda: naive_recurrent_kda(q, k, v, g, beta))
    t_chunk, (o, s) = best_of(a.repeat, lambda: chunk_kda(q, k, v, g, beta, chunk_size=a.chunk_size))
    err = max(((x - r).norm() / r.norm()).item() for x, r in ((o, o_ref), (s, s_ref)))
    if not err <= 1e-5:
        raise SystemExit(f"chunked output differs from the recurrence: relative error {err:.2e}")
    print(f"naive recurrence {t_naive * 1e3:9.1f} ms   chunked {t_chunk * 1e3:8.1f} ms   "
          f"ratio {t_naive / t_chunk:5.1f}x   (rel err {err:.1e})")


def train_form(a: argparse.Namespace, *inputs: torch.Tensor) -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # training/ sits at the repository root, not installed
    from training import kda_autograd

    def fwd_bwd(sub: int) -> list[torch.Tensor]:
        kda_autograd.SUB = sub  # a sub-block as large as the chunk: the pairwise form
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        o, s = kda_autograd.chunk_kda_train(*leaves, chunk_size=a.chunk_size)
        (o.sum() + s.square().sum()).backward()
        return [o.detach(), *(x.grad for x in leaves)]

    sub = kda_autograd.SUB
    try:
        t_pair, ref = best_of(a.repeat, lambda: fwd_bwd(a.chunk_size))
        t_sub, out = best_of(a.repeat, lambda: fwd_bwd(sub))
    finally:
        kda_autograd.SUB = sub
    err = max(((x - r).norm() / r.norm().clamp_min(1e-30)).item() for x, r in zip(out, ref))
    if not err <= 1e-4:
        raise SystemExit(f"sub-blocked training form differs from the pairwise one: relative error {err:.2e}")
    print(f"train fwd+bwd: pairwise {t_pair * 1e3:9.1f} ms   sub-blocked {t_sub * 1e3:8.1f} ms   "
          f"ratio {t_pair / t_sub:5.1f}x   (rel err {err:.1e})")


if __name__ == "__main__":
    main()
