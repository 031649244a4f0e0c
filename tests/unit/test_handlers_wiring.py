"""The kopf wiring without a cluster: handlers registered, observers routed, metrics recorded."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client import generate_latest

from batchknee.adapters.observing import RoutedObserver
from batchknee.api.models import LLMServingStatus, ObservedMetrics
from batchknee.core.observation import Observation, ObservationTarget
from batchknee.core.policy import Decision
from batchknee.operator_metrics import OperatorMetrics
from batchknee.reconcile import Outcome

NOW = datetime(2026, 3, 1, tzinfo=UTC)


def test_handlers_register_with_kopf() -> None:
    import kopf

    import batchknee.handlers as handlers

    registry = kopf.get_default_registry()
    # watching only: no change handler (kopf would write its annotations on every object) and
    # nothing that needs a finalizer
    assert not registry._changing.get_all_handlers()
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert any("on_llmserving" in i for i in watching)
    # no daemon (a task and a finalizer per object): one scheduler over kopf's index of LLMServings
    assert not registry._spawning.get_all_handlers()
    assert any("llmserving_intervals" in h.id for h in registry._indexing.get_all_handlers())
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert any("start_scheduler" in i for i in activities) and any("stop_scheduler" in i for i in activities)
    assert any("login" in i for i in activities)  # kopf's session with a bounded connection pool
    # the engine Deployments: watched for rollouts and for the cache reconcile reads them from
    assert any("on_deployment" in i for i in watching)
    settings = handlers.kopf_settings(handlers.OperatorSettings())
    # with no change handler nothing reads a diff base: none is built from the bodies kopf hands over
    body = kopf.Body({"metadata": {"name": "chat", "labels": {"a": "b"}}, "spec": {"model": {"name": "m"}}})
    assert settings.persistence.diffbase_storage.build(body=body) is None
    assert settings.persistence.diffbase_storage.fetch(body=body) is None
    assert settings.posting.enabled is False
    assert settings.peering.name == "batchknee"
    assert settings.scanning.disabled is False  # cluster-wide: kopf follows CRDs as they come and go


def test_kopfs_line_per_handled_event_is_dropped_and_its_failures_kept() -> None:
    import logging

    from batchknee.handlers import QuietHandlerSuccesses

    def record(level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, msg, None, None)

    quiet = QuietHandlerSuccesses()
    assert not quiet.filter(record(logging.INFO, "Handler 'on_llmserving' succeeded."))
    assert not quiet.filter(record(logging.INFO, "Handler 'on_deployment' succeeded."))
    failed = "Handler 'on_llmserving' failed with an exception and will try again in 60 seconds: boom"
    assert quiet.filter(record(logging.ERROR, failed))
    assert quiet.filter(
        record(logging.INFO, "Removing the finalizer, as there are no handlers requiring it.")
    )


def test_watching_namespaces_needs_no_cluster_scoped_reads() -> None:
    """With namespaces given, kopf must not list/watch Namespaces or CRDs (a namespaced install has
    Roles only; the chart grants nothing cluster-scoped then)."""
    import batchknee.handlers as handlers

    settings = handlers.kopf_settings(handlers.OperatorSettings(namespaces=["ml", "chat"]))
    assert settings.scanning.disabled is True


class Recording:
    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[str, str]]] = []
        self.forgotten: list[tuple[str, str]] = []

    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation:
        self.asked.append((url, target.key))
        return Observation.unavailable(now, "test")

    def forget(self, key: tuple[str, str]) -> None:
        self.forgotten.append(key)


def test_objects_are_routed_to_their_own_prometheus() -> None:
    inner = Recording()
    routed = RoutedObserver(inner, "http://127.0.0.1:9090", ["http://127.0.0.1:9191"])
    a = ObservationTarget("ml", "a", "VLLM", 300)
    b = ObservationTarget("ml", "b", "VLLM", 300)
    routed.route("ml", "b", "http://127.0.0.1:9191")
    routed.observation(a, NOW)
    routed.observation(b, NOW)
    routed.route("ml", "b", None)
    routed.observation(b, NOW)
    assert inner.asked == [
        ("http://127.0.0.1:9090", ("ml", "a")),
        ("http://127.0.0.1:9191", ("ml", "b")),
        ("http://127.0.0.1:9090", ("ml", "b")),
    ]
    routed.forget("ml", "a")
    assert inner.forgotten == [("ml", "a")]
    # one spelling per Prometheus: a trailing slash is the same URL (one observer, one budget)
    routed.route("ml", "b", "http://127.0.0.1:9191//")
    routed.route("ml", "c", " http://127.0.0.1:9090/")
    assert routed.url(b) == "http://127.0.0.1:9191"
    assert (
        routed.url(ObservationTarget("ml", "c", "VLLM", 300)) == routed.default_url == "http://127.0.0.1:9090"
    )


def test_a_budget_takes_from_its_parent_too_and_a_refusal_holds_nothing() -> None:
    from batchknee.adapters.prometheus import AnswerBudget

    shared = AnswerBudget(10)
    mine, theirs = AnswerBudget(8, parent=shared), AnswerBudget(8, parent=shared)
    assert mine.take(6) is None and theirs.take(6) is shared  # 12 > the 10 they share
    assert (mine.held, theirs.held, shared.held) == (6, 0, 6)
    assert mine.take(3) is mine  # 9 > its own 8
    assert mine.take(2, alone=True) is None and (mine.held, shared.held) == (8, 6)  # its own bytes only
    mine.give(2, alone=True)
    mine.give(6)
    assert (mine.held, shared.held) == (0, 0)


def test_a_childs_answers_queue_on_its_own_turn_and_one_at_a_time_at_its_parents() -> None:
    """A tenant's Prometheus with many answers to parse keeps them in its own queue: while one of
    them waits for (or holds) the shared turn, the next waits on its own, so each sibling has one
    answer ahead of it at most; a wait past its deadline holds nothing."""
    import time

    from batchknee.adapters.prometheus import AnswerBudget

    shared = AnswerBudget(10)
    busy, other = AnswerBudget(8, parent=shared), AnswerBudget(8, parent=shared)
    soon = time.monotonic() + 0.05
    assert busy.take_turn(soon)  # one of the busy URL's answers is parsed
    assert not busy.take_turn(soon)  # its next waits on its own turn...
    assert not other.take_turn(soon)  # ...and a sibling's on the shared one, that the first holds
    assert not other.turn.locked()  # (holding nothing after its deadline)
    busy.end_turn()
    assert other.take_turn(time.monotonic() + 0.05) and busy.turn.locked() is False
    other.end_turn()
    assert not shared.turn.locked() and not other.turn.locked()

    # the order: a second answer of the busy URL waits on its own turn, never holding the shared one
    import threading

    busy.turn.acquire()  # (as an answer of its own ahead in its queue)
    waiting = threading.Thread(target=busy.take_turn, args=(time.monotonic() + 2,))
    waiting.start()
    time.sleep(0.1)
    assert not shared.turn.locked() and other.take_turn(time.monotonic() + 0.05)
    other.end_turn()
    busy.turn.release()
    waiting.join()
    busy.end_turn()


def test_operator_metrics() -> None:
    metrics = OperatorMetrics()
    status = LLMServingStatus(max_num_seqs=16, recommended_max_num_seqs=16, b_knee=15.0, hold_reason=None)
    decision = Decision(action="roll", value=16, max_tokens=0, reason="r")
    metrics.record(
        Outcome("ml", "chat", decision=decision, status=status, tpot_target_ms=40, rolled=True), 0.02
    )
    # decided but not written (recommend-only, an adopted workload it may not write): no retune
    metrics.record(Outcome("ml", "chat", decision=decision, status=status, tpot_target_ms=40), 0.02)
    held = status.model_copy(update={"hold_reason": "cooldown"})
    metrics.record(Outcome("ml", "chat", decision=None, status=held, status_written=True), 0.01)
    text = generate_latest(metrics.registry).decode()
    assert "batchknee_status_writes_total 1.0" in text  # the first outcome wrote nothing
    assert 'batchknee_max_num_seqs{name="chat",namespace="ml"} 16.0' in text
    assert 'batchknee_retunes_total{name="chat",namespace="ml"} 1.0' in text
    assert 'batchknee_holds_total{reason="cooldown"} 1.0' in text
    assert "batchknee_reconcile_duration_seconds_count 3.0" in text
    assert 'batchknee_tpot_p99_target_seconds{name="chat",namespace="ml"}' not in text  # target dropped
    observed = ObservedMetrics(avg_context_length=8192, tpot_p99_milliseconds=25.0)
    seen = status.model_copy(update={"observed": observed})
    metrics.record(Outcome("ml", "chat", status=seen, tpot_target_ms=40), 0.01)
    text = generate_latest(metrics.registry).decode()
    assert 'batchknee_observed_context_tokens{name="chat",namespace="ml"} 8192.0' in text
    assert 'batchknee_observed_tpot_p99_seconds{name="chat",namespace="ml"} 0.025' in text
    assert 'batchknee_tpot_p99_target_seconds{name="chat",namespace="ml"} 0.04' in text
    # capacity for a replica autoscaler: 3 ready pods × 16, against 40 running + 20 waiting
    busy = seen.model_copy(update={"observed": ObservedMetrics(running=40.0, waiting=20.0)})
    metrics.record(Outcome("ml", "chat", status=busy, ready_replicas=3), 0.01)
    text = generate_latest(metrics.registry).decode()
    assert 'batchknee_capacity_sequences{name="chat",namespace="ml"} 48.0' in text
    assert 'batchknee_demand_sequences{name="chat",namespace="ml"} 60.0' in text
    # a workload another LLMServing tunes: its demand is that one's, not counted twice
    metrics.record(Outcome("ml", "second", status=busy, tunes=False), 0.01)
    assert 'batchknee_demand_sequences{name="second"' not in generate_latest(metrics.registry).decode()
    # the workload is gone (or another LLMServing now tunes it): no last capacity or demand stays
    metrics.record(Outcome("ml", "chat", status=busy, tunes=False), 0.01)
    text = generate_latest(metrics.registry).decode()
    assert 'batchknee_capacity_sequences{name="chat"' not in text
    assert 'batchknee_demand_sequences{name="chat"' not in text
    assert 'batchknee_max_num_seqs{name="chat",namespace="ml"} 16.0' in text  # what it knows stays
    metrics.record(Outcome("ml", "chat", found=False), 0.01)
    assert 'batchknee_max_num_seqs{name="chat"' not in generate_latest(metrics.registry).decode()


def test_the_target_is_read_from_kopfs_body() -> None:
    import kopf

    from batchknee.handlers import _target

    raw = {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"name": "chat", "namespace": "ml"},
        "spec": {
            "engine": "VLLM",
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpu": {"type": "a100-80gb", "count": 1},
            "tuning": {"windowSeconds": 120},
        },
    }
    assert _target(kopf.Body(raw)) == ObservationTarget("ml", "chat", "VLLM", 120)
    assert _target(kopf.Body({**raw, "spec": {"engine": "Nope"}})) is None
    # the free-form engine options (the reconcile refuses these) are not what the target is of, and
    # are not walked on the event loop
    options = {"x": [[] for _ in range(100_000)]}
    huge = {**raw, "spec": {**raw["spec"], "extraLlmApiOptions": options}}
    assert _target(kopf.Body(huge)) == ObservationTarget("ml", "chat", "VLLM", 120)


def test_full_collections_are_timed_once_watched() -> None:
    import gc

    metrics = OperatorMetrics()
    metrics.time_full_collections()
    was_enabled = gc.isenabled()
    gc.disable()  # only these collections
    try:
        gc.collect(1)  # a younger generation: not counted
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(metrics._on_collection)
        if was_enabled:
            gc.enable()
    text = generate_latest(metrics.registry).decode()
    assert "batchknee_python_full_collection_seconds_count 2.0" in text


def test_live_llmservings_are_scheduled_in_lanes_by_namespace() -> None:
    """A Live LLMServing's evaluations wait on its tenant's engine pods, and one that reads its own
    Prometheus on that Prometheus: the scheduler runs at most LIVE_EVALUATIONS_PER_NAMESPACE of one
    namespace's at once; every other object has no lane."""
    import asyncio

    from batchknee import handlers
    from batchknee.reconcile import Ports

    async def scenario() -> None:
        rt = handlers.Runtime(
            Ports(kube=None, observer=Recording()),  # type: ignore[arg-type]
            RoutedObserver(Recording(), "http://127.0.0.1:9090", ["http://prometheus.team-a:9090"]),
            OperatorMetrics(),
        )
        async with started(rt):
            assert rt.scheduler is not None
            assert rt.scheduler.lane_limit == handlers.LIVE_EVALUATIONS_PER_NAMESPACE == 2
            assert rt.scheduler.lane(("team-a", "chat")) is None
            rt.note("team-a", "chat", {"spec": {"tuning": {"actuation": "Live"}}})
            assert rt.scheduler.lane(("team-a", "chat")) == "team-a"
            rt.forget("team-a", "chat")
            assert rt.scheduler.lane(("team-a", "chat")) is None
            # its own Prometheus, which may be slow: the same lane
            rt.note("team-a", "own", {"spec": {"prometheus": {"url": "http://prometheus.team-a:9090"}}})
            assert rt.scheduler.lane(("team-a", "own")) == "team-a"
            rt.note("team-a", "own", {"spec": {}})
            assert rt.scheduler.lane(("team-a", "own")) is None

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def started(rt: Any, **indexes: Any) -> AsyncIterator[None]:
    """The operator's start with runtime `rt` (kopf passes its indexes to the startup handler by
    name), and its stop."""
    from batchknee import handlers

    handlers.RUNTIME = rt
    try:
        await handlers.start_scheduler(llmserving_intervals={}, **indexes)
        yield
        assert rt.scheduler is not None
        await rt.scheduler.stop()
        for task in rt.background:
            task.cancel()
    finally:
        handlers.RUNTIME = None


