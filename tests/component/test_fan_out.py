"""A reconcile's independent requests go out together: it holds its worker for the slowest of
them, not their sum. Each test makes the calls that must overlap wait for each other at a barrier:
made one after another, the first would wait alone until the barrier breaks, and the test fails."""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import MemoryKube, MemoryRuntime
from test_live_caps import add_pod, live_world

from batchknee.adapters.observing import RoutedObserver
from batchknee.handlers import Runtime
from batchknee.operator_metrics import OperatorMetrics
from batchknee.ports import LiveCap
from batchknee.reconcile import ENGINE_CALLS_PER_EVALUATION, FAN_OUT_THREADS, apply_stages, together
from batchknee.render import deployment_state

MEET_S = 10.0  # how long a call waits for the others at the barrier before the test fails


@dataclass
class MeetingKube(MemoryKube):
    """Reads (while `reads` is set) and the applies of `meet` (while set) wait for each other."""

    reads: threading.Barrier | None = None
    meet: tuple[set[str], threading.Barrier] | None = None
    writes: threading.Barrier | None = None  # the status write and the Events
    log: list[tuple[str, str]] = field(default_factory=list)

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.reads is not None:
            self.reads.wait()
        return super().get_deployment(namespace, name)

    def get_object(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if self.reads is not None:
            self.reads.wait()
        return super().get_object(kind, namespace, name)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        if self.writes is not None:
            self.writes.wait()
        super().patch_status(namespace, name, status)

    def emit_event(self, *args: Any, **kwargs: Any) -> None:
        if self.writes is not None:
            self.writes.wait()
        super().emit_event(*args, **kwargs)

    def apply(self, obj: dict[str, Any]) -> None:
        kind = obj["kind"]
        self.log.append(("start", kind))
        if self.meet is not None and kind in self.meet[0]:
            self.meet[1].wait()
        super().apply(obj)
        self.log.append(("end", kind))


@pytest.fixture
def meeting() -> World:
    world = World()
    world.kube = world.ports.kube = MeetingKube()
    return world


def test_a_new_llmservings_deployment_service_and_budget_are_read_together(meeting: World) -> None:
    kube = meeting.kube
    assert isinstance(kube, MeetingKube)
    kube.create(llmserving())
    kube.reads = threading.Barrier(3, timeout=MEET_S)
    meeting.reconcile()
    kube.reads = None
    assert {kind for _, kind in kube.log} == {"Service", "PodDisruptionBudget", "Deployment"}


def test_applies_go_configmap_first_then_the_rest_together(meeting: World) -> None:
    kube = meeting.kube
    assert isinstance(kube, MeetingKube)
    kube.create(llmserving(engine="TensorRTLLM"))
    kube.meet = ({"Service", "PodDisruptionBudget", "Deployment"}, threading.Barrier(3, timeout=MEET_S))
    meeting.reconcile()
    log = kube.log
    assert log[:2] == [("start", "ConfigMap"), ("end", "ConfigMap")]  # the pods mount it
    assert {kind for when, kind in log[2:5]} == {"Service", "PodDisruptionBudget", "Deployment"}
    assert {when for when, _ in log[2:5]} == {"start"}  # all three under way before one ends


def test_the_events_go_out_with_the_status_write(meeting: World) -> None:
    """A new object's "Deployed" Event and its first status are sent at once, not one after the other."""
    kube = meeting.kube
    assert isinstance(kube, MeetingKube)
    kube.create(llmserving())
    kube.writes = threading.Barrier(2, timeout=MEET_S)
    meeting.reconcile()
    kube.writes = None
    assert [e["reason"] for e in kube.events] == ["Deployed"]
    assert kube.status("default", "chat")["maxNumSeqs"] > 0


@dataclass
class MeetingRuntime(MemoryRuntime):
    """Every read and every set of a cap waits for the calls to the other pods."""

    barrier: threading.Barrier | None = None

    def read_cap(self, address: str) -> LiveCap | None:
        if self.barrier is not None:
            self.barrier.wait()
        return super().read_cap(address)

    def set_cap(self, address: str, api: str, value: int) -> None:
        if self.barrier is not None:
            self.barrier.wait()
        super().set_cap(address, api, value)


def test_every_engine_pods_cap_is_read_and_set_together(world: World) -> None:
    runtime = live_world(world, pods=3)
    meeting = MeetingRuntime(pods=runtime.pods)
    meeting.barrier = threading.Barrier(3, timeout=MEET_S)
    world.ports.runtime = meeting
    world.reconcile()
    assert {cap["cap"] for cap in meeting.pods.values() if cap} == {64}  # read at 224, set to the knee
    assert len(meeting.sets) == 3


def test_together_keeps_the_order_and_raises_the_first_error_once_every_call_ended() -> None:
    assert together([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    ended: list[str] = []
    gate = threading.Barrier(3, timeout=MEET_S)

    def call(name: str, error: Exception | None) -> str:
        gate.wait()  # all three at once
        ended.append(name)
        if error is not None:
            raise error
        return name

    with pytest.raises(KeyError, match="first"):
        together(
            [
                lambda: call("a", None),
                lambda: call("b", KeyError("first")),
                lambda: call("c", ValueError("second")),
            ]
        )
    assert sorted(ended) == ["a", "b", "c"]


def test_together_at_most_keeps_that_many_in_flight_and_makes_every_call() -> None:
    started: queue.Queue[int] = queue.Queue()
    released = [threading.Event() for _ in range(8)]

    def call(i: int) -> int:
        started.put(i)
        assert released[i].wait(MEET_S)
        return i

    results: list[int] = []
    runner = threading.Thread(
        target=lambda: results.extend(together([functools.partial(call, i) for i in range(8)], at_most=2))
    )
    runner.start()
    try:
        in_flight = {started.get(timeout=MEET_S), started.get(timeout=MEET_S)}
        order = sorted(in_flight)
        while len(order) < 8:
            with pytest.raises(queue.Empty):  # a third waits while two are in flight
                started.get(timeout=0.2)
            done = min(in_flight)
            released[done].set()
            following = started.get(timeout=MEET_S)  # the next starts as one ends
            in_flight = in_flight - {done} | {following}
            order.append(following)
    finally:
        for event in released:
            event.set()
        runner.join(MEET_S)
    assert order == list(range(8))
    assert results == list(range(8))


def test_apply_stages_orders_configmaps_then_the_rest() -> None:
    def obj(kind: str) -> dict[str, Any]:
        return {"kind": kind, "metadata": {"name": kind.lower()}}

    stages = apply_stages([obj("Service"), obj("PodDisruptionBudget"), obj("Deployment"), obj("ConfigMap")])
    assert [[o["kind"] for o in stage] for stage in stages] == [
        ["ConfigMap"],
        ["Service", "PodDisruptionBudget", "Deployment"],
    ]
    assert [[o["kind"] for o in s] for s in apply_stages([obj("StatefulSet")])] == [["StatefulSet"]]


@dataclass
class HangingRuntime(MemoryRuntime):
    """Engines that do not answer until released (a tenant's pods, wedged): those whose address
    starts with `hangs`."""

    hangs: str = "127.0.9."
    released: threading.Event = field(default_factory=threading.Event)
    wedged: threading.Event = field(default_factory=threading.Event)  # one evaluation's calls waiting
    waiting: list[str] = field(default_factory=list)

    def read_cap(self, address: str) -> LiveCap | None:
        if address.startswith(self.hangs):
            self.waiting.append(address)
            if len(self.waiting) >= ENGINE_CALLS_PER_EVALUATION:
                self.wedged.set()
            self.released.wait(2 * MEET_S)  # longer than the test waits for the other reconcile
        return super().read_cap(address)


def test_a_live_llmservings_wedged_engines_hold_no_worker_of_the_others(world: World) -> None:
    """Live actuation's reconciles wait on the engines' runtime endpoints: they run on workers of
    their own, and their calls to the pods on threads of their own, so one whose pods do not answer
    (more of them than the fan-out has threads) delays no other LLMServing's reconcile."""
    live_world(world, pods=FAN_OUT_THREADS + 1)  # "chat", actuation Live: more wedged pods than threads
    hanging = HangingRuntime(pods=world.ports.runtime.pods)  # type: ignore[union-attr]
    world.ports.runtime = hanging
    router = RoutedObserver(world.observer, "http://127.0.0.1:9090")
    runtime = Runtime(world.ports, router, OperatorMetrics(), executor=ThreadPoolExecutor(1))
    chat = world.kube.get_llmserving("default", "chat")
    other = world.kube.create(llmserving("other"))

    async def both() -> None:
        wedged = asyncio.create_task(runtime.run("default", "chat", chat))
        assert await asyncio.to_thread(hanging.wedged.wait, MEET_S)  # its pods' calls are waiting
        outcome = await asyncio.wait_for(runtime.run("default", "other", other), MEET_S)
        assert outcome.status_written and not wedged.done()
        hanging.released.set()
        await wedged

    asyncio.run(both())
    assert world.kube.deployment("default", "other")


def test_a_live_evaluations_wedged_engines_hold_a_quarter_of_the_engine_calls(world: World) -> None:
    """One Live evaluation calls at most ENGINE_CALLS_PER_EVALUATION of its pods at once: a tenant
    whose pods do not answer (more of them than the engine calls have threads) holds a quarter of
    those threads, and another Live LLMServing's pods are read and set meanwhile."""
    live_world(world, pods=FAN_OUT_THREADS + 1)  # "chat": more wedged pods than threads
    hanging = HangingRuntime(pods=world.ports.runtime.pods)  # type: ignore[union-attr]
    world.ports.runtime = hanging
    other = world.kube.create(llmserving("other", tuning={"cooldownSeconds": 0, "actuation": "Live"}))
    world.reconcile("other")
    ceiling = deployment_state(world.kube.get_deployment("default", "other")).max_num_seqs  # type: ignore[union-attr]
    for i in range(2):
        add_pod(world, hanging, f"other-abc-{i}", f"127.0.8.{i + 1}", ceiling, owner="other")
    world.kube.finish_rollout("default", "other")
    router = RoutedObserver(world.observer, "http://127.0.0.1:9090")
    runtime = Runtime(world.ports, router, OperatorMetrics())
    runtime.live.update({("default", "chat"), ("default", "other")})
    chat = world.kube.get_llmserving("default", "chat")

    async def both() -> None:
        wedged = asyncio.create_task(runtime.run("default", "chat", chat))
        assert await asyncio.to_thread(hanging.wedged.wait, MEET_S)  # its pods' calls are waiting
        outcome = await asyncio.wait_for(runtime.run("default", "other", other), MEET_S)
        assert outcome.status_written and not wedged.done()
        assert len(hanging.waiting) == ENGINE_CALLS_PER_EVALUATION  # the rest of chat's pods wait
        hanging.released.set()
        await wedged

    asyncio.run(both())
    assert {address for address, _ in hanging.sets} >= {"127.0.8.1:8000", "127.0.8.2:8000"}
    assert len(hanging.waiting) == FAN_OUT_THREADS + 1  # every pod of chat called once released
