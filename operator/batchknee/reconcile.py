"""One idempotent reconcile of one LLMServing: observe → decide → act → status.

Level-based: everything is read again each time, and the cluster is the source of truth — the
applied batch limit is parsed from the Deployment, the rollout record is the Deployment's
annotation written in the same apply as the change. Running it twice, or after a restart at any
moment, converges to the same objects and never rolls twice.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import ValidationError

from batchknee.adopt import (
    ALREADY_TARGETED,
    KNOB_FLAG,
    Target,
    adopt,
    env_patch,
    tuned_workload,
    tuner,
    unobservable,
    wiring_argument,
)
from batchknee.api.admission import AdmissionRules, Forbidden, check_admission
from batchknee.api.models import (
    API_VERSION,
    KIND,
    QUARANTINE_KEPT,
    TARGET_ENV_VAR,
    Actuation,
    CalibrationSample,
    CalibrationStatus,
    Condition,
    ConditionStatus,
    Engine,
    HistoryEntry,
    LLMServing,
    LLMServingStatus,
    ObservedMetrics,
    QuarantineEntry,
    TargetRef,
    WindowFigures,
    format_timestamp,
)
from batchknee.api.models import RecentTarget as RecentTargetStatus
from batchknee.api.resolve import (
    SpecError,
    calibration_fingerprint,
    kv_pool_bytes,
    observation_target,
    parse_llmserving,
    resolve_roofline,
    trtllm_kv_cache,
    tuning_rules,
)
from batchknee.applied import in_place, new_pod_template, recorded_template, stamp, template_hash
from batchknee.core.bandwidth import BandwidthAssessment
from batchknee.core.engine_args import int_flag
from batchknee.core.observation import Observation
from batchknee.core.policy import (
    DEFINITE_BREAK_FACTOR,
    HISTORY_KEPT,
    Applied,
    CalibrationPoint,
    Decision,
    Hold,
    RecentTarget,
    Rollout,
    TuningRules,
    add_calibration_point,
    calibration_due,
    calibration_point,
    decide,
    record,
)
from batchknee.core.roofline import DecodeRoofline
from batchknee.core.spread import phase, same_slot
from batchknee.core.verify import Check, Figures, verify
from batchknee.pacing import Place, RolloutPacer
from batchknee.ports import (
    ApplyConflict,
    ApplyError,
    EngineRuntime,
    EventType,
    KubernetesPort,
    LiveCap,
    LiveCapError,
    ObjectGone,
    Observer,
    TransientApiError,
)
from batchknee.render import (
    ROLLOUTS_ANNOTATION,
    DeploymentState,
    Desired,
    RenderDefaults,
    as_int,
    config_map,
    controlled_by,
    crash_looping,
    deployment,
    deployment_state,
    draining,
    engine_config_selector,
    overridden_args,
    ready_since,
    render,
    selector_labels,
    stale_engine_configs,
)

log = logging.getLogger(__name__)
ROLLBACK = "rollback"
REVERT = "revert"
QUARANTINE_S = 3600  # a failed value is not retried at that context for an hour (or the cooldown)
# A time read back (the status, the rollout record) up to this far ahead of the clock is another
# operator replica's clock running ahead; further ahead it is damage (an edit, a node's clock a day
# off), and it is dropped or taken as now (it froze retuning until then).
CLOCK_SKEW = timedelta(minutes=1)
OTHER_SETUP = "the engine, model, GPU, image or engine args changed since: nothing to compare"

T = TypeVar("T")
# A reconcile's independent requests (the reads of its objects, the applies that do not depend on
# each other, one call per engine pod) go out together: it holds its worker for the slowest of
# them, not their sum, so a few workers keep the apiserver busy and an engine pod that does not
# answer costs one timeout, however many replicas there are. Shared by every worker; nothing run
# here submits to it again (it could wait on itself). The engines' calls (a tenant's pods, which
# may not answer before their timeout) have threads of their own, so wedged pods never hold those
# the apiserver's requests need; and one evaluation holds at most a quarter of them (a namespace's
# Live evaluations run two at a time: its wedged pods hold half at most, never all).
FAN_OUT_THREADS = 16
FAN_OUT = ThreadPoolExecutor(FAN_OUT_THREADS, thread_name_prefix="fan-out")
ENGINE_CALLS = ThreadPoolExecutor(FAN_OUT_THREADS, thread_name_prefix="engine-call")
ENGINE_CALLS_PER_EVALUATION = FAN_OUT_THREADS // 4


def together(
    calls: Sequence[Callable[[], T]], pool: ThreadPoolExecutor = FAN_OUT, at_most: int | None = None
) -> list[T]:
    """Each call's result, in order, the calls made at once on `pool` (`at_most` in flight: the next
    goes as one ends); the first error in order is raised once every call has ended."""
    if len(calls) <= 1:
        return [call() for call in calls]
    limit = len(calls) if at_most is None else max(1, at_most)
    futures: list[Future[T]] = []
    in_flight: set[Future[T]] = set()
    for call in calls:
        if len(in_flight) >= limit:
            in_flight = wait(in_flight, return_when=FIRST_COMPLETED).not_done
        future = pool.submit(call)
        futures.append(future)
        in_flight.add(future)
    wait(futures)  # every call, so none still runs after an error is raised
    return [future.result() for future in futures]


def on_engines(calls: Sequence[Callable[[], T]]) -> list[T]:
    """One evaluation's calls to its engine pods, on the engines' own threads, a quarter at most."""
    return together(calls, ENGINE_CALLS, ENGINE_CALLS_PER_EVALUATION)


def _read_cap(runtime: EngineRuntime, address: str) -> LiveCap | LiveCapError | None:
    try:
        return runtime.read_cap(address)
    except LiveCapError as error:
        return error


def _set_cap(runtime: EngineRuntime, address: str, api: str, value: int) -> LiveCapError | None:
    try:
        runtime.set_cap(address, api, value)
    except LiveCapError as error:
        return error
    return None


WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet"})  # the objects whose write rolls the engine pods


def _refusal(apply: Callable[[dict[str, Any]], None], item: dict[str, Any]) -> str | None:
    """Why the apiserver refused `item` (None: written); a conflict is raised (decide again)."""
    try:
        apply(item)
    except ApplyConflict:
        raise
    except ApplyError as error:
        return str(error)
    return None


def apply_stages(objects: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The order of the applies: ConfigMaps first (the pods mount them: a pod that finds none waits
    in ContainerCreating), then the rest together. The workload's pods come two controllers later
    (its ReplicaSet, then theirs), long after the Service and budget sent with it."""
    first = [o for o in objects if o["kind"] == "ConfigMap"]
    rest = [o for o in objects if o["kind"] != "ConfigMap"]
    return [stage for stage in (first, rest) if stage]


