"""The retuning decision (DESIGN.md §4): what batch limit an engine should run with now, and why.

Pure: the spec's rules, the latest observation, what the cluster runs, the rollout history and the
calibration samples come in as arguments, together with the current time. The answer is a
`Decision` whose `reason` is one line born in the math, e.g.
`avg ctx 2050 tok → B_knee 59.6 → 64 (×1.00, ⌈8⌉)`, and whose holds always say why.

Rules, in the order they are checked (the first that applies names the hold):
- no engine yet: create it at the recommendation for the observed context, or for
  `initial_context_length` before any traffic has been seen (Pinned: the pinned value;
  Recommend: the user's own `--max-num-seqs` when given);
- Pinned: run the pinned value; Recommend: compute and report, never roll;
- a rollout in progress holds; so do unavailable or too-thin metrics, or no running sequences —
  never a zero; so does the metrics window after a rollout (`window_s`);
- the target: knee factor × B_knee rounded up to the granularity, under the KV-capacity cap, under
  the TPOT guard, clamped to [min, max];
- already there, inside the dead band, still moving, not yet held long enough, inside the
  cooldown, or over the rollouts-per-hour budget (both count retunes that restarted the engines,
  not the creation): hold; otherwise roll. Under Live actuation a change under the pods' startup
  ceiling restarts nothing: the cooldown and the budget (both bound restarts) neither hold it nor
  count it (`Rollout.live`). A safety decrease (the KV pool;
  a TPOT target the current limit breaks: goal SLO's bound, goal Knee's guard by more than the dead
  band) skips the dead band and the hold time, and goal Knee's TPOT guard waits while the window
  shifts; its roll says so (`Decision.safety`: it does not wait behind the operator's own new pod
  template, which rolls with it).
- the creation's guess (the initial context's knee) counts its dead band from that knee unrounded.

Hysteresis works on the unrounded target (`Recommendation.unrounded`, the batch before rounding
up to the granularity): rounding turns an 11 % move of the knee into a 12.5–14 % step, so a band
on rounded values lets small swings through. The dead band is measured from the unrounded target
that produced the applied setting (recorded with its rollout). "Still moving" compares with the
target of at least one evaluation interval earlier (`RecentTarget`s, by the time their
observation was sampled: a reconcile that reuses a cached reading never compares it with itself),
and with the window's last third (the windowed average blends before and after a shift). A
setting tuned to traffic changes only once every target for `hold_for_s` (1.5 windows) lay
outside the dead band on the same side: a window to take in the shift, half a window more to see
it stay (a cap set in place under Live actuation: the window alone, no restart at stake); one not chosen from observed traffic (the initial context's, a pinned or the user's) is a
guess, replaced once they have for a third of a window (the window's last third agreeing with the
whole: never mid-shift; waiting a whole window kept a guess of 64 eight minutes where 240 was right).
Traffic that swings out and back within the hold (flapping) never rolls; a steady drift moves less
than the band per interval, so it is not "moving" and rolls once it has held.

The TPOT guard, with a p99 target: once enough calibration samples exist, the calibrated cap
(overhead and efficiency fitted within their bounds to the windows' exact mean TPOT, the TPOT p99
modelled with the prefill chunks the request mix brings: `max_batch_for_tpot_quantile`); before,
the cap one window's mean implies (all excess time taken as lost bandwidth: a safe estimate), and
without a mean a multiplicative step down (×3/4) while the bucketed p99 is over the target and no
raise while it is within 10 % of it.

Goal SLO (`goal="SLO"`): the target is that cap itself at the target less `slo_margin_percent` —
past the knee when the target allows —, under the KV pool and the bounds; before calibration it
starts at the knee and climbs towards the one-window estimate by at most ×3/2 per settled window
while the limit binds and TTFT p99 meets its target. A bound the current limit breaks the target
itself by is a safety decrease (`tpot-target`); one that only trims the margin is an optimisation
(`slo-target`) that the dead band and the trend checks still hold back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Literal

from batchknee.core.bandwidth import (
    DECODE_DOMINATED_SHARE,
    BandwidthAssessment,
    assess,
    efficiency_from_bandwidth,
    prefill_share,
)
from batchknee.core.calibration import (
    RooflineCalibration,
    fit_overhead_at_efficiency,
    fit_step_times,
    unit_roofline,
)
from batchknee.core.observation import Observation, Reading
from batchknee.core.recommend import (
    Recommendation,
    recommend,
    round_down_fine,
    round_down_under_cap,
    round_up,
)
from batchknee.core.roofline import DecodeRoofline, PrefillMix
from batchknee.core.spread import same_slot

Mode = Literal["Auto", "Recommend", "Pinned"]
Goal = Literal["Knee", "SLO"]
Action = Literal["roll", "hold", "recommend"]
Hold = Literal[
    "metrics-unavailable",
    "no-traffic",
    "rollout-in-progress",
    "settling",
    "unsteady",
    "at-target",
    "dead-band",
    "cooldown",
    "rollout-budget",
    "pinned",
    "recommend-mode",
    "single-replica",
    "quarantined",
    "template-first",
]
# "broken": the observed TPOT p99 is past the target by more than any bucket reads (_definitely_broken)
GuardSource = Literal["calibrated", "estimated", "step-down", "no-raise", "broken"]
SloSource = Literal["calibrated", "start", "climb", "step-down", "hold", "broken"]

STEP_DOWN_NUMERATOR, STEP_DOWN_DENOMINATOR = 3, 4  # uncalibrated guard: ×3/4 per evaluation over target
NO_RAISE_FRACTION = 0.9  # uncalibrated guard: no raise while p99 is within 10 % of the target
# An observed TPOT p99 past this many times the target is over it whatever the model or the mean
# says: the p99 is interpolated within the histogram bucket it falls in, and no TPOT bucket of the
# engines' defaults spans more than a factor 2.5 (vLLM's 10–25 ms and 1–2.5 s), so a true p99 at or
# under the target never reads this high.
DEFINITE_BREAK_FACTOR = 2.5
MIN_CALIBRATION_SAMPLES = 6
# Fewer samples suffice when they are far apart: their step times at full efficiency (the fit's x)
# span at least this fraction of their mean, and the line through them fits them closely. Samples
# at one operating point pin a single step time, not both of overhead and efficiency.
MIN_VARIED_CALIBRATION_SAMPLES = 3
VARIED_CALIBRATION_SPREAD = 0.25
MAX_VARIED_CALIBRATION_RELATIVE_RMSE = 0.05
MIN_BANDWIDTH_SAMPLES = 3  # decode-dominated windows with achieved bytes/s, to set the efficiency
# the fit at the measured efficiency is taken while its residual is within this factor of the free
# fit's plus this share of the mean TPOT
MEASURED_EFFICIENCY_RMSE_SLACK = 1.5
MEASURED_EFFICIENCY_RMSE_FLOOR = 0.01
MAX_CALIBRATION_RELATIVE_RMSE = 0.2  # a fit worse than this is noise, not a model
CALIBRATION_SAMPLES_KEPT = 32
HISTORY_KEPT = 10  # rollouts remembered; maxRolloutsPerHour may not exceed it
RECENT_TARGETS_KEPT = 40  # recent unrounded targets remembered (status.recentTargets)
SLO_CLIMB_NUMERATOR, SLO_CLIMB_DENOMINATOR = 3, 2  # goal SLO, uncalibrated: at most ×3/2 per settled window
SLO_CLIMB_MIN_FILL = 0.9  # climb only while the running batch fills the limit (it binds)
TPOT_QUANTILE = 0.99
HOUR = timedelta(hours=1)
# An average context under one token is no context (the adapter says so first): the knee of such a
# context runs to infinity, and the limit with it.
MIN_CONTEXT_TOKENS = 1.0


def _z(moment: datetime, now: datetime) -> str:
    """A moment in a reason: its time of day, with the date when that is not today's (a cooldown
    past midnight, or a time from a clock far off, would read as one already passed)."""
    return moment.strftime("%H:%M:%SZ" if moment.date() == now.date() else "%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class TuningRules:
    """`spec.tuning` as plain values."""

    mode: Mode = "Auto"
    knee_factor_percent: int = 100
    tpot_p99_target_ms: int | None = None
    min_max_num_seqs: int = 8
    max_max_num_seqs: int = 512
    dead_band_percent: int = 10
    cooldown_s: int = 600
    max_rollouts_per_hour: int = 4
    window_s: int = 300
    initial_context_length: int = 2048
    pinned_max_num_seqs: int | None = None
    granularity: int = 8
    evaluation_interval_s: int = 30
    goal: Goal = "Knee"
    slo_margin_percent: int = 10
    ttft_p99_target_ms: int | None = None
    max_num_batched_tokens: int = 2048
    # Live actuation: the pods' startup --max-num-seqs, under which they take a cap in place (None:
    # every change restarts them). A change under it restarts nothing, so neither the cooldown nor
    # the rollout budget (both bound restarts) holds it back; the dead band and the hold still do.
    live_ceiling: int | None = None

    def __post_init__(self) -> None:
        if not 100 <= self.knee_factor_percent <= 200:
            raise ValueError("kneeFactorPercent must be within 100–200")
        if not 1 <= self.min_max_num_seqs <= self.max_max_num_seqs:
            raise ValueError("minMaxNumSeqs must be at least 1 and at most maxMaxNumSeqs")
        if self.tpot_p99_target_ms is not None and self.tpot_p99_target_ms < 1:
            raise ValueError("tpotP99TargetMilliseconds must be positive")
        if not 0 <= self.dead_band_percent <= 100:
            raise ValueError("deadBandPercent must be within 0–100")
        if self.cooldown_s < 0 or self.window_s < 0:
            raise ValueError("cooldownSeconds and windowSeconds must not be negative")
        if not 1 <= self.max_rollouts_per_hour <= HISTORY_KEPT:
            raise ValueError(f"maxRolloutsPerHour must be within 1–{HISTORY_KEPT}")
        if self.initial_context_length < 1:
            raise ValueError("initialContextLength must be positive")
        if self.mode == "Pinned" and self.pinned_max_num_seqs is None:
            raise ValueError("Pinned mode needs pinnedMaxNumSeqs")
        if self.pinned_max_num_seqs is not None and self.pinned_max_num_seqs < 1:
            raise ValueError("pinnedMaxNumSeqs must be positive")
        if self.granularity < 1:
            raise ValueError("granularity must be positive")
        if self.evaluation_interval_s < 1:
            raise ValueError("evaluationIntervalSeconds must be positive")
        if self.goal == "SLO" and self.tpot_p99_target_ms is None:
            raise ValueError("goal SLO needs tpotP99TargetMilliseconds")
        if not 0 <= self.slo_margin_percent <= 90:
            raise ValueError("sloMarginPercent must be within 0–90")
        if self.ttft_p99_target_ms is not None and self.ttft_p99_target_ms < 1:
            raise ValueError("ttftP99TargetMilliseconds must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")

    @property
    def knee_factor(self) -> float:
        return self.knee_factor_percent / 100.0

    @property
    def hold_for_s(self) -> int:
        """How long a change must hold before it rolls: one window for the windowed average to take
        in a shift, and half a window more to see that it stays."""
        return self.window_s * 3 // 2

    @property
    def recent_target_spacing_s(self) -> float:
        """How far apart the remembered targets are, at the most (one evaluation interval, or
        coarser when the hold time spans more intervals than are kept)."""
        return max(float(self.evaluation_interval_s), self.hold_for_s / (RECENT_TARGETS_KEPT - 2))

    @property
    def slo_tpot_s(self) -> float | None:
        """Goal SLO's working target: the TPOT p99 target less the margin."""
        if self.tpot_p99_target_ms is None:
            return None
        return self.tpot_p99_target_ms / 1e3 * (1.0 - self.slo_margin_percent / 100.0)


