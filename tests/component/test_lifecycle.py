"""The object's life around reconcile: deletion, busy apiservers, the settle window, the admin's
Prometheus allow-list, and the operator's per-object state (runtime, router, gauges)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import MemoryObserver, observation
from prometheus_client import generate_latest
from urllib3.exceptions import ReadTimeoutError

from batchknee.adapters.kubernetes import with_retries
from batchknee.adapters.observing import RoutedObserver
from batchknee.core.observation import Observation, ObservationTarget
from batchknee.handlers import Runtime
from batchknee.operator_metrics import OperatorMetrics
from batchknee.ports import TransientApiError
from batchknee.reconcile import Ports
from batchknee.render import deployment_state


def applied(world: World, name: str = "chat") -> int | None:
    state = deployment_state(world.kube.get_deployment("default", name))
    return state.max_num_seqs if state else None


def settle(world: World, seconds: float = 121) -> None:
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(seconds)


def shift_context(world: World, ctx: int) -> None:
    """Traffic moves to `ctx` and evaluations every 30 s see it for a minute (the creation's guess
    holds while the change is younger than a third of the 120 s window); the next evaluation may act
    on it."""
    for _ in range(2):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))
        world.reconcile()
        world.clock.advance(30)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))


def test_a_deleting_object_is_never_rolled(world: World) -> None:
    world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    world.reconcile()
    settle(world)
    shift_context(world, 8192)  # the next evaluation would roll to 16
    meta = world.kube.objects[("LLMServing", "default", "chat")]["metadata"]
    meta["deletionTimestamp"] = "2026-03-01T12:10:00Z"
    writes, applies = world.kube.status_writes, world.kube.applies
    outcome = world.reconcile()
    assert outcome.deleting and outcome.decision is None
    assert applied(world) == 64
    assert (world.kube.status_writes, world.kube.applies) == (writes, applies)
    del meta["deletionTimestamp"]  # the same world without the delete does roll
    world.reconcile()
    assert applied(world) == 16


def test_a_busy_apiserver_is_retried_later_and_does_not_degrade_at_once(world: World) -> None:
    world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    world.reconcile()
    settle(world)
    shift_context(world, 8192)
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
    events = len(world.kube.events)
    world.kube.busy_applies = 1
    with pytest.raises(TransientApiError):
        world.reconcile()
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
    assert world.kube.events[events:] == []
    assert applied(world) == 64
    world.reconcile()  # the apiserver answers again: the retune goes through
    assert applied(world) == 16
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"


def timed_out(what: str) -> TransientApiError:
    """What the adapter makes of a call that got no answer within its timeout (an admission webhook
    that hangs): urllib3's ReadTimeoutError through the adapter's retries."""

    def hang() -> None:
        raise ReadTimeoutError(None, "/apis/apps/v1/namespaces/default/deployments/chat", "Read timed out.")

    try:
        with_retries(hang, what, timeout_s=10)
    except TransientApiError as error:
        return error
    raise AssertionError("a timeout is transient")


BUSY = "apply Deployment chat: 429 Too Many Requests (after 4 tries)"
HANGING = "apply Deployment chat: no answer in 10 s (after 1 try)"


@pytest.mark.parametrize(
    ("error", "summary", "detail"),
    [(None, BUSY, "storage is"), (timed_out, HANGING, "Read timed out")],
    ids=["busy", "no-answer"],
)
def test_an_apiserver_that_keeps_failing_is_degraded_after_five_minutes_until_a_write_goes_through(
    world: World, error: Callable[[str], TransientApiError] | None, summary: str, detail: str
) -> None:
    """A retune's apply meets a busy apiserver at every evaluation (an admission webhook that always
    fails, or never answers, looks the same): for five minutes each is retried at the next
    evaluation and nothing is reported; from then on Degraded says so, once as an Event, and nothing
    else changes; the first reconcile that goes through clears it and rolls."""
    if error is not None:
        world.kube.busy_error = error
    world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    world.reconcile()
    settle(world)
    shift_context(world, 8192)
    router = RoutedObserver(world.observer, "http://127.0.0.1:9090")
    runtime = Runtime(world.ports, router, OperatorMetrics(), clock=lambda: world.clock.now)
    events = len(world.kube.events)
    world.kube.busy_applies = 1000
    for _ in range(10):  # 0 … 270 s of errors
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
        assert runtime.reconcile("default", "chat").error is not None
        assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
        world.clock.advance(30)
    assert world.kube.events[events:] == []
    for _ in range(2):  # 300 s and 330 s
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
        outcome = runtime.reconcile("default", "chat")
        world.clock.advance(30)
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApiErrors")
    assert "since 2026-" in degraded["message"]
    assert summary in degraded["message"]
    assert detail not in degraded["message"]  # what the answer (or urllib3) said stays in the log
    assert outcome.error is not None and applied(world) == 64
    assert [e["reason"] for e in world.kube.events[events:]] == ["ApiErrors"]  # once, not per evaluation
    world.kube.busy_applies = 0
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
    assert runtime.reconcile("default", "chat").error is None
    assert applied(world) == 16
    cleared = world.kube.condition("default", "chat", "Degraded")
    assert (cleared["status"], cleared["reason"]) == ("False", "AsExpected")
    assert runtime.api_failing_since == {}


def test_an_llmserving_deleted_as_its_status_is_written_is_gone_not_an_error(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The status write of a reconcile that raced the LLMServing's deletion finds none (the
    adapter's 404): the object is gone (not found: the runtime frees its state), with no error,
    no retry and no log line."""
    world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    write = world.kube.patch_status

    def deleted_first(namespace: str, name: str, status: dict[str, Any]) -> None:
        world.kube.objects.pop(("LLMServing", namespace, name))
        write(namespace, name, status)

    monkeypatch.setattr(world.kube, "patch_status", deleted_first)
    metrics = OperatorMetrics()
    runtime = Runtime(world.ports, RoutedObserver(world.observer, "http://127.0.0.1:9090"), metrics)
    with caplog.at_level(logging.INFO):
        outcome = runtime.reconcile("default", "chat")
    assert not outcome.found and outcome.error is None
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert metrics.errors._value.get() == 0
    assert runtime.api_failing_since == {}


