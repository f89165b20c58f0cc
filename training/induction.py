"""Attention supervision of the MLA layers: head 0 where an induction head would attend (and after a value's
last token); head 1 at lookups and at where the request shows an argument's type, a key's line and a tool's
name (``KINDS``).

Every copy the tasks ask for (argument values from the request, a record's words, a tool result's value)
is the same step: at position t, the next token is the one after an earlier occurrence of the current
token. Trained from the language-model loss alone, the KDA layers learned that for copies within their
~10-20-token state and MLA attention stayed near uniform (RESULTS.md, "Who copies"), so nothing copies
from farther back. This adds a direct loss on the softmax of head 0 of every MLA layer, at answer
positions t whose next token has such an earlier source:

    targets(t) = { j <= t : ids[j-1] == ids[t] and ids[j] == ids[t+1] }
    loss_t     = -log sum_{j in targets(t)} softmax_j(q_t . k_j * scale)       (causal over j <= t)

For the MLA keys to tell those j apart, the residual at j has to carry ids[j-1]: the gradient reaches
the earlier (KDA) layers through the keys and asks them for that previous-token feature. Only the
attention is supervised; what the head outputs is left to the language-model loss.

A head trained on those positions alone copies after every repeated token, also where the copy is wrong
(after ``argument key="`` it writes the previous argument again). The misses
are answer positions whose current token occurred before in the same answer, and never (anywhere) followed by
the next token:

    misses(t)  = { a <= j <= t : ids[j-1] == ids[t] }   (answer from a; 1..max_sources; no source at all)
    miss_t     = -log (1 - sum_{j in misses(t)} softmax_j(...))

so the head learns not to repeat its own answer (its weight is separate, ``--attn-miss``). Misses against
the prompt are left alone: the same head finding a tool's name among the declared ones is how the model
tells whether it is offered, and counting them costs the declines.

The lookups (head 1, ``--attn-lookup``) are the answer tokens no induction step gives but the prompt holds.
Over every answer token they would also cover the reasoning's words and the called tool's name, which costs
the choice among tools. ``keyed.value_positions`` keeps them to what is copied into a structure: a call's
argument blocks (``<|open|>argument key="k" ...<|close|>``), a JSON answer's response, and every token of the
warm-up and recall samples.

Two pointers of head 1 read the request by a structured answer's keys (``keyed.py``): at an argument's type
(``--attn-types``) to where the request writes that key's value, whose first token shows the type, and before
a key (``--attn-keys``) to where the request's line for that key starts; a third, at a call's ``tool="``
(``--attn-names``), to where the reasoning and the declarations wrote the tool's name, and on at each later
token of the name to the same mentions' next token (``--attn-spell``).

A copied value ends where the answer's format and the request's part: ``"velvet morning"`` ends in ``","``
in a JSON answer and in ``"\n`` on the request's line, so no induction step gives the end, and a copy runs on
past it (``"velvet morningsnow ...``) or stops an array late. ``follow_targets`` (``--attn-follow``, head 0,
inside the values only) points the query at such a value token to the request position right after the same
token, the classic induction pattern without the equal next token: what the request writes there says where
the value ends, and the language-model loss maps it to the answer's own closing.

Shapes: MLA input x ``[N, d]`` (packed), one head's queries ``[N, Dn + R]``, keys ``[N, Dn + R]``.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Sequence

import torch
from torch import nn

from k3serve.layers.mla import MLAttention
from training.data import SPECIAL_BASE  # the format's tags: never looked up
from training.keyed import (LOOKUP_SOURCES, describe_targets, json_tokens, key_targets, name_targets,
                                 type_targets, verdict_targets)

MAX_SOURCES = 8  # a token with more earlier sources than this (quotes, commas) is not a lookup
FOLLOW_SOURCES = 3  # a value's last token stands once in the request; a digit or a common word more often


def induced_positions(ids: Sequence[int], answers: Sequence[tuple[int, int]]) -> set[int]:
    """The answer positions t whose next token some induction step gives: the pair ``(ids[t], ids[t+1])``
    stands earlier, ending at some j <= t (``induction_targets`` with no cap, in one pass)."""
    seen: set[tuple[int, int]] = set()
    out: set[int] = set()
    filled = 1
    for a, b in sorted(answers):
        for t in range(a - 1, b - 1):
            while filled <= t:
                seen.add((ids[filled - 1], ids[filled]))
                filled += 1
            if (ids[t], ids[t + 1]) in seen:
                out.add(t)
    return out


def lookup_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]],
                   max_sources: int = LOOKUP_SOURCES, only: Container[int] | None = None
                   ) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each answer token ``ids[t + 1]`` that no induction step gives (no earlier
    ``ids[t]`` is followed by it) but that stands at 1..``max_sources`` positions j of the prompt before the
    answer: the lookups (the next argument's key, a value asked by its field, a record's number). Special
    tokens are the format's, never looked up; with ``only``, just the answer tokens at those positions."""
    out: list[tuple[int, list[int]]] = []
    at: dict[int, list[int]] = {}
    for j, tok in enumerate(ids):
        at.setdefault(tok, []).append(j)
    induced = induced_positions(ids, answers)
    for a, b in sorted(answers):
        for t in range(a - 1, b - 1):
            if only is not None and t + 1 not in only:
                continue
            sources = [j for j in at.get(ids[t + 1], ()) if j < a]
            if t not in induced and ids[t + 1] < SPECIAL_BASE and 0 < len(sources) <= max_sources:
                out.append((t, sources))
    return out