@dataclass(frozen=True)
class Rollout:
    """One change of the batch limit, recorded together with the change itself. `target` is the
    unrounded target that produced `to_value` (the dead band's origin; None in older records).
    `live`: set in place under the pods' unchanged startup ceiling — it restarted nothing, so the
    pods run it as a live cap, and neither the cooldown nor the rollout budget counts it."""

    time: datetime
    from_value: int | None
    to_value: int
    reason: str
    target: float | None = None
    live: bool = False


@dataclass(frozen=True)
class RecentTarget:
    """One evaluation's unrounded target, at the time its observation was sampled."""

    time: datetime
    batch: float


@dataclass(frozen=True)
class Applied:
    """What the cluster runs now (the cluster is the source of truth).

    `max_num_seqs` is None before the engine Deployment exists. `settled_since` is when the
    current pod set was first seen fully rolled out and available after the last recorded rollout;
    `draining` counts the pods it replaced still terminating (the settled window waits for them, and
    every change but a safety decrease holds).
    """

    max_num_seqs: int | None
    max_tokens: int | None = None
    rolling: bool = False
    settled_since: datetime | None = None
    rollouts: tuple[Rollout, ...] = ()
    draining: int = 0  # replaced pods still terminating after the rollout completed: only safety goes

    @property
    def origin(self) -> float | None:
        """The unrounded target that produced the applied setting; the setting itself when the
        record does not say (an initial, pinned or user value, or an older record)."""
        if self.max_num_seqs is None:
            return None
        return self._traffic_target if self._traffic_target is not None else float(self.max_num_seqs)

    @property
    def tuned_to_traffic(self) -> bool:
        """Whether the applied setting was chosen from observed traffic (what flapping would undo)."""
        return self._traffic_target is not None

    @property
    def _traffic_target(self) -> float | None:
        last = self.rollouts[-1] if self.rollouts else None
        if last is not None and last.to_value == self.max_num_seqs and last.target is not None:
            return last.target
        return None

    @property
    def last_retune(self) -> Rollout | None:
        """The last change of a running engine's limit (creation is not a retune: the settle
        window covers it, cooldown and budget do not)."""
        return next((r for r in reversed(self.rollouts) if r.from_value is not None), None)

    @property
    def last_restart(self) -> Rollout | None:
        """The last retune that restarted the engines (what the cooldown runs from)."""
        return next((r for r in reversed(self.rollouts) if r.from_value is not None and not r.live), None)


@dataclass(frozen=True)
class CalibrationPoint:
    """One settled observation: the running batch per pod, its context, and the TPOT p99 seen."""

    time: datetime
    batch: float
    context_tokens: float
    tpot_p99_s: float
    # The exact per-request mean (histogram sum / count; the p99 is interpolated within coarse
    # buckets), and the request mix that sets how much prefill shares the decode steps.
    tpot_mean_s: float | None = None
    prompt_tokens: float | None = None
    output_tokens: float | None = None
    prefix_hit_ratio: float | None = None  # None: the engine does not say (no cache, TensorRT-LLM)
    # Bytes the engine read per GPU per second over the window (--enable-mfu-metrics): measures
    # the bandwidth efficiency directly in decode-dominated windows.
    read_bytes_per_s: float | None = None

    def mix(self, max_num_batched_tokens: int) -> PrefillMix | None:
        if self.prompt_tokens is None or self.output_tokens is None or self.output_tokens < 1:
            return None
        # An unknown hit ratio models every prompt token as prefilled: the cautious TPOT.
        cached = self.prefix_hit_ratio if self.prefix_hit_ratio is not None else 0.0
        return PrefillMix(self.prompt_tokens, self.output_tokens, max_num_batched_tokens, cached)


