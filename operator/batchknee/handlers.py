"""kopf registration only: every handler funnels into `reconcile` for one object.

- an LLMServing first seen (created, or listed at startup) or with a new spec (a new generation)
  is reconciled at once, from a watch-only handler (kopf writes no annotations on it);
- one scheduler (scheduling.py) re-evaluates every watched object every
  `spec.tuning.evaluationIntervalSeconds` (read live from kopf's index of LLMServings), ticks
  spread evenly over the interval, a bounded number in flight, a failing evaluation never stopping
  it — no kopf daemon, so no task and no finalizer per object (nothing here requires one; the
  finalizer an older build's daemons left on an LLMServing is removed when it is seen);
- changes of an engine Deployment (its rollout progressing) reconcile the owning LLMServing; the
  engine Deployments, Services and PodDisruptionBudgets their watches bring are what reconcile
  reads (the watch cache), so a steady reconcile asks the apiserver nothing for them;
- one reconcile per object at a time (an asyncio lock per object, taken before work goes to a
  thread); different objects run in parallel;
- the object's state (route, cache, lock, gauges) is freed on delete and when it leaves the watch
  (kopf's index drops it: deleted, deleting, or no longer watched);
- kopf peering: replicas see each other through a KopfPeering/ClusterKopfPeering object and only
  the highest-priority one acts (priorities are random by default, so two never tie and pause); kopf
  pauses its watches, and the scheduler reads the same peering object to pause with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import aiohttp
import kopf

from batchknee import logs
from batchknee.adapters import allocator
from batchknee.adapters.engine_runtime import HttpEngineRuntime
from batchknee.adapters.kubernetes import KubernetesAdapter, WatchCache, load_config, pooled_client
from batchknee.adapters.observing import RoutedObserver, normalise_url
from batchknee.adopt import tuned_workload, tuner
from batchknee.api.models import DEFAULT_WINDOW_SECONDS, GROUP, PLURAL, VERSION
from batchknee.api.resolve import SpecError, observation_target, parse_llmserving
from batchknee.core.observation import ObservationTarget
from batchknee.operator_metrics import OperatorMetrics
from batchknee.pacing import RolloutPacer
from batchknee.ports import TransientApiError
from batchknee.reconcile import FAN_OUT_THREADS, Outcome, Ports, reconcile, report_api_errors
from batchknee.render import LABEL, RenderDefaults
from batchknee.scheduling import Key, Scheduler
from batchknee.settings import OperatorSettings

APISERVER_MAX_JSON_DEPTH = 10_000  # encoding/json's nesting limit, which the apiserver decodes with
log = logging.getLogger("batchknee")


def prometheus_observer(settings: OperatorSettings) -> RoutedObserver:
    """The Prometheus adapter: one PrometheusObserver per URL behind a cache that serves every
    object of a tick with one batch of queries (one refresh in flight per URL), routed per object.
    Each URL an LLMServing chose holds one answer's worth of memory at most, under one budget
    they share but for the first bytes of each answer (small answers pass however full it is); the
    operator's own Prometheus is bounded by its query threads alone."""
    from batchknee.adapters.prometheus import (
        ANSWER_BYTES_RESERVED,
        MAX_BODY_BYTES,
        AnswerBudget,
        CachedObserver,
        PrometheusObserver,
    )

    chosen = AnswerBudget()

    def observer_for(url: str) -> PrometheusObserver:
        own = url == normalise_url(settings.prometheus_url)
        return PrometheusObserver(
            url,
            timeout_s=settings.prometheus_timeout_seconds,
            min_samples=settings.prometheus_min_samples,
            budget=None
            if own
            else AnswerBudget(MAX_BODY_BYTES, parent=chosen, reserved=ANSWER_BYTES_RESERVED),
            # the operator's credentials, CA and headers are for its own Prometheus, never a URL a tenant chose
            bearer_token_file=settings.prometheus_bearer_token_file if own else "",
            ca_file=settings.prometheus_ca_file if own else "",
            headers=settings.prometheus_headers if own else None,
            paced=not own,  # a silent chosen URL must not fill the refresh threads the chosen share
        )

    cache = CachedObserver(observer_for, ttl_s=settings.prometheus_cache_seconds)
    return RoutedObserver(cache, settings.prometheus_url, settings.prometheus_allowed_urls)


