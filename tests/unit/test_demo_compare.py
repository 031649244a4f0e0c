"""The demo's Restart/Live comparison, computed from probes: reaction time, new pods, restarts."""

from __future__ import annotations

from pathlib import Path

from batchknee.demo.compare import Probe, rows_for_phase, table, write


def probe(time: float, phase: str, name: str, enforced: int | None, pods: str, restarts: int = 0) -> Probe:
    return Probe(time, phase, name, enforced, frozenset(pods.split()), restarts)


PROBES = [
    # phase a: the Restart twin rolls 64 → 240 (pods p1 p2 replaced by p3 p4); Live sets 80 → 240
    probe(0, "a", "restart", 64, "p1 p2"),
    probe(4, "a", "restart", None, "p1 p2 p3"),
    probe(8, "a", "restart", 240, "p3 p4"),
    probe(12, "a", "restart", 240, "p3 p4"),
    probe(0, "a", "live", 80, "l1 l2"),
    probe(4, "a", "live", None, "l1 l2"),
    probe(8, "a", "live", 240, "l1 l2"),
    probe(12, "a", "live", 240, "l1 l2", restarts=1),
    # phase b, starting at 14: no change for Restart; Live flips to 64 and back (the last run counts)
    probe(16, "b", "restart", 240, "p3 p4"),
    probe(20, "b", "restart", 240, "p3 p4"),
    probe(16, "b", "live", 64, "l1 l2", restarts=1),
    probe(20, "b", "live", None, "l1 l2", restarts=1),
    probe(24, "b", "live", 64, "l1 l2", restarts=1),
]
MODES = {"restart": "Restart", "live": "Live"}


def test_the_first_phase_counts_from_the_starting_pods_and_cap() -> None:
    restart, live = rows_for_phase(PROBES, "a", 0.0, MODES, {"restart": 0, "live": None})
    assert (restart.cap_before, restart.cap_after, restart.reaction_s) == (64, 240, 8)
    assert (restart.new_pods, restart.container_restarts, restart.engine_failed) == (2, 0, 0)
    assert (live.cap_before, live.cap_after, live.reaction_s) == (80, 240, 8)
    assert (live.new_pods, live.container_restarts, live.engine_failed) == (0, 1, None)


def test_a_later_phase_starts_from_the_last_enforced_cap() -> None:
    restart, live = rows_for_phase(PROBES, "b", 14.0, MODES, {})
    assert restart.reaction() == "no change" and restart.new_pods == 0
    assert (live.cap_before, live.cap_after) == (240, 64)
    assert live.reaction_s == 24 - 14  # enforced without a break only from the last probe on
    assert live.container_restarts == 0  # counted from the phase start


def test_not_enforced_at_the_phase_end_says_so(tmp_path: Path) -> None:
    rows = rows_for_phase([*PROBES, probe(28, "b", "restart", None, "p3 p4 p5")], "b", 14.0, MODES, {})
    assert rows[0].reaction() == "not enforced" and rows[0].new_pods == 1
    write(rows, tmp_path)
    text = (tmp_path / "comparison.txt").read_text()
    assert text == table(rows) + "\n"
    assert "not enforced" in text and "240→64" in text and "10 s" in text