class SlowPrometheus:
    """A PrometheusObserver whose every scope refresh takes 0.3 s (a shared, busy Prometheus)."""

    paced = False  # the operator's own

    def __init__(self, url: str) -> None:
        self.url, self.fetched = url, 0

    def fetch(self, scope: Any, now: datetime) -> Any:
        from batchknee.adapters.prometheus import ScopeData

        time.sleep(0.3)
        self.fetched += 1
        return ScopeData(scope, now, 3)

    def close(self) -> None:
        pass


def test_a_fresh_scope_waits_behind_no_other_scopes_refresh() -> None:
    """One URL's refreshes run one at a time. A tenant's objects, each with a window of its own, each
    need one; another team's object whose (shared) scope is fresh reads it at once instead of
    queueing behind them all."""
    import asyncio

    from batchknee.adapters.prometheus import CachedObserver

    router = RoutedObserver(CachedObserver(SlowPrometheus, ttl_s=60), "http://prometheus:9090")
    victim = ObservationTarget("team-b", "llama", "VLLM", 300)
    tenant = [ObservationTarget("team-a", f"x{i}", "VLLM", 31 + i) for i in range(6)]

    async def scenario() -> list[bool]:
        await router.prepare(victim, NOW)  # its scope is fresh from here
        refreshes = [asyncio.create_task(router.prepare(t, NOW)) for t in tenant]
        await asyncio.sleep(0.05)  # the first of six 0.3-s refreshes is in flight
        await router.prepare(victim, NOW)
        finished_before = [refresh.done() for refresh in refreshes]
        await asyncio.gather(*refreshes)
        return finished_before

    assert asyncio.run(scenario()) == [False] * 6  # behind none of them (behind one: it would be done)
    assert all(router.is_fresh(t) for t in [victim, *tenant])


