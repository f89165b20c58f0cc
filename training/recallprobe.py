"""Recall at 2k tokens, teacher-forced, by answer position: which words of a record a snapshot gets right.

A recall answer is a lookup (find the asked record) followed by copies (each next word after the previous
one). Scoring the greedy token at each answer position, with the right answer so far in context, tells
which of the two fails: a model that copies but cannot find the record misses position 0 (the passage form,
where the first word sits three tokens after the label) and gets the rest.

    python -m training.recallprobe runs/wi1 [--recall-form passage|restate] [--records 150] [--n 10]
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from torch import nn

from training import tasks
from training.forward import train_forward
from training.grow import add_source_arguments, open_source
from training.render import encode_sample
from training.tok import load_tokenizer
from training.vocab import CompactVocab


@torch.no_grad()
def by_position(model: nn.Module, vocab: CompactVocab, tok, recall: str, records: int, n: int,
                seed: int = 777) -> tuple[list[float], int, int]:
    """Per answer position (the closing markup included), the share of ``n`` held-out lists whose greedy
    token is right; the number of answers right at every position; the longest prompt in tokens."""
    rng = random.Random(seed)
    right: list[int] = []
    seen: list[int] = []
    exact = longest = 0
    for _ in range(n):
        s = tasks.make("recall", rng, held_out=True, thinking=False, style=tasks.Style(recall=recall),
                       records=records)
        ids, n_prompt = encode_sample(s, tok)
        longest = max(longest, n_prompt)
        compact = torch.tensor(vocab.to_compact(ids))
        hidden = train_forward(model, [compact])
        ok = (model.compute_logits(hidden[n_prompt - 1:len(ids) - 1]).argmax(-1) == compact[n_prompt:]).tolist()
        for i, good in enumerate(ok):
            if i == len(right):
                right.append(0)
                seen.append(0)
            right[i] += int(good)
            seen[i] += 1
        exact += all(ok)
    return [r / k for r, k in zip(right, seen)], exact, longest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.recallprobe", description=__doc__.splitlines()[0])
    add_source_arguments(p)
    p.add_argument("--recall-form", choices=tasks.RECALLS, default=tasks.SHIPPED.recall,
                   help="how the lists write their records (the form the model was trained on)")
    p.add_argument("--records", type=int, default=150, help="records per list (~13-14 tokens each)")
    p.add_argument("--n", type=int, default=10, help="held-out lists")
    args = p.parse_args(argv)
    if args.records < 1 or args.n < 1:
        print("error: --records and --n must be >= 1", file=sys.stderr)
        return 2
    if (opened := open_source(args)) is None:
        return 2
    model, vocab, label = opened
    shares, exact, longest = by_position(model, vocab, load_tokenizer(), args.recall_form, args.records, args.n)
    print(f"{label}: recall ({args.recall_form}, {args.records} records, prompts up to {longest} tokens), "
          f"teacher-forced share right by answer position:")
    print("  " + " ".join(f"{x:.1f}" for x in shares))
    print(f"  every position right: {exact}/{args.n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
