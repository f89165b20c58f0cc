"""``k3serve bench``: load-generate against an OpenAI-compatible server and report vLLM-style serving metrics.

    k3serve bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 200 --request-rate 4 \\
        --goodput ttft:500 tpot:50 --result-file out.json --plot-dir plots/
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import sys
from typing import Any

from k3serve.bench.client import ENDPOINTS, Endpoint, RequestRecord, ServerUnavailable, make_client, send, served_model
from k3serve.bench.datasets import DEFAULT_OUTPUT_LEN, BenchRequest, DatasetConfig, build_dataset, parse_dataset
from k3serve.bench.metrics import Goodput, parse_percentiles, summarize
from k3serve.bench.report import result_dict, summary_text, write_result
from k3serve.bench.runner import LoadConfig, arrival_schedule, run_load
from k3serve.cli import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("TTFT/TPOT/ITL/E2EL, throughputs and goodput follow vllm bench serve (see k3serve/bench/metrics.py). "
                "Output token counts come from the server's usage chunk when present, else from the stream.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (scheme://host:port)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    g.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY when set)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the requested output lengths")
    g.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    g.add_argument("--extra-body", help="JSON object merged into every request body")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", help="random | multiturn | trace:FILE (Mooncake jsonl)")
    d.add_argument("--num-prompts", type=int, help="requests to send (default: 1000, or the whole trace)")
    d.add_argument("--prompt-format", choices=["ids", "text"],
                   help="token ids or text, one word-token per id (default: ids; chat is always text)")
    d.add_argument("--input-len", type=int, default=1024, help="prompt tokens (multiturn: new tokens per turn)")
    d.add_argument("--output-len", type=int,
                   help="max_tokens per request (default: 128; trace: each record's output_length, which a "
                        "given value replaces)")
    d.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    d.add_argument("--prefix-len", type=int, default=0, help="tokens of a prefix shared by all requests")
    d.add_argument("--turns", type=int, default=3, help="user turns per multiturn session")
    d.add_argument("--vocab-size", type=int, default=2048, help="token ids are drawn from [0, vocab-size)")
    d.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per trace hash_id; below 512 shrinks prompts, keeping the sharing")
    d.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies trace timestamps")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=None,
                   help="req/s with Poisson arrivals; inf sends all at once (default: trace timestamps, else inf)")
    t.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    t.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    t.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    o.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report, e.g. 50,90,99")
    o.add_argument("--result-file", help="write the aggregates and every request's raw timestamps as JSON")
    o.add_argument("--plot-dir", help="write latency_cdf.png and throughput.png (needs matplotlib)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")) or "://" == url[-3:]:
        raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT")
    return url.removesuffix("/v1")


def _extra_body(text: str | None) -> tuple[tuple[str, Any], ...]:
    if text is None:
        return ()
    try:
        body = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--extra-body: not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body: expected a JSON object")
    return tuple(body.items())


async def _bench(ep: Endpoint, model: str | None, timeout_s: float, api_key: str | None,
                 requests: list[BenchRequest], load: LoadConfig,
                 schedule: list[float]) -> tuple[Endpoint, list[RequestRecord], float]:
    async with make_client(timeout_s, api_key) as client:
        ep = dataclasses.replace(ep, model=await served_model(client, ep.base_url, model))
        # one short request first, so a server that rejects our requests fails fast with its reason; its prompt
        # (the first id 8 times) shares almost nothing with the dataset's, so it warms no prefix cache
        probe = RequestRecord(-1, 0.0, 0)
        await send(client, ep, BenchRequest((("user", (requests[0].prompt_ids[0],) * 8),), 1), probe, lambda: 0.0)
        if not probe.success:
            raise ServerUnavailable(f"test request to {ep.url} failed: {probe.error}")
        records, duration = await run_load(client, ep, requests, schedule, load)
    return ep, records, duration


def _header(args, kind: str, ep: Endpoint, data: DatasetConfig, num_prompts: int, goodput: Goodput | None,
            percentiles: tuple[float, ...]) -> dict[str, Any]:
    """The run's settings, under vLLM's result keys where vLLM has one."""
    rate: float | str | None = args.request_rate
    if rate is None:
        rate = "trace" if kind == "trace" else "inf"
    elif math.isinf(rate):
        rate = "inf"  # JSON has no infinity
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "backend": "openai",
            "base_url": ep.base_url, "endpoint": ENDPOINTS[ep.kind], "model_id": ep.model, "dataset": args.dataset,
            "prompt_format": ep.prompt_format, "num_prompts": num_prompts, "request_rate": rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
            "dataset_config": dataclasses.asdict(data),
            "goodput_slo": dataclasses.asdict(goodput) if goodput else None, "metric_percentiles": list(percentiles)}


def run(args: argparse.Namespace) -> int:
    kind, trace_path = parse_dataset(args.dataset)
    prompt_format = args.prompt_format or ("text" if args.endpoint == "chat" else "ids")
    if args.endpoint == "chat" and prompt_format == "ids":
        raise ValueError("--prompt-format ids needs --endpoint completions (chat messages are text)")
    ep = Endpoint(_base_url(args.base_url), args.endpoint, "", prompt_format, args.ignore_eos, args.temperature,
                  _extra_body(args.extra_body))  # the model is resolved against the server
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    # a trace keeps its own output lengths unless --output-len is given (then it replaces them)
    output_len = DEFAULT_OUTPUT_LEN if args.output_len is None and kind != "trace" else args.output_len
    data = DatasetConfig(kind, args.num_prompts, args.input_len, output_len, args.range_ratio, args.prefix_len,
                         args.turns, trace_path, args.trace_block_size, args.vocab_size, args.seed)
    load = LoadConfig(args.request_rate, args.burstiness, args.max_concurrency, args.trace_time_scale, args.seed,
                      progress=not args.disable_tqdm)
    goodput = Goodput.parse(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    if args.plot_dir:
        from k3serve.bench.plots import pyplot

        pyplot()  # fail before the run, not after it, when matplotlib is missing
    requests = build_dataset(data)
    schedule = arrival_schedule(requests, load)
    try:
        ep, records, duration = asyncio.run(_bench(ep, args.model, args.timeout, args.api_key or
                                                   os.environ.get("OPENAI_API_KEY"), requests, load, schedule))
    except ServerUnavailable as e:
        raise CLIError(str(e)) from None

    header = _header(args, kind, ep, data, len(requests), goodput, percentiles)
    summary = summarize(records, duration, percentiles, goodput)
    print(summary_text(summary, header))
    if args.result_file:
        write_result(args.result_file, result_dict(header, summary, records))
    if args.plot_dir:
        from k3serve.bench.plots import write_plots

        for path in write_plots(records, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    if summary["completed"] == 0:
        first = next((r.error for r in records if r.error), "no output")
        raise CLIError(f"all {len(records)} requests failed; first error: {first}")
    return 0