def test_a_url_whose_objects_went_while_its_refresh_waited_keeps_no_cache() -> None:
    """A tenant's two objects on their own Prometheus, deleted while the second's refresh waits
    behind the first's (or for a thread): the waiting refresh made the URL's cache again — a session
    and its query threads — after `forget` had dropped it, and nothing would drop it later. Each
    deleted tenant kept one, for good."""
    import asyncio

    from batchknee.adapters.prometheus import CachedObserver

    url = "http://prometheus.team-a:9090"
    cache = CachedObserver(SlowPrometheus, ttl_s=60)
    router = RoutedObserver(cache, "http://prometheus:9090", [url])
    first, second = (ObservationTarget("team-a", name, "VLLM", 300 + i) for i, name in enumerate("ab"))

    async def scenario() -> None:
        for target in (first, second):
            router.route(*target.key, url)
        refreshes = [asyncio.create_task(router.prepare(t, NOW)) for t in (first, second)]
        await asyncio.sleep(0.1)  # the first refresh is in flight, the second waits behind it
        for target in (first, second):
            router.forget(*target.key)
        await asyncio.gather(*refreshes)

    asyncio.run(scenario())
    assert cache.urls() == []
    # an evaluation that read the route just before its object went: nor does its reading keep one
    router.route(*first.key, url)
    routed_url = router.url

    def url_then_forgotten(target: ObservationTarget) -> str:
        chosen = routed_url(target)
        router.forget(*target.key)
        return chosen

    router.url = url_then_forgotten  # type: ignore[method-assign]
    router.observation(first, NOW)
    assert cache.urls() == []


