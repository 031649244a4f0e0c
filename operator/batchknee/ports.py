"""What reconcile needs from the outside world, as protocols.

Production: `batchknee.adapters.kubernetes.KubernetesAdapter` and the Prometheus observer
(`batchknee.adapters.prometheus`). Component tests: in-memory implementations. Both speak plain
dicts (Kubernetes JSON, camelCase) and the core's `Observation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from batchknee.core.observation import Observation, ObservationTarget

EventType = Literal["Normal", "Warning"]


class ApplyError(Exception):
    """The apiserver refused an object (validation, conflict, permissions): the message says why."""


class ApplyConflict(ApplyError):
    """The object changed since it was read (its resourceVersion precondition failed), or appeared
    since it was found missing: nothing was written, and the next reconcile decides again."""


class TransientApiError(Exception):
    """The apiserver stayed busy or in conflict (409, 429, 5xx), or did not answer (a timeout, a
    connection refused or lost, a TLS error), through the adapter's retries: the next reconcile
    tries again; Degraded says so only once it has lasted (reconcile.API_ERRORS_DEGRADED_AFTER)."""

    def __init__(self, summary: str, detail: str = "") -> None:
        # summary: the call and its status code with the standard phrase (or a fixed phrase for no
        # answer), nothing the server (or a proxy in front of it, or the exception) wrote: for
        # status and Events; detail: what the answer or the exception said, for logs
        self.summary = summary
        super().__init__(f"{summary}: {detail}" if detail else summary)


class ObjectGone(Exception):
    """The LLMServing was deleted while the reconcile ran (its status write found none): there is
    nothing to write and nothing to try again."""


class KubernetesPort(Protocol):
    def get_llmserving(self, namespace: str, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        """The LLMServing as stored (metadata, spec, status), or None when it is gone (`fresh`: from
        the apiserver, not what the watch delivered)."""
        ...

    def tuners(self, namespace: str, kind: str, name: str) -> list[tuple[str, str]]:
        """The LLMServings not being deleted whose spec.targetRef is this workload, as
        (creationTimestamp, name), as the watch knows them (one deleted while the watch was down
        may linger until the next start): two must not adopt the same workload."""
        ...

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The engine Deployment as stored, or None when it does not exist."""
        ...

    def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A Deployment, StatefulSet, Service or ConfigMap as stored, or None when it does not exist."""
        ...

    def list_pods(
        self, namespace: str, labels: dict[str, str], *, fresh: bool = False
    ) -> list[dict[str, Any]]:
        """The pods matching every label (the engine pods of one LLMServing); `fresh`: as stored now
        (a consistent read), not as a cache last saw them."""
        ...

    def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply `obj` (field manager "batchknee"). With `metadata.resourceVersion` set
        (an object the caller read and found to be its own) the apply is forced and conditional on
        that version; without it (a create) it is never forced, so it cannot take over an object
        that appeared meanwhile. Raises ApplyConflict when a precondition fails, else ApplyError."""
        ...

    def taking_back(self, kind: str, namespace: str, name: str) -> bool:
        """An object a create met (someone else made it meanwhile) whose taking back has not
        succeeded yet: `apply` of it tries the taking back again (and applies nothing else), so it
        must be called even when the object reads as in place."""
        ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the LLMServing's status through the status subresource. Raises ObjectGone when
        the LLMServing is no longer stored."""
        ...

    def list_config_maps(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The ConfigMaps in `namespace` carrying every one of `labels` (metadata included)."""
        ...

    def watched(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as the operator's watches delivered it (None: they hold none), asking the
        apiserver nothing; without watches, get_object."""
        ...

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the ConfigMap or PodDisruptionBudget if it is still the object with `uid` (gone
        already is fine)."""
        ...

    def emit_event(
        self,
        involved: dict[str, Any],
        event_type: EventType,
        reason: str,
        message: str,
        now: datetime,
        name: str | None = None,
    ) -> None:
        """Record a core/v1 Event about `involved` (an object's apiVersion, kind and metadata).
        With `name` the Event is recorded once, however often it is sent: one of that name already
        there is fine (a retune announced by an operator and again by the one that took over)."""
        ...


class Observer(Protocol):
    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        """The engines of one LLMServing over its window. Never raises for missing data: an
        unavailable reading carries the reason (an exception is treated the same way)."""
        ...


@dataclass(frozen=True)
class LiveCap:
    """One engine pod's runtime batch cap, as its runtime endpoint reports it."""

    api: Literal["runtime-config", "trimtab"]
    cap: int | None  # None: the endpoint sets but does not report it (trimtab)
    ceiling: int | None  # the startup --max-num-seqs, when reported


class LiveCapError(Exception):
    """The pod answered, but not with a cap (an error status, garbage): the message says what."""


class EngineRuntime(Protocol):
    """The engines' runtime endpoints (vLLM's proposed /v1/runtime_config, trimtab's
    /trimtab/set_knobs) on each pod's address."""

    def read_cap(self, address: str) -> LiveCap | None:
        """The pod's live cap, or None when the engine has no runtime endpoint (404/405/501)."""
        ...

    def set_cap(self, address: str, api: str, value: int) -> None:
        """Set the pod's live cap. Raises LiveCapError when the pod refuses it."""
        ...
