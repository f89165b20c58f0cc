"""``k3serve sweep``: run a grid of ``k3serve serve`` configurations for real against a bench workload, add
planner-modelled GPU layouts, and report the Pareto front of throughput vs a latency percentile under SLOs.

    k3serve sweep --models kimi-linear-tiny-random k3-default --grid max_num_seqs=2,64 \\
        --grid enable_prefix_caching=on,off --slo-ttft-p99-ms 30000 --output-dir sweep-out
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from k3serve.sweep.front import SLO, THROUGHPUTS, check_latency_key, eligible, fronts
from k3serve.sweep.modelled import DEFAULT_MODELLED, modelled_points, parse_modelled
from k3serve.sweep.report import POINTS, append_point, load_points, plot, table, write_front
from k3serve.sweep.runner import Workload
from k3serve.sweep.space import DEFAULT_GRID, DEFAULT_MODELS, OPTIONS, Point, default_grid, expand, is_default, parse_grid

_SLO_FLAGS = ("ttft", "tpot", "itl", "e2el")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("Grid options (--grid NAME=V1,V2; the cross product runs for every model):\n" +
                "".join(f"  {o.name:24} {o.help}\n" for o in OPTIONS.values()) +
                "Default grid: " + " ".join(f"{k}={','.join(v)}" for k, v in DEFAULT_GRID.items()) + "\n"
                "Each real point starts 'k3serve serve' on 127.0.0.1 (a free port), warms it up, runs the bench "
                "workload\n(random token-id prompts, fixed seed) and stops it. Results are appended to "
                f"OUTPUT_DIR/{POINTS}; a rerun\nskips the points already there (--fresh starts over). "
                "Modelled points (--modelled GPU:N) come from\n'k3serve plan' rooflines of Kimi K3 and get "
                "their own front. A point is on a front when it met every SLO,\nnone of its requests failed and "
                "no other such point has both more throughput and less latency.")
    s = p.add_argument_group("search space")
    s.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), metavar="MODEL",
                   help="models to serve (built-in names or checkpoint directories)")
    s.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="an option's values (repeat per option); without any --grid: the default grid")
    s.add_argument("--modelled", action="append", default=None, metavar="GPU:N",
                   help=f"planner-modelled Kimi K3 layouts on N GPUs (default: {' '.join(DEFAULT_MODELLED)})")
    s.add_argument("--no-modelled", action="store_true", help="measured points only")
    s.add_argument("--modelled-context", type=int, default=8192,
                   help="modelled points: prompt length and KV depth of the decode")
    w = p.add_argument_group("workload (k3serve bench's random dataset, per point)")
    w.add_argument("--num-prompts", type=int, default=8, help="measured requests per point")
    w.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared prefix included)")
    w.add_argument("--output-len", type=int, default=16, help="output tokens per request (ignore_eos)")
    w.add_argument("--prefix-len", type=int, default=64, help="tokens of a prefix every prompt shares")
    w.add_argument("--max-concurrency", type=int, default=4, help="requests in flight at once")
    w.add_argument("--request-rate", type=float, default=None, help="req/s, Poisson (default: all at once)")
    w.add_argument("--warmup", type=int, default=2, help="warm-up requests before the measured ones")
    w.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    w.add_argument("--point-timeout", type=float, default=600.0,
                   help="seconds a point may take, server start included; past it the point fails")
    o = p.add_argument_group("front")
    o.add_argument("--throughput", choices=THROUGHPUTS, default="output_throughput", help="the front's y axis")
    o.add_argument("--latency", default="p99_tpot_ms",
                   help="the front's x axis: pNN_METRIC_ms, METRIC in ttft, tpot, itl, e2el")
    for m in _SLO_FLAGS:
        o.add_argument(f"--slo-{m}-p99-ms", type=float, default=None, metavar="MS", help=f"p99 {m.upper()} limit")
    o.add_argument("--slo", action="append", default=[], metavar="KEY:MS",
                   help="any other percentile limit, e.g. p90_ttft_ms:500")
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default="sweep-out", help=f"{POINTS}, front.json, front.png, server logs")
    out.add_argument("--fresh", action="store_true", help=f"discard an existing {POINTS} first")
    out.add_argument("--retry-failed", action="store_true", help="rerun points that failed before")
    out.add_argument("--dry-run", action="store_true", help="print the points and launch commands, run nothing")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _slo(args: argparse.Namespace) -> SLO:
    limits = [(f"p99_{m}_ms", getattr(args, f"slo_{m}_p99_ms")) for m in _SLO_FLAGS
              if getattr(args, f"slo_{m}_p99_ms") is not None]
    for item in args.slo:
        key, sep, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = math.nan
        if not sep or not value > 0:
            raise ValueError(f"--slo {item!r}: expected KEY:MS, e.g. p90_ttft_ms:500")
        limits.append((check_latency_key(key), value))
    return SLO(tuple(limits))


def _workload(args: argparse.Namespace) -> Workload:
    rate = None if args.request_rate is None or math.isinf(args.request_rate) else args.request_rate
    if not args.point_timeout > 0:
        raise ValueError(f"--point-timeout must be > 0 seconds, got {args.point_timeout}")
    return Workload(args.num_prompts, args.input_len, args.output_len, args.prefix_len, args.max_concurrency,
                    rate, args.warmup, args.seed)


def _percentiles(slo: SLO, latency: str) -> tuple[float, ...]:
    return tuple(sorted({50.0, 90.0, 99.0, *slo.percentiles(), *SLO(((latency, 1.0),)).percentiles()}))


def run(args: argparse.Namespace) -> int:
    check_latency_key(args.latency)
    grid = parse_grid(args.grid) if args.grid else default_grid()
    points = expand(args.models, grid)
    workload, slo = _workload(args), _slo(args)
    percentiles = _percentiles(slo, args.latency)
    modelled = [] if args.no_modelled else modelled_points(
        parse_modelled(args.modelled or DEFAULT_MODELLED), args.modelled_context, percentiles)
    if args.dry_run:
        for pt in points:
            print(f"{pt.key}\n    {pt.command()}")
        for m in modelled:
            print(f"[modelled] {m['key']}\n    {m['command']}")
        return 0
    from k3serve.core.process import on_stop_signals

    out_dir = Path(args.output_dir)
    if args.fresh and (out_dir / POINTS).exists():
        (out_dir / POINTS).unlink()
        shutil.rmtree(out_dir / "logs", ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    wl = dataclasses.asdict(workload)
    done = load_points(out_dir)
    if any(not p.get("modelled") and p.get("workload") != wl for p in done):
        raise ValueError(f"{out_dir / POINTS} holds points of another workload: use another --output-dir or --fresh")
    stored = {p["key"] for p in done}
    for m in modelled:  # recomputed every run (cheap, deterministic); recorded once
        if m["key"] not in stored:
            append_point(out_dir, m)
    keep = [p for p in done if not p.get("modelled") and not (args.retry_failed and p.get("status") == "failed")]
    have = {p["key"] for p in keep}
    keep += modelled
    todo = [pt for pt in points if pt.key not in have]
    print(f"k3serve sweep: {len(points)} real points ({len(points) - len(todo)} already in {out_dir / POINTS}), "
          f"{len(modelled)} modelled", file=sys.stderr)
    t0 = time.monotonic()
    with on_stop_signals():  # SIGTERM/SIGHUP as Ctrl-C: the running point's server is stopped first
        try:
            _run_points(todo, workload, wl, out_dir, args, percentiles, keep)
        finally:
            wall = time.monotonic() - t0
            if keep:
                _write_outputs(out_dir, keep, points, slo, args, wall)
    return 0


def _run_points(todo: list[Point], workload: Workload, wl: dict[str, Any], out_dir: Path,
                args: argparse.Namespace, percentiles: tuple[float, ...], results: list[dict[str, Any]]) -> None:
    """Run each point, appending its result to points.jsonl and ``results`` as it finishes (an interrupt
    keeps what finished)."""
    from tqdm import tqdm

    from k3serve.sweep.runner import run_point

    bar = tqdm(total=len(todo), unit="point", file=sys.stderr, disable=args.disable_tqdm, dynamic_ncols=True)
    try:
        for pt in todo:
            bar.set_description(pt.key[:60])
            res = run_point(pt, workload, out_dir / "logs", args.point_timeout, percentiles)
            res = {"key": pt.key, "model": pt.model, "modelled": False,
                   "settings": {k: v for k, v in pt.settings}, "command": pt.command(), "default": is_default(pt),
                   "workload": wl, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                   **res}
            append_point(out_dir, res)
            results.append(res)
            line = (f"{args.throughput}={res.get(args.throughput, 0):.3g} {args.latency}={res.get(args.latency, 0):.4g}"
                    if res["status"] == "ok" else f"failed: {res['error']}")
            bar.write(f"{pt.key}: {line}", file=sys.stderr)
            bar.update(1)
    finally:
        bar.close()


def _write_outputs(out_dir: Path, results: list[dict[str, Any]], points: list[Point], slo: SLO,
                   args: argparse.Namespace, wall_s: float) -> None:
    keys = {pt.key for pt in points}
    # this sweep's grid only: points.jsonl may hold others from earlier runs with another grid
    shown = [r for r in results if r.get("modelled") or r["key"] in keys]
    f = fronts(shown, slo, args.throughput, args.latency)
    summary = _best_and_default(shown, slo, args.throughput, args.latency)
    by_model = {m: [p["key"] for p in fronts([r for r in shown if r["model"] == m], slo, args.throughput,
                                             args.latency)["measured"]] for m in summary}
    meta = {"throughput": args.throughput, "latency": args.latency, "slo_ms": dict(slo.limits),
            "measured_front_keys_by_model": by_model,
            "sweep_wall_s": round(wall_s, 1), "best_and_default": summary,
            "failed_points": [{"key": r["key"], "error": r.get("error")} for r in shown if r["status"] == "failed"]}
    write_front(out_dir / "front.json", f, meta)
    print(table(shown, f, slo, args.throughput, args.latency))
    for model, row in summary.items():
        best, default = row["best"], row["default"]
        if best or default:
            print(f"{model}: best (meeting the SLO) {_brief(best, args.throughput)}; "
                  f"default configuration {_brief(default, args.throughput)}")
    try:
        plot(out_dir / "front.png", shown, f, slo, args.throughput, args.latency)
    except ValueError as e:  # no matplotlib: the JSON and the table still stand
        print(f"k3serve sweep: no plot ({e})", file=sys.stderr)
    print(f"wrote {out_dir / 'front.json'}, {out_dir / 'front.png'} and {out_dir / POINTS}", file=sys.stderr)


def _brief(point: dict[str, Any] | None, throughput: str) -> str:
    return "-" if point is None else f"{throughput}={point[throughput]:.4g} ({point['command']})"


def _best_and_default(results: list[dict[str, Any]], slo: SLO, throughput: str,
                      latency: str) -> dict[str, dict[str, Any]]:
    """Per measured model: the eligible point with the most throughput, and the default configuration's
    point (whatever its SLO), both with their launch commands."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in results if not r.get("modelled")):
        mine = [r for r in results if r["model"] == model and not r.get("modelled")]
        ok = [r for r in mine if eligible(r, slo, throughput, latency)]
        best = max(ok, key=lambda r: r[throughput], default=None)
        default = next((r for r in mine if r.get("default") and r["status"] == "ok"), None)
        out[model] = {k: None if r is None else {"key": r["key"], throughput: r[throughput], latency: r.get(latency),
                                                 "command": r["command"]}
                      for k, r in (("best", best), ("default", default))}
    return out