def test_thin_metrics_right_after_a_rollout_are_settling_not_an_alarm(world: World) -> None:
    world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    world.reconcile()
    settle(world)
    shift_context(world, 8192)
    world.reconcile()
    assert applied(world) == 16  # rolled
    thin = "only 1 samples per pod in the last 120s (need 3)"
    world.observer.set("default", "chat", observation(world.clock.now, ctx=None, running=None, reason=thin))
    world.reconcile()  # rolling
    world.kube.finish_rollout("default", "chat")
    world.clock.advance(10)
    world.reconcile()  # settled 10 s ago: the new pods have one sample each
    condition = world.kube.condition("default", "chat", "MetricsAvailable")
    assert (condition["status"], condition["reason"]) == ("Unknown", "Settling")
    assert thin in condition["message"]
    assert not [e for e in world.kube.events if e["reason"] == "MetricsUnavailable"]
    # Still thin a whole window after the pods settled: that is a real gap.
    world.clock.advance(121)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=None, running=None, reason=thin))
    world.reconcile()
    condition = world.kube.condition("default", "chat", "MetricsAvailable")
    assert (condition["status"], condition["reason"]) == ("False", "MetricsUnavailable")
    assert world.kube.events[-1]["reason"] == "MetricsUnavailable"


def test_a_prometheus_url_the_admin_does_not_allow_is_degraded_and_never_fetched(world: World) -> None:
    router = RoutedObserver(UrlRecorder(world.observer), "http://127.0.0.1:9090", ["http://prom-a:9090"])
    world.ports = Ports(world.kube, router, prometheus_url_refusal=router.refusal)
    world.kube.create(llmserving(prometheus={"url": "http://user:hunter2@169.254.169.254/"}))
    world.reconcile()
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PrometheusURLNotAllowed")
    assert degraded["message"].startswith("spec.prometheus.url: http://169.254.169.254/ is not among")
    assert "hunter2" not in str(world.kube.status("default", "chat"))
    assert "hunter2" not in str(world.kube.events)
    assert world.kube.events[-1]["reason"] == "PrometheusURLNotAllowed"
    router.route("default", "chat", "http://user:hunter2@169.254.169.254/")
    assert router.url(ObservationTarget("default", "chat", "VLLM", 120)) == "http://127.0.0.1:9090"
    world.kube.edit_spec("default", "chat", {"prometheus": {"url": "http://prom-a:9090"}})
    world.reconcile()
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"


