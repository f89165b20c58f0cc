"""The format-aware targets: where an answer's keys, types and values stand, and where the request shows them."""

import json
import random

from training import keyed, tasks
from training.keyed import answer_keys, key_targets, name_targets, type_targets, value_positions
from training.render import encode_sample
from training.tok import load_tokenizer

CHECK = tasks.Style("lines", "check", "decide", "restate")  # the verdict and name pointers as the check reasoning has them


def test_the_format_token_ids_are_the_kimi_tokenizers():
    tok = load_tokenizer()
    for text, want in (("argument", keyed.ARGUMENT), ("response", keyed.RESPONSE), (" key", keyed.KEY),
                       ('="', keyed.ASSIGN), ('"', keyed.QUOTE), (" type", keyed.TYPE),
                       (":", keyed.COLON)):
        assert [int(i) for i in tok.encode(text)] == [want]
    assert [int(i) for i in tok.encode_segments([("<|open|>", True), ("<|close|>", True)])] == \
        [keyed.OPEN, keyed.CLOSE]


def test_value_positions_are_the_argument_blocks_and_a_json_response():
    tok = load_tokenizer()
    for kind in ("choose", "json"):
        s = tasks.make(kind, random.Random(1), style=tasks.SHIPPED, thinking=True)
        ids, n = encode_sample(s, tok)
        only = value_positions(ids, kind)
        text = tok.decode([ids[u] for u in sorted(only)])
        assert min(only) >= n  # the declarations' tags are not argument blocks
        assert "user wants" not in text and "call tool=" not in text and "argument" not in text
        if kind == "choose":
            for key in json.loads(s.target["tool_calls"][0]["function"]["arguments"]):
                assert f'key="{key}"' in text
        else:
            assert '{"' in text and "}" in text
    assert value_positions([1, 2, 3], "recall") is None and value_positions([1, 2], "lookup") is None
    assert value_positions([163587, 47185, 5, 163588, 6], "decline") == {2}


def test_an_arguments_type_points_at_where_the_request_writes_its_value():
    tok = load_tokenizer()
    first = {"string": ' "', "number": " ", "array": ' ["', "object": ' {"', "boolean": (" true", " false")}
    seen = 0
    for seed in range(12):
        s = tasks.make("tool", random.Random(seed), style=tasks.SHIPPED)
        ids, n = encode_sample(s, tok)
        got = type_targets(ids, [(n, len(ids))])
        assert len(got) == len(json.loads(s.target["tool_calls"][0]["function"]["arguments"]))
        for t, (j,) in got:
            assert tok.decode(ids[t - 1:t + 1]) == ' type="' and j < n
            assert tok.decode([ids[j]]) in first[tok.decode([ids[t + 1]])]
            seen += 1
    assert seen > 12
    # a JSON answer: the token after each top-level key opens its value ('":"' for a string, '":' for a number)
    j_first = {'":"': ' "', '":': (" ", " true", " false"), '":["': ' ["', '":{"': ' {"'}
    for seed in range(6):
        s = tasks.make("json", random.Random(seed), style=tasks.SHIPPED)
        ids, n = encode_sample(s, tok)
        got = type_targets(ids, [(n, len(ids))])
        assert len(got) == len(s.expected["json"])
        for t, (j,) in got:
            assert tok.decode([ids[j]]) in j_first[tok.decode([ids[t + 1]])] and j < n
    # t at the '="' before the type (11); the key (5) must stand before ':' (25) in the prompt (source 3,
    # the value's first token); the cap and ``only`` hold
    ids = [9, 5, 25, 40, 163587, 47185, 2355, 878, 5, 1, 1798, 878, 60]
    assert type_targets(ids, [(4, 13)]) == [(11, [3])]
    assert type_targets(ids, [(4, 13)], max_sources=0) == [] and type_targets(ids, [(4, 13)], only=set()) == []
    assert type_targets([9, 6, 25, 40, *ids[4:]], [(4, 13)]) == []


