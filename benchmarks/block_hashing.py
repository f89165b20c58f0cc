"""Prefix-block hashing cost (core.hashing), unkeyed and keyed, in ns per 16-token block.

    python benchmarks/block_hashing.py [--blocks 512] [--repeat 7]

The router hashes every prompt's blocks on its request path and the engine every request's; keyed hashes
(a KV events secret, core.kv_auth) must cost about the same as unkeyed ones.
"""

from __future__ import annotations

import argparse
import inspect
import timeit

from k3serve.core.hashing import hash_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    ids = list(range(16 * args.blocks))
    cases = {"unkeyed": {}}
    if "key" in inspect.signature(hash_blocks).parameters:  # so the same script times the code before keys
        cases["keyed"] = {"key": bytes(range(32))}
    for name, kw in cases.items():
        best = min(timeit.repeat(lambda: hash_blocks(ids, 16, **kw), number=20, repeat=args.repeat)) / 20
        print(f"{name:8s} {best / args.blocks * 1e9:6.0f} ns/block ({args.blocks} blocks of 16 tokens)")


if __name__ == "__main__":
    main()
