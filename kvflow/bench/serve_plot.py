"""The picture of a `--sweep`: latency against the throughput it was bought with.

Plotted against *achieved* output throughput rather than the offered request rate, since
past saturation a higher offered rate buys no throughput, only queueing: the curve then
turns upward, which is the knee a capacity plan needs to see.
"""

from __future__ import annotations

import os

from kvflow.bench.serve_report import ServeRunResult


def plot_sweep(results: list[ServeRunResult], path: str, title: str = "kvflow serving sweep") -> str:
    """Write a PNG with TTFT p50/p99 and TPOT p50/p99 (ms) against output tok/s; returns the path."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--sweep plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display on a server, and no GUI toolkit needed
    import matplotlib.pyplot as plt

    xs = [r.output_throughput for r in results]
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name, metric in ((ax_ttft, "TTFT", "ttft_ms"), (ax_tpot, "TPOT", "tpot_ms")):
        p50 = [getattr(r, metric).p50 for r in results]
        p99 = [getattr(r, metric).p99 for r in results]
        ax.plot(xs, p50, "o-", label=f"{name} p50")
        ax.plot(xs, p99, "s--", label=f"{name} p99")
        for x, y, r in zip(xs, p99, results):
            ax.annotate(f"{r.request_rate}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("achieved output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.12, y=0.12)  # room for the rate labels at the ends
        ax.legend()
    fig.suptitle(title + " (labels: offered request rate)")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
