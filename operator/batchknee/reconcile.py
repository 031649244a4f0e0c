"""One idempotent reconcile of one LLMServing: observe → decide → act → status.

Level-based: everything is read again each time, and the cluster is the source of truth — the
applied batch limit is parsed from the Deployment, the rollout record is the Deployment's
annotation written in the same apply as the change. Running it twice, or after a restart at any
moment, converges to the same objects and never rolls twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from batchknee.api.models import (
    API_VERSION,
    KIND,
    CalibrationSample,
    CalibrationStatus,
    Condition,
    ConditionStatus,
    Engine,
    HistoryEntry,
    LLMServing,
    LLMServingStatus,
    ObservedMetrics,
)
from batchknee.api.resolve import (
    SpecError,
    calibration_fingerprint,
    kv_pool_bytes,
    observation_target,
    parse_llmserving,
    resolve_roofline,
    tuning_rules,
)
from batchknee.core.engine_args import int_flag
from batchknee.core.observation import Observation
from batchknee.core.policy import (
    Applied,
    CalibrationPoint,
    Decision,
    add_calibration_point,
    calibration_point,
    decide,
    record,
)
from batchknee.ports import ApplyError, EventType, KubernetesPort, Observer
from batchknee.render import DeploymentState, Desired, RenderDefaults, deployment_state, render

log = logging.getLogger(__name__)


@dataclass
class Ports:
    kube: KubernetesPort
    observer: Observer
    defaults: RenderDefaults = field(default_factory=RenderDefaults)
    # Why an LLMServing may not name this spec.prometheus.url (None: it may); the admin's allow-list.
    prometheus_url_refusal: Callable[[str], str | None] = lambda url: None


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did (for the operator's own metrics and logs)."""

    namespace: str
    name: str
    found: bool = True
    decision: Decision | None = None
    status: LLMServingStatus | None = None
    status_written: bool = False
    error: str | None = None
    deleting: bool = False  # metadata.deletionTimestamp was set: nothing was done
    events: tuple[str, ...] = ()
    tpot_target_ms: int | None = None  # spec.tuning.tpotP99TargetMilliseconds (for the dashboard)


def reconcile(namespace: str, name: str, ports: Ports, now: datetime) -> Outcome:
    raw = ports.kube.get_llmserving(namespace, name)
    if raw is None:
        return Outcome(namespace, name, found=False)
    if (raw.get("metadata") or {}).get("deletionTimestamp"):
        return Outcome(namespace, name, deleting=True)  # never roll what is being deleted
    return _Reconcile(raw, ports, now).run()


# --- status pieces ---------------------------------------------------------------------------------


def _old_status(raw: dict[str, Any]) -> LLMServingStatus:
    """The stored status, or an empty one if it does not parse (it is ours: rebuild it)."""
    try:
        return LLMServingStatus.model_validate(raw.get("status") or {})
    except ValidationError:
        log.warning("%s/%s: stored status does not parse; rebuilding it", *_key(raw))
        return LLMServingStatus()


def _key(raw: dict[str, Any]) -> tuple[str, str]:
    meta = raw.get("metadata", {})
    return meta.get("namespace", "default"), meta.get("name", "")


class _Conditions:
    """Conditions keyed by type, keeping lastTransitionTime when the status does not change."""

    ORDER = ("Ready", "MetricsAvailable", "Progressing", "Degraded")

    def __init__(self, old: Sequence[Condition], generation: int | None, now: datetime) -> None:
        self.old: dict[str, Condition] = {c.type: c for c in old}
        self.new: dict[str, Condition] = {}
        self.generation = generation
        self.now = now

    def set(self, kind: str, status: ConditionStatus, reason: str, message: str) -> None:
        previous = self.old.get(kind)
        since = (
            previous.last_transition_time if previous is not None and previous.status == status else self.now
        )
        self.new[kind] = Condition.model_validate(
            {
                "type": kind,
                "status": status,
                "observedGeneration": self.generation,
                "lastTransitionTime": since,
                "reason": reason,
                "message": message[:32768],
            }
        )

    def keep_old(self) -> None:
        for kind, condition in self.old.items():
            self.new.setdefault(kind, condition)

    def turned(self, kind: str, status: str, *, or_message: bool = False) -> bool:
        """Did `kind` just become `status` (or, with `or_message`, change its message while in it)?"""
        new, old = self.new.get(kind), self.old.get(kind)
        if new is None or new.status != status:
            return False
        return old is None or old.status != status or (or_message and old.message != new.message)

    def result(self) -> list[Condition]:
        return [self.new[k] for k in self.ORDER if k in self.new]


def _ms(value: float | None) -> float | None:
    return round(value * 1e3, 1) if value is not None else None


