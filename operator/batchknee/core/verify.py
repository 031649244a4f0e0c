"""Did a retune do what the model predicted? (pure)

After every change, once the settle window has passed, the window after is compared with the window
before, for similar traffic: the clients' mean prompt (else the running context) within the dead
band — otherwise traffic changed, not the setting.
The change is reverted, and its value quarantined for that context, when

- generation throughput per pod fell by more than 10 % without a TPOT p99 gain,
- preemptions appeared where there were none (the batch no longer fits the KV pool), or
- TPOT p99 now breaks a target it met before;

else it is kept (and the settled window becomes a verified calibration point). Throughput and TPOT
are compared only while the running context has not grown past the band either: a restart only
shortens it, so a rise says the window before still held a shift's shorter contexts (or, under a
shared prefix counted once, a decrease spread the prefix over fewer sequences): inconclusive,
which keeps the change. Preemptions after a raise are judged before that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from batchknee.core.observation import Observation

THROUGHPUT_DROP = 0.10  # a fall in tokens/s per pod larger than this is a regression…
TPOT_GAIN = 0.05  # …unless TPOT p99 improved by at least this much (a deliberate trade)
PREEMPTIONS_NONE = 0.01  # preemptions per second below this count as none

Verdict = Literal["Kept", "Reverted", "Inconclusive"]


@dataclass(frozen=True)
class Figures:
    """What a window showed, per pod where it matters."""

    context_tokens: float
    tokens_per_s_per_pod: float
    tpot_p99_s: float
    preemptions_per_s: float
    tpot_mean_s: float | None = None  # exact (sum/count); the p99 moves in histogram buckets
    prompt_tokens: float | None = None  # mean prompt of the requests finished in the window

    @classmethod
    def of(cls, observation: Observation | None) -> Figures | None:
        """The figures of a usable observation, else None (nothing is compared against a gap)."""
        if observation is None or observation.pods < 1:
            return None
        ctx = observation.avg_context_tokens.value
        tokens = observation.generation_tokens_per_s.value
        tpot = observation.tpot_p99_s.value
        preemptions = observation.preemptions_per_s.value
        if ctx is None or tokens is None or tpot is None or preemptions is None:
            return None
        pods = observation.pods_served.value or observation.pods
        return cls(
            ctx,
            tokens / pods,
            tpot,
            preemptions,
            observation.tpot_mean_s.value,
            observation.prompt_tokens_mean.value,
        )


@dataclass(frozen=True)
class Check:
    verdict: Verdict
    reason: str


def verify(
    before: Figures,
    after: Figures,
    dead_band_percent: int,
    tpot_target_s: float | None = None,
    *,
    raised: bool = True,
) -> Check:
    """The verdict on one change (`raised`: to a larger limit) from the windows before and after it."""
    moved = _traffic_moved(before, after, dead_band_percent)
    if moved is not None:
        return Check("Inconclusive", f"traffic moved ({moved}): nothing to compare")
    change = (
        after.tokens_per_s_per_pod / before.tokens_per_s_per_pod - 1 if before.tokens_per_s_per_pod else 0.0
    )
    figures = (
        f"tok/s per pod {before.tokens_per_s_per_pod:.0f} → {after.tokens_per_s_per_pod:.0f} "
        f"({change * 100:+.0f} %), TPOT p99 {before.tpot_p99_s * 1e3:.1f} → {after.tpot_p99_s * 1e3:.1f} ms, "
        f"preemptions/s {before.preemptions_per_s:.2f} → {after.preemptions_per_s:.2f}"
    )
    # Throughput and TPOT both follow the running context: when it grew past the band while the
    # clients' prompts held, the window before still held a shift's shorter contexts (a restart
    # only shortens it) and neither compares. Preemptions after a raise are the raise's doing
    # whatever the context (the engine preempts the youngest, leaving the running set older);
    # after a cut, with the context grown, they are the longer traffic's.
    grown = after.context_tokens > before.context_tokens and _beyond(
        before.context_tokens, after.context_tokens, dead_band_percent
    )
    if before.preemptions_per_s < PREEMPTIONS_NONE <= after.preemptions_per_s and (raised or not grown):
        return Check("Reverted", f"preemptions appeared: {figures}")
    if grown:
        return Check(
            "Inconclusive",
            f"the running context grew (avg ctx {before.context_tokens:.0f} → {after.context_tokens:.0f} "
            f"tok) while the prompts held: the window before still held shorter contexts; {figures}",
        )
    # A TPOT gain shows in the p99 or, since Prometheus interpolates the p99 inside the engine's
    # histogram buckets (25, 50, 75 ms…), in the exact mean.
    tpot_gained = after.tpot_p99_s <= before.tpot_p99_s * (1 - TPOT_GAIN) or (
        before.tpot_mean_s is not None
        and after.tpot_mean_s is not None
        and after.tpot_mean_s <= before.tpot_mean_s * (1 - TPOT_GAIN)
    )
    if change < -THROUGHPUT_DROP and not tpot_gained:
        return Check("Reverted", f"throughput fell without a TPOT gain: {figures}")
    if tpot_target_s is not None and before.tpot_p99_s <= tpot_target_s < after.tpot_p99_s:
        return Check(
            "Reverted", f"TPOT p99 now breaks its {tpot_target_s * 1e3:.0f} ms target, met before: {figures}"
        )
    return Check("Kept", figures)


def _traffic_moved(before: Figures, after: Figures, dead_band_percent: int) -> str | None:
    """What moved beyond the dead band between the windows, else None.

    The clients' mean prompt is the traffic itself; the running context also shows the engine: a
    restart starts every sequence at its prompt, and a slower step keeps that cohort young for
    longer, so right after a change it falls by itself. The running context is the measure only where
    a window has no prompt mean (no request finished in it); where both have one, a context that
    grew is weighed in `verify` (after a raise's preemptions: the engine preempts the youngest)."""
    old, new = before.prompt_tokens, after.prompt_tokens
    if old is None or new is None:
        what, old, new = "avg ctx", before.context_tokens, after.context_tokens
    else:
        what = "mean prompt"
    if not _beyond(old, new, dead_band_percent):
        return None
    return f"{what} {old:.0f} → {new:.0f} tok"


def _beyond(old: float, new: float, dead_band_percent: int) -> bool:
    return abs(new - old) / max(old, 1.0) * 100 > dead_band_percent
