"""kopf registration only: every handler funnels into `reconcile` for one object.

- create / update / resume of an LLMServing, and a daemon per object that re-evaluates every
  `spec.tuning.evaluationIntervalSeconds` (read live, so a change applies at the next wait);
- changes of an engine Deployment (its rollout progressing) reconcile the owning LLMServing;
- one reconcile per object at a time (an asyncio lock per object, taken before work goes to a
  thread); different objects run in parallel;
- the object's state (route, cache, lock, gauges) is freed on delete and when its daemon ends;
- kopf peering: replicas see each other through a KopfPeering/ClusterKopfPeering object and only
  the highest-priority one acts (priorities are random by default, so two never tie and pause).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from batchknee.adapters.engine_runtime import HttpEngineRuntime
from batchknee.adapters.kubernetes import KubernetesAdapter, load_config, pooled_client
from batchknee.adapters.observing import RoutedObserver
from batchknee.api.models import GROUP, PLURAL, VERSION
from batchknee.api.resolve import SpecError, observation_target, parse_llmserving
from batchknee.core.observation import ObservationTarget
from batchknee.operator_metrics import OperatorMetrics
from batchknee.ports import TransientApiError
from batchknee.reconcile import Outcome, Ports, reconcile
from batchknee.render import LABEL, RenderDefaults
from batchknee.settings import OperatorSettings

log = logging.getLogger("batchknee")


def prometheus_observer(settings: OperatorSettings) -> RoutedObserver:
    """The Prometheus adapter: one PrometheusObserver per URL behind a cache that serves every
    object of a tick with one batch of queries (one refresh in flight per URL), routed per object."""
    from batchknee.adapters.prometheus import CachedObserver, PrometheusObserver

    def observer_for(url: str) -> PrometheusObserver:
        return PrometheusObserver(
            url,
            timeout_s=settings.prometheus_timeout_seconds,
            min_samples=settings.prometheus_min_samples,
        )

    cache = CachedObserver(observer_for, ttl_s=settings.prometheus_cache_seconds)
    return RoutedObserver(cache, settings.prometheus_url, settings.prometheus_allowed_urls)


def _target(body: Any) -> ObservationTarget | None:
    """What the object's engines are observed as, from the body kopf handed over (None when the
    spec does not parse: reconcile reports that)."""
    try:
        # kopf's nested views as plain dicts; only what the target depends on (not the managed
        # fields, annotations and status, which are most of the body)
        meta = body.get("metadata") or {}
        wanted = {k: body.get(k) for k in ("apiVersion", "kind", "spec") if k in body}
        wanted["metadata"] = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation") if k in meta}
        plain = json.loads(json.dumps(wanted, default=dict))
        return observation_target(parse_llmserving(plain))
    except (SpecError, ValueError, TypeError, KeyError):
        return None


@dataclass
class Runtime:
    """What the handlers share: the ports, the metrics and an asyncio lock per object (taken
    before any work goes to a thread, so a waiting object holds no thread)."""

    ports: Ports
    router: RoutedObserver
    metrics: OperatorMetrics
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)  # watched ([]: every namespace)
    targets: dict[tuple[str, str], ObservationTarget] = field(default_factory=dict)
    # Reconciles wait mostly on the apiserver: more of them in flight than asyncio's default
    # executor allows (CPUs + 4) keeps a thousand objects' startup short.
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(16, thread_name_prefix="reconcile")
    )

    async def run(self, namespace: str, name: str, body: Any = None) -> Outcome:
        """One reconcile of one object; only ever called from the event loop's thread."""
        key = (namespace, name)
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            if body is not None:
                spec = body.get("spec") or {}
                self.router.route(namespace, name, (spec.get("prometheus") or {}).get("url"))
                target = _target(body)
                if target is not None:
                    self.targets[key] = target
            target = self.targets.get(key)
            if target is not None:
                await self.router.prepare(target, datetime.now(UTC))
            loop = asyncio.get_running_loop()
            outcome = await loop.run_in_executor(self.executor, self.reconcile, namespace, name)
        if not outcome.found or outcome.deleting:
            self.forget(namespace, name)
        return outcome

    def reconcile(self, namespace: str, name: str) -> Outcome:
        started = time.perf_counter()
        try:
            outcome = reconcile(namespace, name, self.ports, datetime.now(UTC))
        except TransientApiError as error:  # the next tick tries again; nothing is Degraded for it
            self.metrics.errors.inc()
            log.warning("%s/%s: %s; trying again at the next evaluation", namespace, name, error)
            return Outcome(namespace, name, error=str(error))
        except Exception:
            self.metrics.errors.inc()
            raise
        self.metrics.record(outcome, time.perf_counter() - started)
        if outcome.error:
            log.warning("%s/%s: %s", namespace, name, outcome.error)
        elif outcome.decision is not None and outcome.decision.rolls:
            log.info("%s/%s: %s", namespace, name, outcome.decision.reason)
        return outcome

    def forget(self, namespace: str, name: str) -> None:
        """Free every piece of per-object state: route, cache entries, lock, target, gauges."""
        key = (namespace, name)
        self.router.forget(namespace, name)
        self.metrics.forget(namespace, name)
        self.targets.pop(key, None)
        lock = self.locks.get(key)
        if lock is not None and not lock.locked():
            del self.locks[key]


RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    if RUNTIME is None:
        raise RuntimeError("the operator runtime is not configured: start it with `batchknee operator`")
    return RUNTIME


def configure(settings: OperatorSettings) -> Runtime:
    """Connect to the cluster, start /metrics, and build the runtime the handlers use."""
    global RUNTIME
    load_config()
    kube = KubernetesAdapter(pooled_client(settings.reconcile_workers + 4))
    router = prometheus_observer(settings)
    metrics = OperatorMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_address, settings.metrics_port)
    if settings.peering != "standalone":
        kube.ensure_peering(settings.peering_name, settings.namespaces)
    defaults = RenderDefaults(
        vllm_image=settings.vllm_image, trtllm_image=settings.trtllm_image, sglang_image=settings.sglang_image
    )
    executor = ThreadPoolExecutor(settings.reconcile_workers, thread_name_prefix="reconcile")
    ports = Ports(
        kube,
        router,
        defaults,
        settings.admission_rules(),
        runtime=HttpEngineRuntime(),
        prometheus_url_refusal=router.refusal,
    )
    RUNTIME = Runtime(ports, router, metrics, executor=executor, namespaces=list(settings.namespaces))
    return RUNTIME


# --- handlers --------------------------------------------------------------------------------------


# kopf's own HTTP session has no connection limit: a thousand objects found at startup are a
# thousand concurrent TLS handshakes (each connection's buffers stay in the process's heap, and the
# apiserver serves nothing else meanwhile). Its watch streams hold a connection each (at most three
# per watched namespace: LLMServings, Deployments, peering; or a handful cluster-wide); 32 more
# carry kopf's patches.
KOPF_SPARE_CONNECTIONS = 32


def kopf_connection_limit(namespaces: list[str]) -> int:
    return 3 * max(len(namespaces), 1) + 8 + KOPF_SPARE_CONNECTIONS


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
    """The credentials kopf would use (the kubernetes client's: in-cluster or kubeconfig), in a
    session whose connections are bounded (see KOPF_SPARE_CONNECTIONS)."""
    info = kopf.login_via_client(**kwargs)
    if info is None:
        return None
    namespaces = RUNTIME.namespaces if RUNTIME is not None else []
    headers = info.as_http_headers()
    if info.username and info.password and "Authorization" not in headers:  # (older kopf leaves it out)
        headers["Authorization"] = aiohttp.BasicAuth(info.username, info.password).encode()
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=kopf_connection_limit(namespaces), ssl=info.as_ssl_context()),
        headers=headers,
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        aiohttp_session=session,
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
    )


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(**kwargs: Any) -> None:
    await runtime().run(kwargs["namespace"], kwargs["name"], kwargs["body"])


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def on_delete(**kwargs: Any) -> None:
    """Free the object's state (optional: no finalizer of its own is added for this)."""
    runtime().forget(kwargs["namespace"], kwargs["name"])


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def evaluate(**kwargs: Any) -> None:
    """Re-evaluate this object every evaluationIntervalSeconds (the body here is live). When the
    daemon ends (the object is deleted or no longer watched), its state is freed."""
    namespace, name, body, stopped = kwargs["namespace"], kwargs["name"], kwargs["body"], kwargs["stopped"]

    def interval() -> int:
        tuning = (body.get("spec") or {}).get("tuning") or {}
        return max(1, int(tuning.get("evaluationIntervalSeconds") or 30))

    try:
        # on_change has just reconciled (create or resume): the first evaluation comes within one
        # interval, spread at random so that a thousand objects started together do not tick together.
        await stopped.wait(interval() * random.uniform(0.5, 1.5))
        while not stopped:
            try:
                await runtime().run(namespace, name, body)
            except Exception as error:  # keep evaluating; the next tick reads the world again
                log.exception("%s/%s: reconcile failed: %s", namespace, name, error)
            await stopped.wait(interval())
    finally:
        if RUNTIME is not None:
            RUNTIME.forget(namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL: kopf.PRESENT})
async def on_engine_deployment(**kwargs: Any) -> None:
    """An engine Deployment moved (a rollout progressed or finished): reconcile its owner now."""
    event, namespace, labels = kwargs["event"], kwargs["namespace"], kwargs["labels"]
    # Listed at startup (None), deleted, or just created (ADDED: by the reconcile that has just
    # written its owner's status — a second one would find nothing new): only changes count.
    if event.get("type") in (None, "DELETED", "ADDED"):
        return
    owner = labels.get(LABEL)
    if owner:
        try:
            await runtime().run(namespace, owner)
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
