"""Figures that overflow on the way to status, and contexts under one token in the policy: nothing
non-finite reaches status (json.dumps would write `Infinity`, which is no JSON), and a context the
knee cannot use holds the last good setting with the reason."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.core.observation import Observation, Reading
from batchknee.core.policy import Applied, TuningRules, decide
from batchknee.core.verify import Figures
from batchknee.reconcile import _ms, _pct, observed_metrics, window_figures

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ROOFLINE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))
POOL = ROOFLINE.kv_pool_bytes(0.9)


def seen(
    ctx: float, *, tpot_s: float = 0.02, ttft_s: float = 0.1, recent_ctx: float | None = None
) -> Observation:
    def reading(value: float | None) -> Reading:
        return Reading.of(value) if value is not None else Reading.unavailable("series empty in the window")

    return Observation(
        T0, 1, reading(ctx), reading(tpot_s), reading(tpot_s), reading(ttft_s), reading(32.0), reading(0.0),
        reading(0.5), reading(0.0), reading(0.0), reading(900.0), recent_avg_context_tokens=reading(recent_ctx),
    )  # fmt: skip


@pytest.mark.parametrize("value", [1e307, 1.7e308, math.inf, -math.inf, math.nan])
def test_a_figure_that_is_not_finite_in_milliseconds_or_percent_is_left_out(value: float) -> None:
    assert _ms(value) is None and _pct(value) is None
    assert _ms(1e306) is None  # 1e306 s is inf ms


def test_finite_figures_are_rounded_as_before() -> None:
    assert (_ms(0.0314), _pct(0.4567), _ms(None), _pct(None)) == (31.4, 45.7, None, None)


def test_an_observation_of_huge_latencies_gives_strict_json_status() -> None:
    observed = observed_metrics(seen(2048, tpot_s=1e306, ttft_s=1e306)).dump()
    text = json.dumps(observed, allow_nan=False)
    assert "tpotP99Milliseconds" not in json.loads(text) and "ttftP99Milliseconds" not in json.loads(text)
    assert json.loads(text)["avgContextLength"] == 2048


@pytest.mark.parametrize(
    "figures",
    [
        Figures(2048, 1000.0, 1e306, 0.0),  # TPOT p99 1e306 s: inf ms
        Figures(math.inf, 1000.0, 0.02, 0.0),
        Figures(2048, math.nan, 0.02, 0.0),
        Figures(2048, 1000.0, 0.02, math.inf),
    ],
)
def test_a_window_whose_figures_are_not_finite_is_not_kept_for_the_check(figures: Figures) -> None:
    assert window_figures(figures) is None


def test_a_window_keeps_its_finite_figures_and_leaves_out_a_non_finite_optional_one() -> None:
    kept = window_figures(Figures(2048, 1000.0, 0.02, 0.0, tpot_mean_s=1e306, prompt_tokens=math.inf))
    assert kept is not None
    assert (kept.context_tokens, kept.tpot_p99_milliseconds) == (2048, 20.0)
    assert kept.tpot_mean_milliseconds is None and kept.prompt_tokens is None
    json.dumps(kept.dump(), allow_nan=False)


@pytest.mark.parametrize("ctx", [1e-320, 1e-300, 0.25, 0.999])
def test_a_context_under_one_token_holds_the_last_good_setting_and_says_why(ctx: float) -> None:
    applied = Applied(64, settled_since=T0 - timedelta(days=1))
    d = decide(TuningRules(), ROOFLINE, POOL, seen(ctx), applied, (), T0)
    assert (d.rolls, d.value, d.hold) == (False, 64, "metrics-unavailable")
    assert "average context" in d.reason and "under 1" in d.reason, d.reason


def test_a_recent_context_under_one_token_is_no_trend() -> None:
    """(Was: the knee of the window's last third at 1e-300 tokens, an OverflowError.)"""
    applied = Applied(16, settled_since=T0 - timedelta(days=1))  # far under the knee: a raise is due
    steady = decide(TuningRules(), ROOFLINE, POOL, seen(2048), applied, (), T0)
    tiny = decide(TuningRules(), ROOFLINE, POOL, seen(2048, recent_ctx=1e-300), applied, (), T0)
    assert steady.target is not None and steady.target > 16  # (held for the hold time, past the trend)
    assert (tiny.action, tiny.value, tiny.hold, tiny.reason) == (
        steady.action,
        steady.value,
        steady.hold,
        steady.reason,
    )