@dataclass(frozen=True)
class TpotGuard:
    cap: int
    source: GuardSource
    text: str


@dataclass(frozen=True)
class SloBound:
    """Goal SLO's bound on the batch limit and where it came from."""

    cap: int
    source: SloSource
    text: str
    urgent: bool = False  # the current limit breaks the target itself, not only the margin


@dataclass(frozen=True)
class Decision:
    action: Action
    value: int
    max_tokens: int
    reason: str
    hold: Hold | None = None
    recommended: int | None = None
    recommendation: Recommendation | None = None
    context_tokens: float | None = None
    context_source: Literal["observed", "initial"] | None = None
    limited_by: str | None = None
    guard: TpotGuard | None = None
    calibration: RooflineCalibration | None = field(default=None, compare=False)
    target: float | None = None  # the unrounded target behind `recommended`
    recent_targets: tuple[RecentTarget, ...] = ()  # to remember for the next evaluation
    slo_bound: int | None = None  # the largest batch the TPOT target allows (None: no target or unknown)
    bandwidth: BandwidthAssessment | None = field(default=None, compare=False)
    # the running limit the observed TPOT p99 broke past any bucket's reading: not to go back to
    broken: int | None = None
    # a roll down from a running limit that is unsafe: it exceeds the KV-cache pool (the engine
    # preempts), or breaks the TPOT target (goal SLO's bound, goal Knee's guard past the dead band)
    safety: bool = False

    @property
    def rolls(self) -> bool:
        return self.action == "roll"


# --- calibration -----------------------------------------------------------------------------------


# The least batch per pod a calibration sample is taken at: the status keeps it to two decimals,
# and a batch stored as 0 is no decode step to fit.
MIN_CALIBRATION_BATCH = 0.01


def calibration_point(observation: Observation, roofline: DecodeRoofline) -> CalibrationPoint | None:
    """A calibration sample from a settled observation, or None when any input is missing or its
    TPOT is faster than any decode step can be (`_under_floor`)."""
    ctx, tpot, running = (
        observation.avg_context_tokens.value,
        observation.tpot_p99_s.value,
        observation.running.value,
    )
    if ctx is None or tpot is None or running is None or observation.pods < 1:
        return None
    batch = running / observation.pods
    if not (batch >= MIN_CALIBRATION_BATCH and ctx >= MIN_CONTEXT_TOKENS and tpot > 0):
        return None
    mean = observation.tpot_mean_s.value
    prompt, output = observation.prompt_tokens_mean.value, observation.output_tokens_mean.value
    hits = observation.prefix_hit_ratio.value
    point = CalibrationPoint(
        observation.sampled_at,
        batch,
        ctx,
        tpot,
        tpot_mean_s=mean if mean is not None and mean > 0 else None,
        prompt_tokens=prompt if prompt is not None and output is not None and output >= 1 else None,
        output_tokens=output if prompt is not None and output is not None and output >= 1 else None,
        prefix_hit_ratio=min(1.0, max(0.0, hits)) if hits is not None else None,
        read_bytes_per_s=read if (read := observation.read_bytes_per_s_per_gpu.value) else None,
    )
    return None if _under_floor(point, roofline) else point


def tpot_floor_s(roofline: DecodeRoofline) -> float:
    """The least time any decode step takes: the weights one token needs, read at the GPU's peak
    bandwidth. The batch's KV is left out: how much of it a GPU reads depends on what the context
    reading counts (data-parallel attention groups, TensorRT-LLM's reservations)."""
    return unit_roofline(roofline).tpot_s(1, 1)


def _under_floor(point: CalibrationPoint, roofline: DecodeRoofline) -> bool:
    """Whether the window's mean TPOT is under `tpot_floor_s`: no decode step is that fast (a
    histogram in the wrong unit, weights lighter than the spec says, speculative decoding), and
    extrapolating from it would raise the limit on a figure the roofline cannot explain. (The p99
    is interpolated within coarse buckets: not exact enough to judge by.)"""
    return point.tpot_mean_s is not None and point.tpot_mean_s < tpot_floor_s(roofline)


def _floor_note(observation: Observation | None, roofline: DecodeRoofline) -> str:
    """Why the window's mean TPOT is not used, when it is under the floor ("" otherwise)."""
    mean = observation.tpot_mean_s.value if observation is not None else None
    floor = tpot_floor_s(roofline)
    if mean is None or mean >= floor:
        return ""
    return (
        f"TPOT mean {mean * 1e3:.3g} ms is under the {floor * 1e3:.1f} ms any step takes to read the "
        "weights: not used (a histogram in another unit, lighter weights than the spec's, speculative decoding?)"
    )


def current_mix(
    observation: Observation | None,
    points: Sequence[CalibrationPoint],
    max_num_batched_tokens: int,
    roofline: DecodeRoofline,
) -> PrefillMix | None:
    """The request mix now: the observation's, else the newest calibration sample's, else None
    (then TPOT is modelled by decode steps alone)."""
    if observation is not None:
        point = calibration_point(observation, roofline)
        if point is not None and (mix := point.mix(max_num_batched_tokens)) is not None:
            return mix
    for point in reversed(points):
        if (mix := point.mix(max_num_batched_tokens)) is not None:
            return mix
    return None


def calibration_due(
    points: Sequence[CalibrationPoint], point: CalibrationPoint, window_s: float, offset_s: float
) -> bool:
    """Whether `point` is a new sample: one per refresh slot (a window long, from `offset_s`), so it
    comes with the status write that refreshes the figures (`reconcile.figures_only`)."""
    return not points or not same_slot(points[-1].time, point.time, window_s, offset_s)


# Two samples whose KV read per step (batch × context) is this close are one operating point.
SAME_OPERATING_POINT = 0.1
# No sample is kept longer: a sample nothing newer repeats would otherwise stay for good, and an
# engine that changed without a new fingerprint (a node's clocks, a driver) would keep its old fit.
CALIBRATION_HORIZON = timedelta(hours=24)


def add_calibration_point(
    points: Sequence[CalibrationPoint], point: CalibrationPoint, keep: int = CALIBRATION_SAMPLES_KEPT
) -> tuple[CalibrationPoint, ...]:
    """At most `keep` samples, `point` last. Past `keep`, the oldest sample that a newer one
    repeats (the same operating point) goes first, else the oldest: steady traffic adds one sample
    an evaluation window at one point, and evicting by age alone left, within hours, only samples
    that span too little to calibrate (see `calibrate`)."""
    kept = [p for p in points if point.time - p.time <= CALIBRATION_HORIZON] + [point]
    while len(kept) > keep:
        del kept[_repeated(kept)]
    return tuple(kept)


def _repeated(points: Sequence[CalibrationPoint]) -> int:
    """The index of the oldest sample a newer one repeats, else 0 (the oldest)."""
    for i, old in enumerate(points[:-1]):
        load = old.batch * old.context_tokens
        if any(
            abs(new.batch * new.context_tokens - load) <= SAME_OPERATING_POINT * load
            for new in points[i + 1 :]
        ):
            return i
    return 0


