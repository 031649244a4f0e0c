"""Which status changes a steady hold may hold back: its figures' values, for up to a window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from batchknee.reconcile import figures_only

NOW = datetime(2026, 12, 1, 12, 0, 30, tzinfo=UTC)


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


def test_moved_figures_wait_for_the_window() -> None:
    new = stored(sampledAt="2026-12-01T12:00:30Z", avgContextLength=2101, tpotP99Milliseconds=25.1)
    new |= {"bKnee": 58.3, "reason": "avg ctx 2101 tok → B_knee 58.3 → 64 — at target"}
    new["recentTargets"] = [*new["recentTargets"], {"time": "2026-12-01T12:00:30Z", "batch": 58.3}]
    assert figures_only(stored(), new, NOW, refresh_s=60)
    assert not figures_only(stored(), new, NOW + timedelta(seconds=30), refresh_s=60)  # a window old
    assert not figures_only(stored(), new, NOW, refresh_s=0)


def test_news_is_written_at_once() -> None:
    later = {"sampledAt": "2026-12-01T12:00:30Z"}
    assert not figures_only(stored(), stored(**later, pods=3), NOW, 60)
    assert not figures_only(stored(), stored(**later, diagnosis="underused"), NOW, 60)
    assert not figures_only(stored(), stored(**later, bandwidthSource="DCGM"), NOW, 60)
    gone = stored(**later)
    del gone["observed"]["bandwidthUtilizationPercent"]
    assert not figures_only(stored(), gone, NOW, 60)
    assert not figures_only(stored(), {**stored(**later), "holdReason": "dead-band"}, NOW, 60)
    assert not figures_only(stored(), {**stored(**later), "recommendedMaxNumSeqs": 72}, NOW, 60)
    unseen = stored()
    del unseen["observed"]
    assert not figures_only(unseen, stored(**later), NOW, 60)
