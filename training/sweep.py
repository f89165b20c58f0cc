"""Several training runs side by side on one GPU, each sized to a wall-clock budget.

A model this small leaves a GPU mostly idle (each step is thousands of small kernels, bound by the host), so
variants run as concurrent processes. First every variant trains ``--calib-steps`` steps at once, which
measures its seconds per step *under that contention*, QAT switch, snapshot and export included; then each
trains for as many steps as fit ``--budget`` seconds (rounded down to a multiple of 10) and writes compact
snapshots (``export.py``) every quarter of its steps. Every run's full command is printed and kept in its
``train_log.json``, so a run is reproduced by its command alone (up to GPU non-determinism: CUDA's atomic
adds make repeated runs differ in low bits).

    python -m training.sweep --out runs/sweep --budget 420 \\
        --variant a:--tokens-per-step=65536,--lr=0.006 --variant b:--tokens-per-step=65536,--lr=0.012

Every run gets the shipped model's curriculum flags (``COMMON``); flags after ``--`` go to every variant after
those (so they override them), and a variant's own flags come last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

COMMON = ["--workers", "1", "--seed", "0", "--warmup", "50", "--log-every", "20", "--copy-share", "1.0",
          "--copy-until", "0.3", "--copy-after", "0.15", "--lookup-frac", "0.45", "--recall-frac", "0.1"]


def launch(name: str, out: Path, flags: list[str], steps: int, save_every: int, extra: list[str],
           device: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "training.train", "--out", str(out / name), "--device", device,
           "--steps", str(steps), "--save-every", str(save_every), *COMMON, *extra, *flags]
    (out / name).mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    with open(out / name / "stdout.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def seconds_per_step(run: Path) -> float:
    """From the log lines of a calibration run: the time of its second half (the first holds start-up)."""
    lines = [e for e in json.loads((run / "train_log.json").read_text())["log"] if "seconds" in e]
    if len(lines) < 2:
        raise ValueError(f"{run}: a calibration run needs at least two log lines, found {len(lines)}")
    (a, b) = (lines[len(lines) // 2 - 1], lines[-1])
    return (b["seconds"] - a["seconds"]) / (b["step"] - a["step"])


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """``["a:--lr=0.01,--steps=5", ...]`` -> ``{"a": ["--lr=0.01", "--steps=5"]}``; names are unique run
    directory names."""
    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, _, flags = spec.partition(":")
        if not name or not name.replace("-", "").replace("_", "").isalnum() or name in variants or name == "calib":
            raise ValueError(f"bad or repeated variant name {name!r} (letters, digits, - and _; not 'calib')")
        variants[name] = [f for f in flags.split(",") if f]
    return variants


def wait_all(procs: dict[str, subprocess.Popen], deadline: float) -> dict[str, int | None]:
    codes: dict[str, int | None] = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = None
    return codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="sweep directory: <out>/calib/<name>, then <out>/<name>")
    p.add_argument("--budget", type=float, required=True, help="seconds of training per variant (main phase)")
    p.add_argument("--variant", action="append", required=True, metavar="NAME:FLAG,FLAG",
                   help="a run: its name and its own train flags, comma-separated (--flag=value)")
    p.add_argument("--calib-steps", type=int, default=40,
                   help="steps of the concurrent calibration runs that time a step per variant (default: 40)")
    p.add_argument("--device", default="cuda", help="device every variant trains on (default: cuda)")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.calib_steps < 8:
        p.error("--calib-steps must be at least 8")
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    t0 = time.time()
    # QAT from half-way and a snapshot there, so calibration also exercises both; four log lines to time
    calib_flags = ["--qat-from", "0.5", "--log-every", str(max(1, args.calib_steps // 4))]
    calib = {n: launch(n, args.out / "calib", f + calib_flags, args.calib_steps, args.calib_steps // 2, extra,
                       args.device)
             for n, f in variants.items()}
    codes = wait_all(calib, time.time() + 600)
    failed = [n for n, c in codes.items() if c != 0]
    for n in failed:
        print(f"[{n}] calibration failed ({codes[n]}):\n" + (args.out / "calib" / n / "stdout.log").read_text()[-3000:])
    if failed:
        return 1
    plan = {}
    for n in variants:
        sps = seconds_per_step(args.out / "calib" / n)
        steps = max(10, int(args.budget / sps) // 10 * 10)
        plan[n] = steps
        print(f"[{n}] {sps:.3f} s/step under contention -> {steps} steps", flush=True)
    print(f"calibration took {time.time() - t0:.0f} s", flush=True)
    main_runs = {n: launch(n, args.out, f, plan[n], max(10, plan[n] // 4), extra, args.device) for n, f in variants.items()}
    codes = wait_all(main_runs, time.time() + args.budget * 1.25 + 60)
    for n, c in codes.items():
        tail = (args.out / n / "stdout.log").read_text().splitlines()[-3:]
        print(f"[{n}] exit {c}: " + " | ".join(tail)[-600:], flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
