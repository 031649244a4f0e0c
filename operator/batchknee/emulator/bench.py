"""`batchknee bench`: the closed loop in simulated time, no cluster — batchknee against static
settings on the same arrivals.

One engine replica is simulated (`Engine`); a scraper snapshots what it exports every scrape
interval, and every evaluation interval the snapshots of the last window become an `Observation`
the way the Prometheus adapter builds one (gauges averaged over the window, the TPOT/TTFT p99
interpolated within the engine's own histogram buckets, the mean step time from the inter-token
latency's sum/count, the average context from KV usage, the recent third of the window for the
trend). The real `decide()` picks the batch limit, with its dead band, settle window, cooldown and
rollout budget; a rollout takes the pod down for `restart_s` (requests in flight are lost, arrivals
meanwhile are turned away) and starts a fresh engine with the new limit.

Arrivals are open-loop Poisson, drawn once per trace and replayed to every policy. The rate of each
phase is its load × vLLM's default limit's modelled request capacity (256, or 1,024 on a GPU where
vLLM defaults to it; a load of 1 saturates that limit). A
gateway sheds load beyond a queue of max-num-seqs/16 requests (vLLM's `--max-num-queued-reqs`), so a
limit too small loses the requests it cannot serve instead of queueing them for ever.

Policies: `vllm-default` (vLLM's default --max-num-seqs and --max-num-batched-tokens for the GPU
throughout), `best-static` (the single value that did best over the whole trace, in hindsight),
`oracle` (the best value per phase in hindsight, switched for free), `knee` and `slo` (batchknee's
goals). The hindsight baselines search static values whatever the goals chose: a coarse grid, then
every value the policies could set (their granularity, finer at small batches) between each best
and the values tried beside it (`search_statics`). SLO goodput counts the output tokens of requests that met both the TPOT
and the TTFT target, per simulated second. Pure: simulated time only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import (
    Applied,
    CalibrationPoint,
    RecentTarget,
    Rollout,
    TuningRules,
    add_calibration_point,
    calibration_due,
    calibration_point,
    decide,
    record,
)
from batchknee.core.recommend import round_down_fine
from batchknee.core.roofline import DecodeRoofline, PrefillMix
from batchknee.emulator.engine import FINISHED, Engine, EngineConfig, Request, vllm_num_gpu_blocks
from batchknee.emulator.stats import TPOT_BUCKETS, TTFT_BUCKETS, Histogram, percentile
from batchknee.emulator.workload import LoadGenerator, LoadSpec, Schedule
from batchknee.engines import vllm

POLICIES = ("vllm-default", "best-static", "oracle", "knee", "slo")
# the hindsight search's coarse pass (refined around its bests: search_statics)
CANDIDATES = (16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)  # simulated time 0, for the policy's datetimes
OUTPUT_SPREAD = 0.5


@dataclass(frozen=True)
class Phase:
    """One stretch of traffic: its mean lengths, prefix sharing and the load relative to saturation."""

    name: str
    start_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_sharing: float = 0.0
    load: float = 1.0  # × the default limit's request capacity


@dataclass(frozen=True)
class Trace:
    name: str
    phases: tuple[Phase, ...]
    duration_s: float
    tpot_target_ms: int = 30
    ttft_target_ms: int = 10_000

    def phase_at(self, time: float) -> int:
        index = 0
        for i, phase in enumerate(self.phases):
            if phase.start_s <= time:
                index = i
        return index

    def scaled(self, duration_s: float) -> Trace:
        """The same trace compressed or stretched to `duration_s`."""
        factor = duration_s / self.duration_s
        phases = tuple(replace(p, start_s=p.start_s * factor) for p in self.phases)
        return replace(self, phases=phases, duration_s=duration_s)


def _ctx_phase(name: str, start_s: float, context: int, output: int, load: float = 1.0) -> Phase:
    # Running sequences hold prompt + E[output²]/(2·E[output]) on average (uniform ±50 % outputs).
    prompt = max(1, round(context - output * (0.5 + OUTPUT_SPREAD**2 / 6)))
    return Phase(name, start_s, prompt, output, load=load)


def standard_traces(duration_s: float = 3600.0) -> dict[str, Trace]:
    """The demo's shift, a diurnal mix, a flapping mix and a prefix-heavy chat, each `duration_s` long."""
    third = duration_s / 3
    shift = Trace(
        "shift",
        (
            _ctx_phase("ctx-512", 0.0, 512, 512),
            _ctx_phase("ctx-2048", third, 2048, 2048),
            _ctx_phase("ctx-8192", 2 * third, 8192, 6144),
        ),
        duration_s,
    )
    day = [(1024, 0.6), (2048, 0.9), (3072, 1.1), (2048, 1.2), (1024, 1.0), (512, 0.7)]
    sixth = duration_s / len(day)
    diurnal = Trace(
        "diurnal",
        tuple(
            _ctx_phase(f"ctx-{ctx}×{load:g}", i * sixth, ctx, min(2048, ctx), load)
            for i, (ctx, load) in enumerate(day)
        ),
        duration_s,
    )
    flap_s = 180.0 * duration_s / 3600.0
    flapping = Trace(
        "flapping",
        tuple(
            _ctx_phase(
                "ctx-2048" if i % 2 == 0 else "ctx-2300", i * flap_s, 2048 if i % 2 == 0 else 2300, 1024
            )
            for i in range(max(1, math.ceil(duration_s / flap_s)))
        ),
        duration_s,
    )
    chat = Trace(
        "prefix-chat",
        (
            Phase("system-prompt-75%", 0.0, 2048, 256, prefix_sharing=0.75),
            Phase("system-prompt-90%", duration_s / 2, 3072, 256, prefix_sharing=0.9),
        ),
        duration_s,
    )
    return {t.name: t for t in (shift, diurnal, flapping, chat)}


