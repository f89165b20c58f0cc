"""Every subcommand's --help (nested ones too) reads cleanly: no option says "(default: ...)" twice,
none shows "(default: None)", and on/off flags never show "(default: True/False)"."""

from __future__ import annotations

import argparse
import re

import pytest

from k3serve.cli import SUBCOMMANDS, build_parser


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _option_blocks(text: str) -> list[str]:
    """The help text split into one block per option (a block starts at a line opening with '-' or a name)."""
    blocks: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            blocks.append(line)
        elif blocks and line.startswith("    "):
            blocks[-1] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_help_defaults_read_sensibly(command):
    top = build_parser([command])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for path, parser in _parsers(sub, (command,)):
        text = parser.format_help()
        flags = {s for a in parser._actions if a.nargs == 0 for s in a.option_strings}
        for block in _option_blocks(text):
            where = f"k3serve {' '.join(path)} --help: {block!r}"
            assert block.count("(default:") <= 1, where
            assert "(default: None)" not in block, where
            first = block.split()[0].rstrip(",")
            if first in flags:
                assert not re.search(r"\(default: (True|False)\)", block), where


def test_serve_help_keeps_meaningful_defaults():
    top = build_parser(["serve"])
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    blocks = {b.split()[0].rstrip(","): b for b in _option_blocks(sub.format_help())}
    assert "(default: 64)" in blocks["--max-num-seqs"]
    assert "(default: k3-default)" in blocks["model"]
    assert "(default: the model's)" in blocks["--max-model-len"]
    assert "(default: 0)" in blocks["--seed"]
