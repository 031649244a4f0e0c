"""Goal SLO: the largest batch limit whose TPOT p99 meets the target less the margin — past the knee
when the target allows — calibrated from samples, climbing from the knee before there are enough."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import (
    Applied,
    CalibrationPoint,
    Decision,
    RecentTarget,
    Rollout,
    TuningRules,
    calibrate,
    calibration_point,
    decide,
)
from batchknee.core.recommend import round_down_fine
from batchknee.core.roofline import PrefillMix

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
NAIVE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
REAL = DecodeRoofline(NAIVE.model, NAIVE.gpu, bandwidth_efficiency=0.8, overhead_s=0.002)
POOL = NAIVE.kv_pool_bytes(0.9)
SLO = TuningRules(goal="SLO", tpot_p99_target_ms=30, max_max_num_seqs=1024, cooldown_s=0)


def seen(
    ctx: float,
    tpot_p99_ms: float,
    running: float,
    *,
    mean_ms: float | None = None,
    prompt: float = 1024,
    output: float = 2048,
) -> Observation:
    def reading(value: float | None) -> Reading:
        return Reading.of(value) if value is not None else Reading.unavailable("series empty")

    return Observation(
        T0, 1, reading(ctx), reading(tpot_p99_ms / 1e3), reading(None if mean_ms is None else mean_ms / 1e3),
        reading(0.2), reading(running), reading(0.0), reading(0.5), reading(0.0), reading(0.0), reading(900.0),
        prompt_tokens_mean=reading(prompt), output_tokens_mean=reading(output),
    )  # fmt: skip


def steady(
    rules: TuningRules,
    roofline: DecodeRoofline,
    pool: float,
    observation: Observation | None,
    applied: Applied,
    calibration: Sequence[CalibrationPoint],
    now: datetime,
) -> Decision:
    """The decision at `now` after the same traffic was seen every evaluation for two windows (the
    hysteresis lets a change roll only once it has held)."""
    moment = now - timedelta(seconds=2 * rules.window_s)
    recent: tuple[RecentTarget, ...] = ()
    while True:
        seen_now = replace(observation, sampled_at=moment) if observation is not None else None
        decision = decide(
            rules, roofline, pool, seen_now, applied, calibration, moment, recent_targets=recent
        )
        if moment >= now:
            return decision
        recent = decision.recent_targets
        moment += timedelta(seconds=rules.evaluation_interval_s)


def real_mean_ms(batch: int, ctx: int = 2048) -> float:
    return REAL.tpot_with_prefill_s(batch, ctx, PrefillMix(1024, 2048)) * 1e3


def test_goal_slo_needs_a_tpot_target() -> None:
    with pytest.raises(ValueError, match="goal SLO needs tpotP99TargetMilliseconds"):
        TuningRules(goal="SLO")


def test_uncalibrated_it_starts_at_the_knee() -> None:
    d = steady(SLO, NAIVE, POOL, None, Applied(None), (), T0)
    assert d.rolls and d.value == 64 and d.limited_by == "knee"  # ctx 2048 → B_knee 59.8 → 64


def test_uncalibrated_it_climbs_in_a_bounded_step_towards_what_one_window_implies() -> None:
    # The bucketed p99 reads 49 ms (inside the 25–50 ms bucket); the exact mean says there is room.
    d = steady(SLO, NAIVE, POOL, seen(2048, 49.0, running=64, mean_ms=real_mean_ms(64)), Applied(64), (), T0)
    assert d.rolls and d.limited_by == "slo-target" and "climb 64 →" in d.reason
    assert 64 < d.value <= 96  # at most ×3/2 per settled window
    # One window's estimate puts all of the time above the roofline into bandwidth: safe, the
    # climbed value meets the working target on the real engine.
    assert REAL.tpot_with_prefill_s(d.value, 2048, PrefillMix(1024, 2048), 0.99) <= 0.027


def test_uncalibrated_it_steps_down_to_what_one_window_implies() -> None:
    d = steady(
        SLO, NAIVE, POOL, seen(2048, 49.0, running=160, mean_ms=real_mean_ms(160)), Applied(160), (), T0
    )
    assert d.rolls and d.value < 160 and d.limited_by == "tpot-target"  # over the target itself: urgent
    assert REAL.tpot_with_prefill_s(d.value, 2048, PrefillMix(1024, 2048), 0.99) <= 0.027


@pytest.mark.parametrize(
    ("p99_ms", "running", "mean", "value"),
    [
        (20.0, 30, True, 64),  # the limit does not bind: hold
        (40.0, 64, False, 48),  # no mean, bucketed p99 over the target: step ×3/4
        (20.0, 64, False, 64),  # no mean: no climb on a bucketed p99
    ],
)
def test_uncalibrated_it_holds_or_steps_down(p99_ms: float, running: float, mean: bool, value: int) -> None:
    observation = seen(2048, p99_ms, running, mean_ms=real_mean_ms(int(running)) if mean else None)
    d = steady(SLO, NAIVE, POOL, observation, Applied(64), (), T0)
    assert d.value == value


@pytest.mark.parametrize("dead_band", [10, 30])  # a step of ×3/4 lies inside a 30 % band: it goes still
@pytest.mark.parametrize("goal", ["SLO", "Knee"])
@pytest.mark.parametrize("calibrated", [False, True])
def test_a_p99_past_any_bucket_of_the_target_steps_down_whatever_the_mean_says(
    goal: str, calibrated: bool, dead_band: int
) -> None:
    """A p99 of 200 ms against a 30-ms target cannot come from a true p99 under it (the
    interpolation stays within the bucket, and no bucket spans 2.5×): the limit steps down ×3/4 at
    once — before, a healthy mean let goal SLO climb and goal Knee hold at 200 ms or 1 s."""
    rules = replace(SLO, goal=goal, dead_band_percent=dead_band)
    points = calibration_points() if calibrated else ()
    settled = Applied(64, settled_since=T0 - timedelta(seconds=rules.window_s))
    for p99_ms in (200.0, 1000.0):
        observation = seen(2048, p99_ms, running=64, mean_ms=real_mean_ms(64))
        d = decide(rules, NAIVE, POOL, observation, settled, points, T0)
        assert d.rolls and d.value == 48, (p99_ms, d.reason)
        assert "over 2.5× the target 30 ms" in d.reason and d.broken == 64
        # a window that still holds steps of the limit before 64 (settled since less than a
        # window) says nothing of 64: no step from the last limit's tail, which would compound
        fresh = replace(settled, settled_since=T0 - timedelta(seconds=rules.window_s / 3))
        assert "over 2.5×" not in decide(rules, NAIVE, POOL, observation, fresh, points, T0).reason
    # inside the bucket that holds the target (49 ms), the mean decides, as before
    d = steady(
        rules, NAIVE, POOL, seen(2048, 49.0, running=64, mean_ms=real_mean_ms(64)), Applied(64), points, T0
    )
    assert "over 2.5×" not in d.reason


@pytest.mark.parametrize(("holds", "to"), [(40.5, 40), (60.5, 56)])
def test_a_kv_pool_that_cannot_hold_the_limit_lowers_it_at_once_even_inside_the_dead_band(
    holds: float, to: int
) -> None:
    """A KV pool that holds fewer sequences than the limit preempts every step: the decrease goes at
    the first window, unsteady traffic or not, and inside the dead band too (60 of 64)."""
    rules = TuningRules(cooldown_s=0)
    settled = Applied(64, settled_since=T0 - timedelta(hours=2))
    pool = holds * NAIVE.kv_bytes_per_seq(1024)
    d = decide(rules, NAIVE, pool, seen(1024, 20.0, running=64, mean_ms=15.0), settled, (), T0)
    assert d.rolls and d.value == to and d.limited_by == "kv-capacity", d.reason


def test_a_definite_break_is_kept_where_traffic_is_going() -> None:
    """Goal Knee follows the window's last third when traffic moves on (here 2,800 → 3,100 tokens):
    the limit it steps from is still the one the p99 broke, to be quarantined."""
    rules = replace(SLO, goal="Knee")
    tuned = Rollout(T0 - timedelta(hours=1), 96, 64, "tuned")
    settled = Applied(64, settled_since=T0 - timedelta(seconds=2 * rules.window_s), rollouts=(tuned,))
    moving = replace(
        seen(2800, 200.0, running=64, mean_ms=real_mean_ms(64)), recent_avg_context_tokens=Reading.of(3100)
    )
    d = steady(rules, NAIVE, POOL, moving, settled, (), T0)
    assert d.rolls and d.value < 64 and d.broken == 64, d.reason


def calibration_points() -> tuple[CalibrationPoint, ...]:
    """Settled windows of the real engine at several batches: exact mean TPOTs, coarse p99s."""
    points = []
    for i, batch in enumerate((32, 48, 64, 80, 96, 112)):
        mix = PrefillMix(1024, 2048)
        mean = REAL.tpot_with_prefill_s(batch, 2048, mix)
        points.append(
            CalibrationPoint(
                T0 + timedelta(minutes=5 * i),
                batch,
                2048,
                0.05,
                tpot_mean_s=mean,
                prompt_tokens=1024,
                output_tokens=2048,
            )
        )
    return tuple(points)


def test_calibrated_it_runs_the_slo_bound_past_the_knee() -> None:
    d = steady(
        SLO,
        NAIVE,
        POOL,
        seen(2048, 25.0, 64, mean_ms=real_mean_ms(64)),
        Applied(64),
        calibration_points(),
        T0,
    )
    assert d.calibration is not None
    assert d.calibration.bandwidth_efficiency == pytest.approx(0.8, rel=1e-6)
    assert d.calibration.overhead_s == pytest.approx(0.002, rel=1e-6)
    assert SLO.slo_tpot_s is not None
    expected = REAL.max_batch_for_tpot_quantile(SLO.slo_tpot_s, 2048, PrefillMix(1024, 2048))
    assert d.slo_bound == expected
    assert d.value == expected // 8 * 8 > 64  # past the knee
    assert d.rolls and d.limited_by == "slo-target"
    assert REAL.tpot_with_prefill_s(d.value, 2048, PrefillMix(1024, 2048), 0.99) <= SLO.slo_tpot_s


def test_calibrated_it_is_bounded_by_the_kv_pool_and_the_maximum() -> None:
    short = seen(256, 10.0, 64, prompt=128, output=256)
    bounded = TuningRules(goal="SLO", tpot_p99_target_ms=200, max_max_num_seqs=4096, cooldown_s=0)
    d = steady(bounded, NAIVE, POOL, short, Applied(64), calibration_points(), T0)
    assert d.limited_by == "kv-capacity"
    assert d.value <= NAIVE.kv_capacity_batch(256, POOL)
    capped = TuningRules(goal="SLO", tpot_p99_target_ms=200, max_max_num_seqs=256, cooldown_s=0)
    assert steady(capped, NAIVE, POOL, short, Applied(64), calibration_points(), T0).value == 256


def test_goal_knee_keeps_the_knee_and_reports_the_slo_bound() -> None:
    knee = TuningRules(tpot_p99_target_ms=30, cooldown_s=0)
    d = steady(knee, NAIVE, POOL, seen(2048, 25.0, 64), Applied(64), calibration_points(), T0)
    assert d.value == 64 and d.limited_by == "knee"
    assert d.slo_bound is not None and d.slo_bound > 64


def mid_shift(window_ctx: int, recent_ctx: int, running: int) -> Observation:
    """A window mid-shift to longer contexts: the mean step time of the window's own steps at its
    (blended) context, and the last third already at `recent_ctx`."""
    observation = seen(window_ctx, 49.0, running=running, mean_ms=real_mean_ms(running, window_ctx))
    return replace(observation, recent_avg_context_tokens=Reading.of(recent_ctx))


def test_a_limit_breaking_the_target_where_traffic_is_going_steps_down_mid_shift() -> None:
    """Goal SLO does not wait for the window to stop shifting: its bound is taken at the last third's
    context (where traffic is going), and every request served meanwhile over the target is lost."""
    applied = Applied(176, settled_since=T0 - timedelta(hours=1))
    d = decide(SLO, NAIVE, POOL, mid_shift(700, 2000, 150), applied, (), T0)
    assert d.rolls and d.limited_by == "tpot-target", d.reason
    # the bound at 2,000 tokens, not at the window's blend of 700: it meets the working target there
    assert d.value < 112
    assert REAL.tpot_with_prefill_s(d.value, 2000, PrefillMix(1024, 2048), 0.99) <= 0.030
    # goal Knee's guard, taken at the window's blend, still waits for the shift to end
    knee = replace(SLO, goal="Knee")
    held = decide(knee, NAIVE, POOL, mid_shift(700, 2000, 150), applied, (), T0)
    assert not held.rolls


def test_under_live_actuation_a_safety_decrease_skips_settling_cooldown_and_budget() -> None:
    """Lowering a live cap restarts nothing: a safety decrease soon after a retune (in its settle
    window once the window's last third is all after it, in the cooldown, over a spent budget) goes
    at once under Live, and holds under Restart."""
    rules = replace(SLO, cooldown_s=600, max_rollouts_per_hour=1)
    just_now = T0 - timedelta(seconds=rules.window_s // 3)
    retune = Rollout(just_now, 64, 176, "climb", 176.0)
    applied = Applied(176, settled_since=just_now, rollouts=(retune,))
    observation = mid_shift(2000, 2000, 150)
    restart = decide(rules, NAIVE, POOL, observation, applied, (), T0)
    assert restart.hold == "settling" and restart.value == 176
    settled = replace(applied, settled_since=T0 - timedelta(seconds=rules.window_s))
    assert decide(rules, NAIVE, POOL, observation, settled, (), T0).hold == "cooldown"
    live = decide(replace(rules, live_ceiling=224), NAIVE, POOL, observation, applied, (), T0)
    assert live.rolls and live.value < 112 and live.limited_by == "tpot-target", live.reason
    # an optimisation (a climb) still waits out the settle window under Live
    climb = decide(replace(rules, live_ceiling=224), NAIVE, POOL, mid_shift(2048, 2048, 64), Applied(
        64, settled_since=just_now, rollouts=(retune,)), (), T0)  # fmt: skip
    assert climb.hold == "settling"
    # nor does a decrease before the window's last third has seen the change, or after a creation
    sooner = replace(applied, settled_since=T0 - timedelta(seconds=rules.window_s // 3 - 30))
    assert (
        decide(replace(rules, live_ceiling=224), NAIVE, POOL, observation, sooner, (), T0).hold == "settling"
    )
    created = Applied(176, settled_since=just_now, rollouts=(Rollout(just_now, None, 176, "initial"),))
    assert (
        decide(replace(rules, live_ceiling=224), NAIVE, POOL, observation, created, (), T0).hold == "settling"
    )


def test_under_live_actuation_a_change_under_the_ceiling_is_not_held_by_cooldown_or_budget() -> None:
    """The cooldown and the rollout budget bound restarts; a cap raised in place under the pods'
    startup ceiling restarts nothing. One above the ceiling is a restart and waits as before."""
    rules = TuningRules(cooldown_s=3600, max_rollouts_per_hour=1)
    retune = Rollout(T0 - timedelta(minutes=30), 32, 64, "retune", 59.8)
    applied = Applied(64, settled_since=T0 - timedelta(minutes=29), rollouts=(retune,))
    observation = seen(512, 20.0, running=64)
    restart = steady(rules, NAIVE, POOL, observation, applied, (), T0)
    assert restart.hold == "cooldown" and restart.recommended == 240
    live = steady(replace(rules, live_ceiling=256), NAIVE, POOL, observation, applied, (), T0)
    assert live.rolls and live.value == 240 and live.reason.endswith("(live)")
    above = steady(replace(rules, live_ceiling=128), NAIVE, POOL, observation, applied, (), T0)
    assert above.hold == "cooldown"
    spent = replace(rules, cooldown_s=0)
    assert steady(spent, NAIVE, POOL, observation, applied, (), T0).hold == "rollout-budget"
    assert steady(replace(spent, live_ceiling=256), NAIVE, POOL, observation, applied, (), T0).rolls


def test_under_live_actuation_a_change_under_the_ceiling_holds_one_window_not_one_and_a_half() -> None:
    """A setting tuned to traffic changes once the change has held outside the dead band: 1.5
    windows when it restarts the pods, the window alone for a cap set in place."""
    rules = TuningRules(cooldown_s=0)
    retune = Rollout(T0 - timedelta(hours=1), 32, 64, "retune", 59.8)
    applied = Applied(64, settled_since=T0 - timedelta(hours=1), rollouts=(retune,))
    observation = seen(512, 20.0, running=64)  # knee 240, far outside the band of 59.8

    def held_for(seconds: int, ceiling: int | None) -> Decision:
        since = [RecentTarget(T0 - timedelta(seconds=s), 240.0) for s in range(seconds, 0, -30)]
        return decide(
            replace(rules, live_ceiling=ceiling),
            NAIVE,
            POOL,
            observation,
            applied,
            (),
            T0,
            recent_targets=since,
        )

    assert held_for(rules.window_s, 256).rolls
    assert held_for(rules.window_s - 60, 256).hold == "unsteady"
    restart = held_for(rules.window_s, None)
    assert restart.hold == "unsteady" and f"for {rules.hold_for_s}s" in restart.reason
    assert held_for(rules.window_s, 128).hold == "unsteady"  # above the ceiling: a restart
    assert held_for(rules.hold_for_s, None).rolls


# --- calibration from few, far-apart windows ------------------------------------------------------


def window_at(batch: float, ctx: float, minute: int) -> CalibrationPoint:
    """A settled window of the real engine: its exact mean TPOT, a coarse bucketed p99."""
    mix = PrefillMix(ctx / 2, ctx)
    return CalibrationPoint(
        T0 + timedelta(minutes=minute),
        batch,
        ctx,
        0.05,
        tpot_mean_s=REAL.tpot_with_prefill_s(batch, ctx, mix),
        prompt_tokens=ctx / 2,
        output_tokens=ctx,
    )


def test_three_far_apart_windows_calibrate_the_roofline() -> None:
    # a climb from 64 to 176 at 512 tokens, then a shift to 2,048: step times far apart
    points = [window_at(64, 512, 0), window_at(176, 512, 5), window_at(80, 2048, 10)]
    fit, text = calibrate(NAIVE, points)
    assert fit is not None, text
    assert "calibrated on 3 samples" in text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=1e-3)
    assert fit.overhead_s == pytest.approx(0.002, rel=1e-2)


@pytest.mark.parametrize("count", [3, 4, 5, 6, 12])
def test_windows_at_one_operating_point_are_never_trusted(count: int) -> None:
    # the same batch and context every window: one step time pins one line through a point, not
    # both of overhead and efficiency (a few percent of jitter would swing the slope wildly, to
    # the optimistic bound as often as not) — six such windows no more than three
    jitter = (1.0, 1.01, 0.99, 1.005, 0.995) * 3
    points = [
        replace(p, batch=p.batch * jitter[i])
        for i, p in enumerate(window_at(175, 512, 5 * i) for i in range(count))
    ]
    fit, text = calibrate(NAIVE, points)
    assert fit is None
    assert f"uncalibrated, {count}/6 samples whose step times span" in text


def test_steady_traffic_keeps_the_samples_that_span_and_stays_calibrated() -> None:
    """Three far-apart windows calibrate; then hours of steady traffic add one window at one
    operating point each time. The kept samples drop repeats first, so the ones that span stay
    (by age alone, the 32 newest were all at one point within three hours: uncalibrated for good)."""
    from batchknee.core.policy import CALIBRATION_SAMPLES_KEPT, add_calibration_point

    points: tuple[CalibrationPoint, ...] = ()
    for window in (window_at(64, 512, 0), window_at(176, 512, 5), window_at(80, 2048, 10)):
        points = add_calibration_point(points, window)
    jitter = (1.0, 1.02, 0.98, 1.01, 0.99)
    for i in range(5 * CALIBRATION_SAMPLES_KEPT):
        points = add_calibration_point(points, window_at(80 * jitter[i % 5], 2048, 15 + 5 * i))
    assert len(points) == CALIBRATION_SAMPLES_KEPT
    fit, text = calibrate(NAIVE, points)
    assert fit is not None, text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=0.02)


def test_no_calibration_sample_is_kept_past_a_day() -> None:
    """A sample nothing newer repeats is not kept for good: an engine that changed without a new
    fingerprint would keep its old fit."""
    from batchknee.core.policy import CALIBRATION_HORIZON, add_calibration_point

    old = window_at(176, 512, 0)
    points = add_calibration_point((), old)
    points = add_calibration_point(points, window_at(64, 512, 5))
    assert old in points
    later = replace(window_at(64, 2048, 0), time=old.time + CALIBRATION_HORIZON + timedelta(minutes=1))
    assert old not in add_calibration_point(points, later)


def test_few_windows_that_a_line_does_not_fit_closely_are_not_trusted() -> None:
    far = [window_at(64, 512, 0), window_at(176, 512, 5), window_at(80, 2048, 10)]
    off = [far[0], replace(far[1], tpot_mean_s=far[1].tpot_mean_s * 1.15), far[2]]  # type: ignore[operator]
    fit, text = calibrate(NAIVE, off)
    assert fit is None and "residual" in text, text


def test_stored_windows_under_the_rooflines_floor_do_not_enter_the_fit() -> None:
    """Samples a status kept from before the floor was checked (a mean of 1 µs) are left out of
    the fit, not fitted with the rest."""
    far = [window_at(64, 512, 0), window_at(176, 512, 5), window_at(80, 2048, 10)]
    absurd = [replace(p, tpot_mean_s=1e-6) for p in far]
    fit, text = calibrate(NAIVE, [*absurd, *far])
    assert fit is not None and "calibrated on 3 samples" in text, text
    assert fit.bandwidth_efficiency == pytest.approx(0.8, rel=1e-3)
    assert calibrate(NAIVE, absurd)[0] is None


@pytest.mark.parametrize(
    ("cap", "value"),
    [(21, 20), (25, 24), (17, 16), (15, 15), (7, 7), (33, 32), (47, 44), (63, 60), (64, 64), (71, 64)],
)
def test_goal_slo_rounds_finer_than_the_granularity_at_small_batches(cap: int, value: int) -> None:
    # a step of at most 1/8 of the value: vLLM takes any integer and pads to its CUDA graphs
    assert round_down_fine(cap, 8) == value


def test_an_unknown_ttft_does_not_meet_its_target_and_stops_the_climb() -> None:
    """(Was: an unknown TTFT p99 counted as within its target, and the limit climbed.)"""
    rules = replace(SLO, ttft_p99_target_ms=500)
    settled = Applied(64, settled_since=T0 - timedelta(hours=2))
    window = seen(2048, 20, 64, mean_ms=real_mean_ms(64))
    assert steady(rules, NAIVE, POOL, window, settled, (), T0).value > 64  # TTFT 200 ms: climbs
    unknown = replace(window, ttft_p99_s=Reading.unavailable("no TTFT p99 series"))
    d = steady(rules, NAIVE, POOL, unknown, settled, (), T0)
    assert (d.rolls, d.recommended) == (False, 64), d.reason
    assert "TTFT p99 unknown (no TTFT p99 series)" in d.reason


def test_a_tpot_mean_faster_than_any_decode_step_is_not_climbed_on() -> None:
    """A mean TPOT of 1 µs (a histogram in the wrong unit) is under what reading the weights alone
    takes at peak bandwidth: no estimate is made from it. (Was: it climbed 64 → 96.)"""
    settled = Applied(64, settled_since=T0 - timedelta(hours=2))
    d = steady(SLO, NAIVE, POOL, seen(2048, 20, 64, mean_ms=0.001), settled, (), T0)
    assert (d.rolls, d.recommended) == (False, 64), d.reason
    assert "no usable TPOT mean" in d.reason and "under the 7.9 ms any step takes" in d.reason, d.reason


def test_a_window_with_almost_nothing_running_per_pod_is_no_sample_and_a_stored_zero_is_left_out() -> None:
    """0.5 running sequences over 101 pods is a batch of 0.005 per pod: the status stores it to two
    decimals, as 0, and the fit of every later evaluation raised on it (a batch must be positive)."""
    sparse = replace(seen(2048, 25.0, 0.5, mean_ms=20.0), pods=101)
    assert calibration_point(sparse, NAIVE) is None
    points = [window_at(64, 512, 0), window_at(176, 512, 5), window_at(80, 2048, 10)]
    fit, text = calibrate(NAIVE, [replace(points[0], batch=0.0), *points])
    assert fit is not None and "calibrated on 3 samples" in text, text


def tuned_at(value: int, hours_ago: float = 2) -> Applied:
    """`value` running, tuned to traffic `hours_ago` and settled since."""
    retune = Rollout(T0 - timedelta(hours=hours_ago), 64, value, "retune")
    return Applied(value, settled_since=T0 - timedelta(hours=1), rollouts=(retune,))


def test_a_limit_breaking_the_target_goes_down_at_once_to_a_minimum_over_the_slo_bound() -> None:
    # calibrated: 96 breaks the 30-ms target (p99 30.5 ms) and the bound (77) is under the minimum,
    # 80: the decrease is as urgent as one to the bound (it used to wait 1.5 windows as "minimum")
    mix = PrefillMix(1024, 2048)
    p99, mean = (REAL.tpot_with_prefill_s(96, 2048, mix, q) for q in (0.99, None))
    assert p99 * 1e3 > 30
    rules = replace(SLO, min_max_num_seqs=80)
    observed = seen(2048, p99 * 1e3, running=96, mean_ms=mean * 1e3)
    d = decide(rules, NAIVE, POOL, observed, tuned_at(96), calibration_points(), T0)
    assert d.rolls and d.value == 80 and d.limited_by == "tpot-target", d.reason
    assert "(minimum bound)" in d.reason


def test_uncalibrated_a_p99_over_the_target_itself_steps_down_at_once() -> None:
    # no TPOT mean: the observed p99 (45 ms) breaks the 30-ms target itself, not just its margin —
    # a safety decrease, as goal Knee's guard takes it
    d = decide(SLO, NAIVE, POOL, seen(2048, 45.0, running=96), tuned_at(96), (), T0)
    assert d.rolls and d.value == 72 and d.limited_by == "tpot-target", d.reason


def test_a_hold_off_the_granularity_stays_where_it_is() -> None:
    # "stay at 100" rounded down to 96 read as a decrease on no evidence, and rolled with no dead band
    rules = TuningRules(
        goal="SLO", tpot_p99_target_ms=100, max_max_num_seqs=100, dead_band_percent=0, cooldown_s=0
    )
    unobserved = replace(seen(2048, 1.0, running=20), tpot_p99_s=Reading.unavailable("series empty"))
    d = steady(rules, NAIVE, POOL, unobserved, tuned_at(100), (), T0)
    assert not d.rolls and d.value == 100, d.reason


def test_under_live_caps_a_p99_over_the_target_steps_down_once_per_window_it_reads() -> None:
    """Uncalibrated, no mean: the p99 over the target stays in the window for a whole window after
    each live change (the limit before's tail). Urgent at a third of a window, it stepped 128 → 96 →
    72 → … → 8, one step every two minutes, each on the last one's p99."""
    rules = TuningRules(
        goal="SLO", tpot_p99_target_ms=30, max_max_num_seqs=1024, cooldown_s=0, live_ceiling=256
    )
    value, changed = 128, T0 - timedelta(hours=1)
    rollouts: tuple[Rollout, ...] = (Rollout(changed, 64, 128, "retune", live=True),)
    recent: tuple[RecentTarget, ...] = ()
    for step in range(40):
        now = T0 + timedelta(seconds=30 * step)
        over = now - timedelta(seconds=rules.window_s) < changed or step == 0
        observed = replace(seen(2048, 45.0 if over else 25.0, running=100), sampled_at=now)
        applied = Applied(value, settled_since=changed + timedelta(seconds=5), rollouts=rollouts)
        d = decide(rules, NAIVE, POOL, observed, applied, (), now, recent_targets=recent)
        recent = d.recent_targets
        if d.rolls:
            rollouts, value, changed = (
                (*rollouts, Rollout(now, value, d.value, d.reason, live=True)),
                d.value,
                now,
            )
    assert value == 96


def test_a_safety_decrease_says_so_and_an_optimisation_does_not() -> None:
    """`Decision.safety` (a decrease that does not wait behind the operator's new pod template):
    the KV pool exceeded, goal SLO's target broken, goal Knee's guard stepping down; not the knee's
    decrease, a raise or a hold."""
    knee = TuningRules(cooldown_s=0)
    settled = Applied(64, settled_since=T0 - timedelta(hours=2))
    small_pool = 40.5 * NAIVE.kv_bytes_per_seq(1024)
    guard = TuningRules(tpot_p99_target_ms=25, cooldown_s=0)
    for d, running, limited_by in (
        (
            decide(knee, NAIVE, small_pool, seen(1024, 20.0, 64, mean_ms=15.0), settled, (), T0),
            64,
            "kv-capacity",
        ),
        (decide(SLO, NAIVE, POOL, seen(2048, 45.0, running=96), tuned_at(96), (), T0), 96, "tpot-target"),
        (decide(guard, NAIVE, POOL, seen(2048, 40.0, 64), settled, (), T0), 64, "tpot-target"),
    ):
        assert d.rolls and d.value < running and d.limited_by == limited_by and d.safety, d.reason
    for ctx in (8192, 1024):  # the knee's decrease, the knee's raise
        d = steady(knee, NAIVE, POOL, seen(ctx, 20.0, 64), settled, (), T0)
        assert d.rolls and d.limited_by == "knee" and not d.safety, d.reason
    held = decide(knee, NAIVE, POOL, seen(1024, 20.0, 64), settled, (), T0)
    assert not held.rolls and not held.safety, held.reason
