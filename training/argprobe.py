"""Where tool calls go wrong: teacher-forced accuracy on the argument values of held-out tool tasks.

A tool call is exactly right only if every argument value is copied whole from the request. This probe
feeds the reference answer (teacher forcing) and asks, per argument, whether the model's argmax gets the
*key* right (the call follows the request's order, the declaration lists keys sorted by name), the value's
*first* token right (finding the value: the key sits ~6 tokens back, in
``<|open|>argument key="k" type="t"<|sep|>``) and *every* token right (copying the rest of it), by
argument index and by JSON type; a wrong first token that starts another argument's value is counted
as taken from another key.

    python -m training.argprobe k3serve/models/weights/k3-default      # a checkpoint directory
    python -m training.argprobe runs/gw --step 250                      # a run's compact snapshot
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from training import tasks
from training.forward import train_forward
from training.grow import add_source_arguments, open_source
from training.render import encode_sample
from training.tok import load_tokenizer
from training.vocab import CompactVocab

ARGUMENT = re.compile(r'argument key="([^"]*)" type="[^"]*"<\|sep\|>(.*?)<\|close\|>argument', re.S)


@dataclass
class ArgStats:
    samples: int = 0
    by_index: dict[int, list[tuple[bool, bool, bool]]] = field(default_factory=dict)  # (key, first, whole) right
    by_type: dict[str, list[bool]] = field(default_factory=dict)
    first_wrong: dict[str, int] = field(default_factory=lambda: {"other key": 0, "else": 0})

    def add(self, index: int, kind: str, key: bool, first: bool, whole: bool) -> None:
        self.by_index.setdefault(index, []).append((key, first, whole))
        self.by_type.setdefault(kind, []).append(whole)


def argument_tokens(pieces: list[str]) -> list[tuple[str, list[int], list[int]]]:
    """(key, indices of the key's tokens, indices of the value's tokens) per argument, from the answer's
    decoded tokens."""
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += len(p)
    out = []
    for m in ARGUMENT.finditer("".join(pieces)):
        key, value = ([i for i, s in enumerate(starts) if m.start(g) <= s < m.end(g)] for g in (1, 2))
        if key and value:
            out.append((m.group(1), key, value))
    return out


@torch.no_grad()
def arg_accuracy(model: nn.Module, vocab: CompactVocab, tokenizer, n: int = 60, seed: int = 4242,
                 form: str = tasks.SHIPPED.form) -> ArgStats:
    """Teacher-forced argument-value accuracy on ``n`` held-out single-tool tasks (those whose ids the
    vocabulary covers), requests in ``form``."""
    rng, stats = random.Random(seed), ArgStats()
    for _ in range(n):
        s = tasks.make("tool", rng, held_out=True, thinking=rng.random() < 0.6, style=tasks.Style(form))
        ids, n_prompt = encode_sample(s, tokenizer)
        if not vocab.covers(ids):
            continue
        x = torch.tensor(vocab.to_compact(ids))
        pred = model.compute_logits(train_forward(model, [x]))[n_prompt - 1:-1].argmax(-1).tolist()
        want = x[n_prompt:].tolist()
        args = json.loads(s.target["tool_calls"][0]["function"]["arguments"])
        stats.samples += 1
        def right(toks: list[int]) -> bool:
            return all(pred[j] == want[j] for j in toks)

        for i, (key, key_toks, toks) in enumerate(argument_tokens([tokenizer.decode([t]) for t in ids[n_prompt:]])):
            first = right(toks[:1])
            stats.add(i, type(args.get(key)).__name__, right(key_toks), first, right(toks))
            if not first:
                guess = tokenizer.decode([vocab.ids[pred[toks[0]]]]).strip()
                others = [json.dumps(v).strip('"[{') for k, v in args.items() if k != key]
                stats.first_wrong["other key" if guess and any(o.startswith(guess) for o in others) else "else"] += 1
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.argprobe", description=__doc__.splitlines()[0])
    add_source_arguments(p)
    p.add_argument("--n", type=int, default=60, help="held-out tool tasks")
    p.add_argument("--seed", type=int, default=4242, help="task seed (never a training seed)")
    p.add_argument("--form", choices=tasks.FORMS, default=tasks.SHIPPED.form, help="how requests write "
                   "their values (the model's --request-form; default: the shipped model's)")
    args = p.parse_args(argv)
    if (opened := open_source(args)) is None:
        return 2
    model, vocab, label = opened
    st = arg_accuracy(model, vocab, load_tokenizer(), args.n, args.seed, args.form)
    print(f"{label}: {st.samples} held-out tool tasks, teacher-forced arguments")
    for i, rows in sorted(st.by_index.items()):
        key, first, whole = (sum(r[c] for r in rows) / len(rows) for c in range(3))
        print(f"  argument {i}: n={len(rows):3d}  key {key:.2f}  first token {first:.2f}  whole value {whole:.2f}")
    for kind, rows in sorted(st.by_type.items()):
        print(f"  {kind:5s} values: n={len(rows):3d}  whole value {sum(rows) / len(rows):.2f}")
    print(f"  wrong first tokens: {st.first_wrong['other key']} start another argument's value, "
          f"{st.first_wrong['else']} do not")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
