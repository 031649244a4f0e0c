"""`batchknee simulate`'s engine: run the simulation at several `max_num_seqs` and measure each.

Each point is one simulation of the same workload; after a warm-up the window's output tokens per
second, per-request TPOT and TTFT percentiles, goodput (tokens of requests that met the TPOT
target) and preemptions are measured. By default the load is a closed loop with as many requests
in flight as the batch limit (a new request arrives when one finishes), so the limit binds at
every point; with a request rate it is open-loop Poisson instead. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from batchknee.emulator.engine import FINISHED, Engine, EngineConfig, Request
from batchknee.emulator.stats import percentile
from batchknee.emulator.workload import LoadSpec


@dataclass(frozen=True)
class SweepPoint:
    max_num_seqs: int
    throughput_tokens_per_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    ttft_p99_s: float
    goodput_tokens_per_s: float
    preemptions: int
    mean_running: float
    finished: int
    rejected: int
    window_s: float
    roofline_tpot_s: float
    roofline_throughput_tokens_per_s: float

    def to_json(self) -> dict[str, Any]:
        def ms(value: float) -> float | None:
            return None if math.isnan(value) else value * 1e3

        return {
            "maxNumSeqs": self.max_num_seqs,
            "throughputTokensPerSecond": self.throughput_tokens_per_s,
            "tpotP50Ms": ms(self.tpot_p50_s),
            "tpotP99Ms": ms(self.tpot_p99_s),
            "ttftP99Ms": ms(self.ttft_p99_s),
            "goodputTokensPerSecond": self.goodput_tokens_per_s,
            "preemptions": self.preemptions,
            "meanRunning": self.mean_running,
            "finishedRequests": self.finished,
            "rejectedRequests": self.rejected,
            "windowSeconds": self.window_s,
            "rooflineTpotMs": self.roofline_tpot_s * 1e3,
            "rooflineThroughputTokensPerSecond": self.roofline_throughput_tokens_per_s,
        }


@dataclass(frozen=True)
class SweepResult:
    b_knee: float
    context_tokens: float
    points: tuple[SweepPoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "bKnee": self.b_knee,
            "contextLength": self.context_tokens,
            "points": [point.to_json() for point in self.points],
        }


def request_lifetime_s(config: EngineConfig, load: LoadSpec, batch: int) -> float:
    """A rough time one request spends decoding at `batch`: output × roofline TPOT."""
    return load.output_tokens * config.roofline.tpot_s(max(1, batch), load.mean_context_tokens)


def default_duration_s(config: EngineConfig, load: LoadSpec, batches: Sequence[int]) -> float:
    """Long enough for ten request lifetimes at the largest batch, and at least five minutes."""
    return max(300.0, 10.0 * request_lifetime_s(config, load, max(batches)))


def run_point(
    config: EngineConfig,
    load: LoadSpec,
    *,
    duration_s: float,
    warmup_s: float,
    seed: int = 0,
    tpot_target_s: float | None = None,
    step_hook: Callable[[Engine, float, int, int], None] | None = None,
) -> SweepPoint:
    """One simulation; measures [warmup_s, duration_s]."""
    if not 0.0 <= warmup_s < duration_s:
        raise ValueError("warmup must be shorter than the duration")
    finished: list[Request] = []
    window_open = [False]

    def on_finish(request: Request) -> None:
        if window_open[0] and request.state == FINISHED:
            finished.append(request)

    ramp = request_lifetime_s(config, load, config.max_num_seqs) if load.closed_loop else 0.0
    engine = Engine(
        config, load=load, seed=seed, on_finish=on_finish, closed_loop_ramp_s=ramp, step_hook=step_hook
    )
    engine.run_until(warmup_s)
    window_open[0] = True
    start = engine.now
    tokens0 = engine.stats.generation_tokens
    preemptions0 = engine.stats.preemptions
    rejected0 = engine.stats.rejected
    running0 = engine.stats.running_seconds
    engine.run_until(duration_s)
    window = engine.now - start
    if window <= 0:
        raise ValueError("the measurement window is empty")
    tokens = engine.stats.generation_tokens - tokens0
    tpots = [t for t in (r.tpot_s for r in finished) if t is not None]
    ttfts = [t for t in (r.ttft_s for r in finished) if t is not None]
    good = sum(
        r.output for r in finished if tpot_target_s is None or r.tpot_s is None or r.tpot_s <= tpot_target_s
    )
    batch = config.max_num_seqs
    context = load.mean_context_tokens
    roofline_tpot = config.roofline.tpot_s(batch, context)
    return SweepPoint(
        max_num_seqs=batch,
        throughput_tokens_per_s=tokens / window,
        tpot_p50_s=percentile(tpots, 0.5),
        tpot_p99_s=percentile(tpots, 0.99),
        ttft_p99_s=percentile(ttfts, 0.99),
        goodput_tokens_per_s=good / window,
        preemptions=engine.stats.preemptions - preemptions0,
        mean_running=(engine.stats.running_seconds - running0) / window,
        finished=len(finished),
        rejected=engine.stats.rejected - rejected0,
        window_s=window,
        roofline_tpot_s=roofline_tpot,
        roofline_throughput_tokens_per_s=batch / roofline_tpot,
    )


def sweep(
    config: EngineConfig,
    load: LoadSpec,
    batches: Sequence[int],
    *,
    duration_s: float | None = None,
    warmup_s: float | None = None,
    seed: int = 0,
    tpot_target_s: float | None = None,
) -> SweepResult:
    """One point per batch limit. A load without a rate or concurrency is a closed loop with
    `concurrency = max_num_seqs` at each point. `max_num_batched_tokens` is raised to the batch
    limit where it is smaller (vLLM requires it)."""
    if not batches:
        raise ValueError("no batch limits to sweep")
    duration = duration_s if duration_s is not None else default_duration_s(config, load, batches)
    warmup = warmup_s if warmup_s is not None else 0.3 * duration
    points = []
    for batch in batches:
        point_config = replace(
            config, max_num_seqs=batch, max_num_batched_tokens=max(batch, config.max_num_batched_tokens)
        )
        point_load = load
        if load.request_rate == 0.0 and load.concurrency is None:
            point_load = replace(load, concurrency=batch)
        points.append(
            run_point(
                point_config,
                point_load,
                duration_s=duration,
                warmup_s=warmup,
                seed=seed,
                tpot_target_s=tpot_target_s,
            )
        )
    context = load.mean_context_tokens
    return SweepResult(b_knee=config.roofline.b_knee(context), context_tokens=context, points=tuple(points))