def test_a_refresh_of_a_url_a_spec_chose_takes_one_deadline_however_many_scopes_are_due() -> None:
    """Twenty scopes of one tenant's Prometheus (adopted workloads, selectors), each answered just
    inside the deadline: a refresh read them all in turn and held the calling thread — the shared
    reconcile worker, for an adopted workload — for twenty deadlines. It stops once it has taken
    one, paced by the share it read (paced in full, the rest waited ten times as long for their
    turn); a silent URL is still paced in full."""
    from batchknee.adapters.prometheus import PACED_REUSE, CachedObserver, scope_for

    class TenantPrometheus(SlowPrometheus):
        paced, timeout_s, min_samples, shown_url = True, 0.2, 3, "http://prometheus.team-a:9090"
        answers_after = 0.45  # of the deadline: in time, every one

        def fetch(self, scope: Any, now: datetime) -> Any:
            from batchknee.adapters.prometheus import ScopeData

            time.sleep(self.answers_after * self.timeout_s)
            self.fetched += 1
            return ScopeData(scope, now, 3)

    url = "http://prometheus.team-a:9090"
    targets = [ObservationTarget("team-a", f"w{i}", "VLLM", 300, pods=(f"w{i}-0",)) for i in range(20)]
    for answers_after in (0.45, 1.0):
        TenantPrometheus.answers_after = answers_after
        cache = CachedObserver(TenantPrometheus, ttl_s=5)
        for target in targets:
            cache._cache(url).ask(scope_for(target))
        started = time.monotonic()
        cache.refresh(url, targets[0], NOW)
        took = time.monotonic() - started
        fetched = cache._cache(url).observer.fetched  # type: ignore[attr-defined]
        paced_s = cache._cache(url).paced_until - time.monotonic()
        if answers_after < 1:
            assert 1 <= fetched <= 3  # 0.09 s each: stopped past 0.2 s (was 20)
            assert 0 < paced_s <= PACED_REUSE * took * fetched / 20 + 0.05
        else:
            assert fetched == 1 and paced_s >= PACED_REUSE * 0.2 * 0.9  # silent: paced in full
        cache.drop_url(url)


