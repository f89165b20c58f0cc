"""Where a structured answer's keys and types stand, and where the request shows them: the format-aware
targets of the attention supervision (``induction.KINDS``), over token ids.

A call writes each argument as ``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument``, a JSON
answer as ``{"K":VALUE,...}``; a request in lines form writes ``K: VALUE`` one per line, K the very token the
answer writes. ``answer_keys`` finds every key K an answer writes: the position before it (``="`` or the JSON
token that ends in ``"``), its tokens, and the position whose next token shows its type. Two pointers follow:

- ``type_targets`` (head 1): at the type, the request position right after ``K:``, whose token shows the type
  (``minute: "``, ``nights: 4``, ``artist: {``): a wrong argument most often has the wrong type.
- ``name_targets`` (head 1): at a call's ``tool="``, the tool's name where the answer's reasoning wrote it
  (`` close`` ``_payment``, the first token with its space) and where the declarations do: with the reasoning
  naming the right tool, a call can still write another tool's verb there. Spelled (``--attn-spell``), at each
  later token of the name too (``book_flight`` written where the reasoning said ``book_hotel``); it costs the
  choice among tools, so the shipped recipe leaves it off.
- ``verdict_targets`` (head 1): at the reasoning's ``The tool NAME`` (its last token, where ``does`` or ``is``
  comes next), NAME's last token where the declarations wrote it; the first position when no declaration does
  (a decline). Where a hard negative is offered (``open_table`` for ``set_table``) a decline's reasoning can
  name the asked tool and say ``does that``, so the check of the name against the offer is what this
  supervises.
  With the "list" reasoning (``Tools that convert: convert_lamp.`` before it) NAME's last token where the
  list wrote it instead, and ``list_targets`` adds, at the list's ``:`` and each ``,``, the next listed name's
  first token where the declarations wrote it (``[0]`` before ``none``).
- ``describe_targets`` (head 2): at the reasoning's ``The user wants to VERB the OBJ.`` (OBJ, before the
  period), OBJ where a declaration's description says ``Use this to VERB the OBJ.``; the first position when
  none does. The same check as the verdict's, made where both sides write the same tokens.
- ``key_targets`` (head 1): before the key, the request position where ``K:`` starts. The plain lookups point
  at every K of the prompt and drop a key that more than ``LOOKUP_SOURCES`` positions hold; in a choice among
  tools the other tools' schemas share keys, so an argument can take another tool's property.

``value_positions`` is where copies are supervised: inside argument blocks and a JSON response.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterator, Sequence

from training.data import SPECIAL_BASE

OPEN, CLOSE = 163587, 163588  # <|open|> and <|close|> of the K3 format
ARGUMENT, RESPONSE = 47185, 12092  # "argument" and "response" after <|open|> (Kimi vocabulary)
STRUCTURED = frozenset({"tool", "choose", "decline", "json", "followup", "session"})  # tasks with prose answers
KEY, ASSIGN, QUOTE, TYPE, COLON = 2355, 878, 1, 1798, 25  # ' key', '="', '"', ' type', ':'
OPEN_QUOTE = 414  # ' "' (``The tool "close_payment" does that.``: the name's tokens then as declared)
CALL, TOOL = 10257, 4453  # 'call' after <|open|>, ' tool' (``<|open|>call tool="NAME"``)
THE, DOES, IS = (1008, 646), 2354, 387  # 'The' / ' The', ' does', ' is' (``The tool NAME does that.``)
WANTS, TO, THE_, PERIOD, THIS = 11333, 308, 276, 13, 566  # ' wants', ' to', ' the', '.', ' this'
TOOLS, THAT, COMMA, NONE = 30391, 473, 11, 7810  # ' Tools', ' that', ',', ' none' (``Tools that VERB: none.``)
LOOKUP_SOURCES = 4  # a key stands in the schema's properties, its required list and the request: 3


def value_positions(ids: Sequence[int], kind: str) -> set[int] | None:
    """Positions of the tokens inside a call's argument blocks (and, for ``json``, inside the response) after
    the block's tag; ``None`` (every position) for the kinds without prose (warm-ups, recall lists)."""
    if kind not in STRUCTURED:
        return None
    tags = {ARGUMENT, RESPONSE} if kind == "json" else {ARGUMENT}
    out: set[int] = set()
    inside = False
    for u, tok in enumerate(ids):
        if tok == OPEN:
            inside = u + 1 < len(ids) and ids[u + 1] in tags
        elif tok == CLOSE:
            inside = False
        elif inside and ids[u - 1] != OPEN:
            out.add(u)
    return out


