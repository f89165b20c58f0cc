"""Generated tasks render in the K3 format, round-trip through the server's parser, and score strictly."""

import json
import random

import pytest

from training import data, pools, sessions, tasks
from training.render import STOP_ID, encode_sample, parse_output, prompt_ids
from training.tok import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("kind", [*tasks.KINDS, *tasks.WARMUP_KINDS])
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("style", [tasks.Style("inline"), tasks.Style("lines"),
                                   tasks.Style("lines", "check", "decide", "restate")])
def test_target_round_trips_and_scores(tok, kind, thinking, style):
    rng = random.Random(hash((kind, thinking)) % 1000)
    for _ in range(5):
        s = tasks.make(kind, rng, thinking=thinking, style=style)
        ids, n = encode_sample(s, tok)
        assert ids[:n] == [int(i) for i in prompt_ids(s, tok)]
        assert ids[-1] == STOP_ID and STOP_ID not in ids[n:-1]
        content, calls = parse_output(s, tok.decode(ids[n:]))
        assert tasks.score(s, content, calls)


def test_wrong_answers_fail():
    s = tasks.make("choose", random.Random(3), thinking=False)
    call = s.target["tool_calls"][0]
    args = json.loads(call["function"]["arguments"])
    key = next(iter(args))
    bad = dict(args, **{key: "something else"})
    wrong_args = [{**call, "function": {"name": call["function"]["name"], "arguments": json.dumps(bad)}}]
    other = next(t["function"]["name"] for t in s.tools if t["function"]["name"] != s.expected["tool"])
    wrong_tool = [{**call, "function": {"name": other, "arguments": call["function"]["arguments"]}}]
    assert tasks.score(s, "", [call])
    assert not tasks.score(s, "", wrong_args)
    assert not tasks.score(s, "", wrong_tool)
    assert not tasks.score(s, "", [call, call])
    assert not tasks.score(s, "I will not.", [])
    d = tasks.make("decline", random.Random(4))
    assert tasks.score(d, "anything", []) and not tasks.score(d, "", [call])
    j = tasks.make("json", random.Random(5))
    assert not tasks.score(j, j.target["content"][:-1], [])


def test_split_and_determinism(tok):
    rng = random.Random(7)
    for _ in range(200):
        s = tasks.make(random.choice(["tool", "choose", "decline", "followup"]), rng)
        assert not any(pools.is_held_out(t["function"]["name"]) for t in s.tools)
    h = tasks.make("choose", random.Random(8), held_out=True)
    assert all(pools.is_held_out(t["function"]["name"]) for t in h.tools)
    a = encode_sample(tasks.make("recall", random.Random(9), records=150), tok)
    b = encode_sample(tasks.make("recall", random.Random(9), records=150), tok)
    assert a == b and len(a[0]) >= 2000


def test_recall_target_is_far_back():
    s = tasks.make("recall", random.Random(11), records=100)
    doc = s.messages[0]["content"]
    assert doc.index(s.expected["text"]) < len(doc) // 4 + 200


def test_restated_recall_answers_with_the_line_and_every_word_is_one_induction_step(tok):
    from training.induction import induction_targets

    plain = tasks.make("recall", random.Random(5), records=120, thinking=False)
    s = tasks.make("recall", random.Random(5), records=120, thinking=False, style=tasks.Style(recall="restate"))
    assert s.expected["text"] == plain.expected["text"]  # same draws: only the writing differs
    assert s.target["content"] == s.expected["line"] == f"Record {s.expected['line'].split()[1]} {s.expected['text']}"
    assert s.expected["line"] in s.messages[0]["content"].split("\n")
    assert tasks.score(s, s.expected["text"], []) and tasks.score(s, s.expected["line"], [])
    assert not tasks.score(s, plain.target["content"] + " extra", [])
    ids, n = encode_sample(s, tok)
    # from the label on ("Record", " ", label, 8 words), each answer token has a source: an earlier position
    # that follows an occurrence of its predecessor (t is the predecessor's position)
    found = {t for t, _ in induction_targets(ids, [(n, len(ids))])}
    assert set(range(n + 1, n + 10)) <= found
    with pytest.raises(ValueError, match="unknown recall answer"):
        tasks.Style(recall="summary")


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown task kind"):
        tasks.make("poetry", random.Random(0))