def test_objects_with_a_stale_scope_of_their_own_share_their_namespaces_lane() -> None:
    """A scope of the object's own making (a window other than the default, a selector) that needs
    a refresh puts its evaluation in the namespace's lane (two at once); once fresh, or with the
    default scope, it runs free. An adopted workload's pods are a scope of their own, refreshed in
    its reconcile: always in the lane."""
    import asyncio

    from batchknee import handlers
    from batchknee.adapters.prometheus import CachedObserver
    from batchknee.reconcile import Ports

    router = RoutedObserver(CachedObserver(SlowPrometheus, ttl_s=60), "http://prometheus:9090")
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics())  # type: ignore[arg-type]
    own = ObservationTarget("team-a", "own", "VLLM", 61)
    chosen = ObservationTarget("team-a", "sel", "VLLM", 300, selector={"model_name": "m"})
    rt.targets.update({own.key: own, chosen.key: chosen})
    rt.targets[("team-a", "plain")] = ObservationTarget("team-a", "plain", "VLLM", 300)
    assert not rt.in_lane(own.key) and not rt.in_lane(chosen.key)  # no engines yet: no refresh
    for name in ("own", "sel", "plain"):
        rt.cache.seen("Deployment", {"metadata": {"namespace": "team-a", "name": name}})
    assert rt.in_lane(own.key) and rt.in_lane(chosen.key)
    assert not rt.in_lane(("team-a", "plain"))  # the default scope is everyone's
    asyncio.run(router.prepare(own, NOW))
    assert not rt.in_lane(own.key) and rt.in_lane(chosen.key)
    assert rt.prepared_target(("team-a", "plain")) == rt.targets[("team-a", "plain")]
    rt.note("team-a", "plain", {"spec": {"targetRef": {"kind": "Deployment", "name": "vllm"}}})
    assert rt.in_lane(("team-a", "plain"))
    # its reconcile reads its pods by name: refreshing the fleet's default scope first reads nothing it uses
    assert rt.prepared_target(("team-a", "plain")) is None
    # a spec edited into one that is refused: its last scope is neither refreshed nor laned
    rt.note("team-a", "own", {"spec": {"engine": "Nope"}})
    assert rt.prepared_target(own.key) is None and not rt.in_lane(own.key)