def _pct(value: float | None) -> float | None:
    return round(value * 100, 1) if value is not None else None


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def observed_metrics(observation: Observation) -> ObservedMetrics:
    ctx = observation.avg_context_tokens.value
    return ObservedMetrics(
        avg_context_length=round(ctx) if ctx is not None else None,
        tpot_p99_milliseconds=_ms(observation.tpot_p99_s.value),
        ttft_p99_milliseconds=_ms(observation.ttft_p99_s.value),
        running=_round(observation.running.value),
        waiting=_round(observation.waiting.value),
        kv_cache_usage_percent=_pct(observation.kv_cache_usage.value),
        prefix_hit_percent=_pct(observation.prefix_hit_ratio.value),
        pods=observation.pods,
        sampled_at=observation.sampled_at,
    )


def retune_message(decision: Decision, before: int | None, observation: Observation | None) -> str:
    """An Event message naming the inputs, e.g.
    `max-num-seqs 256→64: avg ctx 2050 tokens, B_knee 59.6, TPOT p99 31 ms`."""
    rec = decision.recommendation
    if rec is None or decision.context_tokens is None:
        return decision.reason
    head = f"max-num-seqs {'∅' if before is None else before}→{decision.value}"
    parts = [f"avg ctx {decision.context_tokens:.0f} tokens"]
    if decision.context_source == "initial":
        parts[0] += " (initial, no traffic yet)"
    parts.append(f"B_knee {rec.b_knee:.1f}")
    if observation is not None and observation.tpot_p99_s.value is not None:
        parts.append(f"TPOT p99 {observation.tpot_p99_s.value * 1e3:.0f} ms")
    if decision.limited_by not in (None, "knee"):
        parts.append(f"limited by {decision.limited_by}")
    return f"{head}: {', '.join(parts)}"


def _moved(before: int | None, after: int, dead_band_percent: int) -> bool:
    """A change worth telling about: new, or outside the dead band."""
    return before is None or (before != after and abs(after - before) / before * 100 >= dead_band_percent)


# --- the reconcile ---------------------------------------------------------------------------------


