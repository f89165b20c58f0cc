"""The sweep's output directory: points.jsonl (one result per line, appended as points finish, read back to
resume), front.json (the fronts with each point's launch command), front.png and the terminal table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3serve.sweep.front import SLO, eligible

POINTS = "points.jsonl"


def load_points(out_dir: Path) -> list[dict[str, Any]]:
    """Results already in points.jsonl, the last line of each key winning (a retried point supersedes its
    failure); a torn line (the sweep killed mid-write) is dropped."""
    path = out_dir / POINTS
    if not path.exists():
        return []
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            point = json.loads(line)
        except ValueError:
            continue
        out.pop(point.get("key"), None)
        out[point.get("key")] = point
    return list(out.values())


def append_point(out_dir: Path, point: dict[str, Any]) -> None:
    with (out_dir / POINTS).open("a") as f:
        f.write(json.dumps(point) + "\n")


def write_front(path: Path, fronts: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({**meta, "fronts": fronts}, indent=1) + "\n")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(points: Sequence[dict[str, Any]], fronts: dict[str, list[dict[str, Any]]], slo: SLO,
          throughput: str, latency: str) -> str:
    """One row per measured point and per modelled point on its front: '*' on a front, 'slo' when eligible,
    its throughput, latency and status/error."""
    on_front = {p["key"] for f in fronts.values() for p in f}
    rows = [("", "point", throughput, latency, "slo", "status")]
    hidden = [p for p in points if p.get("modelled") and p["key"] not in on_front]
    for p in points:
        if p in hidden:
            continue
        ok = eligible(p, slo, throughput, latency)
        status = p.get("status", "?") if p.get("status") != "failed" else f"failed: {p.get('error')}"
        if p.get("status") == "ok" and p.get("failed"):
            status = f"ok, {p['failed']} requests failed"
        rows.append(("*" if p["key"] in on_front else "", ("[modelled] " if p.get("modelled") else "") + p["key"],
                     _fmt(p.get(throughput)), _fmt(p.get(latency)), "yes" if ok else "no", status[:80]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    if hidden:
        lines.append(f"   ({len(hidden)} modelled points off their front: see {POINTS})")
    return "\n".join(lines)


def plot(path: Path, points: Sequence[dict[str, Any]], fronts: dict[str, list[dict[str, Any]]], slo: SLO,
         throughput: str, latency: str) -> None:
    """Throughput vs latency: measured points (left) and modelled ones (right, log axes) on their own axes;
    points missing the SLO grey, the others coloured by model (GPU for modelled ones), the front joined by a
    numbered line (the order of front.json)."""
    from k3serve.bench.plots import pyplot

    plt = pyplot()
    kinds = [k for k in ("measured", "modelled") if any(bool(p.get("modelled")) == (k == "modelled") and
                                                         p.get(throughput) is not None for p in points)]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(6.5 * max(1, len(kinds)), 5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = [p for p in points if bool(p.get("modelled")) == (kind == "modelled")
                and p.get(throughput) is not None and p.get(latency) is not None]
        ok = [p for p in mine if eligible(p, slo, throughput, latency)]
        ax.scatter([p[latency] for p in mine], [p[throughput] for p in mine], c="lightgrey", label="misses the SLO")
        groups = "gpu" if kind == "modelled" else "model"  # one colour per model (measured) or GPU (modelled)
        for name in dict.fromkeys(p.get(groups) for p in ok):
            mine_ok = [p for p in ok if p.get(groups) == name]
            ax.scatter([p[latency] for p in mine_ok], [p[throughput] for p in mine_ok], label=str(name))
        front = fronts.get(kind, [])
        ax.plot([p[latency] for p in front], [p[throughput] for p in front], "o-", c="tab:red", label="front")
        for i, p in enumerate(front):
            ax.annotate(str(i + 1), (p[latency], p[throughput]), textcoords="offset points", xytext=(4, 4))
        for key, ms in slo.limits:
            if key == latency:
                ax.axvline(ms, color="grey", linestyle="--", label="SLO")
        if kind == "modelled":
            ax.set(xscale="log", yscale="log")
        ax.set(xlabel=f"{latency}", ylabel=throughput, title=f"{kind} ({len(mine)} points, front numbered)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