def test_the_refresh_before_a_reconcile_reads_at_the_runtimes_clock() -> None:
    """The refresh the event loop runs before a reconcile asks Prometheus at the same time the
    reconcile then decides at: the runtime's clock (a simulated one in the tests and the bench),
    not the wall clock."""
    import asyncio

    from batchknee import handlers
    from batchknee.adapters.prometheus import CachedObserver
    from batchknee.reconcile import Ports

    asked: list[datetime] = []

    class RecordingPrometheus(SlowPrometheus):
        def fetch(self, scope: Any, now: datetime) -> Any:
            asked.append(now)
            return super().fetch(scope, now)

    router = RoutedObserver(CachedObserver(RecordingPrometheus, ttl_s=60), "http://prometheus:9090")
    rt = handlers.Runtime(
        Ports(kube=None, observer=router),  # type: ignore[arg-type]
        router,
        OperatorMetrics(),
        clock=lambda: NOW,
    )
    target = ObservationTarget("team-a", "llama", "VLLM", 300)
    rt.targets[target.key] = target
    rt.cache.seen("Deployment", {"metadata": {"namespace": "team-a", "name": "llama"}})
    rt.reconcile = lambda namespace, name, engine_calls=True: Outcome(namespace, name)  # type: ignore[method-assign]
    asyncio.run(rt.run("team-a", "llama"))
    assert asked == [NOW]


def test_a_spec_refused_past_parsing_drops_its_target_until_it_changes() -> None:
    """A spec that parses but is refused (a Prometheus URL not allowed, an admission rule, a model
    that does not fit) kept its scope refreshed, and its object laned, at every evaluation."""
    import asyncio

    from batchknee import handlers
    from batchknee.adapters.prometheus import CachedObserver
    from batchknee.reconcile import Ports

    router = RoutedObserver(CachedObserver(SlowPrometheus, ttl_s=60), "http://prometheus:9090")
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics(), clock=lambda: NOW)  # type: ignore[arg-type]
    body = {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"namespace": "team-a", "name": "llama", "uid": "u1", "generation": 1},
        "spec": {
            "engine": "VLLM",
            "model": {"name": "llama-3-8b"},
            "gpu": {"type": "a100-80gb"},
            "tuning": {"windowSeconds": 120},
            "prometheus": {"url": "http://prometheus.elsewhere:9090"},  # not allowed: refused
        },
    }
    rt.cache.seen("Deployment", {"metadata": {"namespace": "team-a", "name": "llama"}})
    refused = LLMServingStatus(hold_reason="invalid-spec")
    rt.reconcile = lambda namespace, name, engine_calls=True: Outcome(namespace, name, status=refused)  # type: ignore[method-assign]
    asyncio.run(rt.run("team-a", "llama", body))
    assert rt.prepared_target(("team-a", "llama")) is None and not rt.in_lane(("team-a", "llama"))
    del body["spec"]["prometheus"]  # fixed: observed again
    rt.reconcile = lambda namespace, name, engine_calls=True: Outcome(namespace, name)  # type: ignore[method-assign]
    asyncio.run(rt.run("team-a", "llama", body))
    assert rt.prepared_target(("team-a", "llama")) is not None