@dataclass(frozen=True)
class BenchSetup:
    """The engine as it really runs (`roofline`: fitted overhead and efficiency), the roofline the
    operator is given (`operator_roofline`: the catalog's), and the loop's timing."""

    roofline: DecodeRoofline
    operator_roofline: DecodeRoofline
    rules: TuningRules
    restart_s: float = 120.0
    evaluation_interval_s: float = 30.0
    scrape_interval_s: float = 15.0
    max_num_batched_tokens: int | None = None  # vLLM's default for the GPU when None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int = 16384
    seed: int = 0
    candidates: tuple[int, ...] = CANDIDATES
    live: bool = False  # batchknee's actuation: Live caps (no restart under the ceiling), else Restart

    @property
    def vllm_default(self) -> int:
        """vLLM's default --max-num-seqs on the GPU: the vllm-default policy's limit."""
        return vllm.default_limits(self.roofline.gpu)[0]

    @property
    def batched_tokens(self) -> int:
        """--max-num-batched-tokens: as given, else vLLM's default on the GPU."""
        return self.max_num_batched_tokens or vllm.default_limits(self.roofline.gpu)[1]

    @property
    def num_gpu_blocks(self) -> int:
        return vllm_num_gpu_blocks(self.roofline, self.gpu_memory_utilization, self.block_size)

    @property
    def kv_pool_bytes(self) -> float:
        return self.num_gpu_blocks * self.block_size * self.operator_roofline.kv_bytes_per_token

    def live_ceiling(self, rules: TuningRules, value: int) -> int:
        """Live actuation's startup --max-num-seqs, as the operator sets it: maxMaxNumSeqs bounded
        by the KV pool at the initial context, raised to `value` when that is above it."""
        kv_per_seq = self.operator_roofline.kv_bytes_per_seq(rules.initial_context_length)
        capacity = int(self.kv_pool_bytes / kv_per_seq) if self.kv_pool_bytes > 0 else 0
        base = min(rules.max_max_num_seqs, max(capacity // rules.granularity * rules.granularity, 1))
        return max(base, value)

    def engine_config(self, max_num_seqs: int, prefix_caching: bool) -> EngineConfig:
        return EngineConfig(
            roofline=self.roofline,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(self.batched_tokens, max_num_seqs),
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_prefix_caching=prefix_caching,
            max_waiting=max(1, max_num_seqs // 16),
        )


# --- arrivals --------------------------------------------------------------------------------------


def request_lifetime_s(setup: BenchSetup, phase: Phase) -> float:
    """How long a request of this phase decodes at the default limit, modelled: output × TPOT."""
    context = phase.prompt_tokens * (1 - phase.prefix_sharing) + phase.output_tokens / 2
    mix = PrefillMix(phase.prompt_tokens, phase.output_tokens, setup.batched_tokens, phase.prefix_sharing)
    return phase.output_tokens * setup.roofline.tpot_with_prefill_s(setup.vllm_default, context, mix)


def phase_rate(setup: BenchSetup, phase: Phase) -> float:
    """Requests per second in this phase: its load × the default limit's modelled capacity (Little's
    law: the limit's running requests, each living a request's lifetime), which a load of 1 saturates."""
    return phase.load * setup.vllm_default / request_lifetime_s(setup, phase)


@dataclass(frozen=True)
class Arrival:
    time: float
    prompt: int
    output: int
    shared: int


def arrivals(setup: BenchSetup, trace: Trace) -> list[Arrival]:
    """The trace's Poisson arrivals (deterministic for the seed), replayed to every policy."""
    schedule = Schedule(
        (
            phase.start_s,
            LoadSpec(
                request_rate=phase_rate(setup, phase),
                prompt_tokens=phase.prompt_tokens,
                output_tokens=phase.output_tokens,
                output_distribution="uniform",
                output_spread=OUTPUT_SPREAD,
                prefix_sharing=phase.prefix_sharing,
            ),
        )
        for phase in trace.phases
    )
    generator = LoadGenerator(schedule, random.Random(f"{setup.seed}/{trace.name}"))
    out: list[Arrival] = []
    while generator.next_time < trace.duration_s and len(out) < 10_000_000:
        a = generator.pop()
        out.append(Arrival(a.time, a.prompt_tokens, a.output_tokens, a.shared_prefix_tokens))
    return out


# --- what Prometheus would hold --------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """One scrape of one engine: its gauges, and its counters and histograms (cumulative)."""

    time: float
    running: int
    waiting: int
    kv_usage: float
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    tpot: tuple[tuple[int, ...], float, int]
    ttft: tuple[tuple[int, ...], float, int]
    itl: tuple[tuple[int, ...], float, int]
    prompt_sum: float
    prompt_count: int
    output_sum: float
    output_count: int


def snapshot(engine: Engine) -> Snapshot:
    s = engine.stats

    def hist(h: Histogram) -> tuple[tuple[int, ...], float, int]:
        return tuple(h.counts), h.sum, h.count

    return Snapshot(
        engine.now,
        engine.num_running,
        engine.num_waiting,
        engine.kv_cache_usage,
        s.generation_tokens,
        s.prefix_cache_queries,
        s.prefix_cache_hits,
        s.preemptions,
        hist(s.request_tpot),
        hist(s.ttft),
        hist(s.itl),
        s.request_prompt_tokens.sum,
        s.request_prompt_tokens.count,
        s.request_generation_tokens.sum,
        s.request_generation_tokens.count,
    )


def _quantile(
    bounds: Sequence[float],
    new: tuple[tuple[int, ...], float, int],
    old: tuple[tuple[int, ...], float, int],
    q: float,
) -> float:
    h = Histogram(bounds)
    h.counts = [a - b for a, b in zip(new[0], old[0], strict=True)]
    h.count = new[2] - old[2]
    return h.quantile(q)


def observe(
    snapshots: Sequence[Snapshot], kv_tokens: int, now: float, window_s: float, min_samples: int = 3
) -> Observation:
    """The Prometheus adapter's view of one pod at `now` from its scrapes (`rate`, `avg_over_time`,
    `histogram_quantile` over the window; the recent third for the trend)."""
    at = EPOCH + timedelta(seconds=now)
    inside = [s for s in snapshots if now - window_s < s.time <= now]
    if len(inside) < min_samples:
        return Observation.unavailable(
            at, f"only {len(inside)} samples per pod in the last {window_s:.0f}s", pods=1
        )
    before = [s for s in snapshots if s.time <= now - window_s]
    base = before[-1] if before else inside[0]
    last = inside[-1]
    span = max(1e-9, last.time - base.time)

    def reading(value: float, what: str) -> Reading:
        return Reading.of(value) if math.isfinite(value) else Reading.unavailable(f"no {what} in the window")

    def context_over(samples: Sequence[Snapshot]) -> Reading:
        running = sum(s.running for s in samples) / len(samples)
        usage = sum(s.kv_usage for s in samples) / len(samples)
        if running <= 0:
            return Reading.unavailable("no running sequences")
        return Reading.of(usage * kv_tokens / running)

    recent = [s for s in inside if s.time > now - window_s / 3] or inside[-1:]
    # the mean step time from the inter-token latency (one sample per output step), as the adapter
    # takes it from vLLM's inter_token_latency_seconds
    steps = last.itl[2] - base.itl[2]
    tpot_mean = (last.itl[1] - base.itl[1]) / steps if steps > 0 else math.nan
    prompts = last.prompt_count - base.prompt_count
    outputs = last.output_count - base.output_count
    queries = last.prefix_queries - base.prefix_queries
    return Observation(
        sampled_at=at,
        pods=1,
        avg_context_tokens=context_over(inside),
        tpot_p99_s=reading(_quantile(TPOT_BUCKETS, last.tpot, base.tpot, 0.99), "finished requests"),
        tpot_mean_s=reading(tpot_mean, "output steps"),
        ttft_p99_s=reading(_quantile(TTFT_BUCKETS, last.ttft, base.ttft, 0.99), "started requests"),
        running=Reading.of(sum(s.running for s in inside) / len(inside)),
        waiting=Reading.of(sum(s.waiting for s in inside) / len(inside)),
        kv_cache_usage=Reading.of(sum(s.kv_usage for s in inside) / len(inside)),
        prefix_hit_ratio=reading(
            (last.prefix_hits - base.prefix_hits) / queries if queries else math.nan, "prefix-cache queries"
        ),
        preemptions_per_s=Reading.of((last.preemptions - base.preemptions) / span),
        generation_tokens_per_s=Reading.of((last.generation_tokens - base.generation_tokens) / span),
        recent_avg_context_tokens=context_over(recent),
        prompt_tokens_mean=reading(
            (last.prompt_sum - base.prompt_sum) / prompts if prompts else math.nan, "finished requests"
        ),
        output_tokens_mean=reading(
            (last.output_sum - base.output_sum) / outputs if outputs else math.nan, "finished requests"
        ),
    )


# --- one run ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One policy on one trace: the requests it served (finished) of the trace's `arrivals`."""

    policy: str
    served: list[tuple[float, int, float | None, float | None]] = field(
        default_factory=list
    )  # arrival, output, tpot, ttft
    arrivals: int = 0
    rollouts: int = 0
    restart_gpu_s: float = 0.0
    values: list[tuple[float, int]] = field(default_factory=list)  # (time, max-num-seqs) from then on

    def good(self, trace: Trace, phase: int | None = None) -> float:
        """SLO goodput: output tokens per second of requests meeting both targets (of one phase)."""
        tpot_s, ttft_s = trace.tpot_target_ms / 1e3, trace.ttft_target_ms / 1e3
        tokens = 0
        for arrival, output, tpot, ttft in self.served:
            if phase is not None and trace.phase_at(arrival) != phase:
                continue
            if ttft is not None and ttft <= ttft_s and (tpot is None or tpot <= tpot_s):
                tokens += output
        return tokens / trace.duration_s

    def figures(self) -> dict[str, float]:
        """The latency p99s, over the requests served, and the share of arrivals served: a policy
        that sheds load (the gateway's queue, restarts, arrivals while down) keeps its slow
        requests out of its p99s."""
        tpots = [t for _, _, t, _ in self.served if t is not None]
        ttfts = [t for _, _, _, t in self.served if t is not None]
        return {
            "tpotP99Ms": percentile(tpots, 0.99) * 1e3,
            "ttftP99Ms": percentile(ttfts, 0.99) * 1e3,
            "servedShare": len(self.served) / self.arrivals if self.arrivals else math.nan,
        }


def run_policy(
    setup: BenchSetup,
    trace: Trace,
    stream: Sequence[Arrival],
    policy: str,
    rules: TuningRules | None = None,
    static: int | None = None,
) -> RunResult:
    """Replay `stream` against one engine whose limit is `static`, or what `decide()` under `rules` says."""
    result = RunResult(policy, arrivals=len(stream))
    prefix_caching = any(p.prefix_sharing > 0 for p in trace.phases)
    kv_tokens = setup.num_gpu_blocks * setup.block_size

    def on_finish(request: Request) -> None:
        if request.state == FINISHED:
            result.served.append((request.arrival, request.output, request.tpot_s, request.ttft_s))

    live = setup.live and static is None and rules is not None
    ceiling = 0

    def set_cap(engine: Engine, value: int) -> None:
        # the gateway's queue follows the cap the engine admits to, as it does a restarted limit
        engine.set_live_max_num_seqs(value)
        engine.config = replace(engine.config, max_waiting=max(1, value // 16))

    def start(value: int, at: float) -> Engine:
        nonlocal ceiling
        if live:
            assert rules is not None
            ceiling = setup.live_ceiling(rules, value)
        engine = Engine(
            setup.engine_config(ceiling if live else value, prefix_caching),
            seed=setup.seed,
            on_finish=on_finish,
        )
        engine.now = at
        if live:
            set_cap(engine, value)
        result.values.append((at, value))
        return engine

    now = 0.0
    applied = Applied(None)
    calibration: tuple[CalibrationPoint, ...] = ()
    recent_targets: tuple[RecentTarget, ...] = ()
    if static is not None:
        value = static
    else:
        assert rules is not None
        first = decide(rules, setup.operator_roofline, setup.kv_pool_bytes, None, applied, (), EPOCH)
        value = first.value
        applied = Applied(value, settled_since=EPOCH, rollouts=(Rollout(EPOCH, None, value, first.reason),))
    engine: Engine | None = start(value, 0.0)
    snapshots: list[Snapshot] = []
    down_until = -math.inf
    next_arrival = 0
    next_scrape = 0.0
    next_evaluation = setup.evaluation_interval_s
    horizon = trace.duration_s
    ticks = 0
    while now < horizon and ticks < 10_000_000:
        ticks += 1
        until = min(next_scrape, next_evaluation, horizon, down_until if down_until > now else math.inf)
        while next_arrival < len(stream) and stream[next_arrival].time < until:
            a = stream[next_arrival]
            next_arrival += 1
            if engine is not None:
                engine.submit(a.prompt, a.output, at=a.time, shared_prefix_tokens=a.shared)
        if engine is not None:
            engine.run_until(until)
        now = until
        if engine is None and now >= down_until:  # the restarted pod is up
            engine = start(value, now)
            snapshots = []
            settled = EPOCH + timedelta(seconds=now)
            applied = replace(applied, settled_since=settled, rolling=False)
        if now >= next_scrape:
            if engine is not None:
                snapshots.append(snapshot(engine))
                snapshots = snapshots[-256:]
            next_scrape += setup.scrape_interval_s
        if now >= next_evaluation:
            next_evaluation += setup.evaluation_interval_s
            if static is not None or rules is None or engine is None:
                continue
            at = EPOCH + timedelta(seconds=now)
            observation = observe(snapshots, kv_tokens, now, rules.window_s)
            decision = decide(
                replace(rules, live_ceiling=ceiling) if live else rules,  # caps under it are set in place
                setup.operator_roofline,
                setup.kv_pool_bytes,
                observation,
                applied,
                calibration,
                at,
                recent_targets=recent_targets,
            )
            recent_targets = decision.recent_targets
            settled_since = applied.settled_since
            if (
                not decision.rolls
                and settled_since is not None
                and at >= settled_since + timedelta(seconds=rules.window_s)
            ):
                point = calibration_point(observation, setup.operator_roofline)
                # as the operator samples (one simulated object: where its slots start is moot)
                if point is not None and calibration_due(calibration, point, rules.window_s, 0.0):
                    calibration = add_calibration_point(calibration, point)
            if decision.rolls and live and decision.value <= ceiling:
                # a live cap: no restart, nothing dropped; the window settles from now
                result.rollouts += 1
                value = decision.value
                set_cap(engine, value)
                result.values.append((now, value))
                applied = Applied(value, settled_since=at, rollouts=record(applied, decision, at, live=True))
                continue
            if decision.rolls:
                result.rollouts += 1
                result.restart_gpu_s += setup.restart_s * setup.roofline.tensor_parallel
                engine.drop_all()
                engine = None
                value = decision.value
                down_until = now + setup.restart_s
                applied = Applied(value, rolling=True, rollouts=record(applied, decision, at))
    return result


# --- the hindsight search --------------------------------------------------------------------------

Run = TypeVar("Run")
# a gap of at most this many of the policies' values is tried whole (the default grid's widest,
# 256–320 … 448–512, holds 7); a wider one (a sparse --candidates, 512–1,024 on a GPU whose
# default is 1,024) is halved first
FILL_VALUES = 8


def grid_between(low: int, high: int, granularity: int) -> list[int]:
    """The values the policies can set strictly between `low` and `high`: multiples of the
    granularity, finer under 8 × it as goal SLO rounds (`round_down_fine`)."""
    return [v for v in range(low + 1, high) if round_down_fine(v, granularity) == v]


def refinement(tried: Iterable[int], best: int, granularity: int) -> list[int]:
    """What to try beside `best`: on each side, the policies' values between it and the nearest
    value tried — all of them where they are at most FILL_VALUES, else the middle one."""
    values = set(tried)
    below = max((v for v in values if v < best), default=None)
    above = min((v for v in values if v > best), default=None)
    out: list[int] = []
    for low, high in ((below, best), (best, above)):
        if low is None or high is None:
            continue  # the grid's edge: the search stays within the candidates
        between = grid_between(low, high, granularity)
        out += between if len(between) <= FILL_VALUES else [between[len(between) // 2]]
    return out


def search_statics(
    coarse: Iterable[int],
    granularity: int,
    run: Callable[[int], Run],
    bests: Callable[[dict[int, Run]], Iterable[int]],
) -> dict[int, Run]:
    """Static runs for the hindsight baselines: each coarse value, then the policies' values
    beside each value `bests` picks from the runs so far (`refinement`), until every pick's
    neighbours on the policies' grid are run. Goodput falls off a cliff between coarse neighbours
    (the best value sits just under it), so the coarse grid alone misses the best by up to a step.
    One run serves every phase, so each round tries the union of the picks' neighbourhoods."""
    runs = {v: run(v) for v in sorted(set(coarse))}
    while True:
        missing = sorted(
            {v for best in bests(runs) for v in refinement(runs, best, granularity)} - runs.keys()
        )
        if not missing:
            return dict(sorted(runs.items()))
        for value in missing:
            runs[value] = run(value)


# --- the comparison --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyFigures:
    slo_goodput: float
    ratio_to_oracle: float
    tpot_p99_ms: float
    ttft_p99_ms: float
    rollouts: int
    restart_gpu_s: float
    values: str
    wall_s: float = math.nan  # the slowest single simulation of the trace behind this figure
    ratio_to_p99_oracle: float = math.nan  # ÷ the oracle restricted to values meeting the TPOT p99
    served_share: float = math.nan  # of the trace's arrivals, those that finished

    def to_json(self) -> dict[str, Any]:
        return {
            "sloGoodputTokensPerSecond": round(self.slo_goodput, 2),
            "ratioToOracle": _finite(self.ratio_to_oracle, 4),
            "tpotP99Ms": _finite(self.tpot_p99_ms),
            "ttftP99Ms": _finite(self.ttft_p99_ms),
            "rollouts": self.rollouts,
            "restartGpuSeconds": self.restart_gpu_s,
            "ratioToP99Oracle": _finite(self.ratio_to_p99_oracle, 4),
            "servedShare": _finite(self.served_share, 4),
        }


def _finite(x: float, digits: int = 3) -> float | None:
    """JSON has no NaN or infinity: a figure with no value (a ratio to an oracle that served
    nothing, a p99 of no requests) is null."""
    return round(x, digits) if math.isfinite(x) else None


@dataclass(frozen=True)
class TraceResult:
    """`p99_oracle`: the best value per phase among those whose TPOT p99 in the phase meets the
    target (a phase where none does counts nothing) — the yardstick for a goal that promises the
    p99, beside the issue's oracle, which may pick a value whose p99 misses it. `margin_oracle`: the
    same under goal SLO's own bound, the target less its margin — the most goal SLO can reach even
    switching for free at each phase's start."""

    trace: Trace
    policies: dict[str, PolicyFigures]
    p99_oracle: PolicyFigures | None = None
    margin_oracle: PolicyFigures | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "policies": {name: figures.to_json() for name, figures in self.policies.items()}
        }
        for key, oracle in (("p99Oracle", self.p99_oracle), ("marginOracle", self.margin_oracle)):
            if oracle is not None:
                document[key] = {**oracle.to_json(), "values": oracle.values}
        return document


def _values_text(values: Iterable[tuple[float, int]]) -> str:
    return " → ".join(str(v) for _, v in values)


def bench_trace(
    setup: BenchSetup,
    trace: Trace,
    *,
    knee_rules: TuningRules,
    slo_rules: TuningRules,
    clock: Callable[[], float] | None = None,
) -> TraceResult:
    """Every policy on one trace, on the same arrivals. `clock` (wall seconds) times each run."""
    stream = arrivals(setup, trace)
    walls: dict[str, float] = {}

    def timed(name: str, rules: TuningRules | None = None, static: int | None = None) -> RunResult:
        started = clock() if clock else math.nan
        result = run_policy(setup, trace, stream, name, rules=rules, static=static)
        walls[name] = (clock() - started) if clock else math.nan
        return result

    knee = timed("knee", rules=knee_rules)
    slo = timed("slo", rules=slo_rules)
    phases = range(len(trace.phases))
    per_phase: dict[int, list[float]] = {}  # each static value's goodput per phase
    phase_p99: dict[int, list[float]] = {}  # and its TPOT p99 per phase

    def static_run(value: int) -> RunResult:
        run = timed(f"static-{value}", static=value)
        per_phase[value] = [run.good(trace, p) for p in phases]
        phase_p99[value] = [_phase_tpot_p99(run, trace, p) for p in phases]
        return run

    target_s = trace.tpot_target_ms / 1e3
    margin_s = target_s * (1 - slo_rules.slo_margin_percent / 100)

    def picks_within(values: Iterable[int], limit_s: float) -> list[int | None]:
        """Per phase, the best of `values` whose TPOT p99 in the phase is at most `limit_s` (None
        where none is); the smallest of equals."""
        ordered = sorted(values)
        picks: list[int | None] = []
        for p in phases:
            meeting = [v for v in ordered if phase_p99[v][p] <= limit_s]
            picks.append(max(meeting, key=lambda v, p=p: per_phase[v][p]) if meeting else None)  # type: ignore[misc]
        return picks

    def best_static(values: Iterable[int]) -> int:
        return max(sorted(values), key=lambda v: sum(per_phase[v]))

    def baselines_picks(runs: dict[int, RunResult]) -> set[int]:
        picks = {best_static(runs)}
        for limit_s in (math.inf, target_s, margin_s):
            picks.update(v for v in picks_within(runs, limit_s) if v is not None)
        return picks

    # independent of what the goals chose: the same arrivals give the same baselines
    statics = search_statics(
        (*setup.candidates, setup.vllm_default),
        min(knee_rules.granularity, slo_rules.granularity),
        static_run,
        baselines_picks,
    )
    values = list(statics)
    static_wall = max(walls[f"static-{v}"] for v in values)
    best_value = best_static(values)

    def oracle_within(limit_s: float) -> tuple[RunResult, float, str]:
        """The best value per phase among those whose TPOT p99 in the phase is at most `limit_s`,
        switched for free (a phase where none is counts nothing): its run, goodput and picks."""
        picks = picks_within(values, limit_s)
        chosen = [(p, v) for p, v in zip(phases, picks, strict=True) if v is not None]
        served = [row for p, v in chosen for row in statics[v].served if trace.phase_at(row[0]) == p]
        goodput = sum(per_phase[v][p] for p, v in chosen)
        return (
            RunResult("oracle", served=served, arrivals=len(stream)),
            goodput,
            " | ".join("-" if v is None else str(v) for v in picks),
        )

    oracle, oracle_goodput, oracle_values = oracle_within(math.inf)
    p99_oracle, p99_goodput, p99_values = oracle_within(target_s)
    margin_oracle, margin_goodput, margin_values = oracle_within(margin_s)

    def figures(run: RunResult, goodput: float, values_text: str, wall: float) -> PolicyFigures:
        f = run.figures()
        return PolicyFigures(
            goodput,
            goodput / oracle_goodput if oracle_goodput > 0 else math.nan,
            f["tpotP99Ms"],
            f["ttftP99Ms"],
            run.rollouts,
            run.restart_gpu_s,
            values_text,
            wall,
            goodput / p99_goodput if p99_goodput > 0 else math.nan,
            f["servedShare"],
        )

    default = statics[setup.vllm_default]
    best = statics[best_value]
    return TraceResult(
        trace,
        {
            "vllm-default": figures(
                default, default.good(trace), str(setup.vllm_default), walls[f"static-{setup.vllm_default}"]
            ),
            "best-static": figures(best, best.good(trace), str(best_value), static_wall),
            "oracle": figures(oracle, oracle_goodput, oracle_values, static_wall),
            "knee": figures(knee, knee.good(trace), _values_text(knee.values), walls["knee"]),
            "slo": figures(slo, slo.good(trace), _values_text(slo.values), walls["slo"]),
        },
        figures(p99_oracle, p99_goodput, p99_values, static_wall),
        figures(margin_oracle, margin_goodput, margin_values, static_wall),
    )


def _phase_tpot_p99(run: RunResult, trace: Trace, phase: int) -> float:
    """TPOT p99 of the requests that arrived in one phase (infinite when none finished)."""
    tpots = [t for arrival, _, t, _ in run.served if t is not None and trace.phase_at(arrival) == phase]
    return percentile(tpots, 0.99) if tpots else math.inf