class _Reconcile:
    def __init__(self, raw: dict[str, Any], ports: Ports, now: datetime) -> None:
        self.raw = raw
        self.ports = ports
        self.now = now
        self.namespace, self.name = _key(raw)
        self.generation: int | None = raw.get("metadata", {}).get("generation")
        self.old = _old_status(raw)
        self.conditions = _Conditions(self.old.conditions, self.generation, now)
        self.events: list[str] = []
        self.settling = False

    def involved(self) -> dict[str, Any]:
        meta = self.raw.get("metadata", {})
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
        }

    def event(self, event_type: EventType, reason: str, message: str) -> None:
        try:
            self.ports.kube.emit_event(self.involved(), event_type, reason, message, self.now)
            self.events.append(reason)
        except Exception as error:  # an event is worth a log line, not a failed reconcile
            log.warning("%s/%s: could not record event %s: %s", self.namespace, self.name, reason, error)

    def write(self, status: LLMServingStatus) -> bool:
        new = status.dump()
        if new == (self.raw.get("status") or {}):
            return False
        self.ports.kube.patch_status(self.namespace, self.name, new)
        return True

    # -- invalid spec: say so, change nothing else ----------------------------------------------------

    def invalid(self, error: SpecError, reason: str = "InvalidSpec") -> Outcome:
        applied = self.old.max_num_seqs
        self.conditions.set("Degraded", "True", reason, f"{error}")
        self.conditions.keep_old()
        holding = f"; holding {applied}" if applied is not None else ""
        status = self.old.model_copy(
            update={
                "observed_generation": self.generation,
                "conditions": self.conditions.result(),
                "reason": f"invalid spec — {error}{holding}",
                "action": "hold",
                "hold_reason": "invalid-spec",
            }
        )
        if self.conditions.turned("Degraded", "True", or_message=True):
            self.event("Warning", reason, str(error))
        written = self.write(status)
        return Outcome(self.namespace, self.name, status=status, status_written=written, error=str(error))

    # -- the normal path ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            obj = parse_llmserving(self.raw)
            roofline = resolve_roofline(obj.spec)
            pool = kv_pool_bytes(obj.spec, roofline)
            rules = tuning_rules(obj.spec)
        except SpecError as error:
            return self.invalid(error)
        refusal = obj.spec.prometheus.url and self.ports.prometheus_url_refusal(obj.spec.prometheus.url)
        if refusal:
            return self.invalid(SpecError("spec.prometheus.url", refusal), "PrometheusURLNotAllowed")

        state = deployment_state(self.ports.kube.get_deployment(self.namespace, self.name))
        settled_since = self.settled_since(state)
        observation = self.observe(obj, state)
        fingerprint = calibration_fingerprint(obj.spec)
        calibration = self.calibration_points(fingerprint)
        applied = Applied(
            max_num_seqs=state.max_num_seqs if state else None,
            max_tokens=state.max_tokens if state else None,
            rolling=state.rolling if state else False,
            settled_since=settled_since,
            rollouts=state.rollouts if state else (),
        )
        user_flag = "--max-num-seqs" if obj.spec.engine == Engine.VLLM else "--max_batch_size"
        decision = decide(
            rules,
            roofline,
            pool,
            observation,
            applied,
            calibration,
            self.now,
            user_max_num_seqs=int_flag(obj.spec.args, user_flag),
            previous_recommended=self.old.recommended_max_num_seqs,
        )

        rollouts = record(applied, decision, self.now)
        desired = Desired(decision.value, decision.max_tokens, rollouts)
        apply_error: str | None = None
        try:
            for item in render(obj, desired, self.ports.defaults):
                self.ports.kube.apply(item)
        except ApplyError as error:
            apply_error = str(error)
        rolled = decision.rolls and apply_error is None
        if not rolled:
            rollouts = applied.rollouts

        if rolled:
            before = applied.max_num_seqs
            reason = "Deployed" if before is None else ("Pinned" if rules.mode == "Pinned" else "Retuned")
            self.event("Normal", reason, retune_message(decision, before, observation))
        elif (
            rules.mode == "Recommend"
            and decision.recommended is not None
            and decision.context_source == "observed"
            and _moved(self.old.recommended_max_num_seqs, decision.recommended, rules.dead_band_percent)
        ):
            self.event(
                "Normal",
                "Recommended",
                f"recommend max-num-seqs {decision.recommended} (running {decision.value}): "
                f"{decision.recommendation.explain() if decision.recommendation else decision.reason}",
            )

        # calibration samples: settled observations only, at most one per window
        settled = not applied.rolling and (
            settled_since is None or self.now >= settled_since + timedelta(seconds=rules.window_s)
        )
        spec_changed = self.old.observed_generation != self.generation
        if settled and observation is not None and not decision.rolls and not spec_changed:
            point = calibration_point(observation)
            last_time = calibration[-1].time if calibration else None
            if point is not None and (
                last_time is None or self.now - last_time >= timedelta(seconds=rules.window_s)
            ):
                calibration = add_calibration_point(calibration, point)

        # Right after a rollout the new pods have few samples in the window: expected, not an alarm.
        self.settling = (
            rolled
            or applied.rolling
            or (settled_since is not None and self.now < settled_since + timedelta(seconds=rules.window_s))
        )
        self.set_conditions(obj, state, observation, decision, rolled, apply_error)
        status = self.status(
            obj, state, observation, decision, rolled, rollouts, settled_since, calibration, fingerprint
        )
        if apply_error is not None:
            status = status.model_copy(
                update={
                    "reason": f"apply failed — {apply_error}; holding {applied.max_num_seqs}",
                    "action": "hold",
                }
            )
        written = self.write(status)
        return Outcome(
            self.namespace,
            self.name,
            decision=decision,
            status=status,
            status_written=written,
            error=apply_error,
            events=tuple(self.events),
            tpot_target_ms=obj.spec.tuning.tpot_p99_target_milliseconds,
        )

    def settled_since(self, state: DeploymentState | None) -> datetime | None:
        """When the current pods were first seen all updated and available: after any rollout (a
        retune's or a spec change's), and conservatively now when nothing recorded it."""
        if state is None or state.rolling:
            return None
        last = state.rollouts[-1].time if state.rollouts else None
        previous = self.old.rollout_complete_time
        if previous is not None and (last is None or previous >= last):
            return previous
        return self.now

    def observe(self, obj: LLMServing, state: DeploymentState | None) -> Observation | None:
        if state is None:
            return None
        if state.replicas == 0:
            return Observation.unavailable(self.now, "scaled to zero replicas")
        try:
            return self.ports.observer.observation(observation_target(obj), self.now)
        except Exception as error:  # the observer must not break reconcile: this is "unavailable"
            log.warning("%s/%s: observation failed: %s", self.namespace, self.name, error)
            return Observation.unavailable(self.now, f"observation failed: {error}")

    def calibration_points(self, fingerprint: str) -> tuple[CalibrationPoint, ...]:
        calibration = self.old.calibration
        if calibration is None or calibration.fingerprint != fingerprint:
            return ()
        return tuple(
            CalibrationPoint(s.time, s.batch, float(s.context_length), s.tpot_p99_milliseconds / 1e3)
            for s in calibration.samples
        )

    def set_conditions(
        self,
        obj: LLMServing,
        state: DeploymentState | None,
        observation: Observation | None,
        decision: Decision,
        rolled: bool,
        apply_error: str | None,
    ) -> None:
        c = self.conditions
        # Ready: the engines are rolled out and available.
        if state is None:
            c.set("Ready", "False", "Deploying", "the engine Deployment is being created")
        elif state.replicas == 0:
            c.set("Ready", "False", "ScaledToZero", "spec.replicas is 0")
        elif state.rolling or rolled:
            c.set("Ready", "False", "RolloutInProgress", state.message if state.rolling else "rolling out")
        else:
            c.set("Ready", "True", "EngineAvailable", state.message)

        # MetricsAvailable: can the knee be computed from what the engines report?
        if observation is None:
            c.set("MetricsAvailable", "Unknown", "NoEnginePods", "no engine pods to observe yet")
        elif observation.avg_context_tokens.available:
            c.set("MetricsAvailable", "True", "Observed", f"{observation.pods} pods reporting")
        elif observation.running.value == 0:
            c.set("MetricsAvailable", "True", "NoTraffic", "engines report no running sequences")
        elif self.settling and observation.pods > 0:  # the pods report, only not enough yet
            c.set(
                "MetricsAvailable",
                "Unknown",
                "Settling",
                f"new pods settling after a rollout: {observation.avg_context_tokens.reason}",
            )
        else:
            c.set(
                "MetricsAvailable",
                "False",
                "MetricsUnavailable",
                f"{observation.avg_context_tokens.reason}; holding the last good setting",
            )

        # Progressing: a rollout of the engine pods is under way.
        if rolled:
            c.set("Progressing", "True", "Retuning", decision.reason)
        elif state is not None and state.rolling:
            c.set("Progressing", "True", "RolloutInProgress", state.message)
        else:
            c.set(
                "Progressing", "False", "RolloutComplete", state.message if state else "nothing to roll out"
            )

        # Degraded: something needs a human.
        if apply_error is not None:
            c.set("Degraded", "True", "ApplyFailed", apply_error)
        elif state is not None and state.stalled:
            c.set("Degraded", "True", "RolloutStalled", state.message)
        else:
            c.set("Degraded", "False", "AsExpected", "")

        if c.turned("Degraded", "True", or_message=True):
            reason = c.new["Degraded"].reason
            self.event("Warning", reason, c.new["Degraded"].message)
        if c.turned("MetricsAvailable", "False") and c.old.get("MetricsAvailable") is not None:
            self.event("Warning", "MetricsUnavailable", c.new["MetricsAvailable"].message)

    def status(
        self,
        obj: LLMServing,
        state: DeploymentState | None,
        observation: Observation | None,
        decision: Decision,
        rolled: bool,
        rollouts: Sequence[Any],
        settled_since: datetime | None,
        calibration: Sequence[CalibrationPoint],
        fingerprint: str,
    ) -> LLMServingStatus:
        old = self.old
        usable = observation is not None and observation.avg_context_tokens.available
        rec = decision.recommendation
        applied_value = decision.value if rolled else (state.max_num_seqs if state else None)
        fit = decision.calibration
        calibration_status = CalibrationStatus(
            fingerprint=fingerprint,
            samples=[
                CalibrationSample(
                    time=p.time,
                    batch=round(p.batch, 2),
                    context_length=round(p.context_tokens),
                    tpot_p99_milliseconds=round(p.tpot_p99_s * 1e3, 3),
                )
                for p in calibration
            ],
            overhead_milliseconds=round(fit.overhead_s * 1e3, 3) if fit else None,
            bandwidth_efficiency_percent=round(fit.bandwidth_efficiency * 100, 1) if fit else None,
        )
        return LLMServingStatus(
            observed_generation=self.generation,
            conditions=self.conditions.result(),
            observed=observed_metrics(observation) if usable and observation is not None else old.observed,
            b_knee=round(rec.b_knee, 1) if rec is not None else old.b_knee,
            max_num_seqs=applied_value,
            recommended_max_num_seqs=decision.recommended
            if decision.recommended is not None
            else old.recommended_max_num_seqs,
            max_tokens=(decision.max_tokens if rolled else (state.max_tokens if state else None))
            if obj.spec.engine == Engine.TensorRTLLM
            else None,
            limited_by=decision.limited_by or old.limited_by,
            action="roll" if rolled else ("hold" if decision.action == "roll" else decision.action),
            hold_reason=decision.hold,
            reason=decision.reason,
            last_rollout_time=rollouts[-1].time if rollouts else None,
            rollout_complete_time=settled_since,
            history=[
                HistoryEntry.model_validate(
                    {"time": r.time, "from": r.from_value, "to": r.to_value, "reason": r.reason[:2048]}
                )
                for r in rollouts
            ],
            calibration=calibration_status,
        )