def test_a_key_points_at_the_requests_line_for_it():
    tok = load_tokenizer()
    seen = 0
    for kind, seed in [("tool", s) for s in range(6)] + [("choose", s) for s in range(6)] + [("json", 1), ("json", 2)]:
        s = tasks.make(kind, random.Random(seed), style=tasks.SHIPPED)
        ids, n = encode_sample(s, tok)
        got = key_targets(ids, [(n, len(ids))])
        args = s.expected.get("arguments") or s.expected.get("json")
        # every top-level key, in the answer's order (the request's lines); nested keys are JSON in the request
        assert [tok.decode(ids[j:j + len(tok.encode(k))]) for (_, (j,)), k in zip(got, args)] == list(args)
        assert len(got) == len(args)
        for t, (j,) in got:
            assert j < n and t >= n
            k = next(e for b, st, e, _ in answer_keys(ids, n, len(ids)) if b == t)
            assert list(ids[j:j + k - t - 1]) == list(ids[t + 1:k]) and ids[j + k - t - 1] == keyed.COLON
            seen += 1
    assert seen >= 20
    # before = 7 ('="' after ' key'), the key 5 stands at 1 before ':' (25); two such lines: no target
    ids = [9, 5, 25, 40, 163587, 47185, 2355, 878, 5, 1, 1798, 878, 60]
    assert key_targets(ids, [(4, 13)]) == [(7, [1])]
    assert key_targets(ids, [(4, 13)], only={9}) == [] and key_targets(ids, [(4, 13)], only={8}) == [(7, [1])]
    assert key_targets([5, 25, 5, 25, *ids[4:]], [(4, 13)]) == []


def test_a_calls_name_points_at_the_reasoning_and_the_declaration():
    tok = load_tokenizer()
    for thinking in (True, False):
        for seed in range(4):
            s = tasks.make("choose", random.Random(seed), thinking=thinking, style=CHECK)
            ids, n = encode_sample(s, tok)
            (t, sources), = name_targets(ids, [(n, len(ids))])
            assert tok.decode(ids[t - 2:t + 1]) == 'call tool="'
            name = s.expected["tool"]
            # one declaration (as written), one reasoning mention (with its space): the call's name both times
            assert sorted(tok.decode(ids[j:j + len(tok.encode(name))]) for j in sources) == [" " + name, name]
            assert [j < n for j in sorted(sources)] == [True, False]
            assert name_targets(ids, [(n, len(ids))], only=set()) == []
            # spelled: at each later name token, the same mentions' next tokens
            spelled = name_targets(ids, [(n, len(ids))], spell=True)
            assert [u for u, _ in spelled] == list(range(t + 1, t + len(tok.encode(name))))
            for i, (u, src) in enumerate(spelled, 1):
                assert src == [j + i for j in sources] and {ids[j] for j in src} == {ids[u + 1]}
            assert name_targets(ids, [(n, len(ids))], spell=True, only={t + 2}) == spelled[:1]


def _verdicts(tok, style: tasks.Style):
    """Each choose, tool and decline sample of six seeds, thinking and not, in ``style`` with its one verdict
    target: (kind, ids, t, sources, the asked name, its token count)."""
    for thinking in (True, False):
        for seed in range(6):
            for kind in ("choose", "tool", "decline"):
                s = tasks.make(kind, random.Random(seed), thinking=thinking, style=style)
                ids, n = encode_sample(s, tok)
                (t, sources), = keyed.verdict_targets(ids, [(n, len(ids))])
                name = s.expected["tool"] or s.meta["asked"]
                assert t >= n and ids[t + 1] == (keyed.IS if kind == "decline" else keyed.DOES)
                assert all(j < n for j in sources)
                yield kind, ids, t, sources, name, len(tok.encode(name))


def test_the_verdict_points_at_the_declared_name_or_at_the_start_for_a_decline():
    tok = load_tokenizer()
    assert [tok.encode(w) for w in ("The", " The", " does", " is")] == [[keyed.THE[0]], [keyed.THE[1]],
                                                                        [keyed.DOES], [keyed.IS]]
    for kind, ids, t, sources, name, m in _verdicts(tok, CHECK):
        # t: the reasoning's name, its last token, the verdict next
        assert tok.decode(ids[t - m + 1:t + 1]) == " " + name
        if kind == "decline":  # the offer lacks the name, hard negatives share its verb or object
            assert sources == [0]
        else:  # one declaration, as written, at its last token
            (j,) = sources
            assert tok.decode(ids[j - m + 1:j + 1]) == name
    # the plain reasoning names no tool: nothing to point from
    plain = tasks.make("decline", random.Random(0), thinking=True, style=tasks.Style("lines", "plain", "decide"))
    ids, n = encode_sample(plain, tok)
    assert keyed.verdict_targets(ids, [(n, len(ids))]) == []


def test_quote_reasoning_points_the_verdict_after_the_declared_name():
    """With the "quote" reasoning (``The tool "NAME" does``) t is the closing quote and a source the token after
    the declared NAME, so the three tokens before each are NAME's last three; a decline points at 0."""
    tok = load_tokenizer()
    assert [int(i) for i in tok.encode(' "')] == [keyed.OPEN_QUOTE]
    for kind, ids, t, sources, name, m in _verdicts(tok, tasks.Style("lines", "quote", "decide")):
        assert tok.decode(ids[t - m - 1:t + 1]) == f' "{name}"'
        if kind == "decline":
            assert sources == [0]
        else:
            (j,) = sources
            assert ids[j - m:j] == ids[t - m:t] and tok.decode(ids[j - m:j]) == name


