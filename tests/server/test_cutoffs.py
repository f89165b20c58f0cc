"""Where a chat answer ends early: stop strings on content only, `parallel_tool_calls: false`, and
the engine abort that follows. No server: a toy vocabulary (one token per piece) feeds `ChoiceDecoder`."""

from __future__ import annotations

import asyncio

import pytest

from k3serve.chat.parsers import ContentDelta, K2Parser, K3Parser, ReasoningDelta, ToolCallStart
from k3serve.engine.messages import Output
from k3serve.engine.sampling_params import SamplingParams
from k3serve.server.cutoffs import Cutoff
from k3serve.server.choice import ChoiceDecoder
from k3serve.server.cutoffs import Cutoff
from k3serve.server.generation import run_choices

EOM = "<|end_of_msg|>"
K3_ANSWER_END = "<|close|>response<|sep|><|close|>message<|sep|>"


class Vocab:
    """Token id i is `pieces[i]`; ids are handed out as pieces are first seen."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def ids(self, pieces: list[str]) -> list[int]:
        out = []
        for p in pieces:
            if p not in self.pieces:
                self.pieces.append(p)
            out.append(self.pieces.index(p))
        return out

    def decode_bytes(self, ids) -> bytes:
        return "".join(self.pieces[i] for i in ids).encode()


def decode(pieces: list[str], *, parser, stop=(), one_call=False, finish_reason="length"):
    """Feed one piece per engine step; returns (decoder, deltas per step, steps taken)."""
    vocab = Vocab()
    ids = vocab.ids(pieces)
    dec = ChoiceDecoder(0, vocab.decode_bytes, stop=stop, parser=parser, one_call=one_call)
    steps = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        deltas, _ = dec.push(Output("r", [t], finished=last, finish_reason=finish_reason if last else None))
        steps.append(deltas)
        if dec.done:
            break
    return dec, steps, len(steps)


def content_frames(steps) -> list[str]:
    return [d.text for step in steps for d in step if isinstance(d, ContentDelta)]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_tokens_cuts_content_and_ends_the_request(stream):
    pieces = ["Hello", " wor", "ld, ", "ST", "O", "P here", " more", " never", " sent"]
    dec, steps, n = decode(pieces, parser=K3Parser(thinking=False), stop=["STOP"])
    assert n == 6 and dec.done and dec.finish_reason == "stop" and dec.stopped_on == "STOP"
    assert dec.final_finish_reason() == "stop"
    if stream:
        frames = content_frames(steps)
        assert "".join(frames) == "Hello world, "
        # the partial stop string was held back, never streamed
        assert not any(f.endswith(("S", "ST", "STO")) for f in frames)
        assert steps[3] == [] and steps[4] == []
    else:
        msg = dec.message()
        assert msg.content == "Hello world, " and msg.reasoning_content is None


def test_held_prefix_is_released_when_no_stop_follows():
    dec, steps, _ = decode(["ab", "ST", "OX", "ST"], parser=K3Parser(thinking=False), stop=["STOP"],
                           finish_reason="stop")
    assert content_frames(steps) == ["ab", "STOX", "ST"]
    assert dec.stopped_on is None and dec.final_finish_reason() == "stop"


def test_stop_text_inside_reasoning_does_not_stop():
    pieces = ["I will say ", "ST", "OP then", " stop.", "<|close|>think<|sep|>", "<|open|>response<|sep|>",
              "Answer", " STOP", " tail", K3_ANSWER_END, EOM]
    dec, steps, n = decode(pieces, parser=K3Parser(thinking=True), stop=["STOP"])
    assert n == 8 and dec.stopped_on == "STOP" and dec.finish_reason == "stop"
    msg = dec.message()
    assert msg.reasoning_content == "I will say STOP then stop." and msg.content == "Answer "
    # reasoning streamed as it came (no hold-back for a stop string there)
    assert [d.text for d in steps[1] if isinstance(d, ReasoningDelta)] == ["ST"]


def test_stop_text_inside_tool_arguments_does_not_stop_k3():
    tools = [{"type": "function", "function": {"name": "say", "parameters": {"type": "object"}}}]
    pieces = ["<|close|>response<|sep|>", "<|open|>tools<|sep|>", '<|open|>call tool="say" index="1"<|sep|>',
              '<|open|>argument key="text" type="string"<|sep|>', "ST", "OP now", "<|close|>argument<|sep|>",
              "<|close|>call<|sep|>", "<|close|>tools<|sep|>", "<|close|>message<|sep|>", EOM]
    dec, _, n = decode(pieces, parser=K3Parser(thinking=False, tools=tools), stop=["STOP"], finish_reason="stop")
    assert n == len(pieces) and dec.stopped_on is None
    msg = dec.message()
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("say", '{"text": "STOP now"}')]
    assert dec.final_finish_reason() == "tool_calls"


def test_stop_text_inside_tool_arguments_does_not_stop_k2():
    pieces = ["<think>", "plan STOP", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
              "functions.say:0", "<|tool_call_argument_begin|>", '{"text": "ST', 'OP"}', "<|tool_call_end|>",
              "<|tool_calls_section_end|>", "<|im_end|>"]
    dec, _, n = decode(pieces, parser=K2Parser(reasoning=True), stop=["STOP"], finish_reason="stop")
    assert n == len(pieces) and dec.stopped_on is None
    msg = dec.message()
    assert msg.reasoning_content == "plan STOP" and msg.tool_calls[0].arguments == '{"text": "STOP"}'


def test_held_content_is_released_before_a_tool_call():
    pieces = ["Let me ST", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0",
              "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>"]
    dec, steps, _ = decode(pieces, parser=K2Parser(reasoning=False), stop=["STOP"], finish_reason="stop")
    kinds = [type(d).__name__ for step in steps for d in step]
    assert kinds[:3] == ["ContentDelta", "ContentDelta", "ToolCallStart"]
    assert content_frames(steps) == ["Let me ", "ST"] and dec.message().content == "Let me ST"


def _two_calls_k2() -> list[str]:
    return ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.a:0", "<|tool_call_argument_begin|>",
            '{"x": ', "1}", "<|tool_call_end|>", "<|tool_call_begin|>", "functions.b:1",
            "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|im_end|>"]


@pytest.mark.parametrize("one_call", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(one_call):
    dec, steps, n = decode(_two_calls_k2(), parser=K2Parser(reasoning=False), one_call=one_call,
                           finish_reason="stop")
    calls = dec.message().tool_calls
    if one_call:
        assert n == 7  # ended at the first <|tool_call_end|>: the engine request is aborted there
        assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]
    else:
        assert n == len(_two_calls_k2()) and [c.name for c in calls] == ["a", "b"]
    assert dec.final_finish_reason() == "tool_calls"


def test_parallel_tool_calls_false_when_both_calls_arrive_in_one_step():
    vocab = Vocab()
    text = "".join(_two_calls_k2())
    dec = ChoiceDecoder(0, vocab.decode_bytes, parser=K2Parser(reasoning=False), one_call=True)
    deltas, _ = dec.push(Output("r", vocab.ids([text]), finished=True, finish_reason="stop"))
    assert dec.done and [d.name for d in deltas if isinstance(d, ToolCallStart)] == ["a"]
    assert [c.arguments for c in dec.message().tool_calls] == ['{"x": 1}']


def test_parallel_tool_calls_false_k3_drops_later_calls():
    call = '<|open|>call tool="{}" index="{}"<|sep|><|open|>argument key="q" type="number"<|sep|>{}' \
           '<|close|>argument<|sep|><|close|>call<|sep|>'
    pieces = ["<|close|>response<|sep|>", "<|open|>tools<|sep|>", call.format("a", 1, 5), call.format("b", 2, 6),
              "<|close|>tools<|sep|>", "<|close|>message<|sep|>", EOM]
    dec, _, n = decode(pieces, parser=K3Parser(thinking=False), one_call=True, finish_reason="stop")
    assert n == 3 and [(c.name, c.arguments) for c in dec.message().tool_calls] == [("a", '{"q": 5}')]


def test_cutoff_rejects_empty_stop_and_passes_everything_without_rules():
    with pytest.raises(ValueError):
        Cutoff(["x", ""])
    assert not Cutoff().active
    ds = [ReasoningDelta("r"), ContentDelta("c")]
    assert Cutoff().push(ds) == ds


def test_completions_keep_raw_text_stop():
    vocab = Vocab()
    dec = ChoiceDecoder(0, vocab.decode_bytes, stop=["</think>"])
    text, _ = dec.push(Output("r", vocab.ids(["a<", "/think>b"])))
    assert text == "a" and dec.done and dec.stopped_on == "</think>" and dec.text == "a"


class _Client:
    """An engine stream that never ends by itself; records when the server closes it (= abort)."""

    def __init__(self, vocab: Vocab, pieces: list[str]):
        self.ids = vocab.ids(pieces)
        self.closed_after: int | None = None

    async def generate(self, request_id, prompt_ids, sampling, *, grammar=None, logit_bias=None, images=(),
                       handoff=None):
        sent = 0
        try:
            while True:
                sent += 1
                yield Output(request_id, [self.ids[(sent - 1) % len(self.ids)]])
                await asyncio.sleep(0)
        finally:
            self.closed_after = sent


def test_stop_closes_the_engine_stream_at_once():
    async def go():
        vocab = Vocab()
        client = _Client(vocab, ["one ", "two ", "STOP", "three "])
        dec = ChoiceDecoder(0, vocab.decode_bytes, stop=["STOP"], parser=K3Parser(thinking=False))
        frames = [items async for _, items, _ in run_choices(client, "x", [1], SamplingParams(), [dec])]
        # closed right after the step that hit the stop, before run_choices returned
        assert client.closed_after == 3 and len(frames) == 3
        assert dec.message().content == "one two "

    asyncio.run(go())


def test_anthropic_disable_parallel_tool_use_maps_to_parallel_tool_calls():
    from k3serve.server.anthropic import MessagesRequest

    base = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    off = MessagesRequest(**base, tool_choice={"type": "auto", "disable_parallel_tool_use": True}).to_chat()
    assert off.parallel_tool_calls is False
    assert MessagesRequest(**base, tool_choice={"type": "auto"}).to_chat().parallel_tool_calls is None