@functools.cache
def _tokenizer():
    from training.tok import load_tokenizer

    return load_tokenizer()


@functools.cache
def json_tokens() -> tuple[frozenset[int], frozenset[int]]:
    """Ids whose text starts with ``":`` (a JSON key's end, with the value's opening), and ids whose text ends
    with ``"`` (what stands before a key: ``{"``, ``","``, ``],"``)."""
    tok = _tokenizer()
    texts = [(i, tok.decode([i])) for i in range(SPECIAL_BASE)]
    return (frozenset(i for i, t in texts if t.startswith('":')), frozenset(i for i, t in texts if t.endswith('"')))


def answer_keys(ids: Sequence[int], a: int, b: int) -> Iterator[tuple[int, int, int, int]]:
    """``(before, start, end, typed)`` for each key an answer ``ids[a:b]`` writes: the key's tokens are
    ``ids[start:end]``, ``before`` the position just before them, ``typed`` the position whose next token
    shows the value's type (a JSON key's last token, before ``":...``; an argument's ``="`` before T)."""
    seps, quoted = json_tokens()
    for u in range(a + 1, b):
        if ids[u] not in seps:
            continue
        s = next((i for i in range(u - 1, max(a, u - 6) - 1, -1) if ids[i] in quoted), None)
        if s is not None and s != u - 1:
            yield s, s + 1, u, u - 1
    for u in range(a, b - 6):
        if (ids[u], ids[u + 1], ids[u + 2], ids[u + 3]) != (OPEN, ARGUMENT, KEY, ASSIGN):
            continue
        q = next((i for i in range(u + 4, b - 2) if ids[i] == QUOTE), None)
        if q is not None and q != u + 4 and (ids[q + 1], ids[q + 2]) == (TYPE, ASSIGN):
            yield u + 3, u + 4, q, q + 2


@functools.cache
def spaced(tok_id: int) -> int | None:
    """The id of the same text with a space before it (``create`` -> `` create``), if one token."""
    tok = _tokenizer()
    ids = tok.encode(" " + tok.decode([tok_id]))
    return int(ids[0]) if len(ids) == 1 else None


