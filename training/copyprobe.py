"""Which layers copy: a run's snapshot on synthetic copies, whole and with the MLA or the KDA outputs zeroed.

Every task of the default model copies (argument values, records, tool results), and the softmax (MLA)
layers are the ones that can find a token anywhere in a 2k context; the KDA layers copy from a state of
H x K x K numbers. This probe tells which of them does the copying in a trained snapshot:

- teacher-forced accuracy on ``data.induce_sample`` copies of n tokens (w_2..w_n; w_1 is found through the
  separator), for several n, with every MLA ``o_proj`` or every KDA ``o_proj`` zeroed;
- per MLA layer and head, on one copy: the attention entropy at the answer positions (against uniform)
  and the attention mass on the induction target (the token after the earlier occurrence of the current one).

    python -m training.copyprobe runs/i1 --step 425
    python -m training.copyprobe k3serve/models/weights/k3-default
"""

from __future__ import annotations

import argparse
import copy
import math
import random

import torch
from torch import nn

from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import MLAttention
from training import data
from training.forward import train_forward
from training.grow import add_source_arguments, open_source
from training.vocab import CompactVocab

LENGTHS = (8, 24, 50, 100)


def zero_outputs(model: nn.Module, kind: type[nn.Module]) -> None:
    """Zero the output projection of every ``kind`` layer (MLAttention or KimiDeltaAttention): the layer
    then adds nothing to the residual stream."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, kind):
                m.o_proj.weight.zero_()


@torch.no_grad()
def copy_accuracy(model: nn.Module, vocab: CompactVocab, n: int, samples: int = 6, seed: int = 1) -> float:
    """Teacher-forced argmax accuracy on w_2..w_n of ``samples`` synthetic copies of ``n`` tokens."""
    rng, pool = random.Random(seed), data.token_pool(vocab)
    right = total = 0
    for _ in range(samples):
        e = data.induce_sample(rng, pool, (n, n))
        ids = torch.tensor(vocab.to_compact(e.ids))
        hidden = train_forward(model, [ids])
        pred = model.compute_logits(hidden[e.n_prompt:len(e.ids) - 1]).argmax(-1)
        right += int((pred == ids[e.n_prompt + 1:]).sum())
        total += len(e.ids) - e.n_prompt - 1
    return right / total


def _scores(m: MLAttention, x: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``[H, N, N]`` of one sequence's MLA layer input ``x`` ``[N, d]``."""
    N = x.shape[0]
    s = torch.einsum("qhd,khd->hqk", m.queries(x), m.keys(m.latents(x))) * m.scale
    return s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)


@torch.no_grad()
def mla_attention(model: nn.Module, vocab: CompactVocab, n: int = 30, seed: int = 3) -> list[dict]:
    """Per MLA layer: mean entropy per head at the answer positions, the uniform entropy there, the mean
    attention mass per head on the induction target and what uniform attention would put there."""
    e = data.induce_sample(random.Random(seed), data.token_pool(vocab), (n, n))
    inputs: list[tuple[MLAttention, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0])))
             for m in model.modules() if isinstance(m, MLAttention)]
    try:
        train_forward(model, [torch.tensor(vocab.to_compact(e.ids))])
    finally:
        for h in hooks:
            h.remove()
    target = {i: e.ids.index(e.ids[i]) + 1 for i in range(e.n_prompt, len(e.ids) - 1)}  # w_k -> after its 1st copy
    rows = list(target)
    out = []
    for m, x in inputs:
        p = _scores(m, x)
        entropy = -(p.clamp_min(1e-12).log() * p).sum(-1)[:, rows].mean(-1)
        mass = torch.stack([p[:, i, target[i]] for i in rows], -1).mean(-1)
        out.append({"layer": m.layer_idx, "entropy": [round(float(v), 2) for v in entropy],
                    "uniform_entropy": round(sum(math.log(i + 1) for i in rows) / len(rows), 2),
                    "target_mass": [round(float(v), 3) for v in mass],
                    "uniform_mass": round(sum(1 / (i + 1) for i in rows) / len(rows), 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.copyprobe", description=__doc__.splitlines()[0])
    add_source_arguments(p)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="copy lengths to score")
    args = p.parse_args(argv)
    if (opened := open_source(args)) is None:
        return 2
    model, vocab, label = opened
    print(f"{label}: teacher-forced copy accuracy (w_2..w_n) by copy length n")
    for label, kind in (("whole model", None), ("MLA outputs zeroed", MLAttention),
                        ("KDA outputs zeroed", KimiDeltaAttention)):
        m = model
        if kind:
            m = copy.deepcopy(model)
            zero_outputs(m, kind)
        print(f"  {label:20s} " + "  ".join(f"n={n}: {copy_accuracy(m, vocab, n):.2f}" for n in args.lengths),
              flush=True)
    print("MLA attention on a 30-token copy (per head): entropy vs uniform, mass on the induction target vs uniform")
    for r in mla_attention(model, vocab):
        print(f"  layer {r['layer']}: entropy {r['entropy']} (uniform {r['uniform_entropy']}), "
              f"target mass {r['target_mass']} (uniform {r['uniform_mass']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