class UrlRecorder:
    """The url-aware side of the router over the component tests' in-memory observer."""

    def __init__(self, inner: MemoryObserver) -> None:
        self.inner = inner
        self.urls: list[str] = []
        self.forgotten: list[tuple[str, str]] = []
        self.dropped: list[str] = []

    def observation(self, url: str, target: ObservationTarget, now: datetime) -> Observation:
        self.urls.append(url)
        return self.inner.observation(target, now)

    def forget(self, key: tuple[str, str]) -> None:
        self.forgotten.append(key)

    def drop_url(self, url: str) -> None:
        self.dropped.append(url)


def test_the_runtime_frees_an_objects_state_when_it_is_gone(world: World) -> None:
    recorder = UrlRecorder(world.observer)
    router = RoutedObserver(recorder, "http://127.0.0.1:9090", ["*"])
    metrics = OperatorMetrics()
    runtime = Runtime(Ports(world.kube, router), router, metrics)
    body: dict[str, Any] = world.kube.create(llmserving(prometheus={"url": "http://127.0.0.2:9090"}))

    async def lifecycle() -> None:
        await runtime.run("default", "chat", body)  # creates the Deployment
        await runtime.run("default", "chat", body)  # observes its engines
        assert recorder.urls == ["http://127.0.0.2:9090"]
        assert ("default", "chat") in runtime.locks and ("default", "chat") in runtime.targets
        assert (
            'batchknee_max_num_seqs{name="chat",namespace="default"}'
            in generate_latest(metrics.registry).decode()
        )
        del world.kube.objects[("LLMServing", "default", "chat")]
        outcome = await runtime.run("default", "chat")  # e.g. a Deployment event after the delete
        assert not outcome.found

    asyncio.run(lifecycle())
    assert runtime.locks == {} and runtime.targets == {} and router.urls == {}
    assert recorder.forgotten == [("default", "chat")]
    assert recorder.dropped == ["http://127.0.0.2:9090"]  # nobody else used that Prometheus
    assert 'name="chat"' not in generate_latest(metrics.registry).decode()


class RefreshRecorder(UrlRecorder):
    """With the cache's half too: the refresh the handlers make before a reconcile goes to a thread."""

    def __init__(self, inner: MemoryObserver) -> None:
        super().__init__(inner)
        self.refreshed: list[tuple[str, str]] = []

    def is_fresh(self, url: str, target: ObservationTarget) -> bool:
        return False

    def refresh(self, url: str, target: ObservationTarget, now: datetime) -> None:
        self.refreshed.append(target.key)


def test_an_engine_deployment_not_yet_there_costs_no_prometheus_refresh(world: World) -> None:
    """Before its engine Deployment exists an LLMServing has no series to read: its evaluations
    refresh nothing (a thousand created at once would refresh every engine's series each cache
    period). Once the watch has brought the Deployment they do; before that the reconcile reads
    in its own thread. An adopted workload (spec.targetRef) is read by its pods' names, a scope
    only its reconcile knows (and refreshes): nothing is refreshed for it before."""
    recorder = RefreshRecorder(world.observer)
    router = RoutedObserver(recorder, "http://127.0.0.1:9090")
    runtime = Runtime(Ports(world.kube, router), router, OperatorMetrics())
    body = world.kube.create(llmserving())
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    adopted = llmserving("adopted", targetRef={"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"})
    del adopted["spec"]["rollout"]  # the workload's own

    async def evaluations() -> None:
        await runtime.run("default", "chat", body)  # creates the Deployment
        assert recorder.refreshed == [] and recorder.urls == []
        await runtime.run("default", "chat")  # the Deployment is there, the watch has not said so
        assert recorder.refreshed == [] and recorder.urls == ["http://127.0.0.1:9090"]
        runtime.cache.seen("Deployment", world.kube.objects[("Deployment", "default", "chat")])
        await runtime.run("default", "chat")
        assert recorder.refreshed == [("default", "chat")]
        await runtime.run("default", "adopted", world.kube.create(adopted))
        assert recorder.refreshed == [("default", "chat")]

    asyncio.run(evaluations())
    runtime.forget("default", "adopted")
    assert runtime.adopting == set()


