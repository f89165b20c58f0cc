"""Where does a supervised head look? For held-out tasks, the attention mass one head of each MLA layer puts on
the sources of one pointer (``induction.KINDS``: ``describe_attn``, ``verdict_attn``, ...) at the positions
that pointer supervises, averaged per MLA layer and task group.

Groups: declines whose asked tool shares its object with an offered one (``object``: ``convert_road`` asked,
``share_road`` offered), other declines, and choices among tools. A decline's source is position 0 for the
verdict and description pointers, so the mass there is how surely the head finds nothing offered.

    python -m training.pointerprobe runs/wx20 --pointer describe_attn
    python -m training.pointerprobe runs/wx20 --step 1400 --pointer verdict_attn

Scores per position: ``softmax_j(q_t . k_j * scale)`` over j <= t, as ``induction.attention_loss`` trains
them; queries and keys ``[N, Dn + R]`` of one head.
"""

from __future__ import annotations

import argparse
import random

import torch
from torch import nn

from training import induction, tasks
from training.forward import train_forward
from training.grow import add_source_arguments, add_task_arguments, parse_source
from training.render import encode_sample
from training.styles import add_style_arguments, style_of
from training.tok import load_tokenizer
from training.vocab import CompactVocab

GROUPS = {"object": ("decline", {"object_share": 1.0}), "decline": ("decline", {}), "choose": ("choose", {})}


@torch.no_grad()
def masses(model: nn.Module, vocab: CompactVocab, ids: list[int], targets: list[tuple[int, list[int]]],
           head: int) -> list[list[float]]:
    """Per MLA layer, the mass ``head`` puts on each target's sources (one value per target)."""
    with induction.MLAInputs(model) as taps:
        train_forward(model, [torch.tensor(vocab.to_compact(ids))])
        out = []
        for i, m in enumerate(taps.layers[:len(taps.inputs)]):
            q, k = taps.qk(i, head)
            out.append([torch.softmax((q[t] @ k[:t + 1].T) * m.scale, -1)[src].sum().item() for t, src in targets])
    return out


def probe(model: nn.Module, vocab: CompactVocab, tokenizer, pointer: str, n: int = 20, seed: int = 11,
          style: tasks.Style = tasks.SHIPPED) -> dict[str, list[float]]:
    """Mean mass per MLA layer for each group of ``n`` held-out tasks (samples the vocabulary misses skipped)."""
    targets_of, _, head, _ = induction.KINDS[pointer]
    res: dict[str, list[float]] = {}
    for group, (kind, extra) in GROUPS.items():
        rng, per_layer = random.Random(seed), []
        for _ in range(n):
            ids, n_prompt = encode_sample(tasks.make(kind, rng, held_out=True, style=style, **extra), tokenizer)
            if not vocab.covers(ids) or not (tgt := targets_of(ids, [(n_prompt, len(ids))])):
                continue
            for layer, ms in enumerate(masses(model, vocab, ids, tgt, head)):
                if layer == len(per_layer):
                    per_layer.append([])
                per_layer[layer] += ms
        res[group] = [sum(ms) / len(ms) for ms in per_layer]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.pointerprobe", description=__doc__.splitlines()[0])
    add_source_arguments(p)
    p.add_argument("--pointer", default="describe_attn", choices=sorted(induction.KINDS),
                   help="which supervision's targets to read (default: describe_attn)")
    add_task_arguments(p, 20, 11, "held-out tasks per group")
    add_style_arguments(p)
    args, opened = parse_source(p, argv)
    if opened is None:
        return 2
    model, vocab, label = opened
    res = probe(model, vocab, load_tokenizer(), args.pointer, args.n, args.seed, style_of(args))
    print(f"{label}: {args.pointer} head {induction.KINDS[args.pointer][2]}, mass on the sources per MLA layer")
    for group, per_layer in res.items():
        print(f"  {group:8s} " + " / ".join(f"{m:.2f}" for m in per_layer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
