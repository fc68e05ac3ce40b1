"""`bench compare --plot FILE.png`: output throughput and TPOT against max concurrency."""

from __future__ import annotations

from typing import Any


def plot_sweeps(files: list[tuple[str, dict[Any, dict[str, Any]]]], path: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib (pip install matplotlib).") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, (ax_tput, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.4))
    concs_all: list[int] = []
    for name, runs in files:
        # Runs without a concurrency cap (c=None) have no x position; they are left out.
        pts = sorted((c, r) for c, r in runs.items() if c is not None)
        xs = [c for c, _ in pts]
        concs_all += xs
        ax_tput.plot(xs, [r["output_throughput"] for _, r in pts], marker="o", label=name)
        ax_tpot.plot(xs, [r["mean_tpot_ms"] for _, r in pts], marker="o", label=name)
    for ax, ylabel in ((ax_tput, "output throughput (tok/s)"), (ax_tpot, "mean TPOT (ms)")):
        if concs_all and max(concs_all) >= 8 * min(concs_all):
            ax.set_xscale("log", base=2)
        if concs_all:
            # Ticks at the measured concurrencies only: integers, never 2.5 or 2^1.5.
            ticks = sorted(set(concs_all))
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(int(c)) for c in ticks])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    names = ", ".join(name for name, _ in files)
    fig.suptitle(f"specserve bench serve: output throughput and TPOT vs max concurrency ({names})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