def calibrate(
    roofline: DecodeRoofline, points: Sequence[CalibrationPoint], max_num_batched_tokens: int = 2048
) -> tuple[RooflineCalibration | None, str]:
    """Fit per-step overhead and bandwidth efficiency (within their bounds) to the observed TPOT.
    When every sample carries the exact per-request mean, the fit is to the mean, modelled with the
    sample's prefill mix; the p99 is then predicted by the same model (a bucketed p99 is
    interpolated within 25 ms-wide buckets: too coarse to fit). Older samples without the mean fit
    the p99 to decode steps alone. None (and why) until there are enough, varied, consistent samples."""
    # (stored before the floor and the least batch were checked: a batch rounded to 0 raised here)
    points = [
        p
        for p in points
        if p.batch >= MIN_CALIBRATION_BATCH and p.context_tokens >= 1 and not _under_floor(p, roofline)
    ]
    if len(points) < MIN_VARIED_CALIBRATION_SAMPLES:
        return None, f"uncalibrated, {len(points)}/{MIN_CALIBRATION_SAMPLES} samples"
    unit = unit_roofline(roofline)
    on_mean = all(p.tpot_mean_s is not None for p in points)
    xs: list[float] = []
    ys: list[float] = []
    for p in points:
        mix = p.mix(max_num_batched_tokens) if on_mean else None
        if mix is not None:
            xs.append(unit.tpot_with_prefill_s(p.batch, p.context_tokens, mix))
        else:
            xs.append(unit.tpot_s(p.batch, p.context_tokens))
        ys.append(p.tpot_mean_s if on_mean and p.tpot_mean_s is not None else p.tpot_p99_s)
    few = len(points) < MIN_CALIBRATION_SAMPLES
    spread = (max(xs) - min(xs)) / (sum(xs) / len(xs))
    # samples at one operating point pin one point of the line, not its slope: however many, a few
    # percent of jitter swings the fit to its optimistic bound (efficiency 1, the overhead taking
    # the rest), which puts larger batches under the target that they break
    if spread < VARIED_CALIBRATION_SPREAD:
        return None, (
            f"uncalibrated, {len(points)}/{MIN_CALIBRATION_SAMPLES} samples whose step times span "
            f"{spread:.0%} (at least {VARIED_CALIBRATION_SPREAD:.0%} pins both overhead and efficiency)"
        )
    try:
        fit = fit_step_times(xs, ys)
    except ValueError as error:
        return None, f"uncalibrated: {error}"
    mean = sum(ys) / len(ys)
    if fit.rmse_s > MAX_CALIBRATION_RELATIVE_RMSE * mean:
        return None, f"uncalibrated: fit residual {fit.rmse_s / mean:.0%} of TPOT"
    if few and fit.rmse_s > MAX_VARIED_CALIBRATION_RELATIVE_RMSE * mean:
        return None, (
            f"uncalibrated, {len(points)}/{MIN_CALIBRATION_SAMPLES} samples: the fit through so few "
            f"leaves a residual of {fit.rmse_s / mean:.0%} of TPOT"
        )
    measured = measured_efficiencies(roofline, points, fit.overhead_s, max_num_batched_tokens)
    if len(measured) >= MIN_BANDWIDTH_SAMPLES:
        efficiency = sorted(measured)[len(measured) // 2]
        direct = fit_overhead_at_efficiency(xs, ys, efficiency)
        # the counter is the engine's own estimate of what it reads: one that explains the step times
        # worse than the free fit by more than noise is off (read 15 % high, the SLO cap came out 11 %
        # over what meets the target), and the free fit stands
        if (
            direct.rmse_s
            <= MEASURED_EFFICIENCY_RMSE_SLACK * fit.rmse_s + MEASURED_EFFICIENCY_RMSE_FLOOR * mean
        ):
            return direct, (
                f"calibrated on {direct.samples} samples, bandwidth efficiency {efficiency:.0%} measured "
                f"in {len(measured)} decode-dominated windows"
            )
        return fit, (
            f"calibrated on {fit.samples} samples (the measured bandwidth efficiency {efficiency:.0%} "
            f"leaves a residual of {direct.rmse_s / mean:.0%} of TPOT: not used)"
        )
    return fit, f"calibrated on {fit.samples} samples"


def measured_efficiencies(
    roofline: DecodeRoofline,
    points: Sequence[CalibrationPoint],
    overhead_s: float,
    max_num_batched_tokens: int = 2048,
) -> list[float]:
    """Bandwidth efficiency from the achieved bytes/s of each busy (≥ 1 sequence per pod),
    decode-dominated window (prefill under 1 − DECODE_DOMINATED_SHARE of the step time):
    achieved / peak, less the overhead's share of the window's mean step (the exact TPOT mean; a
    bucketed p99 is no step time)."""
    found: list[float] = []
    for p in points:
        step_s = p.tpot_mean_s
        if p.read_bytes_per_s is None or step_s is None or p.batch < 1:
            continue
        if roofline.decode_compute_bound(p.batch, p.context_tokens):
            continue  # the step waits on compute: its bytes per second are no bandwidth efficiency
        mix = p.mix(max_num_batched_tokens)
        if (
            mix is not None
            and prefill_share(roofline, p.batch, p.context_tokens, mix) > 1 - DECODE_DOMINATED_SHARE
        ):
            continue
        efficiency = efficiency_from_bandwidth(p.read_bytes_per_s / roofline.bandwidth, step_s, overhead_s)
        if efficiency is not None:
            found.append(efficiency)
    return found


def _guard(
    rules: TuningRules,
    observation: Observation | None,
    applied: int | None,
    calibrated_cap: int | None,
    calibration_text: str,
    settled: bool = False,
) -> TpotGuard | None:
    if rules.tpot_p99_target_ms is None:
        return None
    target_ms = rules.tpot_p99_target_ms
    if (broken := _definitely_broken(rules, observation, applied, calibration_text, settled)) is not None:
        cap, text = broken
        return TpotGuard(min(cap, calibrated_cap if calibrated_cap is not None else cap), "broken", text)
    if calibrated_cap is not None:
        return TpotGuard(
            calibrated_cap,
            "calibrated",
            f"TPOT p99 ≤ {target_ms} ms allows {calibrated_cap} ({calibration_text})",
        )
    if observation is None or applied is None:
        return None
    p99 = observation.tpot_p99_s.value
    if p99 is None:  # unknown is not within the target: hold what runs, lower only
        return TpotGuard(
            applied,
            "no-raise",
            f"TPOT p99 unknown ({observation.tpot_p99_s.reason}): no raise past {applied} "
            f"({calibration_text})",
        )
    p99_ms = p99 * 1e3
    if p99_ms > target_ms:
        stepped = round_down_under_cap(
            max(1, applied * STEP_DOWN_NUMERATOR // STEP_DOWN_DENOMINATOR), rules.granularity
        )
        return TpotGuard(
            stepped,
            "step-down",
            f"TPOT p99 {p99_ms:.0f} ms > target {target_ms} ms: step {applied} → {stepped} ({calibration_text})",
        )
    if p99_ms >= NO_RAISE_FRACTION * target_ms:
        return TpotGuard(
            applied,
            "no-raise",
            f"TPOT p99 {p99_ms:.0f} ms within 10% of target {target_ms} ms: no raise past {applied} "
            f"({calibration_text})",
        )
    return None


# --- the decision ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    value: int
    unrounded: float
    recommendation: Recommendation
    guard: TpotGuard | None
    limited_by: str
    text: str
    calibration: RooflineCalibration | None
    slo_bound: int | None = None
    broken: bool = False  # the running limit definitely breaks the TPOT target (_definitely_broken)


def _calibrated_bound(
    rules: TuningRules,
    roofline: DecodeRoofline,
    fit: RooflineCalibration,
    target_s: float,
    context_tokens: float,
    mix: PrefillMix | None,
) -> int:
    """The largest batch whose calibrated TPOT p99 meets `target_s` at this context and mix."""
    model = fit.apply(roofline)
    if mix is None:
        return model.max_batch_for_tpot(target_s, context_tokens)
    return model.max_batch_for_tpot_quantile(target_s, context_tokens, mix, TPOT_QUANTILE)


def _target(
    rules: TuningRules,
    roofline: DecodeRoofline,
    kv_pool_bytes: float,
    context_tokens: float,
    observation: Observation | None,
    applied: int | None,
    calibration: Sequence[CalibrationPoint],
    settled: bool = False,
) -> _Target:
    fit, calibration_text = (None, "")
    calibrated_cap: int | None = None
    mix = current_mix(observation, calibration, rules.max_num_batched_tokens, roofline)
    if rules.tpot_p99_target_ms is not None:
        fit, calibration_text = calibrate(roofline, calibration, rules.max_num_batched_tokens)
        if note := _floor_note(observation, roofline):
            calibration_text = f"{calibration_text}; {note}"
        if fit is not None:
            calibrated_cap = _calibrated_bound(
                rules, roofline, fit, rules.tpot_p99_target_ms / 1e3, context_tokens, mix
            )
    rec = _knee(rules, roofline, kv_pool_bytes, context_tokens)
    if rules.goal == "SLO":
        return _slo_target(
            rules,
            roofline,
            kv_pool_bytes,
            context_tokens,
            observation,
            applied,
            rec,
            fit,
            calibration_text,
            mix,
            settled,
        )
    estimated = None
    if calibrated_cap is None and rules.tpot_p99_target_ms is not None:
        estimated = _estimated_bound(
            rules, roofline, observation, rules.tpot_p99_target_ms / 1e3, context_tokens, mix
        )
        if estimated is not None:
            calibrated_cap = estimated[0]
            calibration_text = f"estimated from {estimated[1]}; {calibration_text}"
    guard = _guard(rules, observation, applied, calibrated_cap, calibration_text, settled)
    if guard is not None and estimated is not None and guard.source != "broken":
        guard = replace(guard, source="estimated")
    value, limited_by, text = rec.max_num_seqs, str(rec.limited_by), rec.explain()
    unrounded = rec.unrounded
    if guard is not None:
        capped = max(rules.min_max_num_seqs, round_down_under_cap(guard.cap, rules.granularity))
        if capped < value:
            value, limited_by = capped, "tpot-target"
            unrounded = min(unrounded, float(max(rules.min_max_num_seqs, guard.cap)))
            text += f" → {value} ({guard.text})"
            if capped == rules.min_max_num_seqs and guard.cap < capped:
                text += f" (minimum bound {rules.min_max_num_seqs})"
    broken = guard is not None and guard.source == "broken"
    return _Target(value, unrounded, rec, guard, limited_by, text, fit, calibrated_cap, broken)


def _definitely_broken(
    rules: TuningRules,
    observation: Observation | None,
    applied: int | None,
    calibration_text: str,
    settled: bool,
) -> tuple[int, str] | None:
    """The observed TPOT p99 is past the target by more than any bucket reads (see
    DEFINITE_BREAK_FACTOR): a step down from what runs, and why; None otherwise, and while the
    window still holds steps of a limit before the running one (`settled`: a whole window since it
    settled) — a step from a p99 of the last limit's tail would compound."""
    p99 = observation.tpot_p99_s.value if observation is not None else None
    if rules.tpot_p99_target_ms is None or applied is None or p99 is None or not settled:
        return None
    if p99 * 1e3 <= DEFINITE_BREAK_FACTOR * rules.tpot_p99_target_ms:
        return None
    stepped = round_down_under_cap(
        max(1, applied * STEP_DOWN_NUMERATOR // STEP_DOWN_DENOMINATOR), rules.granularity
    )
    return stepped, (
        f"TPOT p99 {p99 * 1e3:.0f} ms, over {DEFINITE_BREAK_FACTOR:g}× the target "
        f"{rules.tpot_p99_target_ms} ms whatever the model says: step {applied} → {stepped} "
        f"({calibration_text})"
    )


def _slo_bound(
    rules: TuningRules,
    roofline: DecodeRoofline,
    context_tokens: float,
    observation: Observation | None,
    applied: int | None,
    knee: Recommendation,
    fit: RooflineCalibration | None,
    calibration_text: str,
    mix: PrefillMix | None,
    settled: bool = False,
) -> SloBound:
    """Goal SLO's bound: calibrated, the largest batch whose modelled TPOT p99 stays under the
    target less the margin; uncalibrated, start at the knee, then move towards the bound one window's
    mean TPOT implies — climbing to at most the larger of the knee and ×3/2 per settled window while
    it has headroom, the limit binds and TTFT p99 meets its target; stepping down straight to it."""
    assert rules.tpot_p99_target_ms is not None
    assert rules.slo_tpot_s is not None
    goal_ms = rules.slo_tpot_s * 1e3
    target_ms = rules.tpot_p99_target_ms
    if (broken := _definitely_broken(rules, observation, applied, calibration_text, settled)) is not None:
        return SloBound(broken[0], "broken", broken[1], urgent=True)
    if fit is not None:
        cap = _calibrated_bound(rules, roofline, fit, rules.slo_tpot_s, context_tokens, mix)
        urgent = applied is not None and _breaks(fit.apply(roofline), applied, target_ms, context_tokens, mix)
        return SloBound(
            cap, "calibrated", f"TPOT p99 ≤ {goal_ms:g} ms allows {cap} ({calibration_text})", urgent
        )
    if applied is None or observation is None:
        return SloBound(knee.max_num_seqs, "start", f"start at the knee ({calibration_text})")
    running = observation.running.value
    binds = running is not None and running / max(1, observation.pods) >= SLO_CLIMB_MIN_FILL * applied
    ttft = observation.ttft_p99_s.value
    # an unknown TTFT does not meet its target: no climb on it
    ttft_over = rules.ttft_p99_target_ms is not None and (
        ttft is None or ttft * 1e3 > rules.ttft_p99_target_ms
    )
    point = calibration_point(observation, roofline)
    if point is None or point.tpot_mean_s is None:
        p99 = observation.tpot_p99_s.value
        if p99 is None:
            return SloBound(applied, "hold", f"no TPOT observed: stay at {applied} ({calibration_text})")
        if p99 * 1e3 > target_ms:
            stepped = max(1, applied * STEP_DOWN_NUMERATOR // STEP_DOWN_DENOMINATOR)
            return SloBound(
                stepped,
                "step-down",
                f"TPOT p99 {p99 * 1e3:.0f} ms > target {target_ms} ms: step {applied} → {stepped} "
                f"({calibration_text})",
                # over the target itself, not only its margin — read over a whole window at this
                # limit (a third of one after a live change is mostly the limit before)
                urgent=settled,
            )
        unused = "no TPOT mean observed" if observation.tpot_mean_s.value is None else "no usable TPOT mean"
        return SloBound(applied, "hold", f"{unused}: stay at {applied} ({calibration_text})")
    # One window fixes one parameter; `_one_point_bound` takes the reading that errs on the safe
    # side of the batch it observed, to climb on (in bounded steps) and to step down on.
    estimate, one = _one_point_bound(rules, roofline, point, rules.slo_tpot_s, context_tokens, mix)
    seen = f"TPOT mean {point.tpot_mean_s * 1e3:.1f} ms at {point.batch:.0f} running"
    if estimate < applied:
        return SloBound(
            estimate,
            "step-down",
            f"{seen}: p99 ≤ {goal_ms:g} ms allows about {estimate}: step {applied} → {estimate} ({calibration_text})",
            _breaks(one.apply(roofline), applied, target_ms, context_tokens, mix),
        )
    if estimate > applied and binds and not ttft_over:
        step = round_up(applied * SLO_CLIMB_NUMERATOR / SLO_CLIMB_DENOMINATOR, rules.granularity)
        climbed = min(estimate, max(knee.max_num_seqs, step))
        return SloBound(
            climbed,
            "climb",
            f"{seen}: p99 ≤ {goal_ms:g} ms allows about {estimate}: climb {applied} → {climbed} ({calibration_text})",
        )
    why = (
        f"{seen}: p99 ≤ {goal_ms:g} ms allows about {estimate}"
        if estimate <= applied
        else "the limit does not bind"
        if not binds
        else "TTFT p99 over its target"
        if ttft is not None
        else f"TTFT p99 unknown ({observation.ttft_p99_s.reason})"
    )
    return SloBound(applied, "hold", f"{why}: stay at {applied} ({calibration_text})")


def _breaks(
    model: DecodeRoofline, batch: int, target_ms: int, context: float, mix: PrefillMix | None
) -> bool:
    """Whether `model` puts the TPOT p99 at `batch` over the target itself."""
    p99 = (
        model.tpot_s(batch, context)
        if mix is None
        else model.tpot_with_prefill_s(batch, context, mix, TPOT_QUANTILE)
    )
    return p99 * 1e3 > target_ms


def _estimated_bound(
    rules: TuningRules,
    roofline: DecodeRoofline,
    observation: Observation | None,
    target_s: float,
    context_tokens: float,
    mix: PrefillMix | None,
) -> tuple[int, str] | None:
    """Before calibration: the TPOT cap one window's exact mean TPOT implies (`_one_point_bound`),
    rather than the p99 Prometheus interpolates within 25 ms-wide buckets (a p99 of 26 ms reads
    ~49 ms); None when the window has no mean."""
    point = calibration_point(observation, roofline) if observation is not None else None
    if point is None or point.tpot_mean_s is None:
        return None
    cap, _ = _one_point_bound(rules, roofline, point, target_s, context_tokens, mix)
    return cap, f"TPOT mean {point.tpot_mean_s * 1e3:.1f} ms at {point.batch:.0f} running"


def _one_point_bound(
    rules: TuningRules,
    roofline: DecodeRoofline,
    point: CalibrationPoint,
    target_s: float,
    context_tokens: float,
    mix: PrefillMix | None,
) -> tuple[int, RooflineCalibration]:
    """The TPOT cap one window's exact mean TPOT implies, and the fit it rests on. One window fixes
    one parameter, so the observed time above the roofline is read both ways: all lost bandwidth
    (no overhead) over-predicts TPOT above the observed batch, all per-step overhead (peak
    bandwidth) over-predicts it below. The smaller cap is the one that errs on the safe side."""
    assert point.tpot_mean_s is not None
    unit = unit_roofline(roofline)
    window_mix = point.mix(rules.max_num_batched_tokens)
    modelled = (
        unit.tpot_with_prefill_s(point.batch, point.context_tokens, window_mix)
        if window_mix is not None
        else unit.tpot_s(point.batch, point.context_tokens)
    )
    as_bandwidth = RooflineCalibration(0.0, min(1.0, modelled / point.tpot_mean_s), 0.0, 1, "overhead")
    as_overhead = RooflineCalibration(max(0.0, point.tpot_mean_s - modelled), 1.0, 0.0, 1, "efficiency")
    bounds = [
        (_calibrated_bound(rules, roofline, fit, target_s, context_tokens, mix), fit)
        for fit in (as_bandwidth, as_overhead)
    ]
    return min(bounds, key=lambda bound: bound[0])


def _slo_target(
    rules: TuningRules,
    roofline: DecodeRoofline,
    kv_pool_bytes: float,
    context_tokens: float,
    observation: Observation | None,
    applied: int | None,
    knee: Recommendation,
    fit: RooflineCalibration | None,
    calibration_text: str,
    mix: PrefillMix | None,
    settled: bool = False,
) -> _Target:
    """Goal SLO: the SLO bound itself (past the knee when the target allows), under the KV pool
    and the spec's bounds. While traffic shifts to longer contexts the bound is taken at the
    window's last third: the stricter one, where traffic is going (one rollout, not two)."""
    recent = observation.recent_avg_context_tokens.value if observation is not None else None
    bound_context = (
        max(context_tokens, recent) if recent is not None and recent >= MIN_CONTEXT_TOKENS else context_tokens
    )
    bound = _slo_bound(
        rules, roofline, bound_context, observation, applied, knee, fit, calibration_text, mix, settled
    )
    # finer than the granularity at small batches: the bound sits on a TPOT cliff (a hold stays
    # where it is: rounded down, "stay at 100" would read as a decrease to 96 on no evidence)
    value = bound.cap if bound.source == "hold" else round_down_fine(bound.cap, rules.granularity)
    # A bound that only trims the margin is an optimisation (dead band and trend checks apply); one
    # the current limit breaks the target by is a safety decrease, like the Knee goal's TPOT guard.
    limited_by = "knee" if bound.source == "start" else "tpot-target" if bound.urgent else "slo-target"
    text = f"{knee.explain()}; goal SLO: {bound.text}"
    if knee.capacity_batch < value:
        value, limited_by = round_down_under_cap(knee.capacity_batch, rules.granularity), "kv-capacity"
        text += f" → {value} (KV pool holds {knee.capacity_batch})"
    if value < rules.min_max_num_seqs:
        # a limit that breaks the target goes down to the minimum as urgently as to the bound
        value, limited_by = (
            rules.min_max_num_seqs,
            "tpot-target" if limited_by == "tpot-target" else "minimum",
        )
        text += f" → {value} (minimum bound)"
    elif value > rules.max_max_num_seqs:
        value, limited_by = rules.max_max_num_seqs, "maximum"
        text += f" → {value} (maximum bound)"
    else:
        text += f" → {value}"
    slo_cap = bound.cap if bound.source == "calibrated" else None
    return _Target(value, float(value), knee, None, limited_by, text, fit, slo_cap, bound.source == "broken")


def _knee(
    rules: TuningRules, roofline: DecodeRoofline, kv_pool_bytes: float, context_tokens: float
) -> Recommendation:
    """The planner's recommendation under the spec's factor, bounds and granularity."""
    return recommend(
        roofline,
        context_tokens,
        knee_factor=rules.knee_factor,
        kv_pool_bytes=kv_pool_bytes,
        minimum=rules.min_max_num_seqs,
        maximum=rules.max_max_num_seqs,
        granularity=rules.granularity,
    )


def _origin(
    rules: TuningRules, roofline: DecodeRoofline, kv_pool_bytes: float, applied: Applied, current: int
) -> float:
    """The dead band's origin: the unrounded target behind the applied setting. A creation at the
    initial context's knee counts from that knee unrounded, as a tuned setting does: rounding up to
    the granularity (59.6 → 64 at 2,048 tokens) would otherwise put traffic a few percent off the
    guess (54 at 2,300 tokens) outside the band, and replace a guess that was right."""
    if applied.origin is not None and applied.tuned_to_traffic:
        return applied.origin
    created = applied.rollouts[-1] if applied.rollouts else None
    if created is not None and created.from_value is None and created.to_value == current:
        guess = _knee(rules, roofline, kv_pool_bytes, float(rules.initial_context_length))
        if guess.max_num_seqs == current and guess.unrounded > 0:
            return guess.unrounded
    return applied.origin if applied.origin is not None else float(current)


def _guard_breaks(rules: TuningRules, guard: TpotGuard | None, current: int) -> bool:
    """Goal Knee: whether the TPOT guard says the current limit breaks the target by more than the
    dead band — a safety decrease, whether the guard or the (lower) knee sets the new value. A
    limit within the band of the guard's cap is left to the hysteresis: the uncalibrated estimate
    over-predicts TPOT at larger batches, and a cap one sequence under the limit is no emergency."""
    if rules.goal != "Knee" or guard is None or guard.cap >= current:
        return False
    return guard.source in ("step-down", "broken") or _moves_past(rules, float(guard.cap), float(current))


def _further(origin: float, batch: float, lately: float) -> bool:
    """Whether `lately` lies past `batch` on the way from `origin` (the same direction, further)."""
    return (batch - origin) * (lately - batch) > 0


def _moves_past(rules: TuningRules, value: float, reference: float) -> bool:
    """Whether `value` lies outside the dead band around `reference` (unrounded targets)."""
    return abs(value - reference) / reference * 100 > rules.dead_band_percent


def remember_target(
    rules: TuningRules, recent: Sequence[RecentTarget], sampled_at: datetime, batch: float
) -> tuple[RecentTarget, ...]:
    """The recent targets after this evaluation: a newer reading is added (one reused from the
    observer's cache is the same reading and adds nothing), those too old to matter for the hold
    time are dropped, and the closest-spaced ones are thinned out past `RECENT_TARGETS_KEPT`."""
    kept = list(recent)
    if not kept or sampled_at > kept[-1].time:
        kept.append(RecentTarget(sampled_at, batch))
    horizon = sampled_at - timedelta(seconds=rules.hold_for_s + rules.recent_target_spacing_s)
    kept = [t for t in kept if t.time >= horizon]
    while len(kept) > RECENT_TARGETS_KEPT:  # keep the oldest and the newest; drop the most crowded
        crowded = min(range(1, len(kept) - 1), key=lambda i: kept[i].time - kept[i - 1].time)
        del kept[crowded]
    return tuple(kept)


def _earlier_target(
    rules: TuningRules, recent: Sequence[RecentTarget], sampled_at: datetime
) -> RecentTarget | None:
    """The newest remembered target at least one evaluation interval older than `sampled_at`."""
    limit = sampled_at - timedelta(seconds=rules.evaluation_interval_s)
    return next((t for t in reversed(recent) if t.time <= limit), None)


def _outside_since(
    rules: TuningRules, recent: Sequence[RecentTarget], origin: float, batch: float, sampled_at: datetime
) -> datetime:
    """Since when every target (back from `batch`, now) lay outside the dead band around `origin`
    on the same side as `batch`."""
    rising = batch > origin
    since = sampled_at
    for earlier in reversed(recent):
        if earlier.time >= sampled_at:
            continue
        if not _moves_past(rules, earlier.batch, origin) or (earlier.batch > origin) != rising:
            break
        since = earlier.time
    return since


def _max_tokens(value: int, context_tokens: float) -> int:
    return value * math.ceil(context_tokens)


def decide(
    rules: TuningRules,
    roofline: DecodeRoofline,
    kv_pool_bytes: float,
    observation: Observation | None,
    applied: Applied,
    calibration: Sequence[CalibrationPoint],
    now: datetime,
    user_max_num_seqs: int | None = None,
    recent_targets: Sequence[RecentTarget] = (),
) -> Decision:
    """The batch limit to run now and why. `observation` is None when there is nothing to observe
    yet (no engine pods); `user_max_num_seqs` is a `--max-num-seqs` in the spec's own args, which
    only Recommend mode honours (Auto replaces it, Pinned uses `pinned_max_num_seqs`);
    `recent_targets` are what earlier evaluations' `Decision.recent_targets` said to remember."""
    ctx_reading = observation.avg_context_tokens if observation is not None else None
    observed_ctx = ctx_reading.value if ctx_reading is not None else None
    if observed_ctx is not None and observed_ctx < MIN_CONTEXT_TOKENS:
        ctx_reading = Reading.unavailable(
            f"average context is {observed_ctx:g} tokens, under {MIN_CONTEXT_TOKENS:g}"
        )
        observed_ctx = None
    current = applied.max_num_seqs

    # What the math says, when it can say anything: for status, and for Auto's target.
    target: _Target | None = None
    context: float | None = None
    source: Literal["observed", "initial"] | None = None
    if observed_ctx is not None:
        context, source = observed_ctx, "observed"
    elif current is None:
        context, source = float(rules.initial_context_length), "initial"
    if context is not None:
        # a whole window of the running limit's own steps (the definite-break check reads its p99)
        whole_window = (
            applied.settled_since is not None
            and observation is not None
            and observation.sampled_at - applied.settled_since >= timedelta(seconds=rules.window_s)
        )
        target = _target(
            rules, roofline, kv_pool_bytes, context, observation, current, calibration, whole_window
        )
    remembered = tuple(recent_targets)
    if target is not None and source == "observed" and observation is not None:
        remembered = remember_target(rules, remembered, observation.sampled_at, target.unrounded)

    bandwidth = (
        assess(
            observation,
            roofline,
            max_num_batched_tokens=rules.max_num_batched_tokens,
            ttft_target_s=rules.ttft_p99_target_ms / 1e3 if rules.ttft_p99_target_ms is not None else None,
            tpot_target_s=rules.tpot_p99_target_ms / 1e3 if rules.tpot_p99_target_ms is not None else None,
        )
        if observation is not None
        else None
    )

    def decision(
        action: Action, value: int, reason: str, hold: Hold | None = None, *, safety: bool = False
    ) -> Decision:
        if action != "roll" and applied.max_tokens is not None:
            max_tokens = applied.max_tokens
        else:  # a new value, or none recorded: the cap that goes with it (never a zero)
            max_tokens = _max_tokens(value, context if context is not None else rules.initial_context_length)
        return Decision(
            action=action,
            value=value,
            max_tokens=max_tokens,
            reason=reason,
            hold=hold,
            recommended=target.value if target else None,
            recommendation=target.recommendation if target else None,
            context_tokens=context,
            context_source=source,
            limited_by=target.limited_by if target else None,
            guard=target.guard if target else None,
            calibration=target.calibration if target else None,
            target=target.unrounded if target else None,
            recent_targets=remembered,
            slo_bound=target.slo_bound if target else None,
            bandwidth=bandwidth,
            broken=current if target is not None and target.broken else None,
            safety=safety,
        )

    explain = target.text if target is not None else ""

    # --- modes that never chase the knee ---------------------------------------------------------
    if rules.mode == "Pinned":
        assert rules.pinned_max_num_seqs is not None
        pinned = rules.pinned_max_num_seqs
        note = f"; the knee says {target.value} ({explain})" if target is not None else ""
        if current != pinned:
            return decision("roll", pinned, f"max-num-seqs {_from(current)}→{pinned}: pinned by spec{note}")
        return decision("hold", pinned, f"pinned at {pinned}{note}", "pinned")

    if rules.mode == "Recommend":
        wanted = user_max_num_seqs if user_max_num_seqs is not None else current
        if wanted is None:  # first creation without a user value: start at the recommendation
            assert target is not None
            return decision(
                "roll", target.value, f"max-num-seqs {_from(None)}→{target.value}: initial, {explain}"
            )
        if current != wanted:
            return decision(
                "roll", wanted, f"max-num-seqs {_from(current)}→{wanted}: set in spec.args (Recommend mode)"
            )
        why = f"recommend {target.value}: {explain}" if target is not None else _unobserved(ctx_reading)
        return decision("recommend", wanted, f"{why} — Recommend mode keeps {wanted}", "recommend-mode")

    # --- Auto ------------------------------------------------------------------------------------
    if current is None:
        assert target is not None
        ctx_note = "" if source == "observed" else " (initial context, no traffic seen yet)"
        return decision(
            "roll", target.value, f"max-num-seqs {_from(None)}→{target.value}: {explain}{ctx_note}"
        )

    def hold(kind: Hold, why: str) -> Decision:
        prefix = f"{explain} — " if target is not None else ""
        return decision("hold", current, f"{prefix}holding {current}: {why}", kind)

    if applied.rolling:
        return hold("rollout-in-progress", "rollout in progress")
    if target is None:
        if observation is not None and observation.running.value == 0:
            return decision(
                "hold", current, f"holding {current}: no running sequences to measure", "no-traffic"
            )
        return decision(
            "hold", current, f"holding {current}: {_unobserved(ctx_reading)}", "metrics-unavailable"
        )
    wanted, batch = target.value, target.unrounded
    # A KV-capacity decrease goes at once (it preempts), as does goal SLO's: its bound is taken where
    # traffic is going (the window's last third, when that is the longer context), and every request
    # served meanwhile over the target is lost goodput. A Knee-goal TPOT safety decrease waits for
    # the window to stop shifting: its guard is taken at the window's blend of before and after, and
    # reaching where traffic went costs a second restart.
    at_once = target.limited_by == "kv-capacity" or (
        target.limited_by == "tpot-target" and rules.goal == "SLO"
    )
    goes_now = wanted < current and at_once
    safety = goes_now or (wanted < current and _guard_breaks(rules, target.guard, current))
    if applied.draining and not safety:  # the settled window waits for them (a safety decrease: no)
        drain = applied.draining
        return hold(
            "rollout-in-progress", f"rollout in progress: {drain} old pod{'s' * (drain > 1)} draining"
        )
    settled = applied.settled_since
    # by the observation's time, not the clock's: a cached reading of a slow Prometheus may be a
    # window that still holds the pods before the rollout
    observed_at = observation.sampled_at if observation is not None else now
    settling = settled is not None and observed_at < settled + timedelta(seconds=rules.window_s)
    # Under Live actuation such a decrease after a retune does not wait out the whole settle window:
    # the pods keep running, and the next step can follow once the window's last third is all after
    # the change (an engine just created is left its window: its first requests arrive together).
    follows_live = (
        rules.live_ceiling is not None
        and goes_now
        and applied.last_retune is not None
        and settled is not None
        and observed_at >= settled + timedelta(seconds=rules.window_s / 3)
    )
    if settling and not follows_live:
        assert settled is not None
        until = settled + timedelta(seconds=rules.window_s)
        return hold("settling", f"metrics window settling after the rollout until {_z(until, now)}")
    if wanted == current:
        return decision("hold", current, f"{explain} — at target", "at-target")
    origin = _origin(rules, roofline, kv_pool_bytes, applied, current)
    change_percent = abs(batch - origin) / origin * 100
    if not safety and not _moves_past(rules, batch, origin):
        return hold(
            "dead-band",
            f"{batch:.1f} is within the {rules.dead_band_percent}% dead band of {origin:.1f} "
            f"({change_percent:.0f}%)",
        )
    recent_ctx = observation.recent_avg_context_tokens.value if observation is not None else None
    # the knee of the window's last third: the trend (a decrease that goes at once is not held for it)
    lately = (
        _knee(rules, roofline, kv_pool_bytes, recent_ctx)
        if not goes_now and recent_ctx is not None and recent_ctx >= MIN_CONTEXT_TOKENS
        else None
    )
    if lately is not None and _moves_past(rules, lately.unrounded, target.recommendation.unrounded):
        return hold(
            "unsteady",
            f"traffic is shifting: the window's last third says avg ctx {lately.context_tokens:.0f} tok → "
            f"{lately.max_num_seqs}",
        )
    sampled_at = observation.sampled_at if observation is not None else now
    if not safety:
        earlier = _earlier_target(rules, recent_targets, sampled_at)
        if earlier is not None and _moves_past(rules, batch, earlier.batch):
            return hold(
                "unsteady",
                f"the recommendation is still moving ({earlier.batch:.1f} at {_z(earlier.time, now)} → "
                f"{batch:.1f})",
            )
        since = _outside_since(rules, recent_targets, origin, batch, sampled_at)
        # a setting from the initial context (or pinned, or the user's) is a guess: replaced once the
        # change has held a third of a window (its last third); one tuned to traffic only for a
        # change that also stays: half a window more than the window takes in the shift — or, for a
        # cap set in place (Live, under the startup ceiling), the window alone: it restarts nothing,
        # and one that turns out wrong is undone in place too (the diurnal trace's caps lagged each
        # hour-sixth by 7.5 minutes)
        live_cap = rules.live_ceiling is not None and wanted <= rules.live_ceiling
        if not applied.tuned_to_traffic:
            hold_s = rules.window_s // 3
        else:
            hold_s = rules.window_s if live_cap else rules.hold_for_s
        if sampled_at - since < timedelta(seconds=hold_s):
            until = since + timedelta(seconds=hold_s)
            return hold(
                "unsteady",
                f"{wanted} must hold outside the dead band of {origin:.1f} for {hold_s}s "
                f"(outside since {_z(since, now)}; until {_z(until, now)})",
            )
    if rules.goal == "Knee" and lately is not None and _further(origin, batch, lately.unrounded):
        # Within the band of the window's blend, the last third is where traffic is going: a roll
        # goes there when that rounds to another value (a step to 8,192 tokens read at 7,534 would
        # land on 24, not 16, and the band would then hold it). Goal SLO takes its bound there already.
        going = _target(
            rules,
            roofline,
            kv_pool_bytes,
            lately.context_tokens,
            observation,
            current,
            calibration,
            whole_window,
        )
        if going.value != wanted:
            target, context = going, lately.context_tokens
            explain = f"{going.text} (the window's last third)"
            wanted, batch = going.value, going.unrounded
            if wanted == current:
                return decision("hold", current, f"{explain} — at target", "at-target")
    if rules.live_ceiling is not None and wanted <= rules.live_ceiling:
        # a cap set in place: no restart for the cooldown or the budget to bound
        return decision("roll", wanted, f"max-num-seqs {current}→{wanted}: {explain} (live)", safety=safety)
    last = applied.last_restart
    if last is not None and now < last.time + timedelta(seconds=rules.cooldown_s):
        return hold("cooldown", f"cooldown until {_z(last.time + timedelta(seconds=rules.cooldown_s), now)}")
    recent = rollouts_in_last_hour(applied.rollouts, now)
    if recent >= rules.max_rollouts_per_hour:
        return hold(
            "rollout-budget",
            f"{recent} rollouts in the last hour (maxRolloutsPerHour {rules.max_rollouts_per_hour})",
        )
    return decision("roll", wanted, f"max-num-seqs {current}→{wanted}: {explain}", safety=safety)


def _from(value: int | None) -> str:
    return "∅" if value is None else str(value)


def _unobserved(reading: Reading | None) -> str:
    if reading is not None and reading.reason:
        return f"metrics unavailable ({reading.reason})"
    return "metrics unavailable (no engine pods observed)"


def rollouts_in_last_hour(rollouts: Sequence[Rollout], now: datetime) -> int:
    """Retunes that restarted the engines (not the creation, not a live cap) within the hour before
    `now`."""
    return sum(1 for r in rollouts if r.from_value is not None and not r.live and now - HOUR < r.time <= now)


def record(
    applied: Applied, decision: Decision, now: datetime, keep: int = HISTORY_KEPT, *, live: bool = False
) -> tuple[Rollout, ...]:
    """The rollout history after acting on `decision` (unchanged unless it rolls); `live`: it is set
    in place, restarting nothing."""
    if not decision.rolls:
        return applied.rollouts
    # the dead band's origin: the unrounded target, when the roll went to it from observed traffic
    # (not the initial context, a pinned value or the user's own)
    tuned = decision.value == decision.recommended and decision.context_source == "observed"
    target = decision.target if tuned else None
    entry = Rollout(now, applied.max_num_seqs, decision.value, decision.reason, target, live)
    return (*applied.rollouts, entry)[-keep:]
