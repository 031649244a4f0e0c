"""Every rule of the retuning policy (DESIGN.md §4) as a property."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchknee.core import DecodeRoofline, find_gpu, find_model, recommend
from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import (
    Applied,
    CalibrationPoint,
    RecentTarget,
    Rollout,
    TuningRules,
    decide,
    record,
    rollouts_in_last_hour,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROOFLINE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
POOL = ROOFLINE.kv_pool_bytes(0.9)

contexts = st.integers(16, 131072)


@st.composite
def rules(draw: st.DrawFn, mode: str = "Auto") -> TuningRules:
    low = draw(st.integers(1, 256))
    high = draw(st.integers(low, 1024))
    return TuningRules(
        mode=mode,  # type: ignore[arg-type]
        knee_factor_percent=draw(st.integers(100, 200)),
        min_max_num_seqs=low,
        max_max_num_seqs=high,
        dead_band_percent=draw(st.integers(0, 50)),
        cooldown_s=draw(st.integers(0, 3600)),
        max_rollouts_per_hour=draw(st.integers(1, 10)),
        window_s=draw(st.integers(30, 900)),
        initial_context_length=draw(contexts),
        pinned_max_num_seqs=draw(st.integers(1, 1024)) if mode == "Pinned" else None,
    )


def seen(
    ctx: float | None, *, tpot_ms: float | None = 20.0, running: float = 32.0, now: datetime = T0
) -> Observation:
    def reading(value: float | None) -> Reading:
        return Reading.of(value) if value is not None else Reading.unavailable("series empty in the window")

    return Observation(
        now, 1, reading(ctx), reading(tpot_ms / 1e3 if tpot_ms else None), reading(None), reading(0.1),
        reading(running), reading(0.0), reading(0.5), reading(0.0), reading(0.0), reading(900.0),
    )  # fmt: skip


def steady(applied: int, *rollouts: Rollout) -> Applied:
    return Applied(max_num_seqs=applied, rollouts=tuple(rollouts))


def held(r: TuningRules, ctx: float, applied: Applied, now: datetime = T0) -> tuple[RecentTarget, ...]:
    """Earlier evaluations that saw the same traffic for the whole hold time (so a change is
    neither still moving nor too new)."""
    target = decide(r, ROOFLINE, POOL, seen(ctx, now=now), applied, (), now).target
    assert target is not None
    spacing = r.recent_target_spacing_s
    count = int(r.hold_for_s // spacing) + 2
    return tuple(RecentTarget(now - timedelta(seconds=spacing * i), target) for i in range(count, 0, -1))


@given(rules(), contexts)
def test_bounds_and_granularity(r: TuningRules, ctx: int) -> None:
    d = decide(r, ROOFLINE, POOL, seen(ctx), Applied(None), (), T0)
    assert r.min_max_num_seqs <= d.value <= r.max_max_num_seqs
    if d.value not in (r.min_max_num_seqs, r.max_max_num_seqs) and d.limited_by == "knee":
        assert d.value % 8 == 0
    assert d.reason and d.rolls


@given(rules(), contexts)
def test_before_any_traffic_the_initial_context_is_used(r: TuningRules, ctx: int) -> None:
    for nothing in (None, seen(None, running=0)):
        d = decide(r, ROOFLINE, POOL, nothing, Applied(None), (), T0)
        expected = recommend(
            ROOFLINE, r.initial_context_length, knee_factor=r.knee_factor, kv_pool_bytes=POOL,
            minimum=r.min_max_num_seqs, maximum=r.max_max_num_seqs,
        ).max_num_seqs  # fmt: skip
        assert d.value == expected and d.context_source == "initial"


@given(rules(), st.integers(1, 1024), st.sampled_from([None, "unavailable", "no-traffic"]))
def test_missing_metrics_never_move_the_value(r: TuningRules, applied: int, kind: str | None) -> None:
    observation = None if kind is None else seen(None, running=0 if kind == "no-traffic" else 5)
    d = decide(r, ROOFLINE, POOL, observation, steady(applied), (), T0 + timedelta(days=1))
    assert not d.rolls and d.value == applied
    assert d.hold in ("metrics-unavailable", "no-traffic") and d.reason


@given(rules(), contexts, st.integers(1, 1024))
def test_a_rollout_in_progress_holds(r: TuningRules, ctx: int, applied: int) -> None:
    d = decide(r, ROOFLINE, POOL, seen(ctx), replace(steady(applied), rolling=True), (), T0)
    assert not d.rolls and d.hold == "rollout-in-progress"


@given(rules(), contexts, st.integers(1, 1024), st.integers(0, 10_000))
def test_the_window_after_a_rollout_settles(r: TuningRules, ctx: int, applied: int, since: int) -> None:
    now = T0 + timedelta(seconds=since)
    d = decide(r, ROOFLINE, POOL, seen(ctx), replace(steady(applied), settled_since=T0), (), now)
    if since < r.window_s:
        assert not d.rolls and d.hold == "settling"


@given(rules(), contexts, st.integers(1, 1024), st.integers(1, 600))
def test_the_window_settles_by_the_observations_time_not_the_clocks(
    r: TuningRules, ctx: int, applied: int, lag: int
) -> None:
    """A cached reading (a slow Prometheus a spec chose is read at most a tenth of the time) may
    be a window that ended before the settle did: it still holds the pods before the rollout."""
    settled = replace(steady(applied), settled_since=T0)
    now = T0 + timedelta(seconds=r.window_s + lag)
    stale = seen(ctx, now=now - timedelta(seconds=lag + 1))
    d = decide(r, ROOFLINE, POOL, stale, settled, (), now)
    assert not d.rolls and d.hold == "settling"
    assert decide(r, ROOFLINE, POOL, seen(ctx, now=now), settled, (), now).hold != "settling"


@given(rules(), contexts, st.integers(1, 1024), st.integers(0, 7200))
def test_cooldown(r: TuningRules, ctx: int, applied: int, since: int) -> None:
    last = Rollout(T0, 256, applied, "earlier")
    now = T0 + timedelta(seconds=since)
    state = steady(applied, last)
    d = decide(r, ROOFLINE, POOL, seen(ctx, now=now), state, (), now, recent_targets=held(r, ctx, state, now))
    if since < r.cooldown_s:
        assert not d.rolls
        if d.value != d.recommended and d.hold not in ("dead-band", "at-target"):
            assert d.hold == "cooldown" and "cooldown until" in d.reason


def test_a_moment_not_today_is_named_with_its_date() -> None:
    """A cooldown past midnight (or a time from a clock far off) read "until 00:00:00Z": passed."""
    r = TuningRules(cooldown_s=600)
    for now, until in (
        (datetime(2026, 3, 1, 23, 55, tzinfo=UTC), "2026-03-02T00:00:00Z"),
        (datetime(2026, 3, 1, 12, 0, tzinfo=UTC), "12:05:00Z"),
    ):
        state = steady(64, Rollout(now - timedelta(minutes=5), 256, 64, "earlier"))
        d = decide(
            r, ROOFLINE, POOL, seen(8192, now=now), state, (), now, recent_targets=held(r, 8192, state, now)
        )
        assert d.hold == "cooldown" and d.reason.endswith(f"cooldown until {until}"), d.reason


@given(rules(), contexts, st.integers(1, 1024), st.integers(0, 3599))
def test_caps_set_live_start_no_cooldown_and_spend_no_budget(
    r: TuningRules, ctx: int, applied: int, since: int
) -> None:
    """A cap set in place restarted nothing: a restart after it (actuation switched to Restart, or
    above a Live ceiling) is held neither by the cooldown nor by the rollout budget on its account."""
    r = replace(r, max_rollouts_per_hour=1)
    now = T0 + timedelta(seconds=since)
    live = steady(
        applied,
        Rollout(T0 - timedelta(days=1), None, 256, "created"),
        Rollout(T0, 256, applied, "l", live=True),
    )
    d = decide(r, ROOFLINE, POOL, seen(ctx, now=now), live, (), now, recent_targets=held(r, ctx, live, now))
    assert d.hold not in ("cooldown", "rollout-budget"), d.reason
    assert rollouts_in_last_hour(live.rollouts, now) == 0


@given(rules(), contexts, st.integers(1, 1024), st.none() | st.floats(1.0, 1024.0))
def test_dead_band(r: TuningRules, ctx: int, applied: int, origin: float | None) -> None:
    # The band is measured between unrounded targets (changed rule: it was between rounded values),
    # from the target that produced the applied setting when its rollout recorded one.
    state = steady(applied, Rollout(T0 - timedelta(days=1), None, applied, "created", origin))
    d = decide(r, ROOFLINE, POOL, seen(ctx), state, (), T0, recent_targets=held(r, ctx, state))
    reference = origin if origin is not None else applied
    assert d.target is not None
    outside = abs(d.target - reference) / reference * 100 > r.dead_band_percent
    if d.rolls:
        assert outside or d.limited_by in ("tpot-target", "kv-capacity")
    elif d.recommended is not None and d.recommended != applied:
        assert d.hold == ("unsteady" if outside else "dead-band") or d.limited_by != "knee"


@settings(max_examples=60)
@given(rules(), st.lists(st.tuples(st.integers(60, 1800), contexts), min_size=1, max_size=60))
def test_rollout_budget_and_cooldown_hold_over_any_history(
    r: TuningRules, steps: list[tuple[int, int]]
) -> None:
    applied = Applied(None)
    now = T0
    remembered: tuple[RecentTarget, ...] = ()
    for gap, ctx in steps:
        now += timedelta(seconds=gap)
        d = decide(r, ROOFLINE, POOL, seen(ctx, now=now), applied, (), now, recent_targets=remembered)
        remembered = d.recent_targets
        if d.rolls:
            applied = Applied(d.value, rollouts=record(applied, d, now))
        for rollout in applied.rollouts:
            assert rollouts_in_last_hour(applied.rollouts, rollout.time) <= r.max_rollouts_per_hour
    times = [x.time for x in applied.rollouts if x.from_value is not None]
    assert all(b - a >= timedelta(seconds=r.cooldown_s) for a, b in itertools.pairwise(times))


@given(rules(mode="Recommend"), contexts, st.integers(1, 1024))
def test_recommend_mode_reports_and_never_rolls(r: TuningRules, ctx: int, applied: int) -> None:
    d = decide(r, ROOFLINE, POOL, seen(ctx), steady(applied), (), T0 + timedelta(days=1))
    assert not d.rolls and d.value == applied and d.action == "recommend"
    assert d.recommended is not None and str(d.recommended) in d.reason


@given(rules(mode="Pinned"), contexts, st.none() | st.integers(1, 1024))
def test_pinned_runs_the_pinned_value(r: TuningRules, ctx: int, applied: int | None) -> None:
    d = decide(r, ROOFLINE, POOL, seen(ctx), Applied(applied), (), T0)
    assert d.value == r.pinned_max_num_seqs
    assert d.rolls == (applied != r.pinned_max_num_seqs)


@given(contexts, st.integers(1, 200))
def test_kv_capacity_caps_the_value(ctx: int, small_pool_percent: int) -> None:
    pool = POOL * small_pool_percent / 1000
    r = TuningRules(min_max_num_seqs=1, max_max_num_seqs=4096)
    d = decide(r, ROOFLINE, pool, seen(ctx), Applied(None), (), T0)
    capacity = ROOFLINE.kv_capacity_batch(ctx, pool)
    assert d.value <= max(capacity, 1)


@given(contexts, contexts)
def test_longer_context_never_recommends_more(a: int, b: int) -> None:
    short, long = sorted((a, b))
    r = TuningRules(min_max_num_seqs=1, max_max_num_seqs=4096)
    first = decide(r, ROOFLINE, POOL, seen(short), Applied(None), (), T0)
    second = decide(r, ROOFLINE, POOL, seen(long), Applied(None), (), T0)
    assert second.value <= first.value


@given(st.integers(9, 1024), st.integers(1, 200), st.integers(0, 100))
def test_tpot_over_target_steps_down(applied: int, target_ms: int, over_percent: int) -> None:
    r = TuningRules(
        min_max_num_seqs=8, max_max_num_seqs=1024, tpot_p99_target_ms=target_ms, dead_band_percent=10
    )
    p99 = target_ms * (1 + (over_percent + 1) / 100)
    d = decide(r, ROOFLINE, POOL, seen(512, tpot_ms=p99), steady(applied), (), T0)
    assert (d.recommended is not None and d.recommended < applied) or applied <= 8 or d.recommended == 8
    if d.rolls:
        assert d.value < applied


@given(st.integers(8, 1024), st.integers(10, 200), st.floats(0.9, 1.0))
def test_tpot_near_target_never_raises(applied: int, target_ms: int, fraction: float) -> None:
    r = TuningRules(min_max_num_seqs=8, max_max_num_seqs=1024, tpot_p99_target_ms=target_ms)
    d = decide(r, ROOFLINE, POOL, seen(128, tpot_ms=target_ms * fraction), steady(applied), (), T0)
    assert d.value <= applied
    assert d.recommended is not None and d.recommended <= max(applied, 8)


@settings(max_examples=40)
@given(st.integers(15, 60), st.integers(1024, 4096), st.integers(0, 2**32))  # within the sampled contexts
def test_calibrated_cap_keeps_the_true_p99_under_target(target_ms: int, ctx: int, seed: int) -> None:
    truth = replace(ROOFLINE, bandwidth_efficiency=0.78, overhead_s=0.0025)
    rng = random.Random(seed)
    points = []
    for i in range(12):
        batch = rng.choice([4, 8, 16, 32, 48, 64, 96, 128])
        context = rng.choice([1024, 2048, 4096])
        points.append(
            CalibrationPoint(
                T0 + timedelta(minutes=5 * i),
                batch,
                context,
                truth.tpot_s(batch, context) * rng.gauss(1, 0.01),
            )
        )
    r = TuningRules(
        min_max_num_seqs=1, max_max_num_seqs=1024, tpot_p99_target_ms=target_ms, knee_factor_percent=200
    )
    d = decide(r, ROOFLINE, POOL, seen(ctx, tpot_ms=target_ms * 2), steady(512), points, T0)
    assert d.calibration is not None
    true_cap = truth.max_batch_for_tpot(target_ms / 1e3, ctx)
    assume(true_cap >= 8)
    assert d.recommended is not None
    # the TPOT the calibrated choice really gives stays within 5 % of the target
    assert truth.tpot_s(d.recommended, ctx) <= target_ms / 1e3 * 1.05


@given(rules(), contexts, st.integers(1, 1024), st.integers(0, 100_000))
def test_every_hold_says_why(r: TuningRules, ctx: int, applied: int, seconds: int) -> None:
    last = Rollout(T0, None, applied, "created")
    d = decide(
        r,
        ROOFLINE,
        POOL,
        seen(ctx),
        replace(steady(applied, last), settled_since=T0),
        (),
        T0 + timedelta(seconds=seconds),
    )
    if not d.rolls:
        assert d.hold is not None and d.reason and d.value == applied
    else:
        assert d.reason.startswith(f"max-num-seqs {applied}→{d.value}: avg ctx {ctx} tok → B_knee")


@given(rules(), contexts, st.integers(1, 1024), st.floats(1.0, 1024.0), st.integers(0, 3600))
def test_a_recommendation_still_moving_holds(
    r: TuningRules, ctx: int, applied: int, previous: float, age_s: int
) -> None:
    # Changed rule: "still moving" compares unrounded targets, and only with one recorded at least
    # an evaluation interval before this observation (never with a reading from the same period).
    state = steady(applied)
    history = held(r, ctx, state)
    unmoved = decide(r, ROOFLINE, POOL, seen(ctx), state, (), T0, recent_targets=history)
    assume(unmoved.rolls and unmoved.limited_by not in ("tpot-target", "kv-capacity"))
    assert unmoved.target is not None
    earlier = RecentTarget(T0 - timedelta(seconds=age_s), previous)
    moved = decide(r, ROOFLINE, POOL, seen(ctx), state, (), T0, recent_targets=(*history, earlier))
    compared = age_s >= r.evaluation_interval_s
    if compared and abs(unmoved.target - previous) / previous * 100 > r.dead_band_percent:
        assert moved.hold == "unsteady" and moved.value == applied
        assert "still moving" in moved.reason
    # the same target twice in a row is steady
    again = decide(
        r, ROOFLINE, POOL, seen(ctx), state, (), T0,
        recent_targets=(*history, RecentTarget(T0 - timedelta(seconds=r.evaluation_interval_s), unmoved.target)),
    )  # fmt: skip
    assert again.rolls and again.value == unmoved.value


@given(rules(), contexts, contexts, st.integers(1, 1024))
def test_a_window_mid_shift_holds(r: TuningRules, ctx: int, recent_ctx: int, applied: int) -> None:
    history = held(r, ctx, steady(applied))
    plain = decide(r, ROOFLINE, POOL, seen(ctx), steady(applied), (), T0, recent_targets=history)
    assume(plain.rolls and plain.limited_by not in ("tpot-target", "kv-capacity"))
    shifting = replace(seen(ctx), recent_avg_context_tokens=Reading.of(recent_ctx))
    d = decide(r, ROOFLINE, POOL, shifting, steady(applied), (), T0, recent_targets=history)
    lately = recommend(
        ROOFLINE, recent_ctx, knee_factor=r.knee_factor, kv_pool_bytes=POOL,
        minimum=r.min_max_num_seqs, maximum=r.max_max_num_seqs,
    )  # fmt: skip
    assert plain.recommendation is not None
    whole = plain.recommendation.unrounded  # changed rule: unrounded targets are compared
    if abs(lately.unrounded - whole) / whole * 100 > r.dead_band_percent:
        assert d.hold == "unsteady" and d.value == applied
        assert f"last third says avg ctx {recent_ctx} tok → {lately.max_num_seqs}" in d.reason
    elif d != plain:
        # changed rule: inside the band, a roll goes to the last third's knee when that lies further
        # along the move (from the applied value past the window's target) and rounds elsewhere
        assert plain.target is not None
        assert (plain.target - applied) * (lately.unrounded - plain.target) > 0
        assert d.rolls and d.value == lately.max_num_seqs != plain.value
        assert d.context_tokens == recent_ctx and "(the window's last third)" in d.reason
