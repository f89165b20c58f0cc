"""`benchmarks/tiny_eval.py` through HTTP: a refused request is reported in one line, not a traceback."""

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

import httpx
import pytest

from training import tasks

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tiny_eval.py"


@pytest.fixture(scope="module")
def tiny_eval():
    spec = importlib.util.spec_from_file_location("tiny_eval", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_refused_request_says_what_the_server_said(tiny_eval):
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "The model `k3-default` does not exist.",
                                                   "type": "NotFoundError", "code": 404}})

    ask = tiny_eval.http_answer("http://test/v1", "k3-default", None, transport=httpx.MockTransport(refuse))
    sample = tasks.make("json", random.Random(0), held_out=True, thinking=False)
    with pytest.raises(tiny_eval.EvalError, match=r"HTTP 404: The model `k3-default` does not exist"):
        ask(sample)


def test_an_answer_is_read_from_the_first_choice(tiny_eval):
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"content": "{}", "tool_calls": None,
                                                                  "reasoning_content": "Fill the schema."}}]})

    ask = tiny_eval.http_answer("http://test/v1", "k3-default", None, transport=httpx.MockTransport(answer))
    msg = ask(tasks.make("json", random.Random(0), held_out=True, thinking=False))
    assert (msg["content"], msg["tool_calls"], msg["reasoning_content"]) == ("{}", None, "Fill the schema.")


def test_without_a_model_name_it_asks_for_the_first_served_model(tiny_eval):
    sent = []

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": "k3-default", "object": "model"}]})
        sent.append(json.loads(request.content)["model"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "{}"}}]})

    ask = tiny_eval.http_answer("http://test/v1", None, None, transport=httpx.MockTransport(serve))
    ask(tasks.make("json", random.Random(0), held_out=True, thinking=False))
    assert sent == ["k3-default"]


@pytest.mark.parametrize("recall", tasks.RECALLS)
def test_recall_lists_hold_at_least_2k_tokens_in_either_form(tiny_eval, recall):
    from training.render import prompt_ids
    from training.tok import load_tokenizer

    tok = load_tokenizer()
    samples = [s for s in tiny_eval.make_tasks(3, 7, recall=recall) if s.kind == "recall"]
    assert len(samples) == 3
    assert all(len(prompt_ids(s, tok)) >= 2000 for s in samples)
    line = samples[0].expected.get("line")
    assert (line is not None) == (recall == "restate")


def test_a_failure_says_why(tiny_eval):
    s = tasks.make("tool", random.Random(0), held_out=True)
    want = s.expected["arguments"]
    key = next(iter(want))

    def call(name, args):
        return [{"function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}]

    assert tiny_eval.why_failed(s, "", call(s.expected["tool"], want)) is None
    assert tiny_eval.why_failed(s, "No tool does that.", []) == "declined"
    assert tiny_eval.why_failed(s, "", call("other_tool", want)) == "wrong tool"
    assert tiny_eval.why_failed(s, "", call(s.expected["tool"], "{")) == "invalid JSON"
    assert tiny_eval.why_failed(s, "", call(s.expected["tool"], {**want, "extra": 1})) == "wrong keys"
    retyped = [1] if not isinstance(want[key], list) else "x"
    assert tiny_eval.why_failed(s, "", call(s.expected["tool"], {**want, key: retyped})) == "wrong type"
    j = next(t for t in (tasks.make("json", random.Random(i), held_out=True) for i in range(50))
             if any(isinstance(v, str) for v in t.expected["json"].values()))
    first = next(k for k, v in j.expected["json"].items() if isinstance(v, str))
    other = {**j.expected["json"], first: j.expected["json"][first] + " more"}
    assert tiny_eval.why_failed(j, json.dumps(other), []) == "wrong value"
    assert tiny_eval.why_failed(j, json.dumps(j.expected["json"]), []) is None


def test_declines_are_counted_by_what_the_asked_tool_shares_with_the_offer(tiny_eval):
    s = tasks.make("decline", random.Random(0), held_out=True, thinking=False)

    def asking(asked, offered):
        tools = [{"type": "function", "function": {"name": n}} for n in offered]
        return dataclasses.replace(s, tools=tools, meta={"asked": asked})

    shares_object = asking("convert_road", ["share_road", "open_table"])
    shares_verb = asking("convert_road", ["convert_table"])
    shares_none = asking("convert_road", ["open_table", "share_user"])
    assert [tiny_eval.negative(x) for x in (shares_object, shares_verb, shares_none)] == ["object", "verb", "none"]
    declined = (s.expected["text"], [])
    called = ("", [{"function": {"name": "convert_road", "arguments": "{}"}}])
    got = tiny_eval.declines_by_negative([shares_object, shares_object, shares_none, shares_verb],
                                         [declined, called, declined, called])
    assert got == {"none": "1/1", "object": "1/2", "verb": "0/1"}
