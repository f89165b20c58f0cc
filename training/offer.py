"""What a tool request offers and how its answer decides: the offered tools (``draw_toolset``, with hard
negatives that share the asked tool's verb or object: ``object_twin``, ``same_object``) and the decision
sentences before a call or a decline (``decision_reasoning``, ``decided``) in a run's ``Style``. Tool names are
``verb_object`` (``pools.tool_name``); a tool is ``(name, verb, object)``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from training import pools
from training.styles import PLAIN, Style


def draw_toolset(rng: random.Random, held_out: bool, n: int) -> list[tuple[str, str, str]]:
    """n distinct tools; later ones often share the first one's verb or object (hard negatives)."""
    first = pools.tool_name(rng, held_out)
    out = [first]
    while len(out) < n:
        name, verb, obj = pools.tool_name(rng, held_out)
        if rng.random() < 0.5:
            verb = first[1] if rng.random() < 0.5 else verb
            obj = first[2] if verb != first[1] else obj
            name = f"{verb}_{obj}"
            if pools.is_held_out(name) != held_out:
                continue
        if all((verb, obj) != (v, o) for _, v, o in out) and all(name != n_ for n_, _, _ in out):
            out.append((name, verb, obj))
    return out


def object_twin(rng: random.Random, held_out: bool, tool: tuple[str, str, str],
                taken: list[tuple[str, str, str]]) -> tuple[str, str, str]:
    """A tool with ``tool``'s object and another verb, none of ``taken`` (on ``held_out``'s side of the split)."""
    _, _, obj = tool
    while True:
        verb = rng.choice(pools.VERBS)
        name = f"{verb}_{obj}"
        if pools.is_held_out(name) == held_out and all(name != n for n, _, _ in taken):
            return name, verb, obj


def same_object(rng: random.Random, held_out: bool, offered: list[tuple[str, str, str]]) -> tuple[str, str, str]:
    """A tool that is not offered but shares its object with an offered one (``set_road`` when ``share_road`` is
    offered): the hard negative that only the verb tells apart."""
    return object_twin(rng, held_out, rng.choice(offered), offered)


def decision_reasoning(verb: str, obj: str, name: str, offered: bool, style: Style = PLAIN,
                       offer: Sequence[str] | None = None) -> str:
    """The one-sentence-a-step reasoning before a call (``offered``) or a decline of tool ``name``; ``offer``
    (the offered tools' names, in declaration order) is needed by the "list" reasoning."""
    tool = {"assign": f'The tool="{name}"', "quote": f'The tool "{name}"'}.get(style.reasoning, f"The tool {name}")
    if offered:
        verdict = f"{tool} does that."
    else:
        verdict = "No tool does that." if style.reasoning == "plain" else f"{tool} is not offered."
    if style.reasoning == "list":
        if offer is None:
            raise ValueError("the list reasoning needs the offered tools")
        listed = [n for n in offer if n.split("_", 1)[0] == verb]  # tool names are verb_object
        verdict = f"Tools that {verb}: {', '.join(listed) or 'none'}. {verdict}"
    return f"The user wants to {verb} the {obj}. {verdict}"


def decline_content(verb: str, obj: str) -> str:
    return f"None of the available tools can {verb} the {obj}."


def decided(verb: str, obj: str, name: str, offered: bool, thinking: bool, style: Style = PLAIN,
            offer: Sequence[str] | None = None) -> dict[str, Any]:
    """The assistant message of a call (``offered``: without ``tool_calls``, the caller adds them) or a decline:
    the decision sentences go to the reasoning when thinking, to the content's start with ``nothink``
    "decide", nowhere otherwise."""
    sentences = decision_reasoning(verb, obj, name, offered, style, offer)
    said = "" if thinking or style.nothink == "bare" else sentences
    content = said if offered else " ".join(filter(None, (said, decline_content(verb, obj))))
    return {"role": "assistant", "content": content, "reasoning_content": sentences if thinking else None}
