"""``k3serve verify --base-url URL``: the pre-flight checks against an endpoint; exit 0 when nothing fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=False, help="the endpoint, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--contract", choices=["kimi", "openai"], default="kimi",
                   help="'kimi': Moonshot's K3 API (fixed sampling parameters, exact prompt_tokens without the "
                        "3-token channel stub); 'openai': OpenAI parameter ranges, prompt_tokens up to the full length")
    p.add_argument("--reference", default=None, metavar="PATH|URL",
                   help="also check fidelity (greedy agreement, logprob KL) against a reference: a URL of another "
                        "server, or a checkpoint path / built-in model name run in this process")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds each check may take; past it the check fails and the run goes on")
    p.add_argument("--only", nargs="+", default=[], metavar="CHECK",
                   help="run only these checks or groups (ids as --list shows them)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the results as JSON here")
    p.add_argument("--html", dest="html_out", default=None, metavar="OUT", help="write an HTML report here")


def run(args: argparse.Namespace) -> int:
    from k3serve.verify.checks import CHECKS, Target
    from k3serve.verify.report import Progress, table, to_html, to_json, verdict
    from k3serve.verify.runner import EndpointUnreachable, run_verify

    if args.list:
        for c in CHECKS:
            print(f"{c.id:40} {c.what}" + ("  [needs --reference]" if c.needs_reference else ""))
        return 0
    if not args.base_url:
        raise ValueError("--base-url: required (e.g. --base-url http://127.0.0.1:8000)")
    target = Target(args.base_url, model=args.model, api_key=args.api_key, contract=args.contract,
                    timeout_s=args.timeout, reference=args.reference)
    try:
        results = asyncio.run(run_verify(target, only=args.only, progress=Progress()))
    except EndpointUnreachable as e:
        raise ValueError(str(e)) from None
    print(table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(to_json(results, target), indent=2) + "\n")
    if args.html_out:
        Path(args.html_out).write_text(to_html(results, target))
    sys.stdout.flush()
    return 0 if verdict(results) == "pass" else 1