def _target(body: Any) -> ObservationTarget | None:
    """What the object's engines are observed as, from the body kopf handed over (None when the
    spec does not parse: reconcile reports that)."""
    try:
        # kopf's nested views as plain dicts; only what the target depends on (not the managed
        # fields, annotations and status, which are most of the body; nor the free-form engine
        # options, up to the apiserver's 3 MB: this runs on the event loop at every spec change, and
        # walking them took half a second there, every watch of the operator waiting)
        meta = body.get("metadata") or {}
        wanted = {k: body.get(k) for k in ("apiVersion", "kind") if k in body}
        wanted["spec"] = {k: v for k, v in (body.get("spec") or {}).items() if k != "extraLlmApiOptions"}
        wanted["metadata"] = {k: meta.get(k) for k in ("name", "namespace", "uid", "generation") if k in meta}
        plain = json.loads(json.dumps(wanted, default=dict))
        return observation_target(parse_llmserving(plain))
    except (SpecError, ValueError, TypeError, KeyError, RecursionError):
        return None


REFUSED = ("invalid-spec", "forbidden")  # the holds of a spec reconcile refuses


@dataclass(frozen=True)
class Peering:
    """This replica in kopf's peering: what the scheduler needs to pause when kopf does."""

    name: str
    identity: str  # kopf's id of this replica (passed to kopf.run)
    priority: int
    mandatory: bool
    statuses: Callable[[], list[dict[str, Any]] | None]  # each peering object's status


