"""Which status changes a steady hold may hold back: its figures' values, until its next slot."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from batchknee.core.spread import phase
from batchknee.reconcile import figures_only, refresh_offset_s
from batchknee.scheduling import next_due


def stored(**observed: Any) -> dict[str, Any]:
    figures = {
        "sampledAt": "2026-12-01T12:00:00Z",
        "pods": 2,
        "avgContextLength": 2048,
        "tpotP99Milliseconds": 24.5,
        "bandwidthUtilizationPercent": 71.0,
        "bandwidthSource": "Engine",
        "diagnosis": "memory-bound",
    }
    return {
        "action": "hold",
        "holdReason": "at-target",
        "maxNumSeqs": 64,
        "bKnee": 59.8,
        "reason": "avg ctx 2048 tok → B_knee 59.8 → 64 — at target",
        "recentTargets": [{"time": "2026-12-01T12:00:00Z", "batch": 59.8}],
        "observed": {**figures, **observed},
    }


def moved(sampled_at: str) -> dict[str, Any]:
    """The stored status with its figures moved, sampled at `sampled_at`."""
    new = stored(sampledAt=sampled_at, avgContextLength=2101, tpotP99Milliseconds=25.1)
    new |= {"bKnee": 58.3, "reason": "avg ctx 2101 tok → B_knee 58.3 → 64 — at target"}
    new["recentTargets"] = [*new["recentTargets"], {"time": sampled_at, "batch": 58.3}]
    return new


def test_moved_figures_wait_for_the_next_slot() -> None:
    # the stored figures were sampled at 12:00:00; slots of 60 s from :00 (offset 0) or :45 or :15
    assert figures_only(stored(), moved("2026-12-01T12:00:30Z"), refresh_s=60)
    assert not figures_only(stored(), moved("2026-12-01T12:01:00Z"), refresh_s=60)  # the next slot
    assert figures_only(stored(), moved("2026-12-01T12:00:30Z"), refresh_s=60, offset_s=45)
    assert not figures_only(stored(), moved("2026-12-01T12:00:30Z"), refresh_s=60, offset_s=15)
    assert not figures_only(stored(), moved("2026-12-01T12:00:30Z"), refresh_s=0)


@pytest.fixture
def seoul(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The machine's local time nine hours ahead of UTC, for one test."""
    monkeypatch.setenv("TZ", "KST-9")  # POSIX form: needs no zone database
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_time_without_its_zone_is_utcs_on_any_machine(seoul: None) -> None:
    """As Kubernetes writes times; the machine's own zone plays no part."""
    later = moved("2026-12-01T12:00:30Z")
    assert figures_only(stored(sampledAt="2026-12-01T12:00:00"), later, refresh_s=60)
    assert not figures_only(stored(sampledAt="2026-12-01T11:59:59"), later, refresh_s=60)


def test_a_fleet_writes_its_figures_evenly_over_the_window() -> None:
    """A thousand objects found at once, first written within half a minute, then evaluated every
    30 s on their grids (observations from a 5 s refresh): each writes its figures once a 60 s
    window, and every 10 s of the window carries its share of the fleet's writes."""
    interval, window, cache = 30.0, 60.0, 5.0
    keys = [(f"team-{i % 10}", f"llm-{i:04d}") for i in range(1000)]
    start = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)

    def at(seconds: float) -> str:
        return (start + timedelta(seconds=seconds)).isoformat()

    writes: list[tuple[float, tuple[str, str]]] = []
    for i, key in enumerate(keys):
        written = last = 5.0 + 25.0 * i / len(keys)  # its first status, in the startup's wave
        while last < 600.0:
            last = next_due(last, interval, phase(*key))
            sampled = last - last % cache
            if not figures_only(
                moved(at(written)), moved(at(sampled)), window, offset_s=refresh_offset_s(*key, window)
            ):
                written = sampled
                writes.append((last, key))
    steady = [(t, key) for t, key in writes if 300.0 <= t < 600.0]
    per_object = Counter(key for _, key in steady)
    assert set(per_object.values()) <= {4, 5, 6}  # five windows: once a window (±1 at the edges)
    bins = Counter(int((t - 300.0) // 10) for t, _ in steady)
    share = len(steady) / 30  # ten-second bins
    assert 0.75 * share <= min(bins[b] for b in range(30)) and max(bins.values()) <= 1.25 * share, sorted(
        bins.items()
    )


def test_news_is_written_at_once() -> None:
    later = {"sampledAt": "2026-12-01T12:00:30Z"}
    assert not figures_only(stored(), stored(**later, pods=3), 60)
    assert not figures_only(stored(), stored(**later, diagnosis="underused"), 60)
    assert not figures_only(stored(), stored(**later, bandwidthSource="DCGM"), 60)
    gone = stored(**later)
    del gone["observed"]["bandwidthUtilizationPercent"]
    assert not figures_only(stored(), gone, 60)
    assert not figures_only(stored(), {**stored(**later), "holdReason": "dead-band"}, 60)
    assert not figures_only(stored(), {**stored(**later), "recommendedMaxNumSeqs": 72}, 60)
    unseen = stored()
    del unseen["observed"]
    assert not figures_only(unseen, stored(**later), 60)
