"""Speculative decoding through the server: mean acceptance length and per-request decode speed with and
without each drafter, on a tool-calling and a code-editing workload, at batch 1; and batch-64 throughput.

For each configuration (off, ngram, suffix; eagle3 and eagle_suffix with the head shipped for k3-default, or
``--head DIR``, a head from ``k3serve spec train``; draft_model with ``--draft-model NAME``) a server is started with the package's default model
(``k3-default``) and ``--speculative-config``; the same greedy chat requests go to each:
  * tool: held-out tool-calling tasks (``training.tasks``: the call's arguments copy spans of the request);
  * edit: a short Python file and an instruction to return it with one identifier renamed.
Batch 1: requests one after another, streamed; decode tokens/s of a request = (tokens - 1) / (last token time
- first token time), averaged over requests. Batch 64: ``--batch`` requests at once, output tokens / wall time.
Mean acceptance length = 1 + accepted drafts / verify rows, read from /metrics before and after.

    python benchmarks/spec_decode.py --n 8 --batch 64 --configs off,suffix,eagle3,eagle_suffix --k 6
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3serve.router.launch import free_port, wait_healthy  # noqa: E402
from training import tasks  # noqa: E402

CONFIGS = {"off": None, "ngram": '{"method": "ngram", "num_speculative_tokens": 4}',
           "suffix": '{"method": "suffix", "num_speculative_tokens": 4}'}
CODE = '''def {f}(items, limit):
    total = 0
    for item in items:
        if item.{a} > limit:
            total += item.{a}
    return total


def report_{f}(items):
    value = {f}(items, 10)
    print("{f}:", value)
    return value
'''


def workloads(n: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    tool = []
    for _ in range(n):
        s = tasks.make("tool", rng, held_out=True)
        body = {"messages": s.messages, "tools": s.tools, "chat_template_kwargs": {"thinking": False}}
        tool.append(body)
    edit = []
    names = ["price", "weight", "score", "count", "size", "level", "rank", "speed"]
    for i in range(n):
        f, a = f"sum_{names[i % 8]}", names[(i + 3) % 8]
        text = CODE.format(f=f, a=a)
        msg = f"Here is a file:\n```python\n{text}```\nReturn the whole file with `{a}` renamed to `{a}_value`."
        edit.append({"messages": [{"role": "user", "content": msg}], "chat_template_kwargs": {"thinking": False}})
    return {"tool": tool, "edit": edit}


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text

    def get(name):
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return get("vllm:spec_decode_num_drafts_total"), get("vllm:spec_decode_num_accepted_tokens_total")


def stream_one(client: httpx.Client, body: dict, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds from first to last token) of one streamed greedy request."""
    req = {"model": "m", "temperature": 0, "max_tokens": max_tokens, "stream": True,
           "stream_options": {"include_usage": True}, **body}
    first = last = None
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
    return tokens, (last - first) if first is not None else 0.0


def run_config(name: str, spec: str | None, loads: dict[str, list[dict]], batch: int, max_tokens: int,
               threads: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "k3serve", "serve", "--port", str(port), "--served-model-name", "m",
           "--max-num-seqs", str(max(batch, 8)), "--disable-log-stats"]
    if spec:
        cmd += ["--speculative-config", spec]
    env = {"OMP_NUM_THREADS": str(threads)}
    import os

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})
    out: dict = {"config": name}
    try:
        wait_healthy([proc], [url], 300)
        client = httpx.Client(base_url=url, timeout=600)
        for wl, bodies in loads.items():
            rows0, acc0 = spec_counters(url)
            speeds, texts = [], 0
            for body in bodies:
                n, secs = stream_one(client, body, max_tokens)
                texts += n
                if n > 1 and secs > 0:
                    speeds.append((n - 1) / secs)
            rows1, acc1 = spec_counters(url)
            out[wl] = {"decode_tok_s": statistics.mean(speeds) if speeds else 0.0, "tokens": texts,
                       "accept_len": 1 + (acc1 - acc0) / (rows1 - rows0) if rows1 > rows0 else None}
        bodies = (loads["tool"] * (batch // len(loads["tool"]) + 1))[:batch]
        t = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:
            counts = list(pool.map(lambda b: stream_one(client, b, max_tokens)[0], bodies))
        out["batch_tok_s"] = sum(counts) / (time.perf_counter() - t)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="requests per workload at batch 1")
    ap.add_argument("--batch", type=int, default=64, help="concurrent requests of the throughput run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--configs", default="off,ngram,suffix,eagle3,eagle_suffix",
                    help="comma-separated subset of " + ",".join(CONFIGS) + ",eagle3,eagle_suffix,draft_model")
    ap.add_argument("--head", default=None, help="eagle3 / eagle_suffix: the head's directory (k3serve spec train "
                    "--out; default: the one shipped with k3-default)")
    ap.add_argument("--draft-model", default=None, help="draft_model: a model sharing k3-default's vocabulary")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the model drafters")
    ap.add_argument("--max-running", type=int, default=None,
                    help="the model drafters' max_running (speculation backs off above it; default: the engine's)")
    args = ap.parse_args()
    extra = {} if args.max_running is None else {"max_running": args.max_running}
    head = {"model": args.head} if args.head else {}
    for method in ("eagle3", "eagle_suffix"):
        CONFIGS[method] = json.dumps({"method": method, **head, "num_speculative_tokens": args.k, **extra})
    if args.draft_model:
        CONFIGS["draft_model"] = json.dumps({"method": "draft_model", "model": args.draft_model,
                                             "num_speculative_tokens": args.k, **extra})
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        print(f"spec_decode: unknown config {unknown[0]!r} (known: {', '.join(CONFIGS)})", file=sys.stderr)
        return 2
    loads = workloads(args.n, args.seed)
    rows = [run_config(c, CONFIGS[c], loads, args.batch, args.max_tokens, args.threads)
            for c in args.configs.split(",")]
    base = rows[0]
    print("| config | workload | mean acceptance length | decode tok/s (batch 1) | speedup | tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for wl in ("tool", "edit"):
            d = r[wl]
            acc = "-" if d["accept_len"] is None else f"{d['accept_len']:.2f}"
            sp = d["decode_tok_s"] / base[wl]["decode_tok_s"] if base[wl]["decode_tok_s"] else 0.0
            print(f"| {r['config']} | {wl} | {acc} | {d['decode_tok_s']:.1f} | {sp:.2f}x | {d['tokens']} |")
    print(f"\n| config | batch {args.batch} output tok/s |\n|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['batch_tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
