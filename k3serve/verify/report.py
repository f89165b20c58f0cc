"""The run's outputs: a terminal table (and a progress bar while it runs), JSON, and a self-contained HTML page."""

from __future__ import annotations

import html
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import TextIO

from k3serve.verify.checks import Result, Target

MARK = {"pass": "PASS", "fail": "FAIL", "unsupported": "UNSUP", "error": "ERROR", "skipped": "SKIP"}
COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "unsupported": "#9a6700", "error": "#8250df", "skipped": "#57606a"}


def verdict(results: Sequence[Result]) -> str:
    """'pass' when nothing failed or errored (unsupported features are listed, not failures)."""
    return "fail" if any(r.status in ("fail", "error") for r in results) else "pass"


class Progress:
    """A one-line bar on a terminal (redrawn in place); one line per finished check otherwise."""

    def __init__(self, out: TextIO = sys.stderr):
        self.out, self.tty, self.t0 = out, out.isatty(), time.monotonic()

    def __call__(self, done: int, total: int, last: Result | None) -> None:
        width = 30
        fill = width * done // max(total, 1)
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {time.monotonic() - self.t0:5.0f}s"
                + (f"  {MARK[last.status]:5} {last.id}" if last else ""))
        if self.tty:
            self.out.write("\r" + line.ljust(100)[:100] + ("\n" if done == total else ""))
        elif last is not None:
            self.out.write(line + "\n")
        self.out.flush()


def table(results: Sequence[Result], width: int = 72) -> str:
    name_w = max([len(r.id) for r in results] + [5])
    rows = [f"{'check':<{name_w}}  {'result':<6} {'secs':>6}  detail"]
    for r in results:
        detail = r.detail if len(r.detail) <= width else r.detail[:width - 1] + "…"
        rows.append(f"{r.id:<{name_w}}  {MARK[r.status]:<6} {r.seconds:6.1f}  {detail}")
    counts = Counter(r.status for r in results)
    rows.append(f"verdict: {verdict(results).upper()}  (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")")
    return "\n".join(rows)


def to_json(results: Sequence[Result], target: Target, model: str | None = None) -> dict:
    return {"base_url": target.base_url, "model": model or target.model, "contract": target.contract,
            "reference": target.reference, "verdict": verdict(results),
            "counts": dict(Counter(r.status for r in results)), "checks": [r.to_json() for r in results]}


def to_html(results: Sequence[Result], target: Target) -> str:
    esc = html.escape
    rows = "\n".join(
        f"<tr><td><code>{esc(r.id)}</code><br><small>{esc(r.what)}</small></td>"
        f"<td style='color:{COLOURS[r.status]};font-weight:bold'>{MARK[r.status]}</td>"
        f"<td>{r.seconds:.1f}</td><td>{esc(r.detail)}</td></tr>" for r in results)
    v = verdict(results)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>k3serve verify: {esc(target.base_url)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;text-align:left}}</style></head><body>
<h1>k3serve verify</h1><p>Endpoint <code>{esc(target.base_url)}</code>, contract <b>{esc(target.contract)}</b>,
reference {esc(str(target.reference))}. Verdict:
<b style="color:{COLOURS['pass' if v == 'pass' else 'fail']}">{v.upper()}</b></p>
<script type="application/json" id="results">{esc(json.dumps([r.to_json() for r in results]))}</script>
<table><tr><th>check</th><th>result</th><th>s</th><th>detail</th></tr>
{rows}
</table></body></html>
"""