def test_whether_an_evaluation_may_call_engines_is_decided_with_its_lane() -> None:
    """A tenant flips spec.tuning.actuation between Restart and Live. An evaluation launched as
    Restart (no lane, the shared worker) stays there without engine calls though the spec says
    Live by the time it runs; one launched as Live runs on the Live workers, in its lane."""
    import asyncio
    import threading

    from batchknee import handlers
    from batchknee.adapters.prometheus import CachedObserver
    from batchknee.reconcile import Ports

    router = RoutedObserver(CachedObserver(SlowPrometheus), "http://prometheus:9090")
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics())  # type: ignore[arg-type]
    ran: list[tuple[str, bool]] = []

    def reconcile(namespace: str, name: str, engine_calls: bool = True) -> Outcome:
        ran.append((threading.current_thread().name.split("_")[0], engine_calls))
        return Outcome(namespace, name)

    rt.reconcile = reconcile  # type: ignore[method-assign]
    restart = {"spec": {"tuning": {"actuation": "Restart"}}}
    live = {"spec": {"tuning": {"actuation": "Live"}}}
    rt.note("team-a", "llama", restart)
    assert rt.lane(("team-a", "llama")) is None  # launched on the shared workers
    rt.note("team-a", "llama", live)  # flipped before it ran
    asyncio.run(rt.run("team-a", "llama"))
    assert rt.lane(("team-a", "llama")) == "team-a"  # the next one: the namespace's Live lane
    rt.note("team-a", "llama", restart)  # flipped back before it ran
    asyncio.run(rt.run("team-a", "llama"))
    assert ran == [("reconcile", False), ("reconcile-live", True)]


def adopter(name: str, created: str, workload: str | None, **meta: Any) -> dict[str, Any]:
    spec = (
        {"targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": workload}} if workload else {}
    )
    return {"metadata": {"name": name, "namespace": "ml", "creationTimestamp": created, **meta}, "spec": spec}


def test_who_adopts_a_workload_is_read_from_kopfs_index_not_listed() -> None:
    """Two LLMServings must not adopt one workload: the later one reads who came first from the
    watch's index (kopf fills it from the first listing before any handler runs), where it listed
    every LLMServing of the namespace at each evaluation (a tenant's large specs, parsed each time)."""
    from kopf._core.engines.indexing import Index

    from batchknee.adapters.kubernetes import KubernetesAdapter
    from batchknee.handlers import Tuners, llmserving_tuners

    index: Index[tuple[str, str, str], tuple[str, str]] = Index()
    bodies = [
        adopter("first", "2026-03-01T00:00:00Z", "llama"),
        adopter("second", "2026-03-02T00:00:00Z", "llama"),
        adopter("other", "2026-02-01T00:00:00Z", "mistral"),
        adopter("own", "2026-01-01T00:00:00Z", None),
        adopter("leaving", "2026-01-01T00:00:00Z", "llama", deletionTimestamp="2026-03-03T00:00:00Z"),
    ]
    for body in bodies:  # as kopf feeds an indexer: the object's key → what the function returned
        index._replace(("ml", body["metadata"]["name"], "uid"), llmserving_tuners(namespace="ml", body=body))
    kube = KubernetesAdapter(timeout_s=0.1)  # no apiserver: a request would fail the test
    wire_index(kube, index)
    assert isinstance(kube.tuners_index, Tuners)
    assert sorted(kube.tuners("ml", "Deployment", "llama")) == [
        ("2026-03-01T00:00:00Z", "first"),
        ("2026-03-02T00:00:00Z", "second"),
    ]  # the one being deleted tunes nothing
    assert (
        kube.tuners("ml", "StatefulSet", "llama") == [] and kube.tuners("other", "Deployment", "llama") == []
    )
    # deleted: kopf discards the object's entries
    index._discard(("ml", "first", "uid"))
    assert kube.tuners("ml", "Deployment", "llama") == [("2026-03-02T00:00:00Z", "second")]


def wire_index(kube: Any, index: Any) -> None:
    """What the operator's start does with the index of adopted workloads."""
    import asyncio

    from batchknee import handlers
    from batchknee.reconcile import Ports

    async def scenario() -> None:
        rt = handlers.Runtime(
            Ports(kube=kube, observer=Recording()),
            RoutedObserver(Recording(), "http://127.0.0.1:9090", []),
            OperatorMetrics(),
        )
        async with started(rt, llmserving_tuners=index):
            pass

    asyncio.run(scenario())


