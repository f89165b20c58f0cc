"""Does the model decide between calling a tool and declining? Teacher-forced, at the one token where the two
answers part ways.

A decline and a call share their first tokens (in thinking mode ``The user wants to <verb> the <object>.``),
then part: `` No`` against `` The`` (reasoning ``plain``), `` is`` against `` does`` after the tool's name
(any reasoning but ``plain``), or, without thinking, the content's first token against the call's (with
``nothink`` ``decide``, the content opens with those sentences and they part where the reasoning would). For
held-out decline, single-tool and choose tasks this probe builds the other branch's answer, finds the first
token where the two encodings differ, and reports P(right) / (P(right) + P(other)) there. A model that has not
learnt the decision sits near its training prior for every kind alike. The ``object`` kind is declines whose
asked tool shares its object with an offered one (``tasks.make_decline``'s ``object_share``).

    python -m training.decideprobe k3serve/models/weights/k3-default
    python -m training.decideprobe runs/wk4 --form inline --reasoning plain
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

import torch
from torch import nn

from training import tasks
from training.forward import train_forward
from training.grow import add_source_arguments, add_task_arguments, parse_source
from training.render import encode_sample
from training.styles import add_style_arguments, style_of
from training.tok import load_tokenizer
from training.vocab import CompactVocab

# "object": declines whose asked tool shares its object with an offered one (``convert_road`` asked,
# ``share_road`` offered), the declines a model finds hardest
KINDS = ("decline", "object", "tool", "choose")


def other_branch(s: tasks.Sample, style: tasks.Style) -> dict:
    """The assistant message of the branch ``s`` does not take: a call of the first offered tool for a
    decline (with any reasoning but ``plain``, of the asked tool: the reasoning names it either way), a
    decline for a call."""
    asked = s.meta["asked"] if s.kind == "decline" else s.expected["tool"]
    verb, obj = asked.split("_", 1)  # tool names are verb_object
    offer = [t["function"]["name"] for t in s.tools]
    if s.kind == "decline":
        name = asked if style.reasoning != "plain" else s.tools[0]["function"]["name"]
        call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}
        return {**tasks.decided(verb, obj, name, True, s.thinking, style, offer), "tool_calls": [call]}
    return tasks.decided(verb, obj, asked, False, s.thinking, style, offer)


@torch.no_grad()
def decision(model: nn.Module, vocab: CompactVocab, tokenizer, s: tasks.Sample, style: tasks.Style
             ) -> tuple[float, str, str] | None:
    """(P(right) / (P(right) + P(other)) at the parting token, right token, other token); None if the
    vocabulary does not cover the sample."""
    ids, n_prompt = encode_sample(s, tokenizer)
    alt, _ = encode_sample(replace(s, target=other_branch(s, style)), tokenizer)
    if not vocab.covers(ids) or not vocab.covers(alt):
        return None
    d = next(i for i in range(n_prompt, min(len(ids), len(alt))) if ids[i] != alt[i])
    x = torch.tensor(vocab.to_compact(ids[:d]))
    p = torch.softmax(model.compute_logits(train_forward(model, [x])[-1:]).float().flatten(), -1)
    right, other = (p[vocab.to_compact([t])[0]].item() for t in (ids[d], alt[d]))
    return right / max(right + other, 1e-30), tokenizer.decode([ids[d]]), tokenizer.decode([alt[d]])


def probe(model: nn.Module, vocab: CompactVocab, tokenizer, style: tasks.Style, n: int = 15, seed: int = 99
          ) -> dict[tuple[str, bool], list[float]]:
    """P(right branch) for ``n`` held-out tasks per kind and thinking mode."""
    rng, out = random.Random(seed), {}
    for kind in KINDS:
        for thinking in (True, False):
            extra = {"object_share": 1.0} if kind == "object" else {}
            made = (tasks.make("decline" if kind == "object" else kind, rng, held_out=True, thinking=thinking,
                               style=style, **extra) for _ in range(n))
            got = [decision(model, vocab, tokenizer, s, style) for s in made]
            out[(kind, thinking)] = [g[0] for g in got if g is not None]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.decideprobe", description=__doc__.splitlines()[0])
    add_source_arguments(p)
    add_task_arguments(p, 15, 99, "held-out tasks per kind and thinking mode")
    add_style_arguments(p)
    args, opened = parse_source(p, argv)
    if opened is None:
        return 2
    model, vocab, label = opened
    res = probe(model, vocab, load_tokenizer(), style_of(args), args.n, args.seed)
    print(f"{label}: P(right branch) at the token where calling and declining part, held-out tasks")
    for (kind, thinking), ps in res.items():
        mean = sum(ps) / len(ps) if ps else float("nan")
        print(f"  {kind:8s} {'thinking' if thinking else 'no-think':8s} n={len(ps):3d}  mean {mean:.2f}  "
              f"right > 0.5: {sum(q > 0.5 for q in ps)}/{len(ps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
