"""How a run writes its samples (``Style``): the request's form, how reasoning decides, what a no-think
answer says and how a recall answer copies. A run trains in one style; its evaluations ask in the same."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# How a request writes the values to use: "inline" (``city "Paris"; unit "metric"``) or "lines" (one
# ``city: "Paris"`` per line). A key at a line's start is the very token a call or JSON answer writes
# (``city``), where inline it carries a space (`` city``, another id): with lines every argument is a copy.
FORMS = ("inline", "lines")
# How a decline's reasoning decides: "plain" (``... No tool does that.``) or "check": it first names the tool
# that would do it, as a call's reasoning does (``The tool close_payment``), then says it is not offered. Both
# kinds then write a tool name before deciding, and the decision is whether that name was offered. "assign" is
# "check" with the name written as the call writes it (``The tool="close_payment" does that.``): the same tokens
# `` tool`` ``="`` ``close`` ``_payment``, so the call's name is one induction step from the reasoning's, where
# `` close`` (with its space) is another id than the call's ``close``. "list" is "check" with a sentence between
# that lists the offered tools with the asked verb (``Tools that convert: convert_lamp.``, or ``none``): a name
# is three tokens with the verb two back from the last, so "check" asks one position to match two tokens
# (``convert_road`` asked with ``share_road`` offered: the object matches, the verb does not); listed, each step
# matches one: the verb at the list's start, the object at the verdict's name. "quote" is "check" with the name
# in quotes (``The tool "convert_road" is not offered.``): `` "`` then the name's tokens as the declarations
# write them (``convert`` ``_`` ``road``), so at the closing quote the tokens one to three back are the same ids
# as before the declarations' ``","`` after the name, verb included.
REASONINGS = ("plain", "check", "assign", "list", "quote")
# What a tool, choose or decline answer says without thinking: "bare" (a call has empty content, a decline says
# only ``None of the available tools can ...``) or "decide": the content opens with the sentences the reasoning
# would hold (``The user wants to ... The tool close_payment is not offered.``), so the tool's name is written
# before the decision in both modes, not decided at the answer's first token.
NOTHINKS = ("bare", "decide")
# How a recall list writes its records and the answer copies one: "passage" (``Record 237: "w1 ... w8"``, the
# answer is ``w1 ... w8``) or "restate" (``Record 237 w1 ... w8``, the answer is that whole line). Restating
# starts the answer with the label, so its first word is "the token after an earlier occurrence of the current
# one" (the label) like every later word: one induction step, where "passage" has to find ``Record 237: "``
# from the answer's opening markup.
RECALLS = ("passage", "restate")
STYLED_KINDS = ("tool", "choose", "decline", "json", "followup", "lookup", "recall")  # the kinds a Style changes


@dataclass(frozen=True)
class Style:
    """How a run writes its samples (``FORMS``, ``REASONINGS``); an evaluation asks in its model's ``form``."""

    form: str = "inline"
    reasoning: str = "plain"
    nothink: str = "bare"
    recall: str = "passage"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"unknown request form {self.form!r}; known: {', '.join(FORMS)}")
        if self.reasoning not in REASONINGS:
            raise ValueError(f"unknown reasoning {self.reasoning!r}; known: {', '.join(REASONINGS)}")
        if self.nothink not in NOTHINKS:
            raise ValueError(f"unknown no-think answer {self.nothink!r}; known: {', '.join(NOTHINKS)}")
        if self.recall not in RECALLS:
            raise ValueError(f"unknown recall answer {self.recall!r}; known: {', '.join(RECALLS)}")


PLAIN = Style()
SHIPPED = Style("lines", "check", "decide", "restate")  # the shipped k3-default's: evaluations and probes default to it


def add_style_arguments(p: argparse.ArgumentParser) -> None:
    """A probe's ``--form``, ``--reasoning`` and ``--nothink``: the style the probed model was trained in
    (default: the shipped model's); ``style_of`` reads them back."""
    p.add_argument("--form", choices=FORMS, default=SHIPPED.form,
                   help="the model's --request-form (default: the shipped model's)")
    p.add_argument("--reasoning", choices=REASONINGS, default=SHIPPED.reasoning,
                   help="the model's --reasoning (default: the shipped model's)")
    p.add_argument("--nothink", choices=NOTHINKS, default=SHIPPED.nothink,
                   help="the model's --nothink (default: the shipped model's)")


def style_of(args: argparse.Namespace) -> Style:
    return Style(args.form, args.reasoning, args.nothink, SHIPPED.recall)
