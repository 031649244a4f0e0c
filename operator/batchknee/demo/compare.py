"""Restart and Live side by side: per phase and LLMServing, how long the new cap took to be enforced
on every pod, how many pods the retune cost, and how many requests failed.

What is measured, per sample (the demo's sample interval is the resolution):
- the enforced cap: for Restart, the Deployment's --max-num-seqs once every pod runs it and is Ready
  (no old pod left); for Live, the cap each Ready pod's runtime endpoint reports, once all agree;
  None while pods disagree (a rollout or a live change under way);
- the pods: their UIDs (a pod created after the phase began is a restart) and container restarts.
The reaction time runs from the phase start (the traffic shift) to the first sample from which the
phase's final cap is enforced on every pod until the phase ends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Probe:
    """One look at one LLMServing's pods."""

    time: float  # seconds since the scenario began
    phase: str
    llmserving: str
    enforced: int | None  # the cap every pod runs now; None while they differ
    pods: frozenset[str]  # UIDs of the pods that exist (terminating ones too)
    container_restarts: int


@dataclass(frozen=True)
class Row:
    phase: str
    llmserving: str
    actuation: str  # Restart or Live (Auto mode), or the mode (Recommend, Pinned)
    cap_before: int | None
    cap_after: int | None
    reaction_s: float | None  # None: no change, or not enforced by the phase end
    new_pods: int
    container_restarts: int
    engine_failed: int | None  # the emulators' dropped + rejected requests (None: no figure)
    client_requests: int | None  # the external client's streams (None: no client on it)
    client_errors: int | None

    def reaction(self) -> str:
        if self.cap_after is None:
            return "not enforced"
        if self.cap_before == self.cap_after:
            return "no change"
        return "—" if self.reaction_s is None else f"{self.reaction_s:.0f} s"


def rows_for_phase(
    probes: Sequence[Probe],
    phase: str,
    phase_start: float,
    actuation: Mapping[str, str],
    engine_failed: Mapping[str, int | None],
) -> list[Row]:
    """The phase's row per LLMServing, from every probe taken so far (earlier phases give the
    starting cap and the pods that were already there)."""
    rows = []
    for name, mode in actuation.items():
        mine = [p for p in probes if p.llmserving == name]
        before = [p for p in mine if p.phase != phase and p.time <= phase_start]
        during = [p for p in mine if p.phase == phase]
        if not during:
            continue
        start = before[-1] if before else during[0]
        cap_before = next((p.enforced for p in reversed(before) if p.enforced is not None), None)
        if cap_before is None and not before:
            cap_before = during[0].enforced
        cap_after = during[-1].enforced
        reaction = None
        if cap_after is not None and cap_after != cap_before:
            since = len(during)
            while since > 0 and during[since - 1].enforced == cap_after:
                since -= 1
            reaction = during[since].time - phase_start
        known = frozenset().union(*(p.pods for p in before)) if before else start.pods
        created = frozenset().union(*(p.pods for p in during)) - known
        rows.append(
            Row(
                phase=phase,
                llmserving=name,
                actuation=mode,
                cap_before=cap_before,
                cap_after=cap_after,
                reaction_s=reaction,
                new_pods=len(created),
                container_restarts=max(0, during[-1].container_restarts - start.container_restarts),
                engine_failed=engine_failed.get(name),
                client_requests=None,
                client_errors=None,
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    """The side-by-side table, one line per phase and LLMServing."""
    header = (
        f"{'phase':<9} {'LLMServing':<18} {'actuation':<10} {'max-num-seqs':>12} {'reaction':>12} "
        f"{'new pods':>8} {'restarts':>8} {'failed (engine)':>15} {'failed (client)':>15}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        caps = (
            f"{'—' if r.cap_before is None else r.cap_before}→{'—' if r.cap_after is None else r.cap_after}"
        )
        engine = "—" if r.engine_failed is None else str(r.engine_failed)
        client = "—" if r.client_requests is None else f"{r.client_errors}/{r.client_requests}"
        lines.append(
            f"{r.phase:<9} {r.llmserving:<18} {r.actuation:<10} {caps:>12} {r.reaction():>12} "
            f"{r.new_pods:>8} {r.container_restarts:>8} {engine:>15} {client:>15}"
        )
    return "\n".join(lines)


def write(rows: Sequence[Row], directory: Path) -> None:
    """comparison.txt (the table) and comparison.json (the rows) in the demo's output folder."""
    (directory / "comparison.txt").write_text(table(rows) + "\n")
    (directory / "comparison.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
