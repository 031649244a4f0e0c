"""Goal Knee with a TPOT target, before calibration: the guard on the knee holds on what it does not
know — an unknown TPOT p99 allows no raise, and a mean TPOT no decode step could have is not read as
headroom."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.calibration import unit_roofline
from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import Applied, TuningRules, decide, tpot_floor_s

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROOFLINE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
POOL = ROOFLINE.kv_pool_bytes(0.9)
GUARDED = TuningRules(tpot_p99_target_ms=30, cooldown_s=0)
SETTLED = Applied(40, settled_since=T0 - timedelta(hours=2))


def window(ctx: float, tpot_p99_s: Reading, tpot_mean_s: Reading, running: float = 40) -> Observation:
    r = Reading.of
    return Observation(
        T0, 1, r(ctx), tpot_p99_s, tpot_mean_s, r(0.2), r(running), r(0.0), r(0.5), r(0.0), r(0.0), r(900.0)
    )


def test_an_unknown_tpot_p99_allows_no_raise_past_what_runs() -> None:
    """At 1,024 tokens the knee is about 120; with the TPOT p99 unknown the guard holds 40 (was:
    no guard, 40 → 120 past a target the limit had been stepped down to meet)."""
    unknown = Reading.unavailable("no TPOT p99 series in the last 300s")
    d = decide(GUARDED, ROOFLINE, POOL, window(1024, unknown, unknown), SETTLED, (), T0)
    assert not d.rolls and d.value == 40 and d.recommended == 40, d.reason
    assert d.guard is not None and d.guard.source == "no-raise"
    assert "TPOT p99 unknown (no TPOT p99 series in the last 300s)" in d.reason
    # lowering is not held: at 8,192 tokens the knee (16) is below what runs
    longer = decide(GUARDED, ROOFLINE, POOL, window(8192, unknown, unknown), SETTLED, (), T0)
    assert longer.recommended == 16, longer.reason
    # without a target there is nothing to guard
    free = decide(TuningRules(cooldown_s=0), ROOFLINE, POOL, window(1024, unknown, unknown), SETTLED, (), T0)
    assert free.recommended is not None and free.recommended > 100, free.reason


def test_a_tpot_mean_under_the_rooflines_floor_does_not_lift_the_step_down() -> None:
    """A p99 of 40 ms over the 30 ms target steps 64 down; a mean of 1 µs beside it (no decode step
    reads 16 GB of weights that fast) is not an estimate that the limit is fine. (Was: its cap,
    the ideal roofline's, replaced the step-down and 64 held.)"""
    at64 = Applied(64, settled_since=T0 - timedelta(hours=2))
    over = window(2048, Reading.of(0.040), Reading.of(1e-6), running=64)
    d = decide(GUARDED, ROOFLINE, POOL, over, at64, (), T0)
    assert d.rolls and d.value == 48, d.reason
    assert d.guard is not None and d.guard.source == "step-down"
    assert "TPOT mean 0.001 ms is under the 7.9 ms any step takes to read the weights" in d.reason


def test_the_floor_is_the_weights_alone_not_the_batchs_kv() -> None:
    """How much KV a GPU reads depends on what the context reading counts (data-parallel attention
    groups, TensorRT-LLM's reservations): a mean under the roofline with the batch's KV but over
    the weights' time is a reading (the one-window estimate takes it as peak bandwidth)."""
    at64 = Applied(64, settled_since=T0 - timedelta(hours=2))
    weights_only = tpot_floor_s(ROOFLINE)
    with_kv = unit_roofline(ROOFLINE).tpot_s(64, 2048)
    assert with_kv > 2 * weights_only
    between = (weights_only + with_kv) / 2
    d = decide(
        GUARDED, ROOFLINE, POOL, window(2048, Reading.of(0.040), Reading.of(between), 64), at64, (), T0
    )
    assert d.guard is not None and d.guard.source == "estimated", d.reason
