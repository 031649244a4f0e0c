"""PNG of a `batchknee simulate` sweep (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from batchknee.emulator.bench import POLICIES, TraceResult
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


def plot_bench(results: Sequence[TraceResult], path: Path) -> None:
    """SLO goodput per policy, one group of bars per trace, each bar labelled with its ratio to the oracle."""
    figure, axis = plt.subplots(figsize=(max(8.0, 2.6 * len(results)), 4.8))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        xs = [t + (i - (len(POLICIES) - 1) / 2) * width for t in range(len(results))]
        heights = [r.policies[policy].slo_goodput for r in results]
        bars = axis.bar(xs, heights, width, label=policy)
        for bar, r in zip(bars, results, strict=True):
            ratio = r.policies[policy].ratio_to_oracle
            axis.annotate(
                f"{ratio:.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    axis.set_xticks(range(len(results)), [r.trace.name for r in results])
    axis.set_ylabel("SLO goodput (tokens/s)")
    axis.set_title("batchknee bench: goodput of requests meeting TPOT and TTFT targets (labels: ÷ oracle)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