def test_copied_values_are_the_same_tokens_in_request_and_answer(tok):
    """String values are quoted in the request, so each value's tokens in the answer appear, in order, in
    the request (a bare word would carry a leading space: a different token)."""
    rng = random.Random(11)
    for kind in ("tool", "json", "copy"):
        for _ in range(20):
            s = tasks.make(kind, rng)
            request = [int(t) for t in tok.encode(s.messages[0]["content"])]
            values = s.expected.get("arguments") or s.expected.get("json") or {}
            strings = [v for v in values.values() if isinstance(v, str)] if values else [s.expected["text"]]
            for v in strings:
                ids = [int(t) for t in tok.encode(v)]
                assert any(request[i:i + len(ids)] == ids for i in range(len(request))), (kind, v)


def test_argument_values_are_written_as_the_answer_writes_them():
    """Every top-level value appears in the request exactly as the answer serialises it (K3 argument form
    for tool calls, compact JSON for JSON answers), in the answer's key order."""
    rng = random.Random(5)
    for kind, dumps in (("tool", tasks.TOOL_DUMPS), ("choose", tasks.TOOL_DUMPS), ("json", tasks.JSON_DUMPS)):
        for _ in range(30):
            s = tasks.make(kind, rng)
            user = s.messages[0]["content"]
            values = s.expected.get("arguments") or s.expected["json"]
            at = [user.index(f"{k} {dumps(v)}") for k, v in values.items()]
            assert at == sorted(at), (kind, user)


def test_tool_leaves_widen_training_requests_and_leave_evaluations_alone(tok, monkeypatch):
    """``leaves`` draws up to that many argument leaves; the default is what evaluations draw, unchanged."""
    for kind in ("tool", "choose"):
        assert [tasks.make(kind, random.Random(i)) for i in range(20)] == \
               [tasks.make(kind, random.Random(i), leaves=tasks.TOOL_LEAVES) for i in range(20)]
    def leaves(v):
        return sum(leaves(x) for x in v.values()) if isinstance(v, dict) else 1
    drawn = {leaves(tasks.make("tool", random.Random(i)).expected["arguments"]) for i in range(200)}
    assert drawn == set(range(1, tasks.TOOL_LEAVES + 1))
    wide = {leaves(tasks.make("choose", random.Random(i), leaves=6).expected["arguments"]) for i in range(300)}
    assert wide == set(range(1, 7))
    # a decline's request lists as many values as a call's could
    def lines(s):
        return s.messages[0]["content"].count("\n")
    style = tasks.Style("lines")
    assert max(lines(tasks.make("decline", random.Random(i), style=style)) for i in range(200)) == 3
    assert max(lines(tasks.make("decline", random.Random(i), style=style, leaves=6)) for i in range(200)) == 6
    assert [tasks.make("decline", random.Random(i)) for i in range(20)] == \
           [tasks.make("decline", random.Random(i), leaves=tasks.DECLINE_LEAVES) for i in range(20)]
    # the trainer's draw passes it to tool, choose and decline requests only
    seen = []
    real = tasks.make
    monkeypatch.setattr(tasks, "make", lambda kind, rng, **kw: seen.append((kind, kw.get("leaves"))) or
                        real(kind, rng, **kw))
    for kind in ("tool", "choose", "decline", "json"):
        mix = {k: float(k == kind) for k in data.MIX}
        assert data.draw(random.Random(1), tok, 1.0, data.CopyWarmup(tool_leaves=6), mix=mix).kind == kind
    assert seen == [("tool", 6), ("choose", 6), ("decline", 6), ("json", None)]
    with pytest.raises(ValueError, match="tool_leaves"):
        data.CopyWarmup(tool_leaves=0)