# Evaluations under way at once: more than the reconcile workers, since one that waits for its
# Prometheus refresh waits as a coroutine, holding no worker (objects of another Prometheus go on).
# The rest wait in the scheduler's heap, not as parked coroutines.
EVALUATIONS_IN_FLIGHT = 16
ENGINE_WORKERS = 8  # reconciles of Live LLMServings at once
# ... of those in one namespace at once: a tenant whose engines answer slowly holds a quarter of the
# Live workers, and as many of the scheduler's slots, however many LLMServings it has. The same
# lane holds the namespace's LLMServings that read a Prometheus of their own (a slow one holds the
# slot for its deadline while the evaluation waits on it).
LIVE_EVALUATIONS_PER_NAMESPACE = ENGINE_WORKERS // 4


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
    adopting: set[tuple[str, str]] = field(default_factory=set)  # spec.targetRef: observed by pod names
    live: set[tuple[str, str]] = field(default_factory=set)  # actuation Live: its reconcile calls its engines
    launched_live: dict[tuple[str, str], bool] = field(default_factory=dict)  # by the scheduler, at launch
    evaluated: dict[tuple[str, str], float] = field(default_factory=dict)  # loop time of the last
    spec_versions: dict[tuple[str, str], tuple[Any, Any]] = field(default_factory=dict)  # (uid, generation)
    scheduler: Scheduler | None = None
    max_in_flight: int = EVALUATIONS_IN_FLIGHT  # scheduled evaluations at once
    peering: Peering | None = None  # None: standalone
    outranked: bool = False  # another replica acts (kopf peering): the scheduler pauses
    background: list[asyncio.Task[None]] = field(default_factory=list)
    cache: WatchCache = field(default_factory=WatchCache)  # what the watches delivered, for reconcile
    # since when every reconcile of an object has ended on an apiserver error its retries did not clear
    api_failing_since: dict[tuple[str, str], datetime] = field(default_factory=dict)
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    # the reconcile workers (settings.reconcile_workers)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="reconcile")
    )
    # Live actuation's reconciles wait on the engines' runtime endpoints (a tenant's pods, which may
    # not answer before their timeout): workers of their own, so they never hold those of the rest
    engine_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(ENGINE_WORKERS, thread_name_prefix="reconcile-live")
    )

    async def run(self, namespace: str, name: str, body: Any = None) -> Outcome:
        """One reconcile of one object; only ever called from the event loop's thread."""
        key = (namespace, name)
        # Whether it may call engine pods was decided with its lane, when the scheduler launched
        # it: a spec flipped to Live since must not put engine calls on the shared worker (or
        # outside the lane). Not launched by the scheduler: as its spec says now, before any wait.
        launched_live = self.launched_live.pop(key, None)
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            noted = self.spec_versions.get(key)
            self.evaluated[key] = asyncio.get_running_loop().time()
            if body is not None:
                self.note(namespace, name, body)
            live = launched_live if launched_live is not None else key in self.live
            target = self.prepared_target(key)
            if target is not None:
                await self.router.prepare(target, self.clock())
            loop = asyncio.get_running_loop()
            executor = self.engine_executor if live else self.executor
            outcome = await loop.run_in_executor(executor, self.reconcile, namespace, name, live)
            if outcome.status is not None and outcome.status.hold_reason in REFUSED:
                # refused past parsing (an admission rule, a Prometheus URL not allowed, a model that
                # does not fit): its scope would be refreshed, and laned, for nothing until it changes
                self.targets.pop(key, None)
        # gone, unless another object of the name was noted meanwhile (deleted and created again
        # while this evaluation read it): that one's state stays (none noted: its delete was seen)
        if (not outcome.found or outcome.deleting) and self.spec_versions.get(key) in (noted, None):
            self.forget(namespace, name)
        return outcome

    def note(self, namespace: str, name: str, body: Any) -> None:
        """What the object's spec says about observing it: its Prometheus URL and target."""
        spec = body.get("spec") or {}
        self.router.route(namespace, name, (spec.get("prometheus") or {}).get("url"))
        target = _target(body)
        if target is not None:
            self.targets[(namespace, name)] = target
        else:  # refused: its last good scope would be refreshed, and lane it, for nothing
            self.targets.pop((namespace, name), None)
        if spec.get("targetRef"):
            self.adopting.add((namespace, name))
        else:
            self.adopting.discard((namespace, name))
        if (spec.get("tuning") or {}).get("actuation") == "Live":
            self.live.add((namespace, name))
        else:
            self.live.discard((namespace, name))

    def prepared_target(self, key: tuple[str, str]) -> ObservationTarget | None:
        """The target whose scope the event loop refreshes before the reconcile, if any: a managed
        engine Deployment's. One not yet created has no series to read (a thousand objects' first
        evaluations would otherwise refresh every engine's series each cache period for nobody;
        one the watch has not brought yet is read in the reconcile's thread). An adopted
        workload's pods are a scope of their own, known only to its reconcile, which refreshes it."""
        target = self.targets.get(key)
        if target is None or key in self.adopting or not self.cache.has("Deployment", *key):
            return None
        return target

    def lane(self, key: tuple[str, str]) -> str | None:
        """The scheduler's lane for an evaluation it launches (its namespace, or none); whether
        that evaluation may call engine pods is decided with it (`run`)."""
        self.launched_live[key] = key in self.live
        return key[0] if self.in_lane(key) else None

    def in_lane(self, key: tuple[str, str]) -> bool:
        """Whether the evaluation may wait long on what the object's own spec chose — Live engine
        calls, its own Prometheus, an adopted workload's pods (a scope of their own, refreshed in
        the reconcile), or a refresh of a scope of its own making (a selector or a window other than
        the default) that is not fresh: one URL's refreshes run one at a time, so many such scopes
        would queue every other object's behind them. Such evaluations of one namespace run at most
        LIVE_EVALUATIONS_PER_NAMESPACE at once; a fleet sharing one window finds its scope fresh
        after the first and is not held back, and an object without engines yet refreshes nothing."""
        target = self.prepared_target(key)
        own_refresh = (
            target is not None
            and (bool(target.selector) or target.window_s != DEFAULT_WINDOW_SECONDS)
            and not self.router.is_fresh(target)
        )
        return key in self.live or key in self.adopting or self.router.reads_its_own(*key) or own_refresh

    def reconcile(self, namespace: str, name: str, engine_calls: bool = True) -> Outcome:
        started = time.perf_counter()
        now = self.clock()
        try:
            outcome = reconcile(namespace, name, self.ports, now, engine_calls=engine_calls)
        except TransientApiError as error:  # the next tick tries again; Degraded only if it lasts
            self.metrics.errors.inc()
            log.warning("%s/%s: %s; trying again at the next evaluation", namespace, name, error)
            since = self.api_failing_since.setdefault((namespace, name), now)
            return report_api_errors(namespace, name, self.ports, now, error, since)
        except Exception:
            self.metrics.errors.inc()
            raise
        self.api_failing_since.pop((namespace, name), None)
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
        self.adopting.discard(key)
        self.live.discard(key)
        self.launched_live.pop(key, None)
        self.evaluated.pop(key, None)
        self.spec_versions.pop(key, None)
        self.api_failing_since.pop(key, None)
        self.ports.pacer.done(key)
        lock = self.locks.get(key)
        if lock is not None and not lock.locked():
            del self.locks[key]