def test_a_deployment_change_reconciles_its_llmserving_only_when_there_is_one() -> None:
    """A Deployment carrying the engine label for no LLMServing (a tenant may write Deployments
    in its namespace) queued an evaluation, and an apiserver read, at each of its changes."""
    import asyncio

    from batchknee import handlers
    from batchknee.reconcile import Ports
    from batchknee.scheduling import Scheduler

    router = RoutedObserver(Recording(), "http://127.0.0.1:9090", [])
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics())  # type: ignore[arg-type]
    queued: list[tuple[str, str]] = []
    scheduler = Scheduler(
        evaluate=lambda namespace, name: asyncio.sleep(0),
        known=lambda: {("ml", "chat"): 30.0},
        last_evaluated=lambda key: None,
        forget=lambda namespace, name: None,
    )
    scheduler.soon = queued.append  # type: ignore[method-assign]
    rt.scheduler = scheduler
    handlers.RUNTIME = rt
    try:
        for owner in ("chat", "nobody"):
            event = {"type": "MODIFIED", "object": {"metadata": {"namespace": "ml", "name": owner}}}
            asyncio.run(handlers.on_deployment(event=event, namespace="ml", labels={handlers.LABEL: owner}))
    finally:
        handlers.RUNTIME = None
    assert queued == [("ml", "chat")]


def test_the_watch_cache_is_cleared_at_a_pause_not_at_the_resume(monkeypatch: Any) -> None:
    """kopf lists everything again at the resume (and at the start), before the peers are next
    looked at: clearing then emptied what had just been listed, and an unchanged object sends no
    other event — every read went to the apiserver for good."""
    import asyncio

    from batchknee import handlers
    from batchknee.reconcile import Ports

    router = RoutedObserver(Recording(), "http://127.0.0.1:9090", [])
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics())  # type: ignore[arg-type]
    peers: list[list[dict[str, Any]]] = []

    def statuses() -> list[dict[str, Any]]:
        return peers[-1]

    rt.peering = handlers.Peering("batchknee", "me", 0, False, statuses)
    rt.outranked = True  # until the first look
    monkeypatch.setattr(handlers, "PEERS_CHECK_S", 0.01)
    higher = [{"other": {"priority": 100, "lastseen": datetime.now(UTC).isoformat(), "lifetime": 60}}]
    deployment = {"metadata": {"namespace": "ml", "name": "chat", "resourceVersion": "1"}}

    async def scenario(looks: list[list[dict[str, Any]]]) -> list[bool]:
        seen = []
        rt.outranked = True  # until the first look
        watching = asyncio.create_task(handlers.watch_peers(rt))
        for look in looks:
            peers.append(look)
            rt.cache.seen("Deployment", deployment)  # what kopf's listing brings
            await asyncio.sleep(0.1)
            seen.append(rt.cache.has("Deployment", "ml", "chat"))
        watching.cancel()
        return seen

    # alone (the start), outranked (a pause), alone (the resume)
    assert asyncio.run(scenario([[{}], higher, [{}]])) == [True, False, True]
    assert not rt.outranked
    # a standby: kopf (not started paused) listed before the first look outranked it; what it
    # listed may be gone by the resume, which sends no DELETED
    assert asyncio.run(scenario([higher]))[0] is False


def test_the_peers_are_looked_at_while_every_reconcile_worker_is_busy(monkeypatch: Any) -> None:
    """The peering objects were read on the reconcile worker: behind a queue of evaluations, a
    higher-priority replica's arrival was seen only after them, each writing meanwhile."""
    import asyncio
    import threading

    from batchknee import handlers
    from batchknee.reconcile import Ports

    router = RoutedObserver(Recording(), "http://127.0.0.1:9090", [])
    rt = handlers.Runtime(Ports(kube=None, observer=router), router, OperatorMetrics())  # type: ignore[arg-type]
    higher = [{"other": {"priority": 100, "lastseen": datetime.now(UTC).isoformat(), "lifetime": 60}}]
    rt.peering = handlers.Peering("batchknee", "me", 0, False, lambda: higher)
    monkeypatch.setattr(handlers, "PEERS_CHECK_S", 0.01)
    released = threading.Event()
    rt.executor.submit(released.wait, 10)  # a reconcile that takes long

    async def scenario() -> bool:
        watching = asyncio.create_task(handlers.watch_peers(rt))
        await asyncio.sleep(0.3)
        seen = rt.outranked
        watching.cancel()
        return seen

    try:
        assert asyncio.run(scenario())
    finally:
        released.set()