def _passed(tok, monkeypatch, warmup: data.CopyWarmup, kinds: tuple[str, ...],
            key: str = "object_share") -> list[tuple]:
    """(kind, kwargs[key]) as the trainer's draw passes them to ``tasks.make``: one draw of each kind with
    ``warmup``, then with the default warm-up."""
    seen: list[tuple] = []
    real = tasks.make
    monkeypatch.setattr(tasks, "make", lambda kind, rng, **kw: seen.append((kind, kw.get(key))) or
                        real(kind, rng, **kw))
    for w in (warmup, data.CopyWarmup()):
        for kind in kinds:
            mix = {k: float(k == kind) for k in data.MIX}
            assert data.draw(random.Random(1), tok, 1.0, w, mix=mix).kind == kind
    return seen


def test_decline_object_asks_for_a_tool_sharing_an_offered_tools_object(tok, monkeypatch):
    """``object_share`` 1: every decline asks for an unoffered tool whose object an offered tool has, on the
    requested side of the name split; 0 (evaluations) draws exactly what it drew before."""
    assert [tasks.make("decline", random.Random(i)) for i in range(30)] == \
           [tasks.make("decline", random.Random(i), object_share=0.0) for i in range(30)]
    for held_out in (False, True):
        for i in range(100):
            s = tasks.make("decline", random.Random(i), held_out=held_out, object_share=1.0)
            asked = s.meta["asked"]
            offered = [t["function"]["name"] for t in s.tools]
            assert asked not in offered and pools.is_held_out(asked) == held_out
            assert asked.split("_", 1)[1] in {n.split("_", 1)[1] for n in offered}
            assert s.expected["text"].endswith(f"the {asked.split('_', 1)[1]}.")
    # the trainer's draw passes it to declines only, and only when set
    seen = _passed(tok, monkeypatch, data.CopyWarmup(decline_object=0.5), ("decline", "choose"))
    assert seen == [("decline", 0.5), ("choose", None), ("decline", None), ("choose", None)]
    with pytest.raises(ValueError, match="decline_object"):
        data.CopyWarmup(decline_object=1.5)


def test_choose_object_offers_the_picked_tools_object_with_another_verb(tok, monkeypatch):
    """``object_share`` 1: every choice offers, beside the picked tool, one with its object and another verb
    (all names distinct, on the requested side of the split); 0 (evaluations) draws what it drew before."""
    assert [tasks.make("choose", random.Random(i)) for i in range(30)] == \
           [tasks.make("choose", random.Random(i), object_share=0.0) for i in range(30)]
    for held_out in (False, True):
        for i in range(100):
            s = tasks.make("choose", random.Random(i), held_out=held_out, object_share=1.0)
            picked = s.expected["tool"]
            offered = [t["function"]["name"] for t in s.tools]
            assert picked in offered and len(set(offered)) == len(offered)
            assert all(pools.is_held_out(n) == held_out for n in offered)
            verb, obj = picked.split("_", 1)
            assert any(n.split("_", 1)[1] == obj and n.split("_", 1)[0] != verb for n in offered)
    seen = _passed(tok, monkeypatch, data.CopyWarmup(choose_object=0.5), ("choose", "decline", "tool"))
    assert seen == [("choose", 0.5), ("decline", None), ("tool", None),
                    ("choose", None), ("decline", None), ("tool", None)]
    with pytest.raises(ValueError, match="choose_object"):
        data.CopyWarmup(choose_object=-0.1)


def _answer(s: tasks.Sample):
    """The value object a tool, choose or JSON sample answers with."""
    return s.expected.get("arguments", s.expected.get("json"))


def _arrays(value):
    if isinstance(value, list):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _arrays(v)


