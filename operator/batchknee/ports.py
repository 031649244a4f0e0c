"""What reconcile needs from the outside world, as protocols.

Production: `batchknee.adapters.kubernetes.KubernetesAdapter` and the Prometheus observer
(`batchknee.adapters.prometheus`). Component tests: in-memory implementations. Both speak plain
dicts (Kubernetes JSON, camelCase) and the core's `Observation`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Protocol

from batchknee.core.observation import Observation, ObservationTarget

EventType = Literal["Normal", "Warning"]


class ApplyError(Exception):
    """The apiserver refused an object (validation, conflict, permissions): the message says why."""


class TransientApiError(Exception):
    """The apiserver stayed busy or in conflict (409, 429, 5xx) through the adapter's retries: the
    next reconcile tries again; nothing is reported as Degraded for it."""


class KubernetesPort(Protocol):
    def get_llmserving(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LLMServing as stored (metadata, spec, status), or None when it is gone."""
        ...

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The engine Deployment as stored, or None when it does not exist."""
        ...

    def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply `obj` (field manager "batchknee", forced). Raises ApplyError."""
        ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the LLMServing's status through the status subresource."""
        ...

    def emit_event(
        self, involved: dict[str, Any], event_type: EventType, reason: str, message: str, now: datetime
    ) -> None:
        """Record a core/v1 Event about `involved` (an object's apiVersion, kind and metadata)."""
        ...


class Observer(Protocol):
    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        """The engines of one LLMServing over its window. Never raises for missing data: an
        unavailable reading carries the reason (an exception is treated the same way)."""
        ...
