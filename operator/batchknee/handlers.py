"""kopf registration only: every handler funnels into `reconcile` for one object.

- create / update / resume of an LLMServing, and a daemon per object that re-evaluates every
  `spec.tuning.evaluationIntervalSeconds` (read live, so a change applies at the next wait);
- changes of an engine Deployment (its rollout progressing) reconcile the owning LLMServing;
- one reconcile per object at a time (a lock per object); different objects run in parallel;
- kopf peering: replicas see each other through a KopfPeering/ClusterKopfPeering object and only
  the highest-priority one acts (priorities are random by default, so two never tie and pause).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from batchknee.adapters.engine_runtime import HttpEngineRuntime
from batchknee.adapters.kubernetes import KubernetesAdapter, load_config
from batchknee.adapters.observing import RoutedObserver
from batchknee.api.models import GROUP, PLURAL, VERSION
from batchknee.operator_metrics import OperatorMetrics
from batchknee.reconcile import Outcome, Ports, reconcile
from batchknee.render import LABEL, RenderDefaults
from batchknee.settings import OperatorSettings

log = logging.getLogger("batchknee")


def prometheus_observer(settings: OperatorSettings) -> RoutedObserver:
    """The Prometheus adapter: one PrometheusObserver per URL behind a cache that serves every
    object of a tick with one batch of queries, routed per object."""
    from batchknee.adapters.prometheus import CachedObserver, PrometheusObserver

    observers: dict[str, Any] = {}
    lock = threading.Lock()

    def observer_for(url: str) -> Any:
        with lock:
            if url not in observers:
                observers[url] = PrometheusObserver(
                    url,
                    timeout_s=settings.prometheus_timeout_seconds,
                    min_samples=settings.prometheus_min_samples,
                )
            return observers[url]

    return RoutedObserver(CachedObserver(observer_for), settings.prometheus_url)


@dataclass
class Runtime:
    """What the handlers share: the ports, the metrics and a lock per object."""

    ports: Ports
    router: RoutedObserver
    metrics: OperatorMetrics
    locks: defaultdict[tuple[str, str], threading.Lock] = field(
        default_factory=lambda: defaultdict(threading.Lock)
    )
    guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self.guard:
            return self.locks[(namespace, name)]

    def reconcile(self, namespace: str, name: str, spec: Any = None) -> Outcome:
        if spec is not None:
            self.router.route(namespace, name, (spec.get("prometheus") or {}).get("url"))
        with self.lock(namespace, name):
            started = time.perf_counter()
            try:
                outcome = reconcile(namespace, name, self.ports, datetime.now(UTC))
            except Exception:
                self.metrics.errors.inc()
                raise
            self.metrics.record(outcome, time.perf_counter() - started)
        if outcome.error:
            log.warning("%s/%s: %s", namespace, name, outcome.error)
        elif outcome.decision is not None and outcome.decision.rolls:
            log.info("%s/%s: %s", namespace, name, outcome.decision.reason)
        if not outcome.found:
            self.router.forget(namespace, name)
            with self.guard:
                self.locks.pop((namespace, name), None)
        return outcome


RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    if RUNTIME is None:
        raise RuntimeError("the operator runtime is not configured: start it with `batchknee operator`")
    return RUNTIME


def configure(settings: OperatorSettings) -> Runtime:
    """Connect to the cluster, start /metrics, and build the runtime the handlers use."""
    global RUNTIME
    load_config()
    kube = KubernetesAdapter()
    router = prometheus_observer(settings)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_address, settings.metrics_port)
    if settings.peering != "standalone":
        kube.ensure_peering(settings.peering_name, settings.namespaces)
    defaults = RenderDefaults(
        vllm_image=settings.vllm_image, trtllm_image=settings.trtllm_image, sglang_image=settings.sglang_image
    )
    ports = Ports(kube, router, defaults, settings.admission_rules(), runtime=HttpEngineRuntime())
    RUNTIME = Runtime(ports, router, metrics)
    return RUNTIME


# --- handlers --------------------------------------------------------------------------------------


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(**kwargs: Any) -> None:
    await asyncio.to_thread(runtime().reconcile, kwargs["namespace"], kwargs["name"], kwargs["spec"])


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def evaluate(**kwargs: Any) -> None:
    """Re-evaluate this object every evaluationIntervalSeconds (the spec here is live)."""
    namespace, name, spec, stopped = kwargs["namespace"], kwargs["name"], kwargs["spec"], kwargs["stopped"]
    while not stopped:
        try:
            await asyncio.to_thread(runtime().reconcile, namespace, name, spec)
        except Exception as error:  # keep evaluating; the next tick reads the world again
            log.exception("%s/%s: reconcile failed: %s", namespace, name, error)
        interval = int((spec.get("tuning") or {}).get("evaluationIntervalSeconds") or 30)
        await stopped.wait(max(1, interval))


@kopf.on.event("apps", "v1", "deployments", labels={LABEL: kopf.PRESENT})
async def on_engine_deployment(**kwargs: Any) -> None:
    """An engine Deployment moved (a rollout progressed or finished): reconcile its owner now."""
    event, namespace, labels = kwargs["event"], kwargs["namespace"], kwargs["labels"]
    if event.get("type") in (None, "DELETED"):
        return
    owner = labels.get(LABEL)
    if owner:
        try:
            await asyncio.to_thread(runtime().reconcile, namespace, owner)
        except Exception as error:
            log.warning("%s/%s: reconcile after a Deployment change failed: %s", namespace, owner, error)


# --- running ---------------------------------------------------------------------------------------


def kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    kopf_conf = kopf.OperatorSettings()
    # kopf keeps its own bookkeeping in annotations, never in our (schema-checked) status
    kopf_conf.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="batchknee.io")
    kopf_conf.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="batchknee.io", key="last-handled-configuration"
    )
    kopf_conf.posting.enabled = False  # the Events are ours, each naming its inputs
    kopf_conf.peering.name = settings.peering_name
    kopf_conf.peering.mandatory = settings.peering == "mandatory"
    kopf_conf.peering.stealth = True
    kopf_conf.execution.max_workers = 8
    # Watching given namespaces, kopf needs no cluster-scoped reads: without this it would list and
    # watch every Namespace and CRD, which a namespaced install (Roles only) must not need.
    kopf_conf.scanning.disabled = bool(settings.namespaces)
    return kopf_conf


def run(settings: OperatorSettings) -> int:
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    configure(settings)
    priority = (
        settings.peering_priority if settings.peering_priority is not None else random.randint(1, 2**31 - 1)
    )
    liveness = (
        f"http://{settings.health_address}:{settings.health_port}/healthz" if settings.health_port else None
    )
    kopf.run(
        settings=kopf_settings(settings),
        standalone=True if settings.peering == "standalone" else None,
        priority=priority,  # (no peering_name here: kopf would make peering mandatory; it is in kopf_settings)
        liveness_endpoint=liveness,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
    )
    return 0
