"""PNG of a `batchknee simulate` sweep (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from batchknee.emulator.sweep import SweepResult


def plot_sweep(result: SweepResult, title: str, path: Path) -> None:
    """Throughput and TPOT p99 against max-num-seqs, simulated and roofline, the knee marked."""
    batches = [point.max_num_seqs for point in result.points]
    figure, (throughput_axis, tpot_axis) = plt.subplots(1, 2, figsize=(12, 4.8))
    throughput_axis.plot(
        batches, [p.throughput_tokens_per_s for p in result.points], marker="o", label="simulated"
    )
    throughput_axis.plot(
        batches,
        [p.roofline_throughput_tokens_per_s for p in result.points],
        linestyle=":",
        color="grey",
        label="roofline B / TPOT(B)",
    )
    tpot_axis.plot(
        batches, [p.tpot_p99_s * 1e3 for p in result.points], marker="o", color="tab:red", label="TPOT p99"
    )
    tpot_axis.plot(
        batches, [p.tpot_p50_s * 1e3 for p in result.points], marker=".", color="tab:orange", label="TPOT p50"
    )
    for axis in (throughput_axis, tpot_axis):
        axis.axvline(result.b_knee, color="black", linestyle="--", linewidth=1)
        axis.annotate(
            f"B_knee {result.b_knee:.0f}",
            (result.b_knee, 0),
            xytext=(3, 6),
            textcoords="offset points",
            xycoords=("data", "axes fraction"),
            fontsize=8,
        )
        axis.set_xscale("log", base=2)
        axis.set_xlabel("--max-num-seqs")
        axis.grid(True, alpha=0.3)
        axis.legend()
    throughput_axis.set_ylabel("output tokens/s")
    tpot_axis.set_ylabel("TPOT (ms)")
    figure.suptitle(f"{title} — context {result.context_tokens:.0f} tokens")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
