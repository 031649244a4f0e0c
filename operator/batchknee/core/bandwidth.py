"""The seed's bandwidth signal: how much of the GPU's memory bandwidth the engines achieve, and what
that says about where a fleet stands.

The seed's diagnosis (§ B_knee 추정): TPOT p99 is the signal. When TTFT p99 breaks its SLO first
the bottleneck is prefill; when TPOT p99 rises first the decode batch has passed B_knee; and when
memory-bandwidth utilisation is stuck at 85 % or more, a smaller batch recovers TPOT at once.
From those, and from what the engines report (running vs waiting, the prefill share of the steps):

    memory-bound   bandwidth ≥ 85 % of peak: decode saturates the memory bus — at (or past) the knee
    prefill-bound  TTFT p99 over its target while TPOT p99 meets its own, or prefill chunks take
                   at least half of the step time
    queueing       requests wait while the bus has headroom: the batch limit (or the KV pool) holds
                   them back
    underused      under half of peak and nothing waits: too little traffic for the GPU
    balanced       none of these: between half and 85 % of peak, nothing waiting

Achieved bandwidth also calibrates the roofline's bandwidth efficiency directly: a decode step
lasts overhead + bytes / (efficiency · peak), so over a busy, decode-dominated window the achieved
fraction of peak u = efficiency · (1 − overhead / TPOT), and efficiency = u / (1 − overhead / TPOT).
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchknee.core.observation import Observation, Reading
from batchknee.core.roofline import DecodeRoofline, PrefillMix

Diagnosis = Literal["memory-bound", "prefill-bound", "queueing", "underused", "balanced"]
BandwidthSource = Literal["engine", "dcgm"]

SATURATED_FRACTION = 0.85  # the seed: utilisation stuck at ≥ 85 % → a smaller batch recovers TPOT
UNDERUSED_FRACTION = 0.5
PREFILL_BOUND_SHARE = 0.5  # prefill chunks take at least half of the step time
WAITING_REQUESTS = 1.0  # on average over the window, across the pods
DECODE_DOMINATED_SHARE = 0.8  # calibration: decode takes at least this share of the step time


@dataclass(frozen=True)
class BandwidthAssessment:
    """Achieved bandwidth as a fraction of peak (None: not measured, `reason` says why), where it
    came from, and the one-word diagnosis with the figures behind it."""

    fraction: float | None
    source: BandwidthSource | None
    diagnosis: Diagnosis | None
    reason: str
    read_bytes_per_s: float | None = None  # per GPU, from the engine's counter


def bandwidth_fraction(
    read_bytes_per_s_per_gpu: Reading, dram_active: Reading, peak_bytes_per_s: float
) -> tuple[float | None, BandwidthSource | None, str]:
    """Achieved / peak from the engine's read-bytes counter, else dcgm-exporter's DRAM-active
    fraction (a time share of the memory interface, the closest a node exporter gets), else None
    with both reasons."""
    if not peak_bytes_per_s > 0:
        raise ValueError("the GPU's peak bandwidth must be positive")
    if read_bytes_per_s_per_gpu.value is not None:
        return read_bytes_per_s_per_gpu.value / peak_bytes_per_s, "engine", ""
    if dram_active.value is not None:
        return min(1.0, dram_active.value), "dcgm", ""
    return (
        None,
        None,
        f"engine: {read_bytes_per_s_per_gpu.reason}; dcgm-exporter: {dram_active.reason}",
    )


def prefill_share(roofline: DecodeRoofline, batch: float, context_tokens: float, mix: PrefillMix) -> float:
    """The share of the step time that prefill chunks take, by the roofline's prefill model: 1 −
    decode-only TPOT / TPOT with the mix's prefill."""
    if batch <= 0 or context_tokens <= 0:
        return 0.0
    with_prefill = roofline.tpot_with_prefill_s(batch, context_tokens, mix)
    if not with_prefill > 0:
        return 0.0
    return max(0.0, 1.0 - roofline.tpot_s(batch, context_tokens) / with_prefill)


