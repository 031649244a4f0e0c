"""In-memory adapters for component tests: a Kubernetes store that keeps objects as the apiserver
would (generation, status, owner references), an observer whose readings the test sets, a clock."""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from batchknee.adopt import tuned_workload, tuner
from batchknee.core.observation import Observation, ObservationTarget, Reading
from batchknee.ports import (
    ApplyConflict,
    ApplyError,
    EventType,
    LiveCap,
    LiveCapError,
    ObjectGone,
    TransientApiError,
)

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


@dataclass
class Clock:
    now: datetime = START

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


Key = tuple[str, str, str]  # kind, namespace, name


@dataclass
class MemoryKube:
    """Implements batchknee.ports.KubernetesPort. Apply replaces the object but keeps its status;
    a changed spec bumps metadata.generation (and so starts a Deployment "rollout" that lasts
    until `finish_rollout`)."""

    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    event_names: set[str] = field(default_factory=set)  # named Events recorded
    event_repeats: int = 0  # named Events sent again (the apiserver's AlreadyExists)
    applies: int = 0
    status_writes: int = 0
    fail_apply: set[str] = field(default_factory=set)
    fail_status: bool = False
    fail_events: bool = False
    busy_applies: int = 0  # this many applies answer as an apiserver still busy after retries
    # what such an apply raises, given the call ("apply Deployment chat")
    busy_error: Callable[[str], TransientApiError] = field(
        default=lambda what: TransientApiError(
            f"{what}: 429 Too Many Requests (after 4 tries)", "storage is (re)initializing"
        )
    )
    # objects a create met (someone else's) whose taking back keeps failing (KubernetesAdapter)
    not_taken_back: set[Key] = field(default_factory=set)
    _uids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _versions: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    # a reconcile applies some objects together (reconcile.together): one write at a time, as etcd
    _writing: threading.Lock = field(default_factory=threading.Lock)
    fresh_reads: list[str] = field(default_factory=list)  # LLMServings read past the watch's cache

    # --- the port ---
    def get_llmserving(self, namespace: str, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        if fresh:
            self.fresh_reads.append(name)
        found = self.objects.get(("LLMServing", namespace, name))
        return copy.deepcopy(found) if found else None

    def tuners(self, namespace: str, kind: str, name: str) -> list[tuple[str, str]]:
        return [
            tuner(obj)
            for (found, ns, _), obj in self.objects.items()
            if found == "LLMServing" and ns == namespace and tuned_workload(obj) == (kind, name)
        ]

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get(("Deployment", namespace, name))
        return copy.deepcopy(found) if found else None

    def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found else None

    watched = get_object  # the watches deliver every object here at once

    def list_pods(
        self, namespace: str, labels: dict[str, str], *, fresh: bool = False
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in self.objects.items()
            if kind == "Pod"
            and ns == namespace
            and labels.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def apply(self, obj: dict[str, Any]) -> None:
        """As KubernetesAdapter.apply on the apiserver: conditional on metadata.resourceVersion when
        given (409 when the object moved on), and a create that meets an object someone else made
        meanwhile is a conflict too (the apiserver merges an unforced apply into it unless a field
        conflicts; the adapter takes back what it added and says so, tests/integration/test_ownership)."""
        with self._writing:
            self._apply(obj)

    def taking_back(self, kind: str, namespace: str, name: str) -> bool:
        return (kind, namespace, name) in self.not_taken_back

    def _apply(self, obj: dict[str, Any]) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        if self.taking_back(kind, meta["namespace"], meta["name"]):
            raise ApplyError(
                f"{kind} {meta['namespace']}/{meta['name']}: taking back what the operator added failed"
            )
        if kind in self.fail_apply:
            raise ApplyError(f"{kind} {meta['name']}: admission webhook denied the request")
        if self.busy_applies > 0:
            self.busy_applies -= 1
            raise self.busy_error(f"apply {kind} {meta['name']}")
        key = (kind, meta["namespace"], meta["name"])
        new = copy.deepcopy(obj)
        old = self.objects.get(key)
        expected = meta.get("resourceVersion")
        if old is not None and expected != old["metadata"].get("resourceVersion"):
            raise ApplyConflict(f"{kind} {meta['name']}: the object has been modified")
        if old is None and expected:
            raise ApplyError(f"{kind} {meta['name']}: not found")
        if old is not None and not meta.get("ownerReferences"):
            # a partial apply (the adopted workload's one env entry): merged into the object the way
            # server-side apply merges keyed lists, everything else kept
            new = _apply_merge(copy.deepcopy(old), new)
        body = {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if old is None:
            new["metadata"]["generation"] = 1
            number = next(self._uids)
            new["metadata"]["uid"] = f"uid-{number}"
            created = datetime(2026, 3, 1, tzinfo=UTC) + timedelta(seconds=number)
            new["metadata"]["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
        elif old.get("immutable") and old.get("data") != new.get("data"):
            raise ApplyError(f"{kind} {meta['name']}: field is immutable when `immutable` is set")
        else:
            old_body = {k: v for k, v in old.items() if k not in ("metadata", "status")}
            generation = old["metadata"]["generation"] + (1 if body != old_body else 0)
            new["metadata"]["generation"] = generation
            new["metadata"]["uid"] = old["metadata"]["uid"]
            if "status" in old:
                new["status"] = old["status"]
        if old is not None:
            new["metadata"]["creationTimestamp"] = old["metadata"].get("creationTimestamp")
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"] if old else None
        if new != old:  # a no-op apply leaves the resourceVersion alone, as the apiserver does
            new["metadata"]["resourceVersion"] = str(next(self._versions))
        self.objects[key] = new
        self.applies += 1

    def list_config_maps(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in self.objects.items()
            if kind == "ConfigMap"
            and ns == namespace
            and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        found = self.objects.get((kind, namespace, name))
        if found is not None and found["metadata"]["uid"] == uid:
            del self.objects[(kind, namespace, name)]

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        if self.fail_status:
            raise RuntimeError("connection reset while writing status")
        stored = self.objects.get(("LLMServing", namespace, name))
        if stored is None:  # the adapter's 404
            raise ObjectGone(f"LLMServing {namespace}/{name}")
        stored["status"] = copy.deepcopy(status)
        self.status_writes += 1

    def emit_event(
        self,
        involved: dict[str, Any],
        event_type: EventType,
        reason: str,
        message: str,
        now: datetime,
        name: str | None = None,
    ) -> None:
        if self.fail_events:
            raise RuntimeError("connection reset while recording an Event")
        if name is not None and name in self.event_names:
            self.event_repeats += 1
            return  # the apiserver's AlreadyExists, which the adapter takes as recorded
        if name is not None:
            self.event_names.add(name)
        self.events.append(
            {
                "object": involved["metadata"]["name"],
                "type": event_type,
                "reason": reason,
                "message": message,
                "time": now,
                "name": name,
            }
        )

    # --- what a test does to the world ---
    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(manifest)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta["uid"] = f"uid-{next(self._uids)}"
        meta["generation"] = 1
        meta["creationTimestamp"] = "2026-03-01T12:00:00Z"
        self.objects[("LLMServing", meta["namespace"], meta["name"])] = obj
        return obj

    def edit_spec(self, namespace: str, name: str, change: dict[str, Any]) -> None:
        obj = self.objects[("LLMServing", namespace, name)]
        _merge(obj["spec"], change)
        obj["metadata"]["generation"] += 1

    def deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[("Deployment", namespace, name)]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, namespace, name))

    def finish_rollout(self, namespace: str, name: str, available: int | None = None) -> None:
        """What the Deployment controller reports once every pod runs the new template (`available`
        of them available; all by default)."""
        dep = self.objects[("Deployment", namespace, name)]
        replicas = dep["spec"].get("replicas", 1)
        available = replicas if available is None else available
        dep["status"] = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": available,
            "availableReplicas": available,
        }
        dep["metadata"]["resourceVersion"] = str(next(self._versions))

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[("LLMServing", namespace, name)].get("status", {})

    def condition(self, namespace: str, name: str, kind: str) -> dict[str, Any]:
        return next(c for c in self.status(namespace, name)["conditions"] if c["type"] == kind)


def _apply_merge(into: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply's merge for what the tests apply: maps merge, lists of objects with a
    `name` merge by name (containers, env), anything else is replaced."""
    for key, value in applied.items():
        current = into.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            into[key] = _apply_merge(current, value)
        elif isinstance(value, list) and isinstance(current, list) and all("name" in v for v in value):
            merged = {item["name"]: item for item in current}
            for item in value:
                merged[item["name"]] = _apply_merge(dict(merged.get(item["name"], {})), item)
            into[key] = list(merged.values())
        else:
            into[key] = value
    return into


def _merge(into: dict[str, Any], change: dict[str, Any]) -> None:
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif value is None:
            into.pop(key, None)
        else:
            into[key] = value


def observation(
    now: datetime,
    *,
    ctx: float | None = 2048,
    tpot_p99_ms: float | None = 20.0,
    running: float | None = 48,
    pods: int = 1,
    reason: str = "no samples in the window",
    tokens_per_s: float = 1000.0,
    preemptions_per_s: float = 0.0,
    with_mean: bool = True,
    prefix_hit: float | None = 0.1,
) -> Observation:
    def reading(value: float | None) -> Reading:
        return Reading.of(value) if value is not None else Reading.unavailable(reason)

    return Observation(
        sampled_at=now,
        pods=pods,
        avg_context_tokens=reading(ctx),
        tpot_p99_s=reading(tpot_p99_ms / 1e3 if tpot_p99_ms is not None else None),
        tpot_mean_s=reading(tpot_p99_ms * 0.9e-3 if tpot_p99_ms is not None and with_mean else None),
        ttft_p99_s=reading(0.25),
        running=reading(running),
        waiting=reading(0.0),
        kv_cache_usage=reading(0.4),
        prefix_hit_ratio=reading(prefix_hit),
        preemptions_per_s=reading(preemptions_per_s),
        generation_tokens_per_s=reading(tokens_per_s),
    )


@dataclass
class MemoryObserver:
    """Implements batchknee.ports.Observer; unset targets read as Prometheus being unreachable."""

    readings: dict[tuple[str, str], Observation] = field(default_factory=dict)
    down: bool = False
    calls: int = 0
    asked: list[ObservationTarget] = field(default_factory=list)  # what each reading was asked of
    lag_s: float = 0.0  # a cached reading: sampled this long before it is asked for

    def set(self, namespace: str, name: str, value: Observation) -> None:
        self.readings[(namespace, name)] = value

    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        self.calls += 1
        self.asked = [*self.asked[-15:], target]  # the real observer reads by scope: tests check it
        if self.down or target.key not in self.readings:
            return Observation.unavailable(
                now, "Prometheus at http://127.0.0.1:9090 unreachable (connection refused)"
            )
        found = self.readings[target.key]
        sampled_at = now - timedelta(seconds=self.lag_s)
        return Observation(sampled_at, *[getattr(found, f) for f in list(found.__dataclass_fields__)[1:]])


@dataclass
class MemoryRuntime:
    """Implements batchknee.ports.EngineRuntime: each pod address's runtime endpoint, as a test sets
    it (None: the engine build has none)."""

    pods: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    sets: list[tuple[str, int]] = field(default_factory=list)

    def read_cap(self, address: str) -> LiveCap | None:
        found = self.pods.get(address)
        if found is None:
            return None
        if "silent" in found:  # what HttpEngineRuntime says of a pod that does not answer
            raise LiveCapError(found["silent"])
        return LiveCap(found["api"], found["cap"], found.get("ceiling"))

    def set_cap(self, address: str, api: str, value: int) -> None:
        found = self.pods[address]
        assert found is not None and found["api"] == api
        if value > found.get("ceiling", value):
            raise LiveCapError(f"PATCH /v1/runtime_config {value} answered 400: above the ceiling")
        found["cap"] = value
        self.sets.append((address, value))  # list.append is atomic: the pods are set together
