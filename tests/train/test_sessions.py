"""Sessions: several requests over one tool set; every assistant message is a learnt span."""

from __future__ import annotations

import json
import random

import pytest
import torch

from training import data, sessions, tasks, train
from training.render import STOP_ID, encode_sample, encode_turns, parse_output
from training.tok import load_tokenizer
from training.vocab import CompactVocab

STYLES = [tasks.PLAIN, tasks.Style("lines", "check", "decide")]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("style", STYLES)
def test_every_answer_is_a_span_that_decodes_to_its_message(tok, thinking, style):
    rng = random.Random(7)
    for _ in range(6):
        s = sessions.make(rng, thinking=thinking, style=style)
        ids, n_prompt, spans = encode_turns(s, tok)
        assert (ids, n_prompt) == tuple(encode_sample(s, tok))
        answers = [m for m in s.messages if m["role"] == "assistant"] + [s.target]
        assert len(spans) == len(answers) == s.meta["turns"] + sum(
            1 for m in s.messages if m["role"] == "tool")  # a call and, when more follow, the answer from its result
        assert spans[-1] == (n_prompt, len(ids))
        for (a, b), (c, d) in zip(spans, spans[1:]):
            assert a < b <= c < d
        for (a, b), m in zip(spans, answers):
            assert ids[b - 1] == STOP_ID and STOP_ID not in ids[a:b - 1]
            content, calls = parse_output(s, tok.decode(ids[a:b]))  # each span parses to its own message
            assert content == (m["content"] or "")
            assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in m.get("tool_calls", [])]
        content, calls = parse_output(s, tok.decode(ids[n_prompt:]))
        assert tasks.score(s, content, calls)


def test_calls_use_offered_tools_and_the_absent_one_is_declined():
    rng = random.Random(3)
    seen_decline = seen_followup = 0
    for _ in range(60):
        s = sessions.make(rng, thinking=True, style=tasks.Style("lines", "check"))
        offered = {t["function"]["name"] for t in s.tools}
        assert s.meta["asked"] not in offered and 2 <= s.meta["turns"] <= 4
        msgs = [*s.messages, s.target]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            if m.get("tool_calls"):
                (call,) = m["tool_calls"]
                assert call["function"]["name"] in offered
                if i + 1 < len(msgs):  # asked back: the result follows, then the answer copies the asked value
                    result = json.loads(msgs[i + 1]["content"])
                    ask = msgs[i - 1]["content"].rsplit("Then tell me the ", 1)[1].removesuffix(".")
                    assert msgs[i + 1]["tool_call_id"] == call["id"]
                    assert msgs[i + 2]["content"] == f"The {ask} is {json.dumps(result[ask], ensure_ascii=False)}."
                    seen_followup += 1
            elif msgs[i - 1]["role"] == "tool":
                continue  # the answer from a result (checked with its call)
            else:
                assert m["content"] == tasks.decline_content(*s.meta["asked"].split("_", 1))
                assert m["reasoning_content"].endswith(f"The tool {s.meta['asked']} is not offered.")
                seen_decline += 1
        want = s.target.get("tool_calls")
        assert s.expected == ({"tool": want[0]["function"]["name"], "arguments": json.loads(
            want[0]["function"]["arguments"])} if want else {"tool": None, "text": s.target["content"]})
    assert seen_decline > 10 and seen_followup > 20


class _Uniform:
    """A stand-in model with equal logits everywhere."""

    def __init__(self, size: int):
        self.size = size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], self.size)

    def parameters(self):
        yield torch.zeros(1)


def test_the_batch_loss_covers_every_span(tok, monkeypatch):
    """A session's Encoded carries its spans; the train step takes its loss on all of them."""
    s = sessions.make(random.Random(2), thinking=False, style=tasks.PLAIN)
    ids, n_prompt, spans = encode_turns(s, tok)
    e = data.Encoded("session", ids, n_prompt, spans)
    single = data.Encoded("tool", ids, n_prompt)
    assert e.n_answer == sum(b - a for a, b in spans) > single.n_answer == len(ids) - n_prompt
    vocab = CompactVocab(sorted(set(ids)), 163840)
    monkeypatch.setattr(train, "train_forward", lambda model, seqs: torch.zeros(sum(len(x) for x in seqs), 1))
    by_kind: dict = {}
    _, n = train.step_loss(_Uniform(len(vocab)), vocab, [e, single], by_kind)
    assert n == e.n_answer + single.n_answer
    assert by_kind["session"][1] == e.n_answer and by_kind["tool"][1] == single.n_answer


def test_mix_draws_sessions_only_when_asked(tok):
    assert data.MIX["session"] == 0.0
    rng = random.Random(0)
    kinds = {data.sample_kind(rng, mix=data.MIX) for _ in range(500)}
    assert "session" not in kinds
    mix = data.parse_mix("session=1,tool=0,choose=0,decline=0,json=0,recall=0,followup=0")
    e = data.draw(random.Random(1), tok, 0.9, mix=mix, style=tasks.Style("lines", "check", "decide"))
    assert e.kind == "session" and len(e.spans) >= 2


def test_generate_writes_sessions_with_every_answer_counted(tmp_path):
    from training import generate

    out = tmp_path / "s.jsonl"
    kinds = ["session", "tool", "followup"]
    assert generate.main(["--kinds", *kinds, "--n", "2", "--out", str(out), "--nothink", "decide"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == [k for k in kinds for _ in range(2)]
    for r in rows:
        full = len(load_tokenizer().encode(r["text"], allowed_special="all"))
        last = full - r["prompt_tokens"]
        assert r["answer_tokens"] > last if r["kind"] == "session" else r["answer_tokens"] == last