def diagnose(
    fraction: float,
    *,
    waiting: float | None,
    share_of_prefill: float | None,
    ttft_p99_s: float | None = None,
    ttft_target_s: float | None = None,
    tpot_p99_s: float | None = None,
    tpot_target_s: float | None = None,
) -> tuple[Diagnosis, str]:
    """The one word for a fleet at `fraction` of peak bandwidth, and the figures behind it (rules:
    the module's docstring)."""
    if fraction >= SATURATED_FRACTION:
        return "memory-bound", (
            f"decode reads {fraction:.0%} of peak bandwidth (≥ {SATURATED_FRACTION:.0%}): at the knee; "
            "a smaller batch would cut TPOT"
        )
    ttft_over = ttft_p99_s is not None and ttft_target_s is not None and ttft_p99_s > ttft_target_s
    tpot_within = tpot_target_s is None or (tpot_p99_s is not None and tpot_p99_s <= tpot_target_s)
    if ttft_over and tpot_within and ttft_p99_s is not None and ttft_target_s is not None:
        return "prefill-bound", (
            f"TTFT p99 {ttft_p99_s * 1e3:.0f} ms over its {ttft_target_s * 1e3:.0f} ms target while TPOT "
            f"meets its own, at {fraction:.0%} of peak bandwidth"
        )
    if share_of_prefill is not None and share_of_prefill >= PREFILL_BOUND_SHARE:
        return "prefill-bound", (
            f"prefill chunks take {share_of_prefill:.0%} of the step time, at {fraction:.0%} of peak bandwidth"
        )
    if waiting is not None and waiting >= WAITING_REQUESTS:
        return "queueing", (
            f"{waiting:.1f} requests wait while decode reads {fraction:.0%} of peak bandwidth: the batch "
            "limit or the KV pool holds them back"
        )
    queue = "nothing waits" if waiting is not None else "how many requests wait is unknown"
    if fraction < UNDERUSED_FRACTION:
        return "underused", f"decode reads {fraction:.0%} of peak bandwidth and {queue}"
    return "balanced", f"decode reads {fraction:.0%} of peak bandwidth and {queue}"


def observed_mix(observation: Observation, max_num_batched_tokens: int) -> PrefillMix | None:
    prompt, output = observation.prompt_tokens_mean.value, observation.output_tokens_mean.value
    if prompt is None or output is None or output < 1:
        return None
    hits = observation.prefix_hit_ratio.value
    return PrefillMix(prompt, output, max_num_batched_tokens, min(1.0, max(0.0, hits or 0.0)))


def assess(
    observation: Observation,
    roofline: DecodeRoofline,
    *,
    max_num_batched_tokens: int = 2048,
    ttft_target_s: float | None = None,
    tpot_target_s: float | None = None,
) -> BandwidthAssessment:
    """The bandwidth fraction and diagnosis of one observation (peak: the roofline's GPU bandwidth)."""
    fraction, source, missing = bandwidth_fraction(
        observation.read_bytes_per_s_per_gpu, observation.dram_active, roofline.bandwidth
    )
    read = observation.read_bytes_per_s_per_gpu.value
    if fraction is None:
        return BandwidthAssessment(None, None, None, f"no bandwidth signal ({missing})", read)
    share: float | None = None
    mix = observed_mix(observation, max_num_batched_tokens)
    ctx, running = observation.avg_context_tokens.value, observation.running.value
    if mix is not None and ctx is not None and running is not None and observation.pods > 0:
        share = prefill_share(roofline, running / observation.pods, ctx, mix)
    word, why = diagnose(
        fraction,
        waiting=observation.waiting.value,
        share_of_prefill=share,
        ttft_p99_s=observation.ttft_p99_s.value,
        ttft_target_s=ttft_target_s,
        tpot_p99_s=observation.tpot_p99_s.value,
        tpot_target_s=tpot_target_s,
    )
    via = "the engines' read-bytes counters" if source == "engine" else "dcgm-exporter's DRAM activity"
    return BandwidthAssessment(fraction, source, word, f"{why} (from {via})", read)


def efficiency_from_bandwidth(utilization: float, tpot_s: float, overhead_s: float) -> float | None:
    """The roofline's bandwidth efficiency from an achieved fraction of peak over a busy,
    decode-dominated window: u / (1 − overhead / TPOT). None when the figures cannot say (no time
    left for reading, or a non-finite figure); capped at 1."""
    if not (math.isfinite(utilization) and math.isfinite(tpot_s) and math.isfinite(overhead_s)):
        return None
    if utilization <= 0 or tpot_s <= 0:
        return None
    reading_share = 1.0 - max(0.0, overhead_s) / tpot_s
    if reading_share <= 0:
        return None
    return min(1.0, utilization / reading_share)
