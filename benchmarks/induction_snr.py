"""Can one softmax head find "the position after an earlier occurrence of this token" among L keys, with a
d = 64 residual? The best bilinear score for two ways of storing the previous token (no training involved).

Keys at position j hold the current token e_j and the previous one e_{j-1}; the query at t holds e_t.
The right key is the j with x_{j-1} = x_t (tokens distinct, as in a recall list).

  superposed: r_j = e_j + P e_{j-1} over all d dims (P a random rotation), score q_t^T W r_j with the
              ideal W = P^T cut to the head's rank (its q/k width): the cross terms e_t^T P^T e_j are noise
  split:      e in dims [0, d/2), e_{j-1} in dims [d/2, d) (``--split-residual``), score e_t . e_{j-1}

    python benchmarks/induction_snr.py [--rows 4800] [--trials 20]
"""

from __future__ import annotations

import argparse

import torch


def top1(score_rows: torch.Tensor, want: torch.Tensor) -> float:
    return (score_rows.argmax(1) == want).float().mean().item()


def superposed(E: torch.Tensor, L: int, rank: int, queries: int, g: torch.Generator) -> float:
    d = E.shape[1]
    P = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    U, S, V = torch.linalg.svd(P.T)
    W = (U[:, :rank] * S[:rank]) @ V[:rank]
    e = E[torch.randperm(E.shape[0], generator=g)[:L]]
    r = e.clone()
    r[1:] += e[:-1] @ P.T
    t = torch.randint(0, L - 1, (queries,), generator=g)
    s = e[t] @ W @ r.T
    s[:, 0] = float("-inf")
    return top1(s, t + 1)


def split(E: torch.Tensor, L: int, queries: int, g: torch.Generator) -> float:
    half = E.shape[1] // 2
    e = E[torch.randperm(E.shape[0], generator=g)[:L], :half]
    t = torch.randint(0, L - 1, (queries,), generator=g)
    s = e[t] @ e[:-1].T  # key j + 1 holds e_j
    return top1(s, t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4800, help="vocabulary rows (the default model trains ~4.8k)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--trials", type=int, default=20)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    E = torch.randn(args.rows, args.dim, generator=g)
    print(f"d = {args.dim}, {args.rows} random token rows, top-1 of the right key over {args.trials} x 200 queries")
    for L in (500, 2000):
        res = {f"superposed rank {k}": sum(superposed(E, L, k, 200, g) for _ in range(args.trials)) / args.trials
               for k in (32, args.dim)}
        res["split halves"] = sum(split(E, L, 200, g) for _ in range(args.trials)) / args.trials
        print(f"L = {L:5d}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()))


if __name__ == "__main__":
    main()
