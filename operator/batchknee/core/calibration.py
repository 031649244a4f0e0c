"""Fitting the roofline to what an engine really does.

Measured TPOT is 1.2–1.5× the naive roofline: a fixed per-step overhead (scheduling, sampling,
launches) plus bandwidth the kernels do not achieve. Both fits are least squares on relative residuals.
The roofline fit is constrained to what the parameters can physically be — overhead ≥ 0 and
0 < efficiency ≤ 1 — and when one of them lands on its bound the other is refitted with it fixed:
clamping a fitted negative overhead to zero without refitting the efficiency would leave the slope
of a line through a negative intercept, and every prediction biased low on efficiency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from batchknee.core.roofline import DecodeRoofline

ActiveBound = Literal["overhead", "efficiency", "both"]


@dataclass(frozen=True)
class StepSample:
    """One observation: the running batch, the KV bytes it held (one GPU) and the measured TPOT."""

    batch: float
    kv_bytes: float
    tpot_s: float
    attended_pairs: float = 0.0  # (query, key) pairs attended: the compute roof's attention term


@dataclass(frozen=True)
class RooflineCalibration:
    """TPOT = overhead + (weights read + KV bytes) / (efficiency · bandwidth). `bound` names the
    constraint the fit rests on (None: both terms fitted freely)."""

    overhead_s: float
    bandwidth_efficiency: float
    rmse_s: float
    samples: int
    bound: ActiveBound | None = None

    def apply(self, roofline: DecodeRoofline) -> DecodeRoofline:
        """The roofline with these fitted terms."""
        return replace(
            roofline,
            overhead_s=max(0.0, self.overhead_s),
            bandwidth_efficiency=min(1.0, self.bandwidth_efficiency),
        )


@dataclass(frozen=True)
class LinearTpotFit:
    """TPOT = a + b·B at one context length."""

    a_s: float
    b_s_per_seq: float
    rmse_s: float
    samples: int

    def tpot_s(self, batch: float) -> float:
        return self.a_s + self.b_s_per_seq * batch

    def max_batch_for_tpot(self, tpot_target_s: float) -> int:
        """The calibrated SLO cap ⌊(target − a) / b⌋ (0 when the target is below a)."""
        if tpot_target_s <= self.a_s:
            return 0
        return math.floor((tpot_target_s - self.a_s) / self.b_s_per_seq)


def _check(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) < 3:
        raise ValueError(f"need at least 3 samples to fit, got {len(xs)}")
    if any(not y > 0 for y in ys):
        raise ValueError("every TPOT sample must be positive")
    if max(xs) - min(xs) <= 1e-12 * max(1.0, abs(max(xs))):
        raise ValueError("samples need at least two distinct batch sizes to fit a slope")


def _rmse(xs: Sequence[float], ys: Sequence[float], slope: float, intercept: float) -> float:
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    return math.sqrt(sum(r * r for r in residuals) / len(residuals))


def _relative_least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Slope, intercept and root-mean-square residual of y = intercept + slope·x, minimising the
    *relative* residuals (weights 1/y²): timing jitter scales with the step time, and unweighted
    least squares would let the long steps drown out the short ones that pin the intercept."""
    _check(xs, ys)
    weights = [1.0 / (y * y) for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
    sxy = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    return slope, intercept, _rmse(xs, ys, slope, intercept)


def fit_step_times(unit_times_s: Sequence[float], tpots_s: Sequence[float]) -> RooflineCalibration:
    """Fit TPOT = overhead + unit_time / efficiency, where `unit_times_s` is what the roofline
    predicts for each sample at full efficiency and no overhead, subject to overhead ≥ 0 and
    0 < efficiency ≤ 1 (slope ≥ 1), on relative residuals.

    A convex problem in two variables: its optimum is the free fit when that is feasible, else it
    lies on a bound — the best of (overhead = 0, slope refitted), (slope = 1, overhead refitted)
    and both on their bounds, each the closed-form one-variable fit clamped to its own bound."""
    xs, ys = unit_times_s, tpots_s
    slope, intercept, _ = _relative_least_squares(xs, ys)
    if slope <= 0:
        raise ValueError(
            "TPOT does not grow with the bytes read: these samples cannot calibrate the roofline"
        )
    bound: ActiveBound | None = None
    if intercept < 0 or slope < 1:
        weights = [1.0 / (y * y) for y in ys]

        def loss(s: float, a: float) -> float:
            return sum(w * (y - a - s * x) ** 2 for w, x, y in zip(weights, xs, ys, strict=True))

        # overhead on its bound: the slope through the origin, ≥ 1
        through_origin = sum(w * x * y for w, x, y in zip(weights, xs, ys, strict=True)) / sum(
            w * x * x for w, x in zip(weights, xs, strict=True)
        )
        # efficiency on its bound (slope 1): the mean relative excess, ≥ 0
        excess = sum(w * (y - x) for w, x, y in zip(weights, xs, ys, strict=True)) / sum(weights)
        candidates: list[tuple[float, float, float, ActiveBound]] = [
            (loss(max(1.0, through_origin), 0.0), max(1.0, through_origin), 0.0, "overhead"),
            (loss(1.0, max(0.0, excess)), 1.0, max(0.0, excess), "efficiency"),
        ]
        _, slope, intercept, bound = min(candidates, key=lambda c: c[0])
        if slope == 1.0 and intercept == 0.0:
            bound = "both"
    return RooflineCalibration(
        overhead_s=intercept,
        bandwidth_efficiency=1.0 / slope,
        rmse_s=_rmse(xs, ys, slope, intercept),
        samples=len(ys),
        bound=bound,
    )


def fit_overhead_at_efficiency(
    unit_times_s: Sequence[float], tpots_s: Sequence[float], efficiency: float
) -> RooflineCalibration:
    """With the bandwidth efficiency known (measured, not fitted), only the per-step overhead is
    left: TPOT = overhead + unit_time / efficiency, overhead ≥ 0, on relative residuals."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"a bandwidth efficiency must be within (0, 1], got {efficiency:g}")
    if len(tpots_s) < 1 or any(not y > 0 for y in tpots_s):
        raise ValueError("every TPOT sample must be positive")
    slope = 1.0 / efficiency
    weights = [1.0 / (y * y) for y in tpots_s]
    excess = sum(w * (y - slope * x) for w, x, y in zip(weights, unit_times_s, tpots_s, strict=True))
    overhead = max(0.0, excess / sum(weights))
    return RooflineCalibration(
        overhead_s=overhead,
        bandwidth_efficiency=efficiency,
        rmse_s=_rmse(unit_times_s, tpots_s, slope, overhead),
        samples=len(tpots_s),
        bound="overhead" if overhead == 0.0 else None,
    )


def unit_roofline(roofline: DecodeRoofline) -> DecodeRoofline:
    """The same roofline at full efficiency and no overhead: the x of every calibration fit."""
    return replace(roofline, bandwidth_efficiency=1.0, overhead_s=0.0)


def fit_roofline(roofline: DecodeRoofline, samples: Sequence[StepSample]) -> RooflineCalibration:
    """Recover (overhead, efficiency) from observed decode steps: TPOT is linear in the roofline's
    time at full efficiency (the larger of the memory and compute roofs)."""
    unit = unit_roofline(roofline)
    xs = [unit.step_time_s(s.batch, s.kv_bytes, s.attended_pairs) if s.batch > 0 else 0.0 for s in samples]
    return fit_step_times(xs, [s.tpot_s for s in samples])


def fit_linear_tpot(samples: Sequence[tuple[float, float]]) -> LinearTpotFit:
    """Fit TPOT = a + b·B to (batch, TPOT seconds) pairs taken at one context length."""
    slope, intercept, rmse = _relative_least_squares([b for b, _ in samples], [t for _, t in samples])
    if slope <= 0:
        raise ValueError("TPOT does not grow with the batch: these samples cannot calibrate the SLO cap")
    return LinearTpotFit(a_s=intercept, b_s_per_seq=slope, rmse_s=rmse, samples=len(samples))