RUNTIME: Runtime | None = None


def runtime() -> Runtime:
    if RUNTIME is None:
        raise RuntimeError("the operator runtime is not configured: start it with `batchknee operator`")
    return RUNTIME


def configure(settings: OperatorSettings, identity: str = "", priority: int = 0) -> Runtime:
    """Connect to the cluster, start /metrics, and build the runtime the handlers use (`identity`
    and `priority`: this replica's in kopf peering)."""
    global RUNTIME
    load_config()
    cache = WatchCache()
    # a connection for each thread that may call the apiserver at once: the workers, Live's
    # workers and the fan-out of their requests (reconcile.together); 4 spare
    callers = settings.reconcile_workers + ENGINE_WORKERS + FAN_OUT_THREADS + 4
    kube = KubernetesAdapter(pooled_client(callers), cache=cache)
    router = prometheus_observer(settings)
    metrics = OperatorMetrics()
    metrics.time_full_collections()
    if settings.metrics_port:
        metrics.serve(settings.metrics_address, settings.metrics_port)
    if settings.peering != "standalone":
        kube.ensure_peering(settings.peering_name, settings.namespaces)
    defaults = RenderDefaults(
        vllm_image=settings.vllm_image,
        trtllm_image=settings.trtllm_image,
        sglang_image=settings.sglang_image,
        disruption_budgets=settings.disruption_budgets,
    )
    executor = ThreadPoolExecutor(settings.reconcile_workers, thread_name_prefix="reconcile")
    ports = Ports(
        kube,
        router,
        defaults,
        settings.admission_rules(),
        runtime=HttpEngineRuntime(),
        prometheus_url_refusal=router.refusal,
        pacer=RolloutPacer(settings.template_rollouts_at_once),
    )
    metrics.track_pacer(ports.pacer)
    peering = None
    if settings.peering != "standalone":
        peering = Peering(
            name=settings.peering_name,
            identity=identity,
            priority=priority,
            mandatory=settings.peering == "mandatory",
            statuses=lambda: kube.peering_statuses(settings.peering_name, list(settings.namespaces)),
        )
    RUNTIME = Runtime(
        ports,
        router,
        metrics,
        executor=executor,
        namespaces=list(settings.namespaces),
        max_in_flight=max(EVALUATIONS_IN_FLIGHT, settings.reconcile_workers),
        peering=peering,
        cache=cache,
    )
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