def noted_runtime(world: World, manifest: dict[str, Any]) -> Runtime:
    """A runtime that has seen `manifest`, created, as its watch event would note it."""
    router = RoutedObserver(world.observer, "http://127.0.0.1:9090", ["*"])
    runtime = Runtime(Ports(world.kube, router), router, OperatorMetrics())
    body = world.kube.create(manifest)
    runtime.spec_versions[("default", "chat")] = (body["metadata"]["uid"], 1)
    runtime.note("default", "chat", body)
    return runtime


def test_an_object_created_again_while_an_evaluation_found_it_gone_keeps_its_state(world: World) -> None:
    """kubectl replace --force: the object is deleted and created again (a new uid) while an
    evaluation reads it. The evaluation finds it gone, but the new object's state, noted meanwhile
    by its ADDED event, stays: before, it was freed, and a Live object then stayed unevaluated."""
    runtime = noted_runtime(world, llmserving(tuning={"actuation": "Live"}))
    key = ("default", "chat")
    read = world.kube.get_llmserving

    def read_while_replaced(namespace: str, name: str, fresh: bool = False) -> Any:
        world.kube.get_llmserving = read  # type: ignore[method-assign]
        del world.kube.objects[("LLMServing", namespace, name)]
        found = read(namespace, name)
        again = world.kube.create(llmserving(tuning={"actuation": "Live"}))
        runtime.spec_versions[key] = (again["metadata"]["uid"], 1)  # its ADDED event, meanwhile
        runtime.note(namespace, name, again)
        return found

    world.kube.get_llmserving = read_while_replaced  # type: ignore[method-assign]
    outcome = asyncio.run(runtime.run("default", "chat"))
    assert not outcome.found
    assert key in runtime.live and key in runtime.spec_versions and key in runtime.targets
    assert asyncio.run(runtime.run("default", "chat")).found
    assert world.kube.get("Deployment", "default", "chat") is not None


def test_an_object_deleted_while_the_watch_was_down_does_not_create_its_objects_again(world: World) -> None:
    """kopf's listing after a broken watch does not say what went: the watch cache keeps the deleted
    LLMServing, and the garbage collector deletes its Deployment. Creating that again (owned by the
    dead uid, deleted again by the collector: a GPU pod started and killed each interval) needs a
    fresh read first, which finds it gone. A new object's first creation needs none."""
    world.kube.create(llmserving())
    world.reconcile()
    assert world.kube.fresh_reads == [] and world.kube.get("Deployment", "default", "chat") is not None
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    stale = world.kube.objects.pop(("LLMServing", "default", "chat"))
    del world.kube.objects[("Deployment", "default", "chat")]  # the garbage collector
    read = world.kube.get_llmserving

    def cached(namespace: str, name: str, *, fresh: bool = False) -> Any:
        return read(namespace, name, fresh=True) if fresh else copy.deepcopy(stale)

    world.kube.get_llmserving = cached  # type: ignore[method-assign]
    world.clock.advance(30)
    outcome = world.reconcile()
    assert not outcome.found and world.kube.fresh_reads == ["chat"]
    assert world.kube.get("Deployment", "default", "chat") is None


def test_an_object_whose_delete_is_seen_while_it_is_evaluated_leaves_no_state(world: World) -> None:
    """The DELETED event frees the object's state while an evaluation holds its lock (the lock
    stays then); the evaluation, finding it gone, frees the rest — the lock too."""
    runtime = noted_runtime(world, llmserving())
    read = world.kube.get_llmserving

    def read_while_deleted(namespace: str, name: str, fresh: bool = False) -> Any:
        world.kube.get_llmserving = read  # type: ignore[method-assign]
        del world.kube.objects[("LLMServing", namespace, name)]
        runtime.forget(namespace, name)  # its DELETED event, meanwhile
        return read(namespace, name)

    world.kube.get_llmserving = read_while_deleted  # type: ignore[method-assign]
    assert not asyncio.run(runtime.run("default", "chat")).found
    assert runtime.locks == {} and runtime.spec_versions == {} and runtime.targets == {}
