"""PNG plots of the knee (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from batchknee.core.plan import ContextPlan


def plot_plan(plans: Sequence[ContextPlan], title: str, path: Path) -> None:
    """TPOT and throughput against batch, one line per context length, each knee marked."""
    figure, (tpot_axis, throughput_axis) = plt.subplots(1, 2, figsize=(12, 4.8))
    for plan in plans:
        batches = [row.batch for row in plan.rows]
        (line,) = tpot_axis.plot(
            batches, [row.tpot_s * 1e3 for row in plan.rows], marker="o", label=f"ctx {plan.context_tokens}"
        )
        throughput_axis.plot(
            batches, [row.tokens_per_s for row in plan.rows], marker="o", color=line.get_color()
        )
        knee = plan.recommendation.b_knee
        for axis in (tpot_axis, throughput_axis):
            axis.axvline(knee, color=line.get_color(), linestyle="--", linewidth=1)
        throughput_axis.annotate(
            f"B_knee {knee:.0f}",
            (knee, 0),
            xytext=(3, 6),
            textcoords="offset points",
            color=line.get_color(),
            fontsize=8,
        )
    for axis, label in ((tpot_axis, "TPOT (ms)"), (throughput_axis, "throughput (tokens/s)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("decode batch (running sequences)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    tpot_axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
