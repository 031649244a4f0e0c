"""What an engine counts: cumulative counters and fixed-bucket histograms, as plain numbers.

The simulation updates these; the Prometheus exporter only reads them. A histogram takes a weighted
observation (`observe(value, count)`) because every sequence of a decode step sees the same
inter-token gap: one call per step, not one per sequence. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

# vLLM's buckets (vllm/v1/metrics/loggers.py; REFERENCE.md §2). TensorRT-LLM copies them.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip

# vLLM's FinishReason strings, in enum order (stop, length, abort, error, repetition in 0.11+).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
LEGACY_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to and including `max_value` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class Histogram:
    """Counts per upper bound (`le`), the running sum and count; the last slot is +Inf."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        # Prometheus buckets are `le` (value <= bound): bisect_left puts a value equal to a bound in it.
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count
        self.count += count

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations ≤ bound) for every bound and +Inf, as exposition needs."""
        total = 0
        out: list[tuple[float, int]] = []
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile over these buckets (linear within a bucket); NaN when empty."""
        if self.count == 0:
            return math.nan
        rank = q * self.count
        below = 0
        lower = 0.0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            if below + n >= rank and n > 0:
                if bound == math.inf:
                    return lower
                return lower + (bound - lower) * (rank - below) / n
            below += n
            lower = bound
        return lower


@dataclass
class EngineStats:
    """Everything a vLLM or TensorRT-LLM engine exports that is cumulative."""

    max_model_len: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Requests this engine was given (built-in load and HTTP), and what became of them.
    received: int = 0
    finished: int = 0
    rejected: int = 0
    dropped: int = 0
    success_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    # Work done: every token any step computed (prefill chunks, recompute and decode), the tokens
    # recomputed after preemption, and the tokens served from the prefix cache.
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    steps: int = 0
    busy_time_s: float = 0.0
    # Bytes read from GPU memory by every step, per GPU (weights + the KV the step attended), as
    # the roofline counts them: what `estimated_read_bytes_per_gpu` exports.
    read_bytes: float = 0.0
    # Time integrals over busy steps: Σ running × step time, Σ (running + waiting) × step time.
    running_seconds: float = 0.0
    in_system_seconds: float = 0.0
    ttft: Histogram = field(init=False)
    itl: Histogram = field(init=False)
    request_tpot: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    queue_time: Histogram = field(init=False)
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)
    iteration_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TPOT_BUCKETS)
        self.request_tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(self.max_model_len)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 ≤ q ≤ 1) of `values` with linear interpolation between order statistics
    (numpy's default); NaN for no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be within [0, 1]")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