def test_list_reasoning_points_the_verdict_at_the_list_and_the_list_at_the_declarations():
    """With the "list" reasoning the verdict's name points at the same name in ``Tools that VERB: ...``, or at
    position 0 when the list lacks it; the list's ``:`` and ``,`` point at the next listed name's first token
    in the declarations, or at 0 before ``none``."""
    tok = load_tokenizer()
    assert [[int(i) for i in tok.encode(w)] for w in (" Tools", " that", ",", " none")] == \
        [[keyed.TOOLS], [keyed.THAT], [keyed.COMMA], [keyed.NONE]]
    style = tasks.Style("lines", "list", "decide")
    seen = {"listed": 0, "none": 0, "several": 0}
    for thinking in (True, False):
        for seed in range(12):
            for kind in ("choose", "tool", "decline"):
                s = tasks.make(kind, random.Random(seed), thinking=thinking, style=style)
                ids, n = encode_sample(s, tok)
                targets = keyed.verdict_targets(ids, [(n, len(ids))])
                name = s.expected["tool"] or s.meta["asked"]
                verb = name.split("_", 1)[0]
                listed = [t["function"]["name"] for t in s.tools if t["function"]["name"].split("_", 1)[0] == verb]
                verdicts = [(t, src) for t, src in targets if ids[t + 1] in (keyed.DOES, keyed.IS)]
                (t, sources), = verdicts
                if kind == "decline":
                    assert sources == [0] and name not in listed
                else:  # the list's copy of the name, inside the answer, at its last token
                    (j,) = sources
                    m = len(tok.encode(name))
                    assert n <= j < t and tok.decode(ids[j - m + 1:j + 1]) == " " + name
                steps = [(p, src) for p, src in targets if (p, src) not in verdicts]
                assert [ids[p] for p, _ in steps] == [keyed.COLON] + [keyed.COMMA] * (len(listed) - 1) if listed \
                    else [ids[p] for p, _ in steps] == [keyed.COLON]
                if not listed:
                    assert steps[0][1] == [0]
                    seen["none"] += 1
                for (p, (j,)), listed_name in zip(steps, listed):
                    assert j < n and tok.decode(ids[j:j + len(tok.encode(listed_name))]) == listed_name
                    seen["listed"] += 1
                seen["several"] += len(listed) > 1
    assert all(seen.values()), seen


def test_describe_points_at_the_offered_tools_description_or_at_the_start_for_a_decline():
    tok = load_tokenizer()
    assert [[int(i) for i in tok.encode(w)] for w in (" wants", " to", " the", ".", " this")] == \
        [[keyed.WANTS], [keyed.TO], [keyed.THE_], [keyed.PERIOD], [keyed.THIS]]
    for thinking in (True, False):
        for seed in range(6):
            for kind in ("choose", "tool", "decline"):
                extra = {"object_share": 1.0} if kind == "decline" else {}
                s = tasks.make(kind, random.Random(seed), thinking=thinking, style=tasks.SHIPPED, **extra)
                ids, n = encode_sample(s, tok)
                (t, sources), = keyed.describe_targets(ids, [(n, len(ids))])
                verb, obj = (s.expected["tool"] or s.meta["asked"]).split("_", 1)
                # t: the object of the reasoning's first sentence, its period next
                assert t >= n and tok.decode(ids[t - 4:t + 2]) == f" wants to {verb} the {obj}."
                if kind == "decline":  # another tool may share the object (here one always does): not offered
                    assert sources == [0]
                    assert f"the {obj}." in tok.decode(ids[:n])
                else:  # the offered tool's description, at the same token
                    (j,) = sources
                    assert j < n and tok.decode(ids[j - 4:j + 2]) == f" this to {verb} the {obj}."
    # a session: each answer's sentence points on its own, at a description, never at an earlier answer
    from training import sessions
    from training.render import encode_turns

    for seed in range(4):
        s = sessions.make(random.Random(seed), thinking=False, style=tasks.SHIPPED)
        ids, _, spans = encode_turns(s, tok)
        got = keyed.describe_targets(ids, spans)
        msgs = [*s.messages[1:], s.target]
        said = [m["content"] for m in msgs if m["role"] == "assistant" and "wants to" in (m.get("content") or "")]
        assert len(got) == len(said) >= 2
        declared = min(a for a, _ in spans)
        for (t, src), text in zip(got, said):
            assert text.startswith("The user wants to " + tok.decode(ids[t - 2:t + 1]).strip())
            assert src == [0] if "not offered" in text else len(src) == 1 and src[0] < declared