# kopf's default finalizer name, which every kopf operator shares; an older build's per-object daemons
# put it on LLMServings. kopf takes its configured finalizer off every object it watches where no
# handler of its own needs one: with this name, it would take other kopf operators' finalizers off
# every Deployment, Service and PodDisruptionBudget of the cluster (their delete handlers never run).
LEGACY_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
FINALIZER = f"{GROUP}/kopf"  # ours: nothing adds it, so kopf takes only ours off


def _without_legacy_finalizer(body: dict[str, Any]) -> None:
    meta = body.get("metadata") or {}
    meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != LEGACY_FINALIZER]


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_llmserving(**kwargs: Any) -> None:
    """An LLMServing seen for the first time (listed at startup, or created) or with a new spec (a
    new generation) is reconciled at once; a deleted or deleting one has its state freed. Watching
    only, no kopf change handler: kopf then writes nothing on the object (no last-handled and
    progress annotations, no finalizer); the finalizer an older build left goes with kopf's patch."""
    event, namespace, name, meta = kwargs["event"], kwargs["namespace"], kwargs["name"], kwargs["meta"]
    if LEGACY_FINALIZER in (meta.get("finalizers") or []):
        kwargs["patch"].fns.append(_without_legacy_finalizer)
    rt = runtime()
    remember(rt.cache, "LLMServing", f"{GROUP}/{VERSION}", event)
    if event.get("type") == "DELETED" or meta.get("deletionTimestamp"):
        rt.forget(namespace, name)
        return
    key = (namespace, name)
    spec_version = (meta.get("uid"), meta.get("generation"))
    if rt.spec_versions.get(key) == spec_version:
        return  # a write to status or metadata (ours, at each evaluation): the scheduler's ticks cover it
    rt.spec_versions[key] = spec_version
    rt.note(namespace, name, kwargs["body"])
    if rt.scheduler is not None:  # (started before kopf's watches: always)
        rt.scheduler.soon(key)  # at once, in turn: this handler does not wait for the reconcile
        return
    try:
        await rt.run(namespace, name, kwargs["body"])
    except Exception as error:  # the scheduler evaluates it again at its interval
        log.exception("%s/%s: reconcile failed: %s", namespace, name, error)


def evaluation_interval(spec: Any) -> float:
    tuning = (spec or {}).get("tuning") or {}
    try:
        return float(max(1, int(tuning.get("evaluationIntervalSeconds") or 30)))
    except (TypeError, ValueError):  # admission rejects it; never let the index drop the object
        return 30.0


@kopf.index(GROUP, VERSION, PLURAL)
def llmserving_intervals(**kwargs: Any) -> dict[Key, float]:
    """What the scheduler evaluates: every watched LLMServing not being deleted, with its interval
    (kopf keeps the index from its watch, so a change applies at once and a delete drops it)."""
    if kwargs["meta"].get("deletionTimestamp"):
        return {}
    return {(kwargs["namespace"], kwargs["name"]): evaluation_interval(kwargs["spec"])}


@kopf.index(GROUP, VERSION, PLURAL)
def llmserving_tuners(**kwargs: Any) -> dict[tuple[str, str, str], tuple[str, str]]:
    """Who adopts which workload: (namespace, kind, name) → (creationTimestamp, LLMServing), from the
    watch. kopf fills its indexes from the first listing before any handler runs, so the first
    evaluation after a start already knows every rival."""
    workload = tuned_workload(kwargs["body"])
    return {} if workload is None else {(kwargs["namespace"], *workload): tuner(kwargs["body"])}


COPY_ATTEMPTS = 100


class Tuners:
    """kopf's index of adopted workloads as the Kubernetes adapter reads it, from the reconcile
    threads while the event loop's thread writes it."""

    def __init__(self, index: kopf.Index[tuple[str, str, str], tuple[str, str]]) -> None:
        self.index = index

    def __call__(self, namespace: str, kind: str, name: str) -> list[tuple[str, str]]:
        for _ in range(COPY_ATTEMPTS):  # a store that changes size while copied raises; copy again
            try:
                store = self.index.get((namespace, kind, name))
                return list(store) if store is not None else []
            except RuntimeError:
                continue
        raise RuntimeError(f"the index of {kind} {namespace}/{name} kept changing while read")


