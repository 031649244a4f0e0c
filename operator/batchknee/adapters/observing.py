"""Wiring observers to reconcile's `Observer` port: per-object Prometheus URLs, and batch observers
(`observe(targets, now) -> {key: Observation}`) used one target at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol

from batchknee.core.observation import Observation, ObservationTarget
from batchknee.ports import Observer


class BatchObserver(Protocol):
    def observe(
        self, targets: Sequence[ObservationTarget], now: datetime
    ) -> dict[tuple[str, str], Observation]: ...


class PerTargetObserver:
    """A batch observer asked about one target per call (a caching wrapper that shares one batch of
    queries per tick across objects satisfies `Observer` directly and needs no adapter)."""

    def __init__(self, batch: BatchObserver) -> None:
        self.batch = batch

    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        found = self.batch.observe([target], now).get(target.key)
        return found if found is not None else Observation.unavailable(now, "the observer returned nothing")


class RoutingObserver:
    """The observer for an object's own Prometheus (spec.prometheus.url), else the default one."""

    def __init__(self, factory: Callable[[str], Observer], default_url: str) -> None:
        self.factory = factory
        self.default_url = default_url
        self.urls: dict[tuple[str, str], str] = {}
        self.observers: dict[str, Observer] = {}
        self.lock = threading.Lock()

    def route(self, namespace: str, name: str, url: str | None) -> None:
        with self.lock:
            if url:
                self.urls[(namespace, name)] = url
            else:
                self.urls.pop((namespace, name), None)

    def observer_for(self, url: str) -> Observer:
        with self.lock:
            if url not in self.observers:
                self.observers[url] = self.factory(url)
            return self.observers[url]

    def observation(self, target: ObservationTarget, now: datetime) -> Observation:
        url = self.urls.get(target.key, self.default_url)
        return self.observer_for(url).observation(target, now)
