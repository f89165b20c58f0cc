"""PNG plots of a run (matplotlib, headless): latency CDFs and throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from k3serve.bench.client import RequestRecord
from k3serve.bench.metrics import e2el_s, itl_s, timeline, tpot_s, ttft_s

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (chunk gaps)", "e2el": "E2E latency"}


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot-dir needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display; only files
    import matplotlib.pyplot as plt

    return plt


def write_plots(records: Sequence[RequestRecord], out_dir: str | Path, bucket_s: float | None = None) -> list[Path]:
    """Write ``latency_cdf.png`` and ``throughput.png`` for the successful requests; returns the paths."""
    plt = pyplot()
    ok = [r for r in records if r.success]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    values = {"ttft": [ttft_s(r) for r in ok], "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
              "itl": [g for r in ok for g in itl_s(r)], "e2el": [e2el_s(r) for r in ok]}

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, xs) in zip(axes.flat, values.items()):
        ms = np.sort(np.asarray(xs)) * 1000
        if len(ms):
            ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
            for p, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(ms, p), color="grey", linestyle=style, label=f"p{p}")
            ax.legend(loc="lower right")
        ax.set(title=f"{_LABELS[name]} (n={len(ms)})", xlabel="ms", ylabel="fraction <= x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = out_dir / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    end = max((r.end_s for r in ok), default=1.0)
    bucket = bucket_s or max(0.1, end / 60)  # about 60 points across the run
    tl = timeline(ok, bucket)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.step(tl["t_s"], tl["output_tokens_per_s"], where="post", label="output tokens/s")
    ax.set(xlabel="time since start (s)", ylabel="output tokens/s", title=f"Throughput over time ({bucket:.2g} s bins)")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.step(tl["t_s"], tl["in_flight"], where="post", color="tab:orange", label="requests in flight")
    right.step(tl["t_s"], tl["requests_per_s"], where="post", color="tab:green", label="completed requests/s")
    right.set_ylabel("requests")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    tput = out_dir / "throughput.png"
    fig.savefig(tput, dpi=100)
    plt.close(fig)
    return [cdf, tput]
