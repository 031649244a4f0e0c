"""Fitting the roofline to what an engine really does.

Measured TPOT is 1.2–1.5× the naive roofline: a fixed per-step overhead (scheduling, sampling,
launches) plus bandwidth the kernels do not achieve. Both fits are least squares on relative residuals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchknee.core.roofline import DecodeRoofline


@dataclass(frozen=True)
class StepSample:
    """One observation: the running batch, the KV bytes it held (one GPU) and the measured TPOT."""

    batch: float
    kv_bytes: float
    tpot_s: float


@dataclass(frozen=True)
class RooflineCalibration:
    """TPOT = overhead + (weights read + KV bytes) / (efficiency · bandwidth)."""

    overhead_s: float
    bandwidth_efficiency: float
    rmse_s: float
    samples: int

    def apply(self, roofline: DecodeRoofline) -> DecodeRoofline:
        """The roofline with these fitted terms (efficiency capped at 1: a fit above it is noise)."""
        from dataclasses import replace

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


def _relative_least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Slope, intercept and root-mean-square residual of y = intercept + slope·x, minimising the
    *relative* residuals (weights 1/y²): timing jitter scales with the step time, and unweighted
    least squares would let the long steps drown out the short ones that pin the intercept."""
    if len(xs) < 3:
        raise ValueError(f"need at least 3 samples to fit, got {len(xs)}")
    if any(not y > 0 for y in ys):
        raise ValueError("every TPOT sample must be positive")
    if max(xs) - min(xs) <= 1e-12 * max(1.0, abs(max(xs))):
        raise ValueError("samples need at least two distinct batch sizes to fit a slope")
    weights = [1.0 / (y * y) for y in ys]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
    sxy = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys, strict=True))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    rmse = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    return slope, intercept, rmse


def fit_roofline(roofline: DecodeRoofline, samples: Sequence[StepSample]) -> RooflineCalibration:
    """Recover (overhead, efficiency) from observed steps: TPOT is linear in the bytes read."""
    xs = [(roofline.weight_bytes_read_per_gpu(s.batch) + s.kv_bytes) / roofline.bandwidth for s in samples]
    slope, intercept, rmse = _relative_least_squares(xs, [s.tpot_s for s in samples])
    if slope <= 0:
        raise ValueError(
            "TPOT does not grow with the bytes read: these samples cannot calibrate the roofline"
        )
    return RooflineCalibration(
        overhead_s=intercept, bandwidth_efficiency=1.0 / slope, rmse_s=rmse, samples=len(samples)
    )


def fit_linear_tpot(samples: Sequence[tuple[float, float]]) -> LinearTpotFit:
    """Fit TPOT = a + b·B to (batch, TPOT seconds) pairs taken at one context length."""
    slope, intercept, rmse = _relative_least_squares([b for b, _ in samples], [t for _, t in samples])
    if slope <= 0:
        raise ValueError("TPOT does not grow with the batch: these samples cannot calibrate the SLO cap")
    return LinearTpotFit(a_s=intercept, b_s_per_seq=slope, rmse_s=rmse, samples=len(samples))
