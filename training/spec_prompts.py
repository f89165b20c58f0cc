"""Write a prompt set for ``k3serve spec train --model k3-default``: the shapes of the default model's real use
(tool calls, choosing and declining tools, JSON under a schema, record recall, follow-ups after a tool result,
and short code edits), rendered with the K3 chat template as the server renders a request (thinking off for
most, as ``benchmarks/spec_decode.py`` sends them; on for the rest), one ``{"prompt_ids": [...]}`` per line.

    python -m training.spec_prompts /tmp/spec_prompts.jsonl --n 300
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from k3serve.chat import K3, ChatOptions
from training import tasks
from training.tok import load_tokenizer

NAMES = ["total", "amount", "width", "height", "depth", "cost", "limit", "count", "value", "weight", "age",
         "score", "margin", "offset", "index", "budget"]
CODE = '''def {f}(rows, floor):
    kept = []
    for row in rows:
        if row.{a} >= floor:
            kept.append(row.{a})
    return kept


def show_{f}(rows):
    found = {f}(rows, 3)
    print("{f}:", len(found))
    return found
'''


def code_edit(rng: random.Random) -> dict:
    f, a = f"pick_{rng.choice(NAMES)}", rng.choice(NAMES)
    msg = (f"Here is a file:\n```python\n{CODE.format(f=f, a=a)}```\n"
           f"Return the whole file with `{a}` renamed to `{a}_{rng.choice(NAMES)}`.")
    return {"messages": [{"role": "user", "content": msg}], "tools": None, "response_format": None}


def render(body: dict, thinking: bool, tok) -> list[int]:
    options = ChatOptions(thinking=thinking, effort=None, response_format=body.get("response_format"))
    return [int(i) for i in K3.render(body["messages"], body.get("tools"), options).encode(tok.encode_segments)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON-lines file to write")
    ap.add_argument("--n", type=int, default=300, help="prompts per kind")
    ap.add_argument("--seed", type=int, default=11, help="not the benchmark's (5): other requests, same shapes")
    ap.add_argument("--thinking", type=float, default=0.25, help="share of prompts rendered with thinking on")
    args = ap.parse_args()
    rng, tok = random.Random(args.seed), load_tokenizer()
    count = 0
    with open(args.out, "w") as f:
        for kind in (*tasks.KINDS, "edit"):
            for i in range(args.n):
                if kind == "edit":
                    body = code_edit(rng)
                else:
                    s = tasks.make(kind, rng, held_out=i % 2 == 0)
                    body = {"messages": s.messages, "tools": s.tools, "response_format": s.response_format}
                f.write(json.dumps({"prompt_ids": render(body, rng.random() < args.thinking, tok)}) + "\n")
                count += 1
    print(f"wrote {count} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