def test_array_repeats_write_one_word_twice_in_training_arrays(tok, monkeypatch):
    """``repeats`` 1: every array value of a tool, choose or JSON answer (and so of its request) has a word
    twice; 0 (evaluations) draws exactly what it drew before, where most arrays have distinct words."""
    def arrays(kind: str, repeats: float) -> list[list]:
        out = []
        for i in range(200):
            s = tasks.make(kind, random.Random(i), repeats=repeats)
            out += _arrays(_answer(s))
        return out

    for kind in ("tool", "choose", "json"):
        assert [tasks.make(kind, random.Random(i)) for i in range(30)] == \
               [tasks.make(kind, random.Random(i), repeats=0.0) for i in range(30)]
        repeated = arrays(kind, 1.0)
        assert len(repeated) > 20 and all(len(set(a)) < len(a) for a in repeated)
        drawn = arrays(kind, 0.0)
        assert sum(len(set(a)) < len(a) for a in drawn) < len(drawn) / 4
    seen = _passed(tok, monkeypatch, data.CopyWarmup(array_repeats=0.5),
                   ("json", "tool", "choose", "decline", "followup"), key="repeats")
    assert seen == [("json", 0.5), ("tool", 0.5), ("choose", 0.5), ("decline", None), ("followup", None),
                    ("json", None), ("tool", None), ("choose", None), ("decline", None), ("followup", None)]
    with pytest.raises(ValueError, match="array_repeats"):
        data.CopyWarmup(array_repeats=1.5)


def test_array_twins_write_the_repeated_word_last_beside_its_twin(tok, monkeypatch):
    """``twins`` 1 (with ``repeats`` 1): every array of a tool, choose or JSON answer ends in one word twice
    (``["river","island","island"]``); 0 draws exactly what ``repeats`` alone drew (wx63's stream)."""
    for kind in ("tool", "choose", "json"):
        assert [tasks.make(kind, random.Random(i), repeats=0.5) for i in range(30)] == \
               [tasks.make(kind, random.Random(i), repeats=0.5, twins=0.0) for i in range(30)]
        arrays = [a for i in range(200) for a in
                  _arrays(_answer(tasks.make(kind, random.Random(i), repeats=1.0, twins=1.0)))]
        assert len(arrays) > 20 and all(a[-1] == a[-2] for a in arrays)
        alone = [a for i in range(200) for a in _arrays(_answer(tasks.make(kind, random.Random(i), repeats=1.0)))]
        assert sum(a[-1] != a[-2] for a in alone) > len(alone) / 4  # "repeats" alone often copies further back
    seen = _passed(tok, monkeypatch, data.CopyWarmup(array_repeats=0.5, array_twins=0.5),
                   ("json", "tool", "decline"), key="twins")
    assert seen == [("json", 0.5), ("tool", 0.5), ("decline", None), ("json", None), ("tool", None),
                    ("decline", None)]
    # twins without repeats would be a no-op that looks like a setting: it is passed only with repeats
    assert _passed(tok, monkeypatch, data.CopyWarmup(array_twins=0.5), ("json",), key="twins")[0] == ("json", None)
    with pytest.raises(ValueError, match="array_twins"):
        data.CopyWarmup(array_twins=-0.1)


def test_hard_from_holds_the_object_shares_back_until_that_progress(tok, monkeypatch):
    seen: list[tuple] = []
    real = tasks.make
    monkeypatch.setattr(tasks, "make", lambda kind, rng, **kw: seen.append((kind, kw.get("object_share"))) or
                        real(kind, rng, **kw))
    w = data.CopyWarmup(decline_object=0.5, choose_object=0.25, hard_from=0.75)
    for progress in (0.5, 0.75, 1.0):
        for kind in ("decline", "choose"):
            mix = {k: float(k == kind) for k in data.MIX}
            assert data.draw(random.Random(1), tok, progress, w, mix=mix).kind == kind
    assert seen == [("decline", None), ("choose", None), ("decline", 0.5), ("choose", 0.25),
                    ("decline", 0.5), ("choose", 0.25)]
    with pytest.raises(ValueError, match="hard_from"):
        data.CopyWarmup(hard_from=1.5)