class RefusedSpecs:
    """Refusals of specs, by the object's uid, generation and labels (what the parse reads besides
    the spec is fixed per uid): a spec refused for its size (a 1.7-MB extraLlmApiOptions takes
    0.6 s to walk and validate) is not validated again at every evaluation, on the worker every
    tenant shares, until it changes. The most recent `limit` are kept (a few hundred bytes each)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._refused: OrderedDict[tuple[str, int, str], tuple[str, str]] = OrderedDict()

    def parse(self, raw: dict[str, Any]) -> LLMServing:
        meta = raw.get("metadata") or {}
        uid, generation, labels = meta.get("uid"), meta.get("generation"), meta.get("labels")
        if not (isinstance(uid, str) and isinstance(generation, int)):
            return parse_llmserving(raw)
        key = (uid, generation, repr(sorted(labels.items()) if isinstance(labels, dict) else labels))
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
        if refused is not None:
            raise SpecError(*refused)
        try:
            return parse_llmserving(raw)
        except SpecError as error:
            with self._lock:
                self._refused[key] = (error.field, error.message)
                while len(self._refused) > self.limit:
                    self._refused.popitem(last=False)
            raise


@dataclass
class Ports:
    kube: KubernetesPort
    observer: Observer
    defaults: RenderDefaults = field(default_factory=RenderDefaults)
    admission: AdmissionRules = field(default_factory=AdmissionRules)
    runtime: EngineRuntime | None = None  # the engines' runtime endpoints (actuation: Live)
    # Why an LLMServing may not name this spec.prometheus.url (None: it may); the admin's allow-list.
    prometheus_url_refusal: Callable[[str], str | None] = lambda url: None
    refused_specs: RefusedSpecs = field(default_factory=RefusedSpecs)
    # template changes of the operator's own roll this many engines at a time (default: no limit)
    pacer: RolloutPacer = field(default_factory=RolloutPacer)


# A place's apply not seen in the Deployment read back after this long did not land (or the
# watch is far behind): a Deployment rolled out with as many pods available as before then frees
# it, so no place leaks.
PLACE_APPLY_SEEN_WITHIN = timedelta(seconds=60)
OWN_TEMPLATE = "the operator's new pod template (an operator upgrade, or a changed operator setting)"
WITH_TEMPLATE = "the operator's new pod template rolls with this safety decrease"


@dataclass(frozen=True)
class Paced:
    """The Progressing condition for a new pod template not of a batch-limit change (see `pace`)."""

    status: ConditionStatus
    reason: str
    message: str
    admitted: bool = False  # rolls with a place from the pacer
    took_place: bool = False  # that place was taken now


def queued(paced: Paced | None) -> bool:
    return paced is not None and paced.status == "False"


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
    conflict: bool = False  # a write met a changed object: nothing applied, decide again
    ready_replicas: int | None = None  # engine pods ready now (capacity for replica autoscalers)
    rolled: bool = False  # a new batch limit was written
    tunes: bool = True  # False: an adopted workload it may not write (another LLMServing's, say)


def reconcile(
    namespace: str, name: str, ports: Ports, now: datetime, *, engine_calls: bool = True
) -> Outcome:
    """Converge one LLMServing. When its Deployment changed between the read and the write (another
    operator, a restart that read an older state, a user's edit), the write is refused by its
    resourceVersion precondition and the whole decision is made again once from a fresh read. An
    LLMServing deleted while its reconcile ran (its status write finds none) is gone: not found,
    and nothing else (no error, no retry).

    `engine_calls=False`: this evaluation runs where calls to engine pods must not (the shared
    workers, outside its namespace's Live lane); a spec asking for Live actuation is left for the
    next evaluation, which its spec change has already asked for."""
    outcome = Outcome(namespace, name, found=False)
    for _attempt in range(2):
        raw = ports.kube.get_llmserving(namespace, name)
        if raw is None:
            return Outcome(namespace, name, found=False)
        if (raw.get("metadata") or {}).get("deletionTimestamp"):
            return Outcome(namespace, name, deleting=True)  # never roll what is being deleted
        if not engine_calls and _asks_live(raw):
            log.info(
                "%s/%s: its spec asks for Live actuation since this evaluation was launched on the "
                "shared workers; the next one acts",
                namespace,
                name,
            )
            return Outcome(namespace, name)
        this = _Reconcile(raw, ports, now)
        try:
            outcome = this.run()
        except ObjectGone:
            this.unsent.clear()  # about an object no longer there
            log.debug("%s/%s: deleted while it was reconciled", namespace, name)
            return Outcome(namespace, name, found=False)
        finally:
            this.send_events()  # any a reconcile that stopped before its status write queued
        if not outcome.conflict:
            break
    return outcome


# Busy or failing apiserver answers (409, 429, 5xx), and no answer (a timeout, a connection refused or
# lost), are retried as the adapter allows, and the next evaluation tries again; when every reconcile
# has ended on one for this long it is no passing load spike (an admission webhook that always fails
# or never answers, an apiserver that stays overloaded) and Degraded says so.
API_ERRORS_DEGRADED_AFTER = timedelta(minutes=5)


def report_api_errors(
    namespace: str, name: str, ports: Ports, now: datetime, error: TransientApiError, since: datetime
) -> Outcome:
    """Every reconcile of this object since `since` ended on an apiserver error that the adapter's
    retries did not clear, the last `error`. Once that has lasted API_ERRORS_DEGRADED_AFTER the
    status says so (Degraded, reason ApiErrors, and an Event: the call and its status code, not the
    text of the answer); nothing else is changed, and the first reconcile that goes through sets
    Degraded back."""
    failed = Outcome(namespace, name, error=str(error))
    if now - since < API_ERRORS_DEGRADED_AFTER:
        return failed
    try:
        raw = ports.kube.get_llmserving(namespace, name)
        if raw is None or (raw.get("metadata") or {}).get("deletionTimestamp"):
            return failed
        this = _Reconcile(raw, ports, now)
        try:
            return this.api_errors(error.summary, since)
        except ObjectGone:
            this.unsent.clear()
            return Outcome(namespace, name, found=False)
        finally:
            this.send_events()
    except TransientApiError as still:  # the status write meets the same apiserver
        log.warning("%s/%s: could not report the apiserver errors: %s", namespace, name, still)
        return failed


# --- status pieces ---------------------------------------------------------------------------------


UNPARSABLE = (ValidationError, ValueError, TypeError, RecursionError)


def _old_status(raw: dict[str, Any], now: datetime) -> LLMServingStatus:
    """The stored status; where it does not parse (written by another version of the operator, say,
    then rolled back; or edited by hand), what does: each field, and each entry of a list, that
    parses is kept (a condition of an unknown type must not take the quarantines and the rollout
    history with it), the rest rebuilt."""
    stored = raw.get("status") or {}
    try:
        return _not_ahead(LLMServingStatus.model_validate(stored), now)
    except UNPARSABLE:
        pass
    kept: dict[str, Any] = {}
    for key, value in stored.items() if isinstance(stored, dict) else ():
        entries = [item for item in value if _parses({key: [item]})] if isinstance(value, list) else value
        while isinstance(entries, list) and entries and not _parses({key: entries}):
            entries = entries[1:]  # longer than this version keeps: the oldest go
        if _parses({**kept, key: entries}):
            kept[key] = entries
    log.warning(
        "%s/%s: stored status does not parse in full; kept %d of its %d fields (and their entries "
        "that parse), rebuilding the rest",
        *_key(raw),
        len(kept),
        len(stored) if isinstance(stored, dict) else 0,
    )
    return _not_ahead(LLMServingStatus.model_validate(kept), now)


def _parses(status: dict[str, Any]) -> bool:
    try:
        LLMServingStatus.model_validate(status)
    except UNPARSABLE:
        return False
    return True


def _not_ahead(status: LLMServingStatus, now: datetime) -> LLMServingStatus:
    """The stored status without the times it holds from the future (past `CLOCK_SKEW`): a recent
    target from tomorrow kept any newer one from being remembered, a rollout completed tomorrow kept
    the object settling, a calibration sample from tomorrow outlived the samples' horizon."""
    latest = now + CLOCK_SKEW
    update: dict[str, Any] = {}
    targets = status.recent_targets or []
    if any(t.time > latest for t in targets):
        update["recent_targets"] = [t for t in targets if t.time <= latest] or None
    if status.rollout_complete_time is not None and status.rollout_complete_time > latest:
        update["rollout_complete_time"] = None  # not known: settled from now on
    calibration = status.calibration
    if calibration is not None and any(s.time > latest for s in calibration.samples):
        samples = [s for s in calibration.samples if s.time <= latest]
        update["calibration"] = calibration.model_copy(update={"samples": samples})
    return status.model_copy(update=update) if update else status


def _key(raw: dict[str, Any]) -> tuple[str, str]:
    meta = raw.get("metadata", {})
    return meta.get("namespace", "default"), meta.get("name", "")


class _Conditions:
    """Conditions keyed by type, keeping lastTransitionTime when the status does not change."""

    ORDER = ("Ready", "MetricsAvailable", "Progressing", "Degraded", "ArgsOverridden", "Wired", "Actuation")

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


def _finite(value: float | None) -> float | None:
    """`value` unless it is None, NaN or infinite (nothing non-finite reaches status: json.dumps
    would write it as `Infinity`, which is no JSON)."""
    return value if value is not None and math.isfinite(value) else None


def _ms(value: float | None) -> float | None:
    scaled = _finite(value * 1e3) if value is not None else None
    return round(scaled, 1) if scaled is not None else None


def _pct(value: float | None) -> float | None:
    scaled = _finite(value * 100) if value is not None else None
    return round(scaled, 1) if scaled is not None else None


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def observed_metrics(
    observation: Observation, bandwidth: BandwidthAssessment | None = None
) -> ObservedMetrics:
    ctx = observation.avg_context_tokens.value
    bw = bandwidth if bandwidth is not None and bandwidth.fraction is not None else None
    read = observation.read_bytes_per_s_per_gpu.value
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
        bandwidth_utilization_percent=_pct(bw.fraction) if bw is not None else None,
        bandwidth_source=("Engine" if bw.source == "engine" else "DCGM") if bw is not None else None,
        read_gigabytes_per_second=round(read / 1e9, 1) if read is not None else None,
        diagnosis=bw.diagnosis if bw is not None else None,
        diagnosis_reason=bw.reason if bw is not None else None,
    )


def _ready_address(pod: dict[str, Any]) -> str | None:
    """`ip:port` of a ready, running engine pod (its `http` container port, else 8000)."""
    status = pod.get("status") or {}
    ready = status.get("phase") == "Running" and any(  # a pod ended (Failed) may keep Ready=True
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if not ready or not ip or pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    port = 8000
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("ports") or []:
            if entry.get("name") == "http" and entry.get("containerPort"):
                port = int(entry["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"{host}:{port}"


def _pod_places(pods: list[dict[str, Any]]) -> dict[str, tuple[str | None, str | None]]:
    """Each pod's uid and ready address, by name."""
    return {pod["metadata"]["name"]: (pod["metadata"].get("uid"), _ready_address(pod)) for pod in pods}


def window_figures(figures: Figures) -> WindowFigures | None:
    """The window's figures for status; None when one it needs is not finite (no check compares
    against it), and an optional one that is not finite is left out."""
    context = _finite(figures.context_tokens)
    tokens = _finite(figures.tokens_per_s_per_pod)
    tpot_p99 = _finite(figures.tpot_p99_s * 1e3)
    preemptions = _finite(figures.preemptions_per_s)
    if context is None or tokens is None or tpot_p99 is None or preemptions is None:
        return None
    tpot_mean = _finite(figures.tpot_mean_s * 1e3) if figures.tpot_mean_s is not None else None
    prompt = _finite(figures.prompt_tokens)
    return WindowFigures(
        context_tokens=round(context),
        tokens_per_second_per_pod=round(tokens, 1),
        tpot_p99_milliseconds=round(tpot_p99, 2),
        preemptions_per_second=round(preemptions, 3),
        tpot_mean_milliseconds=round(tpot_mean, 2) if tpot_mean is not None else None,
        prompt_tokens=round(prompt) if prompt is not None else None,
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


def rollout_event(rollout: Rollout, mode: str) -> tuple[EventType, str]:
    """The Event type and reason that announce a rollout."""
    if rollout.reason.startswith(ROLLBACK):
        return "Warning", "RolledBack"
    if rollout.reason.startswith(REVERT):
        return "Warning", "Reverted"
    if rollout.from_value is None:
        return "Normal", "Deployed"
    return "Normal", "Pinned" if mode == "Pinned" else "Retuned"


# How long after a rollout an operator that finds it missing from the status announces it: the one
# that wrote it stopped before its status write (and maybe before its Event). Within the apiserver's
# Event TTL (an hour by default) an Event already sent keeps its name, so none is recorded twice; a
# rollout older than this is history that a lost status forgot, not news.
ANNOUNCED_LATE_WITHIN = timedelta(minutes=30)


def unannounced(history: Sequence[Rollout], stored: Sequence[HistoryEntry], now: datetime) -> Rollout | None:
    """The Deployment's last rollout when it is recent and the stored status does not hold it."""
    if not history or now - history[-1].time > ANNOUNCED_LATE_WITHIN:
        return None
    last = history[-1]
    known = {(format_timestamp(h.time), h.to) for h in stored}
    return None if (format_timestamp(last.time), last.to_value) in known else last


# What a steady hold changes every interval: the window's figures, the knee and the reason line
# that quote them, and the recent targets (which matter once a target leaves the dead band, and
# that evaluation is written: its hold reason changes).
STATUS_FIGURES = frozenset({"observed", "bKnee", "reason", "recentTargets"})


# The holds of a fleet at its targets: nothing is pending, so its figures may wait for the window.
STEADY_HOLDS = ("at-target", "dead-band")


# Observed fields whose change is news, not drift: who reports, and the bandwidth verdict.
OBSERVED_NEWS = ("pods", "bandwidthSource", "diagnosis")


def figures_only(old: dict[str, Any], new: dict[str, Any], refresh_s: float, offset_s: float = 0.0) -> bool:
    """Whether `new` differs from the stored status `old` by its figures' values alone (the same
    figures, pods and bandwidth verdict), sampled in the same refresh slot as the stored ones: a
    write that only refreshes numbers. Each status write costs the apiserver about 15 ms of CPU
    and every watcher an event; a fleet holding steady at a 30 s interval would write every object
    every interval.

    The slots are `refresh_s` long and start at `offset_s` (mod `refresh_s`), so an object's figures
    are written once a slot, on its first evaluation in a new one. An offset of its own per object
    spreads a fleet's writes evenly over the slot: waiting for the stored figures to be `refresh_s`
    old instead kept the fleet in step with the startup that first wrote them (half a minute of
    every minute with no writes, then the apiserver answering a burst in 0.5 s)."""
    if any(old.get(key) != new.get(key) for key in old.keys() | new.keys() if key not in STATUS_FIGURES):
        return False
    before, after = old.get("observed") or {}, new.get("observed") or {}
    if not before.get("sampledAt") or not after.get("sampledAt") or before.keys() != after.keys():
        return False  # a figure appeared or went away
    if any(before.get(key) != after.get(key) for key in OBSERVED_NEWS):
        return False
    try:
        earlier, later = (datetime.fromisoformat(str(figures["sampledAt"])) for figures in (before, after))
    except ValueError:
        return False
    return same_slot(earlier, later, refresh_s, offset_s)


def refresh_offset_s(namespace: str, name: str, refresh_s: float) -> float:
    """Where an object's refresh slots start: its own point of the slot, unrelated to where its
    evaluations fall in their interval (tied to those, a fleet's writes would bunch again)."""
    return phase(namespace, name, "status") * refresh_s


def _moved(before: int | None, after: int, dead_band_percent: int) -> bool:
    """A change worth telling about: new, or outside the dead band."""
    return before is None or (before != after and abs(after - before) / before * 100 >= dead_band_percent)


# --- the reconcile ---------------------------------------------------------------------------------


def _asks_live(raw: dict[str, Any]) -> bool:
    tuning = (raw.get("spec") or {}).get("tuning") or {}
    return isinstance(tuning, dict) and tuning.get("actuation") == Actuation.Live.value


class _Reconcile:
    def __init__(self, raw: dict[str, Any], ports: Ports, now: datetime) -> None:
        self.raw = raw
        self.ports = ports
        self.now = now
        self.namespace, self.name = _key(raw)
        self.generation: int | None = raw.get("metadata", {}).get("generation")
        self.old = _old_status(raw, now)
        self.conditions = _Conditions(self.old.conditions, self.generation, now)
        self.events: list[str] = []  # the reasons of the Events sent
        # queued, sent with the status write: (type, reason, message, the Event's name or None)
        self.unsent: list[tuple[EventType, str, str, str | None]] = []
        self.settling = False

    def involved(self) -> dict[str, Any]:
        meta = self.raw.get("metadata", {})
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion")},
        }

    def event(self, event_type: EventType, reason: str, message: str, name: str | None = None) -> None:
        """Queue an Event: it goes out at once with the status write that ends the reconcile (or
        after it, if the reconcile stops before one: `send_events`). A named one is recorded once."""
        self.unsent.append((event_type, reason, message, name))

    def announce(self, rollout: Rollout, mode: str, message: str) -> None:
        """The Event of a rollout, named after it: the operator that wrote it and one that takes
        over after a crash before the status said so (`unannounced`) record one Event between them."""
        uid = self.raw.get("metadata", {}).get("uid")
        key = f"{uid}/{format_timestamp(rollout.time)}/{rollout.to_value}"
        name = f"{self.name}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        self.event(*rollout_event(rollout, mode), message, name)

    def send_events(self) -> None:
        """The queued Events, in order."""
        unsent, self.unsent = self.unsent, []
        for event_type, reason, message, name in unsent:
            try:
                self.ports.kube.emit_event(self.involved(), event_type, reason, message, self.now, name)
                self.events.append(reason)
            except Exception as error:  # an event is worth a log line, not a failed reconcile
                log.warning("%s/%s: could not record event %s: %s", self.namespace, self.name, reason, error)

    def write(self, status: LLMServingStatus, refresh_s: float | None = None) -> bool:
        """Write the status when it changed. With `refresh_s` (a steady hold), a change of its
        figures alone waits for this object's next refresh slot (`figures_only`)."""
        # validated again: model_copy(update=...) skips validation, and every text must be bounded
        new = LLMServingStatus.model_validate(status.dump()).dump()
        old = self.raw.get("status") or {}
        if new == old or (
            refresh_s is not None
            and figures_only(
                old, new, refresh_s, offset_s=refresh_offset_s(self.namespace, self.name, refresh_s)
            )
        ):
            self.send_events()
            return False
        together([lambda: self.ports.kube.patch_status(self.namespace, self.name, new), self.send_events])
        return True

    # -- something stops the reconcile (invalid spec, name conflict, apiserver errors): say so ---------

    def degraded(
        self,
        reason: str,
        message: str,
        update: dict[str, Any],
        *,
        error: str | None = None,
        or_message: bool = True,
    ) -> Outcome:
        """Something stops this reconcile: say so in Degraded (one Warning Event when it turns), keep
        the other conditions and the rest of the old status with `update`, and change nothing else."""
        self.conditions.set("Degraded", "True", reason, message)
        self.conditions.keep_old()
        status = self.old.model_copy(update={**update, "conditions": self.conditions.result()})
        if self.conditions.turned("Degraded", "True", or_message=or_message):
            self.event("Warning", reason, message)
        written = self.write(status)
        return Outcome(
            self.namespace, self.name, status=status, status_written=written, error=error or message
        )

    def invalid(self, error: SpecError, reason: str = "InvalidSpec") -> Outcome:
        applied = self.old.max_num_seqs
        if isinstance(error, Forbidden):
            reason = "Forbidden"
        holding = f"; holding {applied}" if applied is not None else ""
        forbidden = reason == "Forbidden"
        return self.degraded(
            reason,
            str(error),
            {
                "observed_generation": self.generation,
                "reason": f"{'forbidden' if forbidden else 'invalid'} spec — {error}{holding}",
                "action": "hold",
                "hold_reason": "forbidden" if forbidden else "invalid-spec",
            },
        )

    # -- the normal path ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        self.free_place()  # whatever the spec now says: refused, conflicting, adopted
        # waiting is this evaluation's to say again (pace() does, when it is refused): one that ends
        # early (a refused spec, a name conflict) must not leave it counted as waiting
        self.ports.pacer.not_waiting((self.namespace, self.name))
        if not self.ports.defaults.disruption_budgets:
            self.delete_disruption_budget()  # whatever the spec now says: refused, conflicting, adopted
        try:
            obj = self.ports.refused_specs.parse(self.raw)
            check_admission(obj.spec, self.ports.admission)  # Forbidden: nothing is rendered or applied
            roofline = resolve_roofline(obj.spec)
            pool = kv_pool_bytes(obj.spec, roofline)
            rules = tuning_rules(obj.spec)
        except SpecError as error:
            return self.invalid(error)
        refusal = obj.spec.prometheus.url and self.ports.prometheus_url_refusal(obj.spec.prometheus.url)
        if refusal:
            return self.invalid(SpecError("spec.prometheus.url", refusal), "PrometheusURLNotAllowed")

        uid = self.raw.get("metadata", {}).get("uid")
        found: dict[str, Any] | None = None
        read: dict[tuple[str, str], dict[str, Any] | None] = {}  # this reconcile's reads, by kind and name
        target: Target | None = None
        if obj.spec.target_ref is None:
            # the three objects that carry its name, read together (a new object's first reconcile
            # finds none of them in the watches)
            kube, namespace, name = self.ports.kube, self.namespace, self.name
            budgets = self.ports.defaults.disruption_budgets  # off: none rendered, none to read
            found, read["Service", name], read["PodDisruptionBudget", name] = together(
                [
                    lambda: kube.get_deployment(namespace, name),
                    lambda: kube.get_object("Service", namespace, name),
                    lambda: kube.get_object("PodDisruptionBudget", namespace, name) if budgets else None,
                ]
            )
            read["Deployment", name] = found
            # someone else's Deployment of this name is never read as ours (and claim() refuses it)
            state = deployment_state(found if found is not None and controlled_by(found, uid) else None)
            history = state.rollouts if state else ()
            if state is not None and state.rollouts_damage is not None:
                # said once: this evaluation's apply writes the record back from what was read
                # (again only while a paced template holds the Deployment's apply back)
                log.warning(
                    "%s/%s: Deployment annotation %s: %s",
                    self.namespace,
                    self.name,
                    ROLLOUTS_ANNOTATION,
                    state.rollouts_damage,
                )
        else:
            target = self.adopted(obj.spec.target_ref, obj.spec.engine)
            # with a problem the workload is not this LLMServing's: its rollouts, stalls and crashes
            # are not judged here (another LLMServing may tune it); status still shows its pods
            state = target.state if target.problem is None else None
            history = self.recorded_rollouts(state)  # nothing but the one env value is kept on the workload
            if target.problem is not None or not target.wired:
                rules = replace(rules, mode="Recommend")  # report only, write nothing
        live = self.live_pods(obj, state, target)
        if live and state is not None:  # pods that take caps in place, under their startup value
            rules = replace(rules, live_ceiling=state.max_num_seqs)
        settled_since = self.settled_since(state, history)
        if settled_since is not None and history and settled_since >= history[-1].time:
            checked = self.verdicts.setdefault((history[-1].time, history[-1].to_value), {})
            checked["completed"] = checked.get("completed") or settled_since
        # the Deployment's completion is the history's `completed`; the settled window (the check
        # after a change, calibration, the stored settle time, the policy's settling) waits for the
        # pods it replaced to be gone (`draining_pods`). Meanwhile every retune holds but a safety
        # decrease, which settles from when the newest pod serving turned Ready (the rollout's
        # completion, about; not known: from now), no earlier than the last change (a Live cap
        # restarts no pod). Not the history's first sighting of a completion: a rollout that is no
        # batch-limit change (an image edit) has none of its own. An adopted workload's query
        # leaves terminating pods out already (`observe`): nothing to wait for.
        still_draining = self.draining_pods(settled_since) if target is None else []
        settling_from = settled_since
        if still_draining:
            settling_from = min(self.now, ready_since(self.pods) or self.now)
            if history:
                settling_from = max(settling_from, history[-1].time)
            settled_since = None
        shown = state or (target.state if target is not None else None)  # whoever tunes it
        observation = self.observe(obj, shown, target)
        # the image that runs: the default one changes with the operator, an adopted one with its owner
        image = (
            target.image
            if target is not None
            else obj.spec.image or self.ports.defaults.image(obj.spec.engine)
        )
        stored = self.old.calibration.fingerprint if self.old.calibration is not None else None
        # an adopted workload missing for a while (its image unknown) is no other setup
        fingerprint = (
            stored if image is None and stored is not None else calibration_fingerprint(obj.spec, image)
        )
        calibration = self.calibration_points(fingerprint)
        self.forget_other_setup(fingerprint)
        running = state.max_num_seqs if state else None
        if (
            target is None
            and state is not None
            and history
            and (obj.spec.tuning.actuation == Actuation.Live or history[-1].live)
        ):
            # the cap last decided: live, the pods run it under their ceiling; when Live cannot work,
            # or the spec asks for restarts now, rendering it restarts them with it (the fallback) —
            # never at the ceiling, which no decision chose
            running = history[-1].to_value
        applied = Applied(
            max_num_seqs=running,
            max_tokens=state.max_tokens if state else None,
            rolling=state.rolling if state else False,
            settled_since=settling_from,
            draining=len(still_draining),
            rollouts=history,
        )
        user_flag = KNOB_FLAG[obj.spec.engine]
        decision = decide(
            rules,
            roofline,
            pool,
            observation,
            applied,
            calibration,
            self.now,
            user_max_num_seqs=int_flag(obj.spec.args, user_flag),
            recent_targets=tuple(
                RecentTarget(t.time, t.batch) for t in self.old.recent_targets or () if t.batch > 0
            ),
        )

        spec_changed = self.old.observed_generation != self.generation
        # its writer's change: the spec is not the one the Deployment was rendered from (or, on one
        # an older operator rendered, not the one the status last saw)
        rendered_from = state.spec_generation if state is not None and target is None else None
        writers_change = spec_changed if rendered_from is None else rendered_from != self.generation
        own_workload = found if target is None and not writers_change else None
        decision, quarantine = self.rollout_safety(
            obj, state, applied, decision, rules, observation, settled_since, live is not None, own_workload
        )
        quarantine = self.quarantine_broken(decision, rules, quarantine)
        rendered = decision.value
        if live is not None:
            rendered = self.ceiling(obj, state, decision, roofline, pool, rules)
        # a cap set in place under an unchanged ceiling: no restart for a cooldown or budget to count
        set_live = live is not None and state is not None and rendered == state.max_num_seqs
        rollouts = record(applied, decision, self.now, live=set_live)
        desired = Desired(
            rendered,
            decision.max_tokens,
            rollouts,
            state.template_changed_at if state is not None else None,
            state.paced_template if state is not None else None,
        )
        paced: Paced | None = None  # a new pod template not of a batch-limit change: rolling, or waiting
        if target is None:
            objects = render(obj, desired, self.ports.defaults)
            if state is not None and found is not None:
                self.resume_place(state, found)
            new_template = not decision.rolls and new_pod_template(objects[-1], found)
            if new_template and state is not None:
                template = template_hash(objects[-1])
                paced = self.pace(state, rendered, writers_change, template)
                desired = replace(
                    desired,
                    # its time goes with it: a stall from now on is this template's (one during a
                    # rollout still under way is that rollout's too, as before)
                    template_changed_at=self.now
                    if self.last_rollout_completed(history)
                    else desired.template_changed_at,
                    paced_template=template if paced.admitted else desired.paced_template,
                )
                objects = render(obj, desired, self.ports.defaults)
            elif self.carries_template and state is not None:
                # a safety decrease with the operator's new template: one rollout, with a place
                template = template_hash(objects[-1])
                paced = self.pace_with_safety(template)
                desired = replace(
                    desired,
                    # its time is the rollout's own: a stall of it is the template's (rollout_safety)
                    template_changed_at=self.now,
                    paced_template=template if paced.admitted else desired.paced_template,
                )
                objects = render(obj, desired, self.ports.defaults)
            foreign, pending = self.claim(objects, read, uid)
            gone = not foreign and self.recreates(pending) and self.gone(uid)
            if (foreign or gone) and paced is not None and paced.took_place:
                self.ports.pacer.done((self.namespace, self.name))  # nothing rolls: another may
            if foreign:
                return self.name_conflict(foreign)
            if gone:
                return Outcome(self.namespace, self.name, found=False)
            if queued(paced):  # the engines run as they are; the rest (a ConfigMap, say) goes
                pending = [item for item in pending if item["kind"] != "Deployment"]
        else:  # an adopted workload: the one env value, only when it changes and the args use it
            writable = target.problem is None and target.wired
            objects = (
                [env_patch(target, self.namespace, decision.value)] if decision.rolls and writable else []
            )
            pending = objects
        apply_error: str | None = None
        conflict = False
        went_through: list[dict[str, Any]] = []
        try:
            for stage in apply_stages(pending):
                refusals = together(
                    [functools.partial(_refusal, self.ports.kube.apply, item) for item in stage]
                )
                went_through += [
                    item for item, refusal in zip(stage, refusals, strict=True) if refusal is None
                ]
                apply_error = next((refusal for refusal in refusals if refusal is not None), None)
                if apply_error is not None:
                    break  # a later stage needs this one (the pods mount its ConfigMaps)
        except ApplyConflict as error:
            conflict, apply_error = True, str(error)
        # The workload (its pods) went through, or had nothing to write: a Service or budget refused
        # beside it (a quota, a policy) is Degraded, but the pods roll all the same
        workload_written = all(
            any(done is item for done in went_through) for item in pending if item["kind"] in WORKLOAD_KINDS
        )
        if not workload_written and paced is not None and paced.took_place:
            self.ports.pacer.done((self.namespace, self.name))  # nothing rolls: another may
        if conflict:
            # Transient, not Degraded: the Deployment moved after it was read. Nothing more is
            # written from this (stale) decision; reconcile() decides again from a fresh read.
            log.info("%s/%s: %s; deciding again", self.namespace, self.name, apply_error)
            return Outcome(self.namespace, self.name, decision=decision, error=apply_error, conflict=True)
        rolled = decision.rolls and workload_written and bool(objects)
        if (
            apply_error is None
            and target is None
            and obj.spec.engine == Engine.TensorRTLLM
            and not queued(paced)
        ):
            self.prune_engine_configs(obj, desired)
        if live is not None and workload_written:
            enforced = decision.value if rolled else applied.max_num_seqs
            if enforced is not None and state is not None and enforced <= (state.max_num_seqs or 0):
                self.set_live_caps(live, enforced, rolling=state.rolling)
        if not rolled:
            rollouts = applied.rollouts

        self.remember_before(rolled, decision, rollouts, observation)
        missed = unannounced(history, self.old.history, self.now) if target is None else None
        if missed is not None:
            self.announce(missed, rules.mode, missed.reason)
        if rolled:
            corrective = decision.reason.startswith((ROLLBACK, REVERT))
            message = (
                decision.reason if corrective else retune_message(decision, applied.max_num_seqs, observation)
            )
            if self.carries_template and not corrective and not message.endswith(WITH_TEMPLATE):
                message = f"{message}; {WITH_TEMPLATE}"
            self.announce(rollouts[-1], rules.mode, message)
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

        # calibration samples: settled observations only (by their own time: a cached reading may be
        # older than the clock), one per refresh slot (a window long), so a new sample lands in the
        # status write that refreshes the figures
        observed_at = observation.sampled_at if observation is not None else self.now
        settled = (
            not applied.rolling
            and not applied.draining
            and (settled_since is None or observed_at >= settled_since + timedelta(seconds=rules.window_s))
        )
        if settled and observation is not None and not decision.rolls and not spec_changed:
            point = calibration_point(observation, roofline)
            offset_s = refresh_offset_s(self.namespace, self.name, rules.window_s)
            if point is not None and calibration_due(calibration, point, rules.window_s, offset_s):
                calibration = add_calibration_point(calibration, point)

        # Right after a rollout the new pods have few samples in the window: expected, not an alarm.
        self.settling = (
            rolled
            or applied.rolling
            or applied.draining > 0
            or (settled_since is not None and observed_at < settled_since + timedelta(seconds=rules.window_s))
        )
        # A crash-looping container leaves its pod unready, and the Deployment says so: pods are
        # listed only then (a healthy fleet costs no pod LIST per object and interval).
        unready = (
            state is not None
            and state.replicas > 0
            and (state.rolling or state.ready_replicas < state.replicas)
        )
        crashing = crash_looping(self.pods) if unready else []
        self.set_conditions(
            obj, state, observation, decision, rolled, apply_error, crashing, target, shown, paced
        )
        if target is not None:
            self.set_wired(obj.spec.engine, target)
        else:
            self.report_overridden_args(overridden_args(obj, desired))
        status = self.status(
            obj, applied, observation, decision, rolled, rollouts, settled_since, calibration, fingerprint
        )
        status = status.model_copy(update={**self.scale_status(shown, target), "quarantine": quarantine})
        if live is not None:
            status = status.model_copy(
                update={"ceiling_max_num_seqs": rendered if rolled or state is None else state.max_num_seqs}
            )
        if target is not None and rules.mode == "Recommend":
            status = status.model_copy(update={"action": "recommend"})
        if apply_error is not None and not rolled:
            status = status.model_copy(
                update={
                    "reason": f"apply failed — {apply_error}; holding {applied.max_num_seqs}",
                    "action": "hold",
                }
            )
        steady = decision.hold in STEADY_HOLDS and not rolled and apply_error is None
        written = self.write(status, refresh_s=rules.window_s if steady else None)
        return Outcome(
            self.namespace,
            self.name,
            decision=decision,
            status=status,
            status_written=written,
            error=apply_error,
            events=tuple(self.events),
            tpot_target_ms=obj.spec.tuning.tpot_p99_target_milliseconds,
            ready_replicas=state.ready_replicas if state is not None else None,
            rolled=rolled,
            tunes=target is None or target.problem is None,
        )

    # -- rollout safety -------------------------------------------------------------------------------

    def rollout_safety(
        self,
        obj: LLMServing,
        state: DeploymentState | None,
        applied: Applied,
        decision: Decision,
        rules: TuningRules,
        observation: Observation | None,
        settled_since: datetime | None,
        live: bool = False,
        unchanged_spec_workload: dict[str, Any] | None = None,
    ) -> tuple[Decision, list[QuarantineEntry]]:
        """What the math decided, made safe to roll: a rollout whose pods never became Ready is rolled
        back, and a settled change that did worse than before is reverted — either way its value is
        quarantined; a quarantined value is not tried again at that context; a single replica without
        a surge pod is not restarted unless the user accepts the gap."""
        quarantine = [q for q in self.old.quarantine if q.until > self.now and not self.other_setup]
        last = applied.rollouts[-1] if applied.rollouts else None
        until = self.now + timedelta(seconds=max(QUARANTINE_S, rules.cooldown_s))
        # the context a failure is quarantined at (None: none was observed, held at every context)
        context = None if decision.context_tokens is None else round(decision.context_tokens)
        if (
            state is not None
            and state.stalled
            and last is not None
            and last.from_value is not None
            and state.max_num_seqs == last.to_value
            # the controller keeps a stall's condition until the next template makes progress: one
            # stamped before the last rollout speaks of the value that rollout replaced
            and (state.stalled_at is None or state.stalled_at > last.time)
            # a new template since (the spec's image, the operator's upgrade) is what stalled, not
            # the batch limit: rolling the limit back would only flip it at every deadline. One of
            # the same time rolled with it (a safety decrease and the operator's new template): the
            # lower limit is not rolled back to the unsafe one for it either
            and not (
                state.template_changed_at is not None and last.time <= state.template_changed_at <= self.now
            )
            # nor after the limit rolled out whole (an adopted workload's owner upgraded it since: no
            # template time is kept on it), nor a rollback's or revert's (that value ran before)
            and not self.last_rollout_completed(applied.rollouts)
            and not last.reason.startswith((ROLLBACK, REVERT))
            and rules.mode != "Recommend"
        ):
            bad, good = last.to_value, last.from_value
            why = f"pods with max-num-seqs {bad} were not Ready by the progress deadline ({state.message})"
            quarantine.append(
                QuarantineEntry(
                    max_num_seqs=bad,
                    direction="Above" if bad > good else "Below",
                    # a raise at every context: pods that do not start at a larger batch (memory
                    # for its CUDA graphs) fail whatever the traffic; a lowered limit needs less, so
                    # its stall is more likely the node's, and is held off only near this context
                    context_tokens=None if bad > good else context,
                    until=until,
                    reason=why,
                )
            )
            rollback = replace(
                decision,
                action="roll",
                value=good,
                hold=None,
                reason=f"{ROLLBACK} {bad}→{good}: {why}",
                safety=False,
            )
            return rollback, quarantine[-QUARANTINE_KEPT:]
        check = self.check_last_change(state, applied, rules, observation, settled_since)
        if (
            check is not None
            and check.verdict == "Reverted"
            and last is not None
            and last.from_value is not None
        ):
            bad, good = last.to_value, last.from_value
            before = self.verdicts[(last.time, bad)]["before"]
            quarantine.append(
                QuarantineEntry(
                    max_num_seqs=bad,
                    direction="Above" if bad > good else "Below",
                    context_tokens=before.context_tokens if before else context,
                    until=until,
                    reason=check.reason,
                )
            )
            revert = replace(
                decision,
                action="roll",
                value=good,
                hold=None,
                reason=f"{REVERT} {bad}→{good}: {check.reason}",
                safety=False,
            )
            return revert, quarantine[-QUARANTINE_KEPT:]
        if not decision.rolls or applied.max_num_seqs is None:
            return decision, quarantine

        def hold(kind: Hold, why: str) -> Decision:
            return replace(
                decision,
                action="hold",
                value=applied.max_num_seqs or decision.value,
                max_tokens=applied.max_tokens or decision.max_tokens,
                hold=kind,
                reason=f"holding {applied.max_num_seqs}: {why}",
                safety=False,
            )

        seen = decision.context_tokens
        for entry in quarantine:
            failed_at = entry.context_tokens
            band = max(1.0, (failed_at or 0) * rules.dead_band_percent / 100)
            # A raised limit that failed is no better at a longer context (each sequence holds more
            # KV), a lowered one no better at a shorter: the quarantine holds there too, not only
            # within the dead band of the context it failed at. One that failed where no context
            # was seen holds at every context.
            if entry.direction == "Above":
                covered = failed_at is None or (seen is not None and seen >= failed_at - band)
                beyond = decision.value >= entry.max_num_seqs
            else:
                covered = failed_at is None or (seen is not None and seen <= failed_at + band)
                beyond = decision.value <= entry.max_num_seqs
            if beyond and covered:
                where = "an unobserved context" if failed_at is None else f"avg ctx {failed_at} tok"
                return hold(
                    "quarantined",
                    f"{decision.value} would reach the quarantined {entry.max_num_seqs} (failed at "
                    f"{where}, until {format_timestamp(entry.until)})",
                ), quarantine
        rollout = obj.spec.rolling_update
        if (
            obj.spec.target_ref is None
            and not (live and state is not None and decision.value <= (state.max_num_seqs or 0))
            and state is not None
            and state.replicas == 1
            and not rollout.surges
            and not rollout.allow_serving_gap
        ):
            return hold(
                "single-replica",
                f"retuning to {decision.value} would restart the only replica and serve nothing meanwhile; "
                "allow it with spec.rollout.maxSurge: 1 (a spare GPU) or spec.rollout.allowServingGap: true",
            ), quarantine
        if self.operator_template_pending(obj, state, decision, unchanged_spec_workload):
            assert state is not None  # (a template is pending only on a workload found)
            # A safety decrease that restarts the engines does not wait for a free place (the engine
            # preempts, or breaks its TPOT target, meanwhile — for hours on a large fleet): the
            # template rolls with it, in one restart, in a place taken ahead of the waiters
            # (`RolloutPacer.admit_safety`, bounded); a stall of it is the template's. A cap set in
            # place (Live) waits: rolled with the template, it would restart the pods.
            restarts = not (live and decision.value <= (state.max_num_seqs or 0))
            urgent = decision.safety and restarts
            if urgent and self.take_safety_place(obj, state, decision):
                self.carries_template = True
                return replace(decision, reason=f"{decision.reason}; {WITH_TEMPLATE}"), quarantine
            return hold(
                "template-first",
                "the operator's new pod template (an operator upgrade, or a changed operator setting) "
                "rolls out first, alone; the batch limit follows it"
                + (
                    " (this safety decrease too: its namespace holds its share of the places, and of the "
                    f"{self.ports.pacer.at_once} more that safety decreases may take, or those are taken)"
                    if urgent
                    else ""
                ),
            ), quarantine
        return decision, quarantine

    def take_safety_place(self, obj: LLMServing, state: DeploymentState, decision: Decision) -> bool:
        """A place from the pacer for the operator's new template rolling with a safety decrease:
        ahead of the engines that wait, within bounds (`RolloutPacer.admit_safety`)."""
        key = (self.namespace, self.name)
        held = self.ports.pacer.place(key) is not None
        rendered = deployment(obj, Desired(decision.value, decision.max_tokens), self.ports.defaults)
        if not self.ports.pacer.admit_safety(
            key, Place(template_hash(rendered), self.now, state.available_replicas)
        ):
            return False
        self.safety_took_place = not held
        return True

    def operator_template_pending(
        self,
        obj: LLMServing,
        state: DeploymentState | None,
        decision: Decision,
        workload: dict[str, Any] | None,
    ) -> bool:
        """Would the Deployment, rendered at the batch limit it runs, get a new pod template? With
        the spec unchanged (`workload` given only then), that is the operator's own change: it rolls
        out alone, paced, before a retune (one rollout of both would leave a stall no one's) — but
        a safety decrease, which it rolls with (a stall of both is then the template's)."""
        if workload is None or state is None or state.max_num_seqs is None:
            return False
        running = Desired(state.max_num_seqs, state.max_tokens or decision.max_tokens)
        if not new_pod_template(deployment(obj, running, self.ports.defaults), workload):
            return False
        # A batch flag edited by hand (kubectl edit) renders another template too: rendered at the
        # value the operator last wrote into the Deployment, the recorded one is no change of its own
        # (the edit is put back, or retuned, at once — not queued as an operator template)
        written = next((r.to_value for r in reversed(state.rollouts) if not r.live), None)
        if written is None or written == state.max_num_seqs:
            return True
        return new_pod_template(
            deployment(obj, replace(running, max_num_seqs=written), self.ports.defaults), workload
        )

    # -- live caps (spec.tuning.actuation: Live) ----------------------------------------------------

    def live_pods(
        self, obj: LLMServing, state: DeploymentState | None, target: Target | None
    ) -> dict[str, tuple[str, LiveCap]] | None:
        """Live actuation's pods: each ready engine pod's address and live cap. None when the spec
        asks for restarts, or when Live cannot work — then the condition says why and restarts are
        used (never a silent no-op)."""
        if obj.spec.tuning.actuation != Actuation.Live:
            return None
        if target is not None or obj.spec.engine != Engine.VLLM or self.ports.runtime is None:
            why = (
                "spec.targetRef: the operator writes only the env value of an adopted workload"
                if target is not None
                else f"{obj.spec.engine.value} has no runtime batch-cap endpoint"
                if obj.spec.engine != Engine.VLLM
                else "this operator has no client for the engines' runtime endpoints"
            )
            self.conditions.set("Actuation", "False", "LiveUnsupported", f"{why}; retuning by restart")
            return None
        caps: dict[str, tuple[str, LiveCap]] = {}
        missing: list[str] = []
        unread: list[str] = []
        if state is not None and state.replicas > 0:
            ready = [(pod["metadata"]["name"], _ready_address(pod)) for pod in self.pods]
            addresses = [(name, address) for name, address in ready if address is not None]
            runtime = self.ports.runtime
            reads = [functools.partial(_read_cap, runtime, address) for _, address in addresses]
            answers = on_engines(reads)
            for (name, address), answer in zip(addresses, answers, strict=True):
                if isinstance(answer, LiveCapError):
                    log.info("%s/%s: %s: %s", self.namespace, self.name, name, answer)
                    unread.append(f"{name}: {answer}")
                    continue  # not answering now: read and set again next evaluation
                if answer is None:
                    missing.append(name)
                else:
                    caps[name] = (address, answer)
        if missing:
            self.conditions.set(
                "Actuation",
                "False",
                "LiveUnsupported",
                f"pods {', '.join(sorted(missing)[:5])} answer neither /v1/runtime_config nor "
                "/trimtab/set_knobs (an engine build without a runtime cap endpoint); retuning by restart",
            )
            return None
        if unread:  # the cap of the others is set; these are read again at the next evaluation
            self.conditions.set(
                "Actuation",
                "False",
                "LiveCapUnread",
                f"{len(caps)} pods take their batch cap live; could not read {len(unread)}: "
                f"{'; '.join(sorted(unread)[:3])}",
            )
        else:
            self.conditions.set(
                "Actuation",
                "True",
                "Live",
                f"{len(caps)} pods take their batch cap live, below the startup ceiling",
            )
        return caps

    def ceiling(
        self,
        obj: LLMServing,
        state: DeploymentState | None,
        decision: Decision,
        roofline: DecodeRoofline,
        pool: float,
        rules: TuningRules,
    ) -> int:
        """The startup --max-num-seqs under Live actuation: kept while the decided cap fits under it;
        raised by a restart when it does not (the condition says so)."""
        current = state.max_num_seqs if state is not None else None
        if current is not None and decision.value <= current:
            return current
        capacity = int(pool / roofline.kv_bytes_per_seq(rules.initial_context_length)) if pool > 0 else 0
        base = min(rules.max_max_num_seqs, max(capacity // rules.granularity * rules.granularity, 1))
        ceiling = max(base, decision.value)
        if current is not None:
            message = (
                f"max-num-seqs {decision.value} is above the pods' startup ceiling {current}: restarting them "
                f"with a ceiling of {ceiling}"
            )
            self.conditions.set("Actuation", "False", "AboveCeiling", message)
            self.event("Normal", "AboveCeiling", message)
        return ceiling

    def set_live_caps(self, live: dict[str, tuple[str, LiveCap]], value: int, *, rolling: bool) -> None:
        """Level-based: every ready pod whose cap differs (or cannot be read back) is set again."""
        runtime = self.ports.runtime
        assert runtime is not None
        # not those already there, nor an old pod the rollout to a higher ceiling replaces
        due = [
            (name, address, cap)
            for name, (address, cap) in sorted(live.items())
            if cap.cap != value and (cap.ceiling is None or value <= cap.ceiling)
        ]
        below = sorted(
            name for name, (_, cap) in live.items() if cap.ceiling is not None and value > cap.ceiling
        )
        if below and not rolling:  # no rollout replaces them: say so, not a silent Live
            self.conditions.set(
                "Actuation",
                "False",
                "LiveCapRefused",
                f"pods {', '.join(below[:5])} report a startup limit below the cap {value}; their cap is "
                "not set (a pod started with another --max-num-seqs than its Deployment's)",
            )
        elif below and (shown := self.conditions.new.get("Actuation")) is not None and shown.reason == "Live":
            self.conditions.set(
                "Actuation",
                "True",
                "Live",
                f"{len(live) - len(below)} pods take their batch cap live, below the startup ceiling; "
                f"{len(below)} started below {value} wait for the rollout that replaces them",
            )
        if due:
            # The pods again, as stored now, just before their caps are set: one deleted since they
            # were read (Prometheus and the apply came between) may have left its address to another
            # team's pod by now; a cache's list could still show it.
            read, now = _pod_places(self.pods), _pod_places(self.list_pods(fresh=True))
            due = [(name, address, cap) for name, address, cap in due if now.get(name) == read[name]]
        sets = [functools.partial(_set_cap, runtime, address, cap.api, value) for _, address, cap in due]
        answers = on_engines(sets)
        failed = [
            f"{name}: {error}" for (name, _, _), error in zip(due, answers, strict=True) if error is not None
        ]
        if failed:
            self.conditions.set(
                "Actuation",
                "False",
                "LiveCapRefused",
                f"could not set the cap to {value} on {'; '.join(failed[:3])}",
            )

    # -- the check after every change ---------------------------------------------------------------

    @functools.cached_property
    def verdicts(self) -> dict[tuple[datetime, int], dict[str, Any]]:
        """The check's record per change (time, to): before/after figures and the verdict, carried
        over from the stored status history."""
        return {
            (h.time, h.to): {
                "before": h.before,
                "after": h.after,
                "verdict": h.verdict,
                "verdictReason": h.verdict_reason,
                "completed": h.completed,
            }
            for h in self.old.history
        }

    def check_last_change(
        self,
        state: DeploymentState | None,
        applied: Applied,
        rules: TuningRules,
        observation: Observation | None,
        settled_since: datetime | None,
    ) -> Check | None:
        """The verdict on the last retune, once its settle window has passed (None before that, or
        when it was checked already or has nothing to compare against). Recorded, with an Event."""
        last = applied.rollouts[-1] if applied.rollouts else None
        if last is None or last.from_value is None or state is None or state.rolling or settled_since is None:
            return None
        record = self.verdicts.setdefault((last.time, last.to_value), {})
        before: WindowFigures | None = record.get("before")
        if before is None or record.get("verdict") is not None:
            return None
        # the window after is all after the settle: by the observation's time (a cached reading
        # may be older than the clock)
        if observation is None or observation.sampled_at < settled_since + timedelta(seconds=rules.window_s):
            return None
        after = Figures.of(observation)
        if after is None:
            return None
        check = verify(
            Figures(
                before.context_tokens,
                before.tokens_per_second_per_pod,
                before.tpot_p99_milliseconds / 1e3,
                before.preemptions_per_second,
                before.tpot_mean_milliseconds / 1e3 if before.tpot_mean_milliseconds is not None else None,
                before.prompt_tokens,
            ),
            after,
            rules.dead_band_percent,
            rules.tpot_p99_target_ms / 1e3 if rules.tpot_p99_target_ms is not None else None,
            raised=last.to_value > last.from_value,
        )
        record.update(after=window_figures(after), verdict=check.verdict, verdictReason=check.reason)
        message = f"max-num-seqs {last.from_value}→{last.to_value}: {check.verdict.lower()} — {check.reason}"
        self.event("Warning" if check.verdict == "Reverted" else "Normal", f"Change{check.verdict}", message)
        return check

    other_setup = False  # the engine, model, GPU, image or args changed since the last evaluation
    carries_template = False  # a safety decrease rolls the operator's new pod template (rollout_safety)
    safety_took_place = False  # ... in a place it did not hold before (freed if its apply fails)

    def forget_other_setup(self, fingerprint: str) -> None:
        """What another setup showed says nothing of this one (its calibration is dropped by the
        same fingerprint): a change still waiting for its check is Inconclusive, as its window
        before ran elsewhere, and the quarantines go (`rollout_safety`)."""
        stored = self.old.calibration.fingerprint if self.old.calibration is not None else None
        if stored is None or stored == fingerprint:
            return
        self.other_setup = True
        if not self.old.history:
            return
        entry = self.old.history[-1]  # the one change a check can still be waiting for
        record = self.verdicts[(entry.time, entry.to)]
        if record.get("before") is None or record.get("verdict") is not None:
            return  # never checked (creation, a rollback or revert), or checked already
        record.update(verdict="Inconclusive", verdictReason=OTHER_SETUP)
        self.event(
            "Normal",
            "ChangeInconclusive",
            f"max-num-seqs {entry.from_}→{entry.to}: inconclusive — {OTHER_SETUP}",
        )

    def remember_before(
        self, rolled: bool, decision: Decision, rollouts: Sequence[Rollout], observation: Observation | None
    ) -> None:
        """A retune keeps the window before it, for the check after it."""
        if not rolled or not rollouts or decision.reason.startswith((ROLLBACK, REVERT)):
            return
        if self.other_setup or self.carries_template:
            # the window before ran on another setup, or on the template that rolled out with the
            # retune: nothing to compare the new one with
            return
        new = rollouts[-1]
        figures = Figures.of(observation)
        if new.from_value is not None and figures is not None:
            self.verdicts[(new.time, new.to_value)] = {"before": window_figures(figures)}

    # -- adopted workloads (spec.targetRef) -----------------------------------------------------------

    def adopted(self, ref: TargetRef, engine: Engine) -> Target:
        target = adopt(
            ref, engine, self.ports.kube.get_object(ref.kind, self.namespace, ref.name), self.namespace
        )
        self.pod_labels = target.pod_labels
        if target.problem is None:
            rival = self.rival(ref)
            if rival is not None:
                target = replace(
                    target,
                    problem=(
                        ALREADY_TARGETED,
                        f"{ref.kind} {self.namespace}/{ref.name} is already tuned by LLMServing {rival}; "
                        "one workload takes one LLMServing — delete one of them",
                    ),
                )
        return target

    def rival(self, ref: TargetRef) -> str | None:
        """The LLMServing that tunes the same workload and came first (older, then by name)."""
        me = tuner(self.raw)
        tuners = self.ports.kube.tuners(self.namespace, ref.kind, ref.name)
        for earlier in sorted(t for t in tuners if t < me and t[1] != self.name):
            # as stored now: the watch's index keeps an object deleted while the watch was down
            # (kopf's next listing does not say what went), which would hold this one off for good
            stored = self.ports.kube.get_llmserving(self.namespace, earlier[1], fresh=True)
            if (
                stored is not None
                and tuned_workload(stored) == (ref.kind, ref.name)
                and tuner(stored) == earlier
            ):
                return earlier[1]
        return None

    def recorded_rollouts(self, state: DeploymentState | None) -> tuple[Rollout, ...]:
        """An adopted workload's rollouts, as status keeps them. A value the workload runs that the
        record does not end with was written by a retune whose status write failed (or by hand): it
        counts as a rollout from now, or the cooldown and the budget would not hold after it."""
        recorded = tuple(Rollout(h.time, h.from_, h.to, h.reason) for h in self.old.history)
        running = state.max_num_seqs if state is not None else None
        if not recorded or running is None or running == recorded[-1].to_value:
            return recorded
        last = recorded[-1].to_value
        unrecorded = Rollout(
            self.now,
            last,
            running,
            f"the workload runs {running}, not the recorded {last}: a retune whose status write failed, "
            "or an edit; counted from now",
        )
        return (*recorded, unrecorded)[-HISTORY_KEPT:]

    def set_wired(self, engine: Engine, target: Target) -> None:
        c = self.conditions
        if target.problem is not None:
            reason, message = target.problem
            c.set("Wired", "False", reason, f"{message}; nothing is written, recommendations only")
        elif target.second_limit is not None:
            c.set(
                "Wired",
                "False",
                "SecondBatchLimit",
                f"container {target.container} of {target.kind} {target.name} also sets "
                f"{target.second_limit}, a second cap on vLLM's running batch (vLLM refuses to start when "
                f"it is above --max-num-seqs, and under it the value the operator writes is not what runs): "
                "remove it; until then the operator writes nothing and reports recommendations only",
            )
        elif not target.wired:
            c.set(
                "Wired",
                "False",
                "ArgsDoNotReferenceVariable",
                f"container {target.container} of {target.kind} {target.name} does not reference "
                f"$({TARGET_ENV_VAR}): add the argument {wiring_argument(engine)} to it; until then the "
                "operator writes nothing and reports recommendations only",
            )
        else:
            c.set(
                "Wired",
                "True",
                "ArgsReferenceVariable",
                f"container {target.container} of {target.kind} {target.name} takes its batch limit from "
                f"$({TARGET_ENV_VAR})",
            )
        if c.turned("Wired", "False", or_message=True):
            self.event("Warning", c.new["Wired"].reason, c.new["Wired"].message)

    def scale_status(self, state: DeploymentState | None, target: Target | None) -> dict[str, Any]:
        """The scale subresource's status: the engine pods and their selector."""
        labels = (target.pod_labels if target is not None else selector_labels(self.name)) or {}
        return {
            "replicas": state.replicas if state is not None else 0,
            "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or None,
        }

    def claim(
        self,
        objects: Sequence[dict[str, Any]],
        read: Mapping[tuple[str, str], dict[str, Any] | None],
        uid: str | None,
    ) -> tuple[list[str], list[dict[str, Any]]]:
        """Make each rendered object safe to apply: one that exists must be controlled by this
        LLMServing, and is then applied conditionally on the resourceVersion read here (so a
        rollout decided on a stale Deployment cannot land). `read`: the objects this reconcile
        has read already, by kind and name (the others are read here, together). Returns the objects that
        exist and belong to someone else (if there are any, nothing may be applied), and the
        objects to apply: those not already in the cluster exactly as rendered (each stamped with
        its content hash, see `batchknee.applied`)."""
        keys = [(item["kind"], item["metadata"]["name"]) for item in objects]
        unread = [key for key in keys if key not in read]
        kube, namespace = self.ports.kube, self.namespace
        fetched = together(
            [functools.partial(kube.get_object, kind, namespace, name) for kind, name in unread]
        )
        existing_by_key = {**read, **dict(zip(unread, fetched, strict=True))}
        foreign, pending = [], []
        for item in objects:
            kind, name = item["kind"], item["metadata"]["name"]
            stamp(item)
            existing = existing_by_key[kind, name]
            if existing is None:
                pending.append(item)
                continue
            if not controlled_by(existing, uid):
                foreign.append(f"{kind} {self.namespace}/{name}")
                continue
            if in_place(item, existing) and not kube.taking_back(kind, namespace, name):
                continue
            item["metadata"]["resourceVersion"] = existing.get("metadata", {}).get("resourceVersion")
            pending.append(item)
        return foreign, pending

    def quarantine_broken(
        self, decision: Decision, rules: TuningRules, quarantine: list[QuarantineEntry]
    ) -> list[QuarantineEntry]:
        """A step down from a limit whose TPOT p99 broke the target past any bucket's reading keeps
        that limit off at this context (and longer ones): the model or the mean that allowed it
        would allow it again once the p99 is back, and the limit would flap between the two."""
        broken = decision.broken
        # Auto's own step only: Recommend and Pinned roll what their writer set, not this
        if rules.mode != "Auto" or not decision.rolls or broken is None or decision.value >= broken:
            return quarantine
        entry = QuarantineEntry(
            max_num_seqs=broken,
            direction="Above",
            context_tokens=None if decision.context_tokens is None else round(decision.context_tokens),
            until=self.now + timedelta(seconds=max(QUARANTINE_S, rules.cooldown_s)),
            reason=f"TPOT p99 over {DEFINITE_BREAK_FACTOR:g}× the target at max-num-seqs {broken}",
        )
        return [*quarantine, entry][-QUARANTINE_KEPT:]

    def recreates(self, pending: Sequence[dict[str, Any]]) -> bool:
        """An object this LLMServing had (its status was written) is to be created again."""
        return self.old.observed_generation is not None and any(
            "resourceVersion" not in item["metadata"] for item in pending
        )

    def gone(self, uid: str | None) -> bool:
        """The LLMServing is no longer stored (or another of its name is): the watch cache keeps an
        object deleted while the watch was down (kopf's next listing does not say what went), and
        its objects, deleted by the garbage collector, would be created again at every evaluation."""
        stored = self.ports.kube.get_llmserving(self.namespace, self.name, fresh=True)
        return stored is None or (stored.get("metadata") or {}).get("uid") != uid

    def name_conflict(self, foreign: Sequence[str]) -> Outcome:
        """Objects of the names this LLMServing needs exist and are not its own: touch nothing."""
        message = (
            f"{', '.join(foreign)} already exists and is not controlled by this LLMServing; nothing was "
            "applied — rename the LLMServing, or delete or rename that object"
        )
        update = {
            "observed_generation": self.generation,
            "reason": f"name conflict — {message}",
            "action": "hold",
            "hold_reason": "name-conflict",
        }
        return self.degraded("NameConflict", message, update)

    def api_errors(self, error: str, since: datetime) -> Outcome:
        """Writes have failed on apiserver errors since `since`: say so, change nothing else."""
        message = (
            f"every reconcile since {since.isoformat(timespec='seconds')} ended on an apiserver error "
            f"its retries did not clear, last: {error}; nothing was changed, and each evaluation tries "
            "again — check the apiserver's load and the admission webhooks on Deployments, Services "
            "and PodDisruptionBudgets"
        )
        # one Event when it turns, not one per changed "last" call
        return self.degraded("ApiErrors", message, {}, error=error, or_message=False)

    def settled_since(self, state: DeploymentState | None, rollouts: Sequence[Rollout]) -> datetime | None:
        """When the current pods were first seen all updated and available: after any rollout (a
        retune's or a spec change's), and conservatively now when nothing recorded it. The settled
        window starts there only once the pods it replaced are gone (`draining_pods`)."""
        if state is None or state.rolling:
            return None
        last = rollouts[-1].time if rollouts else None
        previous = self.old.rollout_complete_time
        if previous is not None and (last is None or previous >= last):
            return previous
        return self.now

    def draining_pods(self, settled_since: datetime | None) -> list[str]:
        """The pods of the engines' workload still terminating when the Deployment is first seen
        rolled out: the replaced pods drain for their grace period, and Prometheus scrapes them until
        they are deleted (each counted by its share of the window: a draining pod reads as a whole
        pod with a running batch falling to zero). The rollout is still finishing for the settled
        window until none is left (or the ones left are stuck: `render.draining`).

        Pods are listed only at the moment `settled_since` would store a new settle time (one not
        yet in status.rolloutCompleteTime): once per completed rollout, again each evaluation only
        while old pods drain (their grace period, bounded), and never once it is stored. A Live
        engine's pods are listed every evaluation anyway (the same LIST); an adopted workload is not
        asked (its query leaves terminating pods out)."""
        if settled_since is None or settled_since == self.old.rollout_complete_time:
            return []
        return draining(self.pods, self.now)

    @functools.cached_property
    def pods(self) -> list[dict[str, Any]]:
        """The engine pods: the adopted workload's own selector, else the managed Deployment's."""
        return self.list_pods()

    def list_pods(self, *, fresh: bool = False) -> list[dict[str, Any]]:
        labels = dict(self.pod_labels or selector_labels(self.name))
        return self.ports.kube.list_pods(self.namespace, labels, fresh=fresh)

    pod_labels: Mapping[str, str] | None = None

    def observe(
        self, obj: LLMServing, state: DeploymentState | None, target: Target | None
    ) -> Observation | None:
        if state is None:
            return None
        if state.replicas == 0:
            return Observation.unavailable(self.now, "scaled to zero replicas")
        where = observation_target(obj)
        if target is not None and target.problem is not None and unobservable(target):
            return Observation.unavailable(self.now, target.problem[1])  # its pods cannot be told apart
        if target is not None:
            names = tuple(
                p["metadata"]["name"] for p in self.pods if not p["metadata"].get("deletionTimestamp")
            )
            if not names:
                return Observation.unavailable(self.now, f"{target.kind} {target.name} has no pods")
            where = replace(where, pods=names)
        try:
            return self.ports.observer.observation(where, self.now)
        except Exception as error:  # the observer must not break reconcile: this is "unavailable"
            log.warning("%s/%s: observation failed: %s", self.namespace, self.name, error)
            return Observation.unavailable(self.now, f"observation failed: {error}")

    def last_rollout_completed(self, history: Sequence[Rollout]) -> bool:
        """Did the engines run the last batch limit rolled out, all updated and available, at some
        moment since it was applied (whatever is unavailable now)?"""
        done = self.old.rollout_complete_time
        if not history or (done is not None and done >= history[-1].time):
            return True
        return self.verdicts.get((history[-1].time, history[-1].to_value), {}).get("completed") is not None

    def pace(self, state: DeploymentState, rendered: int, writers_change: bool, template: str) -> Paced:
        """A new pod template that is neither a batch-limit decision nor a change of the spec (a new
        operator version's or setting's rendering, at the limit the engine runs) rolls the engines
        only with a place from the pacer (`batchknee.pacing`); one whose Deployment is replacing
        pods already needs none."""
        own = not writers_change and not state.template_progressing and rendered == state.max_num_seqs
        if not own:
            return Paced("True", "TemplateRollout", "rolling out a new pod template")
        key = (self.namespace, self.name)
        held = self.ports.pacer.place(key) is not None
        if self.ports.pacer.admit(key, Place(template, self.now, state.available_replicas)):
            return Paced(
                "True", "TemplateRollout", f"rolling out {OWN_TEMPLATE}", admitted=True, took_place=not held
            )
        why = (
            f"{OWN_TEMPLATE} waits its turn, the engines running as they are: the operator restarts at "
            f"most {self.ports.pacer.at_once} engines at a time for such changes (operator setting "
            "templateRolloutsAtOnce), a namespace all of them but one, namespaces holding fewer first"
        )
        return Paced("False", "RolloutQueued", why)

    def pace_with_safety(self, template: str) -> Paced:
        """The operator's new pod template rolling with a safety decrease, in the place
        `take_safety_place` took (for the template as rendered: it frees as any, `free_place`)."""
        key = (self.namespace, self.name)
        place = self.ports.pacer.place(key)
        if place is not None and place.template != template:
            self.ports.pacer.resume(key, replace(place, template=template))
        return Paced(
            "True",
            "TemplateRollout",
            f"rolling out {OWN_TEMPLATE} with a safety decrease",
            admitted=True,
            took_place=self.safety_took_place,
        )

    def resume_place(self, state: DeploymentState, found: Mapping[str, Any]) -> None:
        """The rollout of a template that got a place is still replacing pods, stalled, or has
        replaced them all with none available, and this operator gave no place for it (it started
        since): it takes one again, limit or not, so a restart does not let a template that cannot
        start reach more engines."""
        key = (self.namespace, self.name)
        if self.ports.pacer.at_once == 0 or self.ports.pacer.place(key) is not None:
            return
        template = recorded_template(found)
        if template is None or state.paced_template != template:
            return
        # every pod replaced, none available, within the progress deadline of the template's
        # change: neither replacing pods nor stalled yet, and no place (a pod lost long after a
        # rollout is not the template's)
        deadline = as_int(found.get("spec", {}).get("progressDeadlineSeconds")) or 600
        changed = state.template_changed_at
        starting = changed is not None and (self.now - changed).total_seconds() <= deadline
        unavailable = starting and state.replicas > 0 and state.available_replicas == 0
        if state.template_progressing or state.stalled or unavailable:
            since = state.template_changed_at or self.now
            self.ports.pacer.resume(key, Place(template, since, min(1, state.replicas)))

    def free_place(self) -> None:
        """A place the pacer gave this LLMServing frees once its Deployment runs the template it was
        given for, rolled out with as many pods available as when it was given; or is gone or no
        longer its own. A read that does not show that template yet (the watch behind the write)
        keeps it, for a minute."""
        key = (self.namespace, self.name)
        place = self.ports.pacer.place(key)
        if place is None:
            return
        found = self.ports.kube.get_deployment(self.namespace, self.name)
        uid = self.raw.get("metadata", {}).get("uid")
        ours = found if found is not None and controlled_by(found, uid) else None
        state = deployment_state(ours)
        if ours is None or state is None:
            self.ports.pacer.done(key)
            return
        # rolled out, with as many pods available as before it (a pod unavailable for reasons of
        # its own, a pending scale-up, does not hold the place; a template that does not start does)
        settled = not state.template_progressing and state.available_replicas >= min(
            place.available, state.replicas
        )
        seen = recorded_template(ours) == place.template
        if settled and (seen or self.now - place.since >= PLACE_APPLY_SEEN_WITHIN):
            self.ports.pacer.done(key)

    def prune_engine_configs(self, obj: LLMServing, desired: Desired) -> None:
        """Delete this LLMServing's options ConfigMaps past the newest few (best effort: a failure
        is a log line, retried next time)."""
        try:
            current = config_map(obj, desired)["metadata"]["name"]
            found = self.ports.kube.list_config_maps(self.namespace, engine_config_selector(self.name))
            for name, uid in stale_engine_configs(obj, found, current):
                self.ports.kube.delete("ConfigMap", self.namespace, name, uid)
        except Exception as error:
            log.warning("%s/%s: could not prune old engine options: %s", self.namespace, self.name, error)

    def delete_disruption_budget(self) -> None:
        """With budgets turned off, the one an earlier evaluation made goes (never another's of the
        name; best effort: a failure is a log line, retried next time)."""
        uid = self.raw.get("metadata", {}).get("uid")
        try:
            found = self.ports.kube.watched("PodDisruptionBudget", self.namespace, self.name)
            if found is not None and controlled_by(found, uid):
                self.ports.kube.delete(
                    "PodDisruptionBudget", self.namespace, self.name, found["metadata"]["uid"]
                )
        except Exception as error:
            log.warning("%s/%s: could not delete its disruption budget: %s", self.namespace, self.name, error)

    def report_overridden_args(self, overridden: Sequence[str]) -> None:
        """ArgsOverridden=True (and a Warning event when it turns so or changes) while spec.args
        sets a flag the operator manages to another value; absent otherwise."""
        if not overridden:
            return
        message = "the operator manages and replaces: " + "; ".join(overridden)
        if len(message) > 1024:  # bounded for the condition and the event alike
            message = message[:1023] + "…"
        self.conditions.set("ArgsOverridden", "True", "ManagedFlags", message)
        if self.conditions.turned("ArgsOverridden", "True", or_message=True):
            self.event("Warning", "ArgsOverridden", message)

    def calibration_points(self, fingerprint: str) -> tuple[CalibrationPoint, ...]:
        calibration = self.old.calibration
        if calibration is None or calibration.fingerprint != fingerprint:
            return ()
        return tuple(
            CalibrationPoint(
                s.time,
                s.batch,
                float(s.context_length),
                s.tpot_p99_milliseconds / 1e3,
                tpot_mean_s=None if s.tpot_mean_milliseconds is None else s.tpot_mean_milliseconds / 1e3,
                prompt_tokens=s.prompt_tokens,
                output_tokens=s.output_tokens,
                prefix_hit_ratio=None if s.prefix_hit_percent is None else s.prefix_hit_percent / 100,
                read_bytes_per_s=None
                if s.read_gigabytes_per_second is None
                else s.read_gigabytes_per_second * 1e9,
            )
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
        crashing: Sequence[str],
        target: Target | None,
        workload: DeploymentState | None,
        paced: Paced | None = None,
    ) -> None:
        """`workload`: the engines' workload as shown (an adopted one's, whoever tunes it); `state`:
        the one this LLMServing may write, whose rollouts it judges; `paced`: the operator's new pod
        template, applied or waiting (see `pace`)."""
        c = self.conditions
        problem = target.problem if target is not None else None
        # Ready: the engines are rolled out and available.
        if workload is None and problem is not None:
            c.set("Ready", "False", problem[0], problem[1])
        elif workload is None:
            c.set("Ready", "False", "Deploying", "the engine Deployment is being created")
        elif workload.replicas == 0:
            c.set("Ready", "False", "ScaledToZero", "spec.replicas is 0")
        elif workload.rolling or rolled:
            c.set(
                "Ready", "False", "RolloutInProgress", workload.message if workload.rolling else "rolling out"
            )
        else:
            c.set("Ready", "True", "EngineAvailable", workload.message)

        # MetricsAvailable: can the knee be computed from what the engines report?
        if problem is not None and target is not None and unobservable(target):
            c.set("MetricsAvailable", "Unknown", problem[0], f"not observed: {problem[1]}")
        elif observation is None:
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
        elif queued(paced) and paced is not None:
            c.set("Progressing", paced.status, paced.reason, paced.message)
        elif state is not None and state.rolling:
            c.set("Progressing", "True", "RolloutInProgress", state.message)
        elif paced is not None and apply_error is None:
            c.set("Progressing", paced.status, paced.reason, paced.message)
        else:
            c.set(
                "Progressing", "False", "RolloutComplete", state.message if state else "nothing to roll out"
            )

        # Degraded: something needs a human.
        if apply_error is not None:
            c.set("Degraded", "True", "ApplyFailed", apply_error)
        elif crashing:
            c.set(
                "Degraded",
                "True",
                "EngineCrashLooping",
                f"engine containers restarting: {', '.join(crashing[:5])}"
                f"{f' and {len(crashing) - 5} more' if len(crashing) > 5 else ''} — "
                "check the pod logs and the engine args",
            )
        elif state is not None and state.stalled:
            c.set("Degraded", "True", "RolloutStalled", state.message)
        else:
            c.set("Degraded", "False", "AsExpected", "")

        if c.turned("Degraded", "True", or_message=True):
            reason = c.new["Degraded"].reason
            self.event("Warning", reason, c.new["Degraded"].message)
        if paced is not None and queued(paced) and c.turned("Progressing", "False", or_message=True):
            self.event("Normal", paced.reason, paced.message)
        if c.turned("MetricsAvailable", "False") and c.old.get("MetricsAvailable") is not None:
            self.event("Warning", "MetricsUnavailable", c.new["MetricsAvailable"].message)

    def status(
        self,
        obj: LLMServing,
        applied: Applied,
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
        # what runs: under a live cap, the cap, not the pods' startup ceiling
        applied_value = decision.value if rolled else applied.max_num_seqs
        fit = decision.calibration
        calibration_status = CalibrationStatus(
            fingerprint=fingerprint,
            samples=[
                CalibrationSample(
                    time=p.time,
                    batch=round(p.batch, 2),
                    context_length=round(p.context_tokens),
                    tpot_p99_milliseconds=round(p.tpot_p99_s * 1e3, 3),
                    tpot_mean_milliseconds=None if p.tpot_mean_s is None else round(p.tpot_mean_s * 1e3, 3),
                    prompt_tokens=None if p.prompt_tokens is None else round(p.prompt_tokens, 1),
                    output_tokens=None if p.output_tokens is None else round(p.output_tokens, 1),
                    prefix_hit_percent=None
                    if p.prefix_hit_ratio is None
                    else round(p.prefix_hit_ratio * 100, 1),
                    read_gigabytes_per_second=None
                    if p.read_bytes_per_s is None
                    else round(p.read_bytes_per_s / 1e9, 3),
                )
                for p in calibration
            ],
            overhead_milliseconds=round(fit.overhead_s * 1e3, 3) if fit else None,
            bandwidth_efficiency_percent=round(fit.bandwidth_efficiency * 100, 1) if fit else None,
        )
        return LLMServingStatus(
            observed_generation=self.generation,
            conditions=self.conditions.result(),
            observed=observed_metrics(observation, decision.bandwidth)
            if usable and observation is not None
            else old.observed,
            b_knee=round(rec.b_knee, 1) if rec is not None else old.b_knee,
            max_num_seqs=applied_value,
            recommended_max_num_seqs=decision.recommended
            if decision.recommended is not None
            else old.recommended_max_num_seqs,
            max_tokens=trtllm_kv_cache(obj.spec).max_tokens
            if obj.spec.engine == Engine.TensorRTLLM
            else None,
            limited_by=decision.limited_by or old.limited_by,
            slo_bound_max_num_seqs=decision.slo_bound,
            action="roll" if rolled else ("hold" if decision.action == "roll" else decision.action),
            hold_reason=decision.hold,
            reason=decision.reason,
            last_rollout_time=rollouts[-1].time if rollouts else None,
            rollout_complete_time=settled_since,
            history=[
                HistoryEntry.model_validate(
                    {
                        "time": r.time,
                        "from": r.from_value,
                        "to": r.to_value,
                        "reason": r.reason,
                        **{
                            k: v
                            for k, v in self.verdicts.get((r.time, r.to_value), {}).items()
                            if v is not None
                        },
                    }
                )
                for r in rollouts
            ],
            calibration=calibration_status,
            recent_targets=[
                RecentTargetStatus(time=t.time, batch=round(t.batch, 3)) for t in decision.recent_targets
            ]
            or None,
        )
