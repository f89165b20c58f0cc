"""Sessions: several requests in one conversation over one set of offered tools, every answer learnt.

A single-turn task pays for its tool declarations (~250 of its ~400 tokens) to teach one answer. A session
declares 2-4 tools once and then asks 2-4 times: a call of one of them (when more requests follow, asking
back a value of its result, which the next assistant message answers), or a request for a tool that is not
offered (declined). Every assistant message is a target: the K3 renderer writes history turns exactly as it
writes a fresh answer (reasoning too, when thinking), so the training data marks each assistant message's
span (``render.encode_turns``) and the loss covers them all. The last turn is a single-turn ``tool``,
``choose`` or ``decline`` answer with history in front, and is what ``expected`` and ``score`` check.

    python -m training.generate --kinds session --n 2
"""

from __future__ import annotations

import random

from training import tasks
from training.tasks import PLAIN, Sample, Style

TURNS = (2, 4)  # requests per session
THINKING = 0.6  # the share of sessions in thinking mode, as for single tasks (``tasks.make``)


def make(rng: random.Random, *, held_out: bool = False, thinking: bool | None = None, style: Style = PLAIN,
         turns: tuple[int, int] = TURNS) -> Sample:
    if thinking is None:
        thinking = rng.random() < THINKING
    return make_session(rng, held_out, thinking, style, turns)


def make_session(rng: random.Random, held_out: bool, thinking: bool, style: Style = PLAIN,
                 turns: tuple[int, int] = TURNS) -> Sample:
    n_offered = rng.randint(2, 4)
    tools = tasks.draw_toolset(rng, held_out, n_offered + 1)
    absent = tools.pop()  # shares a verb or an object with an offered tool half the time: a hard negative
    schemas = [tasks.make_schema(rng, rng.randint(1, 4)) for _ in tools]
    decl = [tasks.declare_tool(*tool, schema) for tool, (schema, _, _) in zip(tools, schemas)]
    offer = [tool[0] for tool in tools]
    # which tools are asked for, in order; index n_offered is the absent one (asked at most once)
    asked = rng.sample(range(n_offered + 1), rng.randint(turns[0], min(turns[1], n_offered + 1)))
    messages: list[dict] = []
    expected: dict = {}
    for k, pick in enumerate(asked, 1):
        more = k < len(asked)
        if pick == n_offered:
            name, verb, obj = absent
            _, _, mentions = tasks.make_schema(rng, rng.randint(1, 3))
            reply = tasks.decided(verb, obj, name, False, thinking, style, offer)
            messages += [{"role": "user", "content": tasks.write_request(rng, verb, obj, mentions, style.form)}, reply]
            expected = {"tool": None, "text": reply["content"]}
            continue
        (name, verb, obj), (schema, values, mentions) = tools[pick], schemas[pick]
        request = tasks.write_request(rng, verb, obj, mentions, style.form)
        if more:
            result, ask = tasks.draw_result(rng, schema)
            request = tasks.ask_back(request, ask, style.form)
        call = tasks.tool_call(name, values, k)
        messages += [{"role": "user", "content": request},
                     {**tasks.decided(verb, obj, name, True, thinking, style, offer), "tool_calls": [call]}]
        if more:
            messages += [tasks.tool_message(result, k), tasks.answer_from(result, ask, thinking)]
        expected = {"tool": name, "arguments": values}
    target = messages.pop()
    return Sample("session", messages, target, expected, decl, thinking, tasks.draw_effort(rng, thinking),
                  meta={"asked": absent[0], "turns": len(asked)})