class Intervals(Mapping[Key, float]):
    """kopf's index (key → a store of one value per object) as key → interval."""

    def __init__(self, index: kopf.Index[Key, float]) -> None:
        self.index = index

    def __getitem__(self, key: Key) -> float:
        return next(iter(self.index[key]))

    def __iter__(self) -> Iterator[Key]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index


@kopf.on.startup()
async def start_scheduler(**kwargs: Any) -> None:
    rt = runtime()
    intervals = Intervals(kwargs["llmserving_intervals"])
    if isinstance(rt.ports.kube, KubernetesAdapter):
        rt.ports.kube.tuners_index = Tuners(kwargs["llmserving_tuners"])
    rt.scheduler = Scheduler(
        evaluate=rt.run,
        known=lambda: intervals,
        last_evaluated=rt.evaluated.get,
        forget=rt.forget,
        max_in_flight=rt.max_in_flight,
        paused=lambda: rt.outranked,
        settled=freeze_found_fleet,
        lane=rt.lane,
        lane_limit=LIVE_EVALUATIONS_PER_NAMESPACE,
    )
    rt.background.append(asyncio.get_running_loop().create_task(rt.scheduler.run(), name="scheduler"))
    if rt.peering is not None:
        rt.outranked = True  # until the first look at the peers
        rt.background.append(asyncio.get_running_loop().create_task(watch_peers(rt), name="peers"))


def freeze_found_fleet() -> None:
    """Every LLMServing found at startup has been evaluated: what the operator keeps for them lives
    on, and Python's full collections need not walk it again (`allocator.freeze_long_lived`)."""
    frozen = allocator.freeze_long_lived()
    log.info(
        "every LLMServing found was evaluated; %d long-lived objects kept out of full collections", frozen
    )


@kopf.on.cleanup()
async def stop_scheduler(**_: Any) -> None:
    if RUNTIME is None:
        return
    if RUNTIME.scheduler is not None:
        await RUNTIME.scheduler.stop()
    for task in RUNTIME.background:
        task.cancel()
    await asyncio.gather(*RUNTIME.background, return_exceptions=True)


def outranked(statuses: list[dict[str, Any]], identity: str, priority: int, now: datetime) -> bool:
    """kopf's rule for pausing: another live peer (seen within its lifetime) with a priority as
    high as ours, in any of the peering objects."""
    for status in statuses:
        for peer, info in status.items():
            if peer == identity or not isinstance(info, dict):
                continue
            try:
                lastseen = datetime.fromisoformat(str(info["lastseen"]))
                if lastseen.tzinfo is None:
                    lastseen = lastseen.replace(tzinfo=UTC)
                alive = lastseen + timedelta(seconds=int(info.get("lifetime", 60))) > now
                rank = int(info.get("priority", 0))
            except (KeyError, TypeError, ValueError):
                continue
            if alive and rank >= priority:
                return True
    return False


PEERS_CHECK_S = 5.0


