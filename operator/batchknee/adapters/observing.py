"""reconcile's `Observer` port over the Prometheus adapter's url-aware, tick-cached observer.

An LLMServing may name its own Prometheus (spec.prometheus.url); every other one is read from the
operator's default URL. The cache behind (`batchknee.adapters.prometheus.CachedObserver`) serves
all objects of one URL with one batch of queries per tick.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Protocol

from batchknee.core.observation import Observation, ObservationTarget


class UrlObserver(Protocol):
    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation: ...


class RoutedObserver:
    """Implements `batchknee.ports.Observer`: which Prometheus to ask is remembered per object."""

    def __init__(self, inner: UrlObserver, default_url: str) -> None:
        self.inner = inner
        self.default_url = default_url
        self.urls: dict[tuple[str, str], str] = {}
        self.lock = threading.Lock()

    def route(self, namespace: str, name: str, url: str | None) -> None:
        with self.lock:
            if url:
                self.urls[(namespace, name)] = url
            else:
                self.urls.pop((namespace, name), None)

    def forget(self, namespace: str, name: str) -> None:
        with self.lock:
            self.urls.pop((namespace, name), None)
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            forget((namespace, name))

    def url(self, target: ObservationTarget) -> str:
        with self.lock:
            return self.urls.get(target.key, self.default_url)

    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        return self.inner.observation(self.url(target), target, now)