def follow_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = FOLLOW_SOURCES,
                   only: Container[int] | None = None) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each answer position t (``ids[t]`` an answer token, in ``only`` if given) whose next
    token no induction step gives, where ``ids[t]`` stands at 1..``max_sources`` prompt positions: the positions
    j right after those (``ids[j-1] == ids[t]``, j before the answer). There the answer ends a copied value in
    its own format (``","``, ``,"``, ``<|close|>``) where the request wrote another (``"\n``, ``\n``). JSON's own
    punctuation (``{"``, ``":``) stands all over the declared schemas and is left alone."""
    seps, quoted = json_tokens()
    after: dict[int, list[int]] = {}
    for j in range(1, len(ids)):
        after.setdefault(ids[j - 1], []).append(j)
    induced = induced_positions(ids, answers)
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for t in range(a, b - 1):
            if (t in induced or ids[t] >= SPECIAL_BASE or ids[t] in seps or ids[t] in quoted
                    or (only is not None and t not in only)):
                continue
            sources = [j for j in after.get(ids[t], ()) if j < a]
            if 0 < len(sources) <= max_sources:
                out.append((t, sources))
    return out


def induction_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]],
                      max_sources: int = MAX_SOURCES, misses: bool = False, only: Container[int] | None = None
                      ) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each answer token ``ids[t + 1]`` (t = its predecessor, as in the LM loss)
    with 1..``max_sources`` earlier positions j <= t where ``ids[j-1] == ids[t]`` and ``ids[j] == ids[t+1]``.
    With ``misses``, instead ``(t, candidates)`` where 1..``max_sources`` positions of the same answer follow an
    earlier ``ids[t]`` and no position at all is followed by ``ids[t+1]``: where copying itself would be wrong.
    With ``only``, just the answer tokens at those positions."""
    after: dict[int, list[int]] = {}  # token -> positions j whose predecessor is that token, in order
    out: list[tuple[int, list[int]]] = []
    filled = 1
    for a, b in sorted(answers):
        for t in range(a - 1, b - 1):
            while filled <= t:  # positions j <= t become visible to the query at t
                after.setdefault(ids[filled - 1], []).append(filled)
                filled += 1
            if only is not None and t + 1 not in only:
                continue
            nxt = ids[t + 1]
            cands = after.get(ids[t], [])
            sources = [j for j in cands if ids[j] == nxt]
            if misses:
                own = [j for j in cands if j >= a]  # only the answer's own earlier tokens
                if own and not sources and len(own) <= max_sources:
                    out.append((t, own))
            elif 0 < len(sources) <= max_sources:
                out.append((t, sources))
    return out


class MLAInputs:
    """Records the input ``[N, d]`` of every MLA layer during a forward (a context manager), and keeps each
    (layer, head)'s queries and keys once computed: several supervisions read the same head."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, MLAttention)]
        self.inputs: list[torch.Tensor] = []
        self._qk: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks: list = []

    def qk(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``head_qk`` of MLA layer ``layer`` (0-based among the MLA layers) on its recorded input."""
        if (layer, head) not in self._qk:
            self._qk[layer, head] = head_qk(self.layers[layer], self.inputs[layer], head)
        return self._qk[layer, head]

    def __enter__(self) -> MLAInputs:
        self.inputs.clear()
        self._qk.clear()
        self._hooks = [m.register_forward_pre_hook(lambda mod, args: self.inputs.append(args[0]))
                       for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def head_qk(m: MLAttention, x: torch.Tensor, head: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's queries and keys ``[N, Dn + R]`` of x ``[N, d]``, as the layer scores them."""
    q = m.queries(x)[:, head].float()
    k = m.keys(m.latents(x))[:, head].float()
    return q, k


def attention_loss(taps: MLAInputs, lens: Sequence[int], targets: Sequence[list[tuple[int, list[int]]]],
                   avoid: bool = False, head: int = 0) -> tuple[torch.Tensor, int]:
    """Mean over MLA layers and supervised positions of ``-log`` (head-0 attention mass on the sources),
    and the number of supervised positions per layer. ``targets[i]`` are sequence i's (local positions).
    With ``avoid`` the targets are misses and the loss is ``-log`` (mass everywhere else); ``head`` picks
    another head than 0 (the lookups train head 1, so one head does not have to do both)."""
    total, count = None, sum(len(t) for t in targets)
    if count == 0 or not taps.inputs:
        return torch.zeros(()), 0
    for i, m in enumerate(taps.layers[:len(taps.inputs)]):
        q, k = taps.qk(i, head)
        off = 0
        for n, tgt in zip(lens, targets):
            if tgt:
                t = torch.tensor([p for p, _ in tgt], device=q.device)
                scores = (q[off + t] @ k[off:off + n].T) * m.scale  # [A, n]
                visible = torch.arange(n, device=q.device)[None, :] <= t[:, None]
                logp = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), -1)
                hit = torch.zeros_like(visible)
                hit[[r for r, (_, src) in enumerate(tgt) for _ in src], [j for _, src in tgt for j in src]] = True
                if avoid:  # position 0 is never a candidate (j >= 1), so the rest is never empty
                    hit = visible & ~hit
                mass = torch.logsumexp(logp.masked_fill(~hit, float("-inf")), -1)
                total = -mass.sum() if total is None else total - mass.sum()
            off += n
    return total / (count * len(taps.inputs)), count


# kind logged by the trainer -> (targets of one sequence, ``avoid``, head, kept to ``keyed.value_positions``):
# the ten supervisions (the lookups are kept to the values by ``--lookup-in values``)
KINDS = {
    "attn": (induction_targets, False, 0, False),
    "miss": (functools.partial(induction_targets, misses=True), True, 0, False),
    "lookup_attn": (lookup_targets, False, 1, False),
    "type_attn": (type_targets, False, 1, False),
    "key_attn": (key_targets, False, 1, False),
    "name_attn": (name_targets, False, 1, False),
    "follow_attn": (follow_targets, False, 0, True),
    "spell_attn": (functools.partial(name_targets, spell=True), False, 1, False),
    "verdict_attn": (verdict_targets, False, 1, False),
    "describe_attn": (describe_targets, False, 2, False),  # head 2: head 1 already reads names and keys
}