async def watch_peers(rt: Runtime) -> None:
    """Keep rt.outranked as kopf's own pause decision would be, from the same peering objects."""
    assert rt.peering is not None
    loop = asyncio.get_running_loop()
    # its own thread: behind the reconcile workers' queue, a pause was seen only once up to sixteen
    # evaluations had run, each of them writing while another replica acted
    reader = ThreadPoolExecutor(1, thread_name_prefix="peers")
    first = True
    while True:
        try:
            statuses = await loop.run_in_executor(reader, rt.peering.statuses)
            if statuses is None:  # no peering object (or CRD): kopf runs alone unless peering is mandatory
                paused = rt.peering.mandatory
            else:
                paused = outranked(statuses, rt.peering.identity, rt.peering.priority, datetime.now(UTC))
            if paused != rt.outranked:
                log.info("scheduled evaluations %s (kopf peering)", "paused" if paused else "resumed")
            if paused and (first or not rt.outranked):
                # kopf's watches pause too: what they brought before (before the pause, or at the
                # start of a standby that kopf did not start paused) may be old by the resume, and
                # its listing then sends no DELETED. Not at the resume: kopf has listed everything
                # again by then, and what does not change sends no other event.
                rt.cache.clear()
            rt.outranked = paused
            first = False
        except Exception as error:  # keep the last decision; look again
            log.warning("could not read the peering objects: %s", error)
        await asyncio.sleep(PEERS_CHECK_S)


def remember(
    cache: WatchCache, kind: str, api_version: str, event: Mapping[str, Any], *, label: str | None = None
) -> None:
    """Keep the object a watch event brought in the cache (with `label`: only while it carries it,
    so an object that stops being the operator's is read from the apiserver again). Listed objects
    come without their kind: it is put back, as a GET would return it."""
    body = event.get("object") or {}
    meta = body.get("metadata") or {}
    if event.get("type") is None:  # listed (kopf's convention): at the watch's start, or after a 410
        cache.listed(kind, meta.get("namespace") or "")
    if event.get("type") == "DELETED" or (label is not None and label not in (meta.get("labels") or {})):
        cache.gone(kind, meta.get("namespace") or "", meta.get("name") or "")
    else:
        cache.seen(kind, {"apiVersion": api_version, "kind": kind, **body})


# Watched unfiltered (kopf filters labels in the process, not in the watch): a Deployment whose label
# is taken off must leave the cache.
@kopf.on.event("apps", "v1", "deployments")
async def on_deployment(**kwargs: Any) -> None:
    """Cached while it is an engine Deployment; one that moved (a rollout progressed or finished)
    has its owner reconciled now."""
    event, namespace, labels = kwargs["event"], kwargs["namespace"], kwargs["labels"]
    rt = runtime()
    remember(rt.cache, "Deployment", "apps/v1", event, label=LABEL)
    # Listed at startup (None), deleted, or just created (ADDED: by the reconcile that has just
    # written its owner's status — a second one would find nothing new): only changes count.
    if event.get("type") in (None, "DELETED", "ADDED"):
        return
    owner = labels.get(LABEL)
    if not owner:
        return
    if rt.scheduler is not None:  # in turn with the others; events while it waits count once
        if (namespace, owner) in rt.scheduler.known():  # not a Deployment labelled for no LLMServing
            rt.scheduler.soon((namespace, owner))
        return
    try:
        await rt.run(namespace, owner)
    except Exception as error:
        log.warning("%s/%s: reconcile after a Deployment change failed: %s", namespace, owner, error)


# The engine Service and PodDisruptionBudget: read from their watches too, so a steady reconcile asks
# the apiserver nothing for them (two GETs per LLMServing and interval before: 67 a second at a
# thousand with a 30 s interval). A change to one needs no reconcile now: the next evaluation puts
# back what someone else altered, as it did when it read them.
@kopf.on.event("", "v1", "services")
async def on_service(**kwargs: Any) -> None:
    remember(runtime().cache, "Service", "v1", kwargs["event"], label=LABEL)


@kopf.on.event("policy", "v1", "poddisruptionbudgets")
async def on_disruption_budget(**kwargs: Any) -> None:
    remember(runtime().cache, "PodDisruptionBudget", "policy/v1", kwargs["event"], label=LABEL)


# --- running ---------------------------------------------------------------------------------------


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base. kopf's change handlers compare an object with the "essence" last handled, and
    kopf builds that essence for every event it processes, a deep copy of the whole body; with no
    change handler here (watching and indexing only), nothing reads it, and building it took 7 %
    of the operator's busy time while a thousand LLMServings started."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return None

    def fetch(self, *, body: Any) -> None:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


