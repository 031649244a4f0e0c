"""The recommended batch limit: the knee, scaled and rounded, under the SLO and KV-capacity caps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchknee.core.roofline import DEFAULT_RESERVE_BYTES, DecodeRoofline, PrefillMix

VLLM_BATCH_GRANULARITY = 8  # vLLM captures CUDA graphs at multiples of 8
LimitedBy = Literal["knee", "tpot-target", "kv-capacity", "minimum", "maximum"]
Goal = Literal["Knee", "SLO"]


@dataclass(frozen=True)
class Recommendation:
    context_tokens: float
    b_knee: float
    knee_factor: float
    granularity: int
    knee_target: int
    slo_batch: int | None
    capacity_batch: int
    max_num_seqs: int
    max_tokens: int
    limited_by: LimitedBy
    minimum: int = 1
    maximum: int = 1024

    @property
    def unrounded(self) -> float:
        """The batch the rules ask for before rounding to the granularity: the scaled knee under the
        caps, within [minimum, maximum]. The dead band compares these, never the rounded steps."""
        value = self.knee_factor * self.b_knee
        for cap in (self.slo_batch, self.capacity_batch):
            if cap is not None:
                value = min(value, float(cap))
        return min(max(value, float(self.minimum)), float(self.maximum))

    def explain(self) -> str:
        """One line whose every number comes from the math, e.g.
        `avg ctx 2048 tok → B_knee 59.6 → 64 (×1.00, ⌈8⌉)`."""
        text = (
            f"avg ctx {self.context_tokens:.0f} tok → B_knee {self.b_knee:.1f} → {self.knee_target} "
            f"(×{self.knee_factor:.2f}, ⌈{self.granularity}⌉)"
        )
        if self.limited_by == "tpot-target":
            text += f" → {self.max_num_seqs} (TPOT target allows {self.slo_batch})"
        elif self.limited_by == "kv-capacity":
            text += f" → {self.max_num_seqs} (KV pool holds {self.capacity_batch})"
        elif self.limited_by in ("minimum", "maximum"):
            text += f" → {self.max_num_seqs} ({self.limited_by} bound)"
        return text


def round_up(value: float, granularity: int) -> int:
    return max(granularity, math.ceil(value / granularity - 1e-9) * granularity)


def round_down_under_cap(cap: int, granularity: int) -> int:
    """The largest multiple of the granularity within `cap`; the cap itself when it is smaller."""
    return cap // granularity * granularity if cap >= granularity else cap


FINE_STEPS = 8  # a fine grid's step is at most 1/8 of the value (12.5 %, about the dead band)


def round_down_fine(cap: int, granularity: int) -> int:
    """The largest value within `cap` on a grid whose step is the granularity, halved (down to 1)
    while it is over 1/8 of the cap: 20 under a cap of 21 where the granularity of 8 gives 16, a
    fifth less. vLLM takes any integer --max-num-seqs (it pads a batch to the next CUDA graph it
    captured: 1, 2, 4, then multiples of 8); a step of 8 at 16 is half of the batch, and on a TPOT
    cliff the difference between meeting a target and not."""
    step = granularity
    while step > 1 and cap < FINE_STEPS * step:
        step //= 2
    return round_down_under_cap(cap, step)


def recommend(
    roofline: DecodeRoofline,
    context_tokens: float,
    *,
    knee_factor: float = 1.0,
    tpot_target_s: float | None = None,
    gpu_memory_utilization: float = 0.9,
    reserve_bytes: float = DEFAULT_RESERVE_BYTES,
    kv_pool_bytes: float | None = None,
    minimum: int = 1,
    maximum: int = 1024,
    granularity: int = VLLM_BATCH_GRANULARITY,
    prefill: PrefillMix | None = None,
    goal: Goal = "Knee",
) -> Recommendation:
    """max-num-seqs = min(knee_factor · B_knee rounded up, SLO batch, KV-capacity batch), clamped to
    [minimum, maximum]. A cap below the rounded knee is rounded *down* to the granularity, so the
    result never exceeds it. The SLO batch comes from `roofline` itself: pass a calibrated one
    (fitted overhead and efficiency) — the naive roofline overestimates it 1.6–2.3×. With a
    `prefill` mix the SLO batch keeps the TPOT *p99* under the target, the prefill-chunk steps
    included (`DecodeRoofline.tpot_with_prefill_s`); without one, the decode step alone.
    Goal `SLO` (needs the target) runs the SLO batch itself — past the knee when the target allows
    it — under the KV-capacity cap and the bounds.
    """
    if goal == "SLO" and tpot_target_s is None:
        raise ValueError("goal SLO needs a TPOT target")
    if context_tokens <= 0:
        raise ValueError("context_tokens must be positive")
    if knee_factor <= 0:
        raise ValueError("knee_factor must be positive")
    if not 1 <= minimum <= maximum:
        raise ValueError("bounds must satisfy 1 <= minimum <= maximum")
    if granularity < 1:
        raise ValueError("granularity must be at least 1")

    b_knee = roofline.b_knee(context_tokens)
    knee_target = round_up(knee_factor * b_knee, granularity)
    slo_batch: int | None = None
    if tpot_target_s is not None:
        slo_batch = (
            roofline.max_batch_for_tpot(tpot_target_s, context_tokens)
            if prefill is None
            else roofline.max_batch_for_tpot_quantile(tpot_target_s, context_tokens, prefill)
        )
    pool = (
        kv_pool_bytes
        if kv_pool_bytes is not None
        else roofline.kv_pool_bytes(gpu_memory_utilization, reserve_bytes)
    )
    capacity_batch = roofline.kv_capacity_batch(context_tokens, pool)

    value, limited_by = knee_target, "knee"
    if goal == "SLO" and slo_batch is not None:
        value, limited_by = round_down_under_cap(slo_batch, granularity), "tpot-target"
    for cap, name in ((slo_batch, "tpot-target"), (capacity_batch, "kv-capacity")):
        if cap is not None and cap < value:
            value, limited_by = round_down_under_cap(cap, granularity), name
    if value < minimum:
        value, limited_by = minimum, "minimum"
    elif value > maximum:
        value, limited_by = maximum, "maximum"

    return Recommendation(
        context_tokens=context_tokens,
        b_knee=b_knee,
        knee_factor=knee_factor,
        granularity=granularity,
        knee_target=knee_target,
        slo_batch=slo_batch,
        capacity_batch=capacity_batch,
        max_num_seqs=value,
        max_tokens=value * math.ceil(context_tokens),
        limited_by=limited_by,  # type: ignore[arg-type]
        minimum=minimum,
        maximum=maximum,
    )