def _has(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_lines_form_writes_each_key_as_the_token_the_answer_writes(tok):
    """In the "lines" form every top-level value sits on its own ``key: value`` line, in the answer's key
    order, and both the key and the value are, token for token, what the call or JSON answer writes; inline,
    the key carries a leading space (another id)."""
    rng = random.Random(21)
    for kind, dumps in (("tool", tasks.TOOL_DUMPS), ("choose", tasks.TOOL_DUMPS), ("json", tasks.JSON_DUMPS),
                        ("followup", tasks.TOOL_DUMPS)):
        for _ in range(25):
            s = tasks.make(kind, rng, style=tasks.Style("lines"))
            user = s.messages[0]["content"]
            values = s.expected.get("arguments") or s.expected.get("json") or json.loads(
                s.messages[1]["tool_calls"][0]["function"]["arguments"])
            lines = user.splitlines()
            at = [lines.index(f"{k}: {dumps(v)}") for k, v in values.items()]
            assert at == sorted(at), (kind, user)
            request = [int(t) for t in tok.encode(user)]
            for k, v in values.items():
                assert _has(request, [int(t) for t in tok.encode(k)]), (kind, k)
                if isinstance(v, str):
                    assert _has(request, [int(t) for t in tok.encode(v)]), (kind, v)
    inline = tasks.make("tool", random.Random(4), style=tasks.Style("inline"))
    request = [int(t) for t in tok.encode(inline.messages[0]["content"])]
    assert not any(_has(request, [int(t) for t in tok.encode(k)]) for k in inline.expected["arguments"])


def test_lines_form_lookup_and_decline():
    rng = random.Random(6)
    for _ in range(30):
        s = tasks.make("lookup", rng, style=tasks.Style("lines"))
        user = s.messages[0]["content"]
        key = user.rsplit('What is "', 1)[1].removesuffix('"?')
        assert f"{key}: {s.target['content']}" in user.splitlines()
        d = tasks.make("decline", rng, style=tasks.Style("lines"))
        assert "\n" in d.messages[0]["content"] and d.expected == {"tool": None, "text": d.target["content"]}
    with pytest.raises(ValueError, match="request form"):
        tasks.Style("yaml")
    with pytest.raises(ValueError, match="reasoning"):
        tasks.Style(reasoning="long")


def test_check_reasoning_names_the_tool_that_would_do_it():
    rng, check = random.Random(9), tasks.Style(reasoning="check")
    for _ in range(20):
        d = tasks.make("decline", rng, thinking=True, style=check)
        offered = {t["function"]["name"] for t in d.tools}
        asked = d.meta["asked"]
        assert asked not in offered and d.target["reasoning_content"].endswith(f" The tool {asked} is not offered.")
        assert d.target["content"] == d.expected["text"]
        t = tasks.make("choose", rng, thinking=True, style=check)  # a call's reasoning is the same in both
        assert t.target["reasoning_content"].endswith(f" The tool {t.expected['tool']} does that.")
    plain = tasks.make("decline", random.Random(1), thinking=True)
    assert plain.target["reasoning_content"].endswith(" No tool does that.")


def test_list_reasoning_lists_the_offered_tools_with_the_asked_verb():
    """``reasoning="list"``: between the request and the verdict, ``Tools that VERB:`` and the offered tools
    with that verb in declaration order, or ``none``; sessions and follow-ups too. Without the offer it is an
    error, not a silent "none"."""
    rng, style = random.Random(5), tasks.Style("lines", "list", "decide")
    shapes = set()
    for kind in ("tool", "choose", "decline", "followup", "session") * 12:
        s = tasks.make(kind, rng, thinking=True, style=style) if kind != "session" else \
            sessions.make(rng, style=style)
        offer = [t["function"]["name"] for t in s.tools]
        for m in [*s.messages, s.target]:
            said = m.get("reasoning_content") or ""
            if "Tools that" not in said:
                continue
            verb = said.split("Tools that ")[1].split(":")[0]
            listed = [n for n in offer if n.split("_", 1)[0] == verb]
            asked = said.split("The tool ")[1].split(" ")[0]
            assert f"Tools that {verb}: {', '.join(listed) or 'none'}. The tool {asked} " in said
            assert said.endswith("does that." if asked in listed else "is not offered.")
            shapes.add((kind, len(listed)))
    assert {("decline", 0), ("decline", 1), ("choose", 1), ("choose", 2), ("tool", 1)} <= shapes, shapes
    with pytest.raises(ValueError, match="offered tools"):
        tasks.decided("convert", "road", "convert_road", True, True, style)


def test_assign_reasoning_writes_the_name_as_the_call_does():
    """``reasoning="assign"``: the reasoning's `` tool="NAME"`` is token for token the call's, so an induction
    step (``induction_targets``) points the call's first name token back at the reasoning's."""
    from training.induction import induction_targets

    tok, rng, assign = load_tokenizer(), random.Random(4), tasks.Style("lines", "assign", "decide")
    for thinking in (True, False):
        t = tasks.make("choose", rng, thinking=thinking, style=assign)
        said = t.target["reasoning_content"] if thinking else t.target["content"]
        assert said.endswith(f' The tool="{t.expected["tool"]}" does that.')
        ids, n = encode_sample(t, tok)
        ids, name = list(ids), list(tok.encode(' tool="' + t.expected["tool"]))
        starts = [i for i in range(n, len(ids)) if ids[i:i + len(name)] == name]
        assert len(starts) == 2  # the reasoning's, then the call's
        call_eq = starts[1] + 1  # the call's ="
        sources = dict(induction_targets(ids, [(n, len(ids))]))[call_eq]
        assert starts[0] + 2 in sources  # the reasoning's first name token
        d = tasks.make("decline", rng, thinking=thinking, style=assign)
        said = d.target["reasoning_content"] if thinking else d.target["content"]
        assert f' The tool="{d.meta["asked"]}" is not offered.' in said


def test_decide_without_thinking_opens_the_content_with_the_reasoning():
    """``nothink="decide"``: a no-think answer's content starts with the very sentences a thinking answer
    reasons with (same draws otherwise); thinking answers and the other kinds are unchanged."""
    decide = tasks.Style("lines", "check", "decide")
    for kind in ("tool", "choose", "decline", "followup", "json"):
        for seed in range(8):
            bare = tasks.make(kind, random.Random(seed), thinking=False, style=tasks.Style("lines", "check"))
            said = tasks.make(kind, random.Random(seed), thinking=False, style=decide)
            think = tasks.make(kind, random.Random(seed), thinking=True, style=decide)
            assert think == tasks.make(kind, random.Random(seed), thinking=True, style=tasks.Style("lines", "check"))
            assert said.expected.get("arguments") == bare.expected.get("arguments")
            if kind in ("json", "followup"):
                assert said.target == bare.target
            if kind == "followup":  # the earlier call in the history says it too
                assert said.messages[1]["content"] == think.messages[1]["reasoning_content"]
            if kind in ("tool", "choose", "decline"):
                assert said.target["reasoning_content"] is None
                reasoning = think.target["reasoning_content"]
                assert said.target["content"] == " ".join(filter(None, (reasoning, bare.target["content"])))
                assert said.target.get("tool_calls") == bare.target.get("tool_calls")
    with pytest.raises(ValueError, match="no-think"):
        tasks.Style(nothink="long")


def test_lexicon_words_are_single_tokens_and_recall_never_repeats_a_word(tok):
    for w in pools.LEXICON:
        assert len(tok.encode(w)) == 1 and len(tok.encode(" " + w)) == 1, w
    s = tasks.make("recall", random.Random(3), records=150)
    lines = [ln.split('"')[1].split() for ln in s.messages[0]["content"].splitlines() if ln.startswith("Record")]
    words = [w for ln in lines for w in ln]
    assert len(lines) == 150 and len(words) == len(set(words))


def test_lookup_answer_is_the_value_written_after_its_key():
    import json

    rng = random.Random(8)
    assert all("What is the " in tasks.make("lookup", rng).messages[0]["content"] for _ in range(20))
    forms = set()
    for _ in range(60):
        s = tasks.make("lookup", rng, objects=0.5)
        user, answer = s.messages[0]["content"], s.target["content"]
        assert s.expected["text"] == answer
        if "What is the " in user:
            forms.add("word")
            key = user.rsplit("What is the ", 1)[1][:-1]
            assert f"{key} {answer}" in user
            continue
        # keys asked in quotes, answered as an object in the asked order, each value as written after its key
        forms.add("object")
        asked = json.loads("[" + user.rsplit(" Give ", 1)[1].removesuffix(" as an object.") + "]")
        got = json.loads(answer)
        assert list(got) == asked and 1 <= len(asked) <= 3
        for key, value in got.items():
            assert f"{key} {json.dumps(value, ensure_ascii=False)}" in user
    assert forms == {"word", "object"}


def test_json_tasks_use_strict_closed_schemas():
    """JSON tasks ask as OpenAI strict structured outputs do: every object closed, so the answer validates and
    an answer with one more member (what an undertrained model writes) does not."""
    import jsonschema

    rng = random.Random(9)
    for _ in range(40):
        s = tasks.make("json", rng)
        js = s.response_format["json_schema"]
        assert js["strict"] is True
        objects = [js["schema"]]
        while objects:
            o = objects.pop()
            assert o["additionalProperties"] is False
            objects += [v for v in o["properties"].values() if v.get("type") == "object"]
        jsonschema.validate(s.expected["json"], js["schema"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**s.expected["json"], "extra": 1}, js["schema"])


def test_history_puts_earlier_exchanges_in_front_and_keeps_the_answer(tok):
    base = data.draw(random.Random(11), tok, 1.0)
    assert data.draw(random.Random(11), tok, 1.0, history=0.0) == base  # off: the same draws as before
    rng = random.Random(5)
    seen = 0
    for _ in range(40):
        e = data.draw(rng, tok, 1.0, history=1.0)
        text = tok.decode(e.ids[:e.n_prompt])
        if e.kind == "recall":
            continue
        seen += 1
        assert 2 <= text.count('<|open|>message role="user"') <= 4  # 1-3 earlier exchanges + the task's own
        assert text.count('<|open|>message role="assistant"') >= 1
    assert seen >= 20
    s = tasks.make("tool", random.Random(2), thinking=True)
    h = data.with_history(random.Random(3), s, 2)
    assert h.target == s.target and h.messages[-1] == s.messages[-1] and len(h.messages) == 5
    ids, n = encode_sample(h, tok)
    own, n_own = encode_sample(s, tok)
    assert ids[n:] == own[n_own:]  # the loss-bearing answer is the task's own, unchanged
    content, calls = parse_output(h, tok.decode(ids[n:]))
    assert tasks.score(h, content, calls)


def test_induce_samples_copy_by_content_only():
    pool = list(range(1000, 1300))
    rng = random.Random(4)
    for _ in range(200):
        e = data.induce_sample(rng, pool)
        assert e.kind == "induce" and set(e.ids) <= set(pool)
        sep = e.ids[e.n_prompt - 1]
        first = e.ids.index(sep)
        words = e.ids[e.n_prompt:]
        lo, hi = data.INDUCE_ITEMS
        assert lo <= len(words) <= hi and len(set(words)) == len(words)
        # the separator occurs exactly twice, and what follows the first is the answer
        assert e.ids.count(sep) == 2 and e.ids[first + 1:first + 1 + len(words)] == words
        assert e.n_prompt == first + len(words) + 2 and first <= data.INDUCE_FILLER
        # so every answer token is the one after the earlier occurrence of the token before it
        for i in range(e.n_prompt, len(e.ids)):
            assert e.ids[e.ids.index(e.ids[i - 1]) + 1] == e.ids[i]
    with pytest.raises(ValueError, match="token pool"):
        data.draw(random.Random(0), None, 0.0, data.CopyWarmup(share=1.0, until=1.0, induce=1.0))


def test_assoc_samples_find_each_value_by_its_key():
    pool = list(range(2000, 4000))
    rng = random.Random(5)
    glues = set()
    for pairs in (1, 2, 7, 40, 160):
        for _ in range(20):
            e = data.assoc_sample(rng, pool, pairs)
            assert e.kind == "assoc" and set(e.ids) <= set(pool)
            context, answer = e.ids[:e.n_prompt - 1], e.ids[e.n_prompt:]
            end = context[-1]
            records, cur = [], []
            for t in context:
                cur.append(t)
                if t == end:
                    records.append(cur)
                    cur = []
            assert len(records) == pairs and not cur
            # every record is key, the same glue, 1-8 value tokens, the end token; no token repeats elsewhere
            if pairs == 1:  # one record: its glue cannot be told from its value
                continue
            glue = [t for t in records[0][1:-1] if context.count(t) == pairs]
            glue_n = len(glue)
            for r in records:
                assert r[1:1 + glue_n] == glue and 1 <= len(r) - 2 - glue_n <= 8
            unique = [t for r in records for t in (r[0], *r[1 + glue_n:-1])]
            assert len(set(unique)) == len(unique) and e.ids[e.n_prompt - 1] not in unique
            glues.add(glue_n)
            # the answer asks back half of the records (at least one), whole and unchanged
            by_key = {r[0]: r for r in records}
            asked, i = [], 0
            while i < len(answer):
                r = by_key[answer[i]]
                assert answer[i:i + len(r)] == r
                asked.append(r[0])
                i += len(r)
            assert len(asked) == max(1, pairs // 2) and len(set(asked)) == len(asked)
    assert glues == set(range(data.ASSOC_GLUE + 1))


def test_assoc_samples_lengthen_with_the_curriculum():
    assert data.assoc_pairs(0.0) == (data.ASSOC_PAIRS[0], 2 * data.ASSOC_PAIRS[0])
    assert data.assoc_pairs(data.RAMP[1]) == data.assoc_pairs(1.0) == data.ASSOC_PAIRS
    pool = list(range(2000, 6000))
    warm = data.CopyWarmup(induce_until=1.0, assoc=1.0)
    for progress in (0.0, 0.5, 0.99):
        lo, hi = data.assoc_pairs(progress)
        for seed in range(5):
            e = data.draw(random.Random(seed), None, progress, warm, pool=pool)
            n_records = e.ids[:e.n_prompt].count(e.ids[e.n_prompt - 2])
            assert e.kind == "assoc" and lo <= n_records <= hi
    kinds = {data.draw(random.Random(s), None, 0.0, data.CopyWarmup(induce_until=1.0, assoc=0.5), pool=pool).kind
             for s in range(40)}
    assert kinds == {"assoc", "induce"}


def test_probe_style_arguments_default_to_the_shipped_style():
    import argparse

    from training.styles import add_style_arguments, style_of

    p = argparse.ArgumentParser()
    add_style_arguments(p)
    assert style_of(p.parse_args([])) == tasks.SHIPPED
    assert style_of(p.parse_args(["--reasoning", "list", "--form", "inline"])) == \
        tasks.Style("inline", "list", tasks.SHIPPED.nothink, tasks.SHIPPED.recall)
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning", "long"])
