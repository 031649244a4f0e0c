"""The continuous-batching simulation: its figures against the roofline and its conservation laws."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.emulator import (
    DROPPED,
    FINISHED,
    REJECTED,
    Engine,
    EngineConfig,
    EngineConfigError,
    LoadSpec,
    Request,
    Schedule,
    vllm_num_gpu_blocks,
)
from batchknee.emulator.engine import REFUSED_RETRY_S

SEED_ROOFLINE = DecodeRoofline(
    find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=2.0e12
)


def config(**overrides: object) -> EngineConfig:
    values: dict[str, object] = {
        "roofline": SEED_ROOFLINE,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "num_gpu_blocks": vllm_num_gpu_blocks(SEED_ROOFLINE, 0.9, 16),
    }
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


def checked(engine: Engine, duration: float, tokens: int, decoding: int) -> None:
    engine.check_invariants()
    assert tokens <= engine.config.max_num_batched_tokens


def test_lockstep_batch_has_the_roofline_tpot_at_its_batch() -> None:
    # Overhead 0, efficiency 1, 64 sequences prefilled in one step and then decoding together:
    # every step is the roofline's decode step at B = 64; context grows 2049 → 2111 (mean 2080).
    done: list[Request] = []
    engine = Engine(config(max_num_batched_tokens=64 * 2048), on_finish=done.append, step_hook=checked)
    for _ in range(64):
        engine.submit(2048, 64)
    assert engine.drain()
    expected = SEED_ROOFLINE.tpot_s(64, 2048 + 64 / 2)
    assert len(done) == 64
    for request in done:
        assert request.tpot_s == pytest.approx(expected, rel=0.02)
    assert expected == pytest.approx(0.01672, rel=1e-3)  # the seed's 16.6 ms at B 64, ctx 2048


def test_saturated_steady_state_tpot_matches_the_core_at_the_running_batch() -> None:
    # A closed loop of 64 requests with short prompts: the batch stays at 64 and every step is a
    # decode step at B = 64 (the 32-token prefills ride along under the memory roof), so TPOT is
    # the core's TPOT at the mean decode context, 32 + 4096 / 2.
    done: list[Request] = []
    load = LoadSpec(prompt_tokens=32, output_tokens=4096, concurrency=64)
    engine = Engine(config(), load=load, on_finish=done.append, closed_loop_ramp_s=4096 * 0.0167)
    engine.run_until(200.0)
    running0, busy0 = engine.stats.running_seconds, engine.stats.busy_time_s
    engine.run_until(1200.0)
    recent = [r for r in done if r.arrival > 200.0]
    assert len(recent) > 100
    mean_running = (engine.stats.running_seconds - running0) / (engine.stats.busy_time_s - busy0)
    assert mean_running == pytest.approx(64, rel=0.01)
    mean_tpot = statistics.mean(r.tpot_s for r in recent if r.tpot_s is not None)
    assert mean_tpot == pytest.approx(SEED_ROOFLINE.tpot_s(64, 32 + 4096 / 2), rel=0.02)


def test_littles_law() -> None:
    finished: list[Request] = []
    load = LoadSpec(
        request_rate=2.0,
        prompt_tokens=1024,
        output_tokens=512,
        prompt_distribution="lognormal",
        output_distribution="uniform",
    )
    engine = Engine(config(), load=load, seed=3, on_finish=finished.append)
    engine.run_until(3000.0)
    horizon = engine.now
    in_system = engine.stats.in_system_seconds / horizon  # L, time-averaged
    throughput = len(finished) / horizon  # λ (stable: arrivals = departures + the few in flight)
    mean_latency = statistics.mean(r.e2e_s for r in finished if r.e2e_s is not None)  # W
    assert in_system == pytest.approx(throughput * mean_latency, rel=0.03)
    assert throughput == pytest.approx(2.0, rel=0.05)


def test_tokens_are_conserved_through_chunking_preemption_and_prefix_hits() -> None:
    finished: list[Request] = []
    cfg = config(
        max_num_seqs=32,
        max_num_batched_tokens=512,
        num_gpu_blocks=700,
        block_size=16,
        max_model_len=4096,
        enable_prefix_caching=True,
    )
    load = LoadSpec(
        request_rate=4.0,
        prompt_tokens=600,
        output_tokens=400,
        prompt_distribution="uniform",
        output_distribution="lognormal",
        prefix_sharing=0.4,
    )
    engine = Engine(cfg, load=load, seed=11, on_finish=finished.append, step_hook=checked)
    engine.run_until(300.0)
    assert engine.drain()
    stats = engine.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.finished == len(finished) == stats.received - stats.rejected
    assert stats.generation_tokens == sum(r.output for r in finished)
    assert stats.prompt_tokens == sum(r.prompt for r in finished)
    # Every token a step computed: each request's prompt and all but its last output token, plus
    # what preemption threw away, minus what the prefix cache supplied.
    assert stats.computed_tokens == (
        sum(r.prompt + r.output - 1 for r in finished) + stats.recomputed_tokens - stats.prefix_cache_hits
    )
    assert engine.used_blocks == 0 and engine.num_decoding == 0


def _burst(count: int, blocks: int, **overrides: object) -> Engine:
    engine = Engine(
        config(max_num_seqs=16, num_gpu_blocks=blocks, max_model_len=2048, **overrides), step_hook=checked
    )
    for _ in range(count):
        engine.submit(256, 512)
    assert engine.drain()
    assert engine.stats.finished == count
    return engine


def test_preemption_exactly_when_the_pool_cannot_hold_the_batch() -> None:
    # Each request ends holding ceil((256 + 512 − 1) / 16) = 48 blocks. 256 blocks hold 5 of them
    # (240) but not 6 (288).
    assert _burst(5, 256).stats.preemptions == 0
    crowded = _burst(6, 256)
    assert crowded.stats.preemptions > 0
    assert crowded.stats.recomputed_tokens > 0
    assert crowded.stats.generation_tokens == 6 * 512


def test_kv_usage_and_running_batch_stay_within_limits_under_overload() -> None:
    peak = {"running": 0, "usage": 0.0}

    def watch(engine: Engine, duration: float, tokens: int, decoding: int) -> None:
        checked(engine, duration, tokens, decoding)
        peak["running"] = max(peak["running"], engine.num_running)
        peak["usage"] = max(peak["usage"], engine.kv_cache_usage)

    cfg = config(max_num_seqs=48, num_gpu_blocks=4000, max_model_len=4096, max_waiting=200)
    load = LoadSpec(request_rate=20.0, prompt_tokens=900, output_tokens=700, output_distribution="lognormal")
    engine = Engine(cfg, load=load, seed=5, step_hook=watch)
    engine.run_until(120.0)
    assert peak["running"] == 48
    assert 0.9 < peak["usage"] <= 1.0
    assert engine.stats.rejected > 0  # the queue cap turned the overload away
    assert engine.num_waiting <= 200 + 48  # new arrivals are capped; preempted requests requeue


def test_trtllm_reservation_caps_the_batch_by_tokens_and_never_preempts() -> None:
    # Guaranteed-no-evict: each request reserves ceil((256 + 512 − 1) / 32) = 24 blocks up front;
    # 100 blocks admit 4 at a time.
    peak = [0]

    def watch(engine: Engine, duration: float, tokens: int, decoding: int) -> None:
        checked(engine, duration, tokens, decoding)
        peak[0] = max(peak[0], engine.num_running)

    engine = Engine(
        config(
            max_num_seqs=64, num_gpu_blocks=100, block_size=32, max_model_len=2048, reserve_full_sequence=True
        ),
        step_hook=watch,
    )
    for _ in range(10):
        engine.submit(256, 512)
    assert engine.drain()
    assert peak[0] == 4
    assert engine.stats.preemptions == 0
    assert engine.stats.finished == 10


def test_prefix_caching_stores_the_shared_prefix_once() -> None:
    # 1024-token prompts sharing their first half: 32 shared blocks are stored once and every
    # request after the first finds them in the cache.
    def run(caching: bool) -> Engine:
        engine = Engine(config(enable_prefix_caching=caching, max_num_batched_tokens=64 * 1024))
        for _ in range(40):
            engine.submit(1024, 64, shared_prefix_tokens=512)
        engine.run_until(0.0)
        engine.run_until(engine.now)  # after the prefill step
        return engine

    shared, plain = run(True), run(False)
    assert shared.num_running == plain.num_running == 40
    assert plain.used_blocks - shared.used_blocks == 39 * 32
    assert shared.stats.prefix_cache_hits == 39 * 512
    assert shared.stats.prefix_cache_queries == 40 * 1024
    assert plain.stats.prefix_cache_queries == 0


def test_chunked_prefill_respects_the_token_budget_and_delays_the_first_token() -> None:
    budgets: list[int] = []
    done: list[Request] = []
    engine = Engine(
        config(max_num_batched_tokens=512),
        on_finish=done.append,
        step_hook=lambda e, d, tokens, n: budgets.append(tokens),
        keep_token_times=True,
    )
    engine.submit(2000, 4)
    assert engine.drain()
    # 2000 prompt tokens in chunks of 512: four prefill steps, then three decode steps.
    assert budgets == [512, 512, 512, 464, 1, 1, 1]
    (request,) = done
    assert engine.step_end_times is not None
    assert request.ttft_s == engine.step_end_times[3]
    assert request.finish_time == engine.step_end_times[6]


def test_token_times_give_the_inter_token_gaps() -> None:
    done: list[Request] = []
    engine = Engine(config(max_num_seqs=8), load=LoadSpec(request_rate=3.0), seed=1, on_finish=done.append,
                    keep_token_times=True)  # fmt: skip
    engine.run_until(60.0)
    request = done[5]
    times = engine.token_times(request)
    assert len(times) == request.output
    assert times[0] == request.first_token_time and times[-1] == request.finish_time
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap > 0 for gap in gaps)
    assert statistics.mean(gaps) == pytest.approx(request.tpot_s)
    # The ITL histogram saw every gap: one sample per output token after each request's first.
    assert engine.stats.itl.count == engine.stats.generation_tokens - engine.stats.ttft.count


def test_sliding_window_sums_stay_exact() -> None:
    roofline = DecodeRoofline(find_model("mistral-7b-v0.1"), find_gpu("h100-sxm"))
    cfg = EngineConfig(
        roofline, max_num_seqs=16, max_num_batched_tokens=4096, num_gpu_blocks=20_000, max_model_len=8192
    )
    engine = Engine(
        cfg, load=LoadSpec(request_rate=1.0, prompt_tokens=3900, output_tokens=400), step_hook=checked
    )
    engine.run_until(200.0)
    assert engine.stats.finished > 50


def test_same_seed_same_run_and_noise_changes_steps_not_arrivals() -> None:
    load = LoadSpec(request_rate=5.0, prompt_distribution="lognormal", output_distribution="lognormal")

    def run(seed: int, noise: float) -> tuple[int, int, float]:
        engine = Engine(config(step_noise=noise), load=load, seed=seed)
        engine.run_until(120.0)
        return engine.stats.received, engine.stats.generation_tokens, engine.stats.busy_time_s

    assert run(4, 0.1) == run(4, 0.1)
    assert run(4, 0.1) != run(5, 0.1)
    quiet, noisy = run(4, 0.0), run(4, 0.2)
    assert quiet[0] == noisy[0] and quiet[2] != noisy[2]


def test_schedule_changes_the_offered_rate() -> None:
    schedule = Schedule([(0.0, LoadSpec(request_rate=1.0)), (100.0, LoadSpec(request_rate=8.0))])
    arrivals: list[float] = []
    engine = Engine(config(), load=schedule, seed=2, on_finish=lambda r: arrivals.append(r.arrival))
    engine.run_until(200.0)
    early = sum(1 for t in arrivals if t < 100.0)
    late = sum(1 for t in arrivals if 100.0 <= t < 190.0)
    assert 70 < early < 130 and 600 < late < 840


def test_rejections_and_drops_are_counted() -> None:
    outcomes: list[Request] = []
    engine = Engine(config(max_num_seqs=2, max_waiting=3, max_model_len=4096), on_finish=outcomes.append)
    too_long = engine.submit(5000, 10)
    assert too_long.state == REJECTED
    for _ in range(6):
        engine.submit(100, 1000)
    engine.run_until(0.5)
    assert engine.stats.rejected == 1 + 3  # one too long, then the queue of 3 was full
    assert engine.num_running == 2
    assert engine.num_waiting == 1
    dropped = engine.drop_all()
    assert dropped == 3  # two running, one waiting
    assert engine.stats.dropped == dropped
    assert engine.used_blocks == 0 and engine.in_flight == 0
    assert sum(1 for r in outcomes if r.state == DROPPED) == dropped
    assert all(r.state in (REJECTED, DROPPED, FINISHED) for r in outcomes)


@pytest.mark.parametrize(
    ("prompt", "concurrency", "max_waiting"),
    [(5000, 4, 100), (100, 64, 1)],  # every prompt past max_model_len; more clients than seats and queue
)
def test_refused_closed_loop_clients_come_back_later_not_at_once(
    prompt: int, concurrency: int, max_waiting: int
) -> None:
    """Each refused client sent its next request at the same simulated instant: the run looped
    there for ever (`simulate --max-model-len 10`, an emulator whose queue is full)."""
    engine = Engine(
        config(max_num_seqs=2, max_waiting=max_waiting, max_model_len=4096),
        load=LoadSpec(prompt_tokens=prompt, output_tokens=1000, concurrency=concurrency),
    )
    engine.run_until(1.0)
    refused_per_second = (concurrency if prompt > 4096 else concurrency - 2 - max_waiting) / REFUSED_RETRY_S
    assert 0.5 * refused_per_second <= engine.stats.rejected <= 1.1 * refused_per_second


def test_config_refuses_what_vllm_refuses() -> None:
    with pytest.raises(EngineConfigError, match="max_num_batched_tokens"):
        config(max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(EngineConfigError, match="max_model_len"):
        config(num_gpu_blocks=100, max_model_len=8192)


def test_five_simulated_minutes_serve_what_arrived() -> None:
    """Under the batch limit nothing is refused or left behind but the last steps' requests (how
    fast the simulation runs is `batchknee simulate --benchmark`'s figure, not an assertion here)."""
    engine = Engine(
        config(max_num_seqs=256), load=LoadSpec(request_rate=10.0, prompt_tokens=256, output_tokens=128)
    )
    engine.run_until(300.0)
    stats = engine.stats
    assert 300.0 <= engine.now < 301.0
    assert abs(stats.received - 3000) < 5 * math.sqrt(3000)  # Poisson arrivals at 10/s
    assert stats.rejected == stats.dropped == stats.preemptions == 0
    # a request lasts about 128 steps of ~10 ms: those of the last ~2 s are still running
    assert stats.received - 60 <= stats.finished <= stats.received


@pytest.mark.parametrize("read_once", [True, False])
def test_shared_prefix_is_read_once_per_step_with_cascade_attention(read_once: bool) -> None:
    # 40 sequences of 1024 + 64 tokens sharing their first 512 tokens, decoding in lockstep.
    # Read once (vLLM's cascade attention), the step reads 40 unique parts and one shared prefix:
    # the planner's roofline with that sharing fraction; re-read, it is the roofline without.
    roofline = replace(SEED_ROOFLINE, shared_prefix_read_once=read_once)
    done: list[Request] = []
    cfg = config(roofline=roofline, enable_prefix_caching=True, max_num_batched_tokens=64 * 1024)
    engine = Engine(cfg, on_finish=done.append, step_hook=checked)
    for _ in range(40):
        engine.submit(1024, 64, shared_prefix_tokens=512)
    assert engine.drain()
    context = 1024 + 64 / 2
    planner = replace(roofline, prefix_sharing=512 / context if read_once else 0.0)
    for request in done:
        assert request.tpot_s == pytest.approx(planner.tpot_s(40, context), rel=0.02)
    if read_once:
        assert planner.tpot_s(40, context) < SEED_ROOFLINE.tpot_s(40, context) * 0.9