def kopf_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    kopf_conf = kopf.OperatorSettings()
    # kopf keeps its own bookkeeping in annotations, never in our (schema-checked) status
    kopf_conf.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="batchknee.io")
    kopf_conf.persistence.diffbase_storage = NoDiffBase()
    kopf_conf.persistence.finalizer = FINALIZER
    kopf_conf.posting.enabled = False  # the Events are ours, each naming its inputs
    kopf_conf.peering.name = settings.peering_name
    kopf_conf.peering.mandatory = settings.peering == "mandatory"
    kopf_conf.peering.stealth = True
    kopf_conf.execution.max_workers = 8
    # kopf keeps a worker per object while its events come, and waits this long for another before
    # it lets go; our handlers only queue work, so a short wait frees the thousand workers of a
    # startup listing (and of each interval's status writes) about as soon as they are done.
    kopf_conf.queueing.idle_timeout = 1.0
    # Watching given namespaces, kopf needs no cluster-scoped reads: without this it would list and
    # watch every Namespace and CRD, which a namespaced install (Roles only) must not need.
    kopf_conf.scanning.disabled = bool(settings.namespaces)
    return kopf_conf


class QuietHandlerSuccesses(logging.Filter):
    """Drops kopf's "Handler 'on_llmserving' succeeded." (INFO, one line per watch event of every
    object: 17 a second at a thousand LLMServings). These handlers only queue work; what a reconcile
    decides is logged by it, and a handler that fails is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (
            record.levelno == logging.INFO
            and message.startswith("Handler '")
            and message.endswith("succeeded.")
        )


def run(settings: OperatorSettings) -> int:
    logs.configure(settings.verbose)
    if not settings.verbose:
        logging.getLogger("kopf.objects").addFilter(QuietHandlerSuccesses())
    priority = (
        settings.peering_priority if settings.peering_priority is not None else random.randint(1, 2**31 - 1)
    )
    # kopf's own form of a replica's id (its POD_ID when set), given to kopf so the scheduler knows it
    identity = os.environ.get("POD_ID") or (
        f"batchknee@{socket.gethostname()}/{datetime.now(UTC):%Y%m%d%H%M%S}/{random.randrange(36**3):03x}"
    )
    configure(settings, identity, priority)
    allocator.freeze_long_lived()  # the imports and the runtime: a full collection need not walk them
    allocator.limit_arenas(2)  # before the worker threads start: each would take an arena of its own
    allocator.limit_tls_read_buffer(64 * 1024)  # before kopf opens its watch streams
    liveness = settings.liveness_endpoint()
    # kopf parses each watch event with json.loads, which recurses once per level: an object the
    # apiserver accepts (any free-form field nested up to its 10,000 levels) must parse, not stop
    # every watch (the spec is then refused, InvalidSpec, by parse_llmserving's depth bound).
    sys.setrecursionlimit(max(sys.getrecursionlimit(), APISERVER_MAX_JSON_DEPTH + 2_000))
    try:  # from CPython 3.12 the C code's own limit does not follow setrecursionlimit
        json.loads("[" * APISERVER_MAX_JSON_DEPTH + "]" * APISERVER_MAX_JSON_DEPTH)
    except RecursionError:
        log.warning(
            "this Python (%s) cannot parse JSON nested %d levels deep, which the apiserver stores: one "
            "LLMServing nested that deep would stop kopf's watches; run the operator on CPython 3.11, as "
            "its image does",
            sys.version.split()[0],
            APISERVER_MAX_JSON_DEPTH,
        )
    kopf.run(
        settings=kopf_settings(settings),
        standalone=True if settings.peering == "standalone" else None,
        identity=cast(Any, identity),
        priority=priority,  # (no peering_name here: kopf would make peering mandatory; it is in kopf_settings)
        liveness_endpoint=liveness,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
    )
    return 0
