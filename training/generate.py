"""Write synthetic K3 conversations as JSON lines (the training stream draws the same tasks on the fly).

    python -m training.generate --n 20 --out /tmp/k3-tasks.jsonl [--held-out] [--seed 0]

Each line: the OpenAI-style request (messages, tools, response_format, thinking, effort), the assistant
``target``, the ``expected`` answer, the rendered K3 text (prompt + answer) and its token counts (a session's
``answer_tokens`` counts every assistant message). Samples are written in the shipped model's style unless
``--form``/``--reasoning``/``--nothink`` say otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

from training import sessions, tasks
from training.render import encode_sample, encode_turns
from training.tok import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10, help="conversations per kind")
    p.add_argument("--out", default="-", help="output .jsonl ('-' = stdout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out", action="store_true", help="draw held-out tool names (evaluation side)")
    p.add_argument("--kinds", nargs="+", default=list(tasks.KINDS),
                   choices=[*tasks.KINDS, *tasks.WARMUP_KINDS, "session"])
    p.add_argument("--form", choices=tasks.FORMS, default=tasks.SHIPPED.form, help="how requests write values")
    p.add_argument("--reasoning", choices=tasks.REASONINGS, default=tasks.SHIPPED.reasoning,
                   help="how a decline's reasoning decides")
    p.add_argument("--nothink", choices=tasks.NOTHINKS, default=tasks.SHIPPED.nothink,
                   help="what a tool, choose or decline answer says without thinking")
    p.add_argument("--recall", choices=tasks.RECALLS, default=tasks.SHIPPED.recall,
                   help="how recall lists write their records and the answer copies one")
    p.add_argument("--records", type=int, default=150, help="records in recall contexts (~14 tokens each)")
    args = p.parse_args(argv)
    if args.n < 1 or args.records < 1:
        print("error: --n and --records must be >= 1", file=sys.stderr)
        return 2
    tok, rng = load_tokenizer(), random.Random(args.seed)
    style = tasks.Style(args.form, args.reasoning, args.nothink, args.recall)
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        for kind in args.kinds:
            for _ in range(args.n):
                kwargs = {"records": args.records} if kind == "recall" else {}
                if kind == "session":
                    s = sessions.make(rng, held_out=args.held_out, style=style)
                else:
                    s = tasks.make(kind, rng, held_out=args.held_out, style=style, **kwargs)
                if kind == "session":  # every assistant message is learnt
                    ids, n_prompt, spans = encode_turns(s, tok)
                else:  # only the final answer is (a follow-up's earlier call is context)
                    ids, n_prompt = encode_sample(s, tok)
                    spans = ((n_prompt, len(ids)),)
                row = dataclasses.asdict(s) | {"text": tok.decode(ids), "prompt_tokens": n_prompt,
                                               "answer_tokens": sum(b - a for a, b in spans)}
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
