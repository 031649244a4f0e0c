"""The check after a change (pure): what reverts, what is kept, what is inconclusive."""

from __future__ import annotations

from batchknee.core.verify import Figures, verify


def figures(ctx: float = 8192, tokens: float = 1000, p99_ms: float = 49.7, mean_ms: float | None = 45.0,
            preemptions: float = 0.0) -> Figures:  # fmt: skip
    return Figures(ctx, tokens, p99_ms / 1e3, preemptions, None if mean_ms is None else mean_ms / 1e3)


def test_a_tpot_gain_inside_one_histogram_bucket_shows_in_the_mean() -> None:
    """64 → 16 at 8,192 tokens: throughput per pod falls, TPOT halves; the p99 read from vLLM's
    buckets stays near 50 ms, the exact mean shows the gain: kept."""
    check = verify(figures(tokens=1000, mean_ms=45), figures(tokens=700, mean_ms=24), dead_band_percent=10)
    assert check.verdict == "Kept"


def test_throughput_lost_with_no_tpot_gain_reverts() -> None:
    check = verify(figures(tokens=1000, mean_ms=45), figures(tokens=700, mean_ms=46), dead_band_percent=10)
    assert check.verdict == "Reverted" and "throughput fell without a TPOT gain" in check.reason
    no_mean = verify(figures(mean_ms=None), figures(tokens=700, mean_ms=None), dead_band_percent=10)
    assert no_mean.verdict == "Reverted"


def test_preemptions_and_a_broken_target_revert_and_moved_traffic_is_inconclusive() -> None:
    assert verify(figures(), figures(preemptions=1.0), 10).verdict == "Reverted"
    broke = verify(figures(p99_ms=38), figures(p99_ms=45), 10, tpot_target_s=0.040)
    assert broke.verdict == "Reverted" and "40 ms target" in broke.reason
    assert verify(figures(ctx=2048), figures(ctx=8192, tokens=10), 10).verdict == "Inconclusive"