def name_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = LOOKUP_SOURCES,
                 only: Container[int] | None = None, spell: bool = False) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each call ``<|open|>call tool="NAME"`` of the answers, t at its ``="``: the first
    token of each earlier mention of NAME, in the answer before it with a space (the reasoning's
    ``The tool close_payment``) or anywhere before it as written (the declarations' ``"name":"close_payment"``).
    With ``spell``, instead one target at each of the name's tokens but the last, pointing at the mentions'
    next token: where ``book_hotel`` and ``book_flight`` are both offered, the choice falls at ``_hotel``.
    With ``only``, just the name tokens (the first, or those spelled) that stand at those positions."""
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for u in range(a, b - 5):
            if (ids[u], ids[u + 1], ids[u + 2], ids[u + 3]) != (OPEN, CALL, TOOL, ASSIGN):
                continue
            t = u + 3
            q = next((i for i in range(t + 1, b) if ids[i] == QUOTE), None)
            if q is None or q == t + 1:
                continue
            name, first = list(ids[t + 1:q]), spaced(ids[t + 1])
            m = len(name)
            steps = [i for i in (range(1, m) if spell else (0,)) if only is None or t + i + 1 in only]
            if not steps:  # before the scan of the whole prefix
                continue
            sources = [j for j in range(t - m + 1) if (ids[j] == name[0] or (j >= a and ids[j] == first))
                       and list(ids[j + 1:j + m]) == name[1:]]  # the cheap test first: this runs every step
            if 0 < len(sources) <= max_sources:
                out += [(t + i, [j + i for j in sources]) for i in steps]
    return out


@functools.cache
def unspaced(tok_id: int) -> int | None:
    """The id of the same text without its leading space (`` create`` -> ``create``), if one token."""
    tok = _tokenizer()
    text = tok.decode([tok_id])
    ids = tok.encode(text[1:]) if text.startswith(" ") else []
    return int(ids[0]) if len(ids) == 1 else None


def verdict_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = LOOKUP_SOURCES,
                    only: Container[int] | None = None) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each ``The tool NAME does``/``is`` of the answers (the ``check`` reasoning, in the
    reasoning or the content; the ``quote`` reasoning's in ``_quoted_verdict``), t at NAME's last token: the
    last token of each earlier NAME as written (the first token without its space: the declarations'
    ``"name":"set_table"``), or ``[0]`` where there is none
    and the verdict is `` is`` (not offered: a fixed place to look when the offer lacks the name). ``only``
    is accepted for the common signature; the verdict is never inside a value."""
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for u in range(max(a, 1), b - 2):
            if ids[u] != TOOL or ids[u - 1] not in THE or ids[u + 1] == ASSIGN:
                continue
            if ids[u + 1] == OPEN_QUOTE:
                out += _quoted_verdict(ids, u, b, max_sources)
                continue
            v = next((i for i in range(u + 2, min(b, u + 10)) if ids[i] in (DOES, IS)), None)
            first = unspaced(ids[u + 1])
            if v is None or first is None:
                continue
            said, m, t = list(ids[u + 1:v]), v - u - 1, v - 1  # the name as the reasoning wrote it
            name = [first, *said[1:]]
            listed = [j + m - 1 for j in range(a, u - m) if list(ids[j:j + m]) == said]
            sources = listed or [j + m - 1 for j in range(a - m + 1) if ids[j] == first and list(ids[j:j + m]) == name]
            if not sources and ids[v] == IS:
                sources = [0]
            if 0 < len(sources) <= max_sources:
                out.append((t, sources))
        out += list_targets(ids, a, b, max_sources)
    return out


def _quoted_verdict(ids: Sequence[int], u: int, b: int, max_sources: int) -> list[tuple[int, list[int]]]:
    """The "quote" reasoning's ``The tool "NAME" does``/``is`` (`` tool`` at u): t at the closing quote, where
    the verdict comes next, pointing at the token after each earlier NAME (the declarations' ``","`` after
    ``"name":"NAME``), or ``[0]`` where there is none and the verdict is `` is``. The three tokens before t
    are then NAME's last three, the same ids as before each source: the verb two back from the object is
    written alike on both sides (the "check" reasoning's `` convert`` and the declarations' ``convert`` are
    two ids)."""
    v = next((i for i in range(u + 3, min(b, u + 12)) if ids[i] in (DOES, IS)), None)
    if v is None or ids[v - 1] != QUOTE or v - 1 == u + 2:
        return []
    name, t = list(ids[u + 2:v - 1]), v - 1
    m = len(name)
    sources = [j + m for j in range(u + 2 - m + 1) if list(ids[j:j + m]) == name]
    if not sources and ids[v] == IS:
        sources = [0]
    return [(t, sources)] if 0 < len(sources) <= max_sources else []


def list_targets(ids: Sequence[int], a: int, b: int, max_sources: int = LOOKUP_SOURCES) -> list[tuple[int, list[int]]]:
    """For the "list" reasoning's ``Tools that VERB: NAME, NAME.`` (or ``none``) in answer ``[a, b)``: at the
    ``:`` and at each ``,``, the first token of the next listed name where the declarations wrote it (unspaced),
    or ``[0]`` before ``none``. Where the verdict then points at the listed name, not the declared one (each a
    one-token match: the verb here, the object there)."""
    out: list[tuple[int, list[int]]] = []
    for u in range(max(a, 1), b - 3):
        if ids[u] != TOOLS or ids[u + 1] != THAT or ids[u + 3] != COLON:
            continue
        p = u + 3
        while p + 1 < b and ids[p] in (COLON, COMMA):
            end = next((i for i in range(p + 1, min(b, p + 12)) if ids[i] in (COMMA, PERIOD)), None)
            if end is None:
                break
            if ids[p + 1] == NONE:
                sources = [0]
            else:
                first = unspaced(ids[p + 1])
                name = [first, *ids[p + 2:end]]
                sources = [j for j in range(a - len(name) + 1) if list(ids[j:j + len(name)]) == name]
            if 0 < len(sources) <= max_sources:
                out.append((p, sources))
            p = end
    return out


def describe_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = LOOKUP_SOURCES,
                     only: Container[int] | None = None) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each reasoning's ``The user wants to VERB the OBJ.``, t at OBJ's last token: the
    same token of each declaration's ``Use this to VERB the OBJ.`` (the description of the tool that does
    it), or ``[0]`` where no declaration has one (not offered). A tool name is three tokens
    (``convert`` ``_`` ``road``), so matching a reasoning's name against the declared ones needs the token two
    back at the last one, and spaced in the reasoning, unspaced in the declarations (a request for
    ``convert_road`` with ``share_road`` offered is the decline trained models miss most). The two sentences are
    the same tokens, the verb two back from the object in both. ``only`` is accepted for the common
    signature."""
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for u in range(a, b - 3):
            if ids[u] != WANTS or ids[u + 1] != TO:
                continue
            the = next((i for i in range(u + 3, min(b, u + 8)) if ids[i] == THE_), None)
            end = None if the is None else next((i for i in range(the + 2, min(b, the + 8)) if ids[i] == PERIOD),
                                                None)
            if end is None:
                continue
            phrase = [THIS, TO, *ids[u + 2:end]]
            m = len(phrase)
            sources = [j + m - 1 for j in range(a - m + 1) if ids[j] == THIS and list(ids[j:j + m]) == phrase] or [0]
            if len(sources) <= max_sources:
                out.append((end - 1, sources))
    return out


def _request_keys(ids: Sequence[int], key: list[int], before: int) -> list[int]:
    """Positions j < ``before`` where ``K:`` starts (K = the ``key`` tokens): where the request writes K."""
    k = len(key)
    return [j for j in range(0, before - k) if ids[j + k] == COLON and list(ids[j:j + k]) == key]


def type_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = LOOKUP_SOURCES,
                 only: Container[int] | None = None) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each key K of the answers, t where its type is written next (``answer_keys``): the
    prompt positions right after ``K:`` (where the request writes K's value). With ``only``, just the types
    whose token stands at those positions."""
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for _, start, end, typed in answer_keys(ids, a, b):
            if only is not None and typed + 1 not in only:
                continue
            k = end - start
            sources = [j + k + 1 for j in _request_keys(ids, list(ids[start:end]), a) if j + k + 1 < a]
            if 0 < len(sources) <= max_sources:
                out.append((typed, sources))
    return sorted(out)


def key_targets(ids: Sequence[int], answers: Sequence[tuple[int, int]], max_sources: int = 1,
                only: Container[int] | None = None) -> list[tuple[int, list[int]]]:
    """``(t, sources)`` for each key K of the answers, t just before it: the prompt positions where ``K:``
    starts (the request's line; one, unless the request writes the key twice). With ``only``, just the keys
    whose first token stands at those positions."""
    out: list[tuple[int, list[int]]] = []
    for a, b in sorted(answers):
        for before, start, end, _ in answer_keys(ids, a, b):
            if only is not None and start not in only:
                continue
            sources = _request_keys(ids, list(ids[start:end]), a)
            if 0 < len(sources) <= max_sources:
                out.append((before, sources))
    return sorted(out)
