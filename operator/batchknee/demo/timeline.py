"""Sampling the closed loop while it runs: one line per sample on the terminal, the whole list in
timeline.json, and a picture of it in timeline.png."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


@dataclass(frozen=True)
class Sample:
    """One moment of one LLMServing. Field names are the timeline.json contract."""

    time: float  # seconds since the scenario began
    phase: str
    llmserving: str
    mode: str
    avgContextLength: float | None
    bKnee: float | None
    appliedMaxNumSeqs: int | None
    recommendedMaxNumSeqs: int | None
    tpotP99Ms: float | None
    tokensPerSecond: float | None
    running: float | None
    rollouts: int
    reason: str
    holdReason: str | None = None

    def line(self) -> str:
        def number(value: float | None, spec: str) -> str:
            return "—" if value is None else format(value, spec)

        return (
            f"[{self.time:5.0f}s] {self.phase:<9} {self.llmserving:<22} ctx {number(self.avgContextLength, '>5.0f')}"
            f"  B_knee {number(self.bKnee, '>5.1f')}  max-num-seqs {number(self.appliedMaxNumSeqs, '>3')}"
            f" (recommended {number(self.recommendedMaxNumSeqs, '>3')})  running {number(self.running, '>5.1f')}"
            f"  TPOT p99 {number(self.tpotP99Ms, '>5.1f')} ms  {number(self.tokensPerSecond, '>6,.0f')} tok/s"
            f"  rollouts {self.rollouts}"
        )


def write_json(samples: Sequence[Sample], path: Path) -> None:
    path.write_text(json.dumps([asdict(sample) for sample in samples], indent=1) + "\n")


def plot(
    samples: Sequence[Sample], phases: Sequence[tuple[str, float, float]], name: str, path: Path
) -> None:
    """Context, knee and batch limits over time (one LLMServing), TPOT p99 and throughput below."""
    mine = [s for s in samples if s.llmserving == name]
    times = [s.time for s in mine]

    def series(field: str) -> list[Any]:
        return [getattr(s, field) if getattr(s, field) is not None else float("nan") for s in mine]

    figure, (context_axis, batch_axis, tpot_axis) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    context_axis.plot(
        times, series("avgContextLength"), color="tab:purple", label="observed avg context (tokens)"
    )
    context_axis.set_yscale("log", base=2)
    context_axis.set_ylabel("tokens per sequence")
    batch_axis.plot(times, series("bKnee"), color="tab:gray", linestyle="--", label="B_knee")
    batch_axis.step(
        times, series("recommendedMaxNumSeqs"), where="post", color="tab:orange", label="recommended"
    )
    batch_axis.step(
        times,
        series("appliedMaxNumSeqs"),
        where="post",
        color="tab:blue",
        linewidth=2,
        label="applied --max-num-seqs",
    )
    batch_axis.plot(
        times, series("running"), color="tab:green", alpha=0.6, label="running sequences (all pods)"
    )
    batch_axis.set_yscale("log", base=2)
    batch_axis.set_ylabel("sequences")
    tpot_axis.plot(times, series("tpotP99Ms"), color="tab:red", label="TPOT p99 (ms)")
    tpot_axis.set_ylabel("TPOT p99 (ms)")
    throughput_axis = tpot_axis.twinx()
    throughput_axis.plot(times, series("tokensPerSecond"), color="tab:cyan", label="output tokens/s")
    throughput_axis.set_ylabel("output tokens/s")
    tpot_axis.set_xlabel("seconds")
    for axis in (context_axis, batch_axis, tpot_axis):
        for index, (phase, start, end) in enumerate(phases):
            axis.axvspan(start, end, color="0.93" if index % 2 else "white", zorder=0)
            if axis is context_axis:
                axis.text((start + end) / 2, 1.02, phase, transform=axis.get_xaxis_transform(), ha="center")
        axis.grid(True, alpha=0.3)
    for axis in (context_axis, batch_axis):
        axis.legend(loc="upper right", fontsize=8)
    lines = tpot_axis.get_legend_handles_labels()[0] + throughput_axis.get_legend_handles_labels()[0]
    tpot_axis.legend(lines, [str(line.get_label()) for line in lines], loc="upper left", fontsize=8)
    figure.suptitle(f"batchknee: {name} retuned as traffic shifts", y=0.995)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
