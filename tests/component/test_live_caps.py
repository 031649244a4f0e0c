"""actuation: Live — pods start at a ceiling and each ready pod's cap is set through its runtime
endpoint, level-based, without a restart; what cannot be done live falls back to a restart and
says why."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import MemoryRuntime, observation

from batchknee.reconcile import reconcile
from batchknee.render import deployment_state


def live_world(
    world: World,
    *,
    supported: bool = True,
    pods: int = 2,
    tuning: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
) -> MemoryRuntime:
    runtime = MemoryRuntime()
    world.ports.runtime = runtime
    tuning = {"cooldownSeconds": 0, "actuation": "Live", **(tuning or {})}
    world.kube.create(llmserving(tuning=tuning, **({"rollout": rollout} if rollout else {})))
    world.reconcile()  # creates the Deployment at the ceiling
    ceiling = deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs  # type: ignore[union-attr]
    for i in range(pods):
        add_pod(world, runtime, f"chat-abc-{i}", f"127.0.9.{i + 1}", ceiling if supported else None)
    world.kube.finish_rollout("default", "chat")
    return runtime


def add_pod(
    world: World, runtime: MemoryRuntime, name: str, ip: str, ceiling: int | None, owner: str = "chat"
) -> None:
    world.kube.objects[("Pod", "default", name)] = {
        "metadata": {"name": name, "namespace": "default", "labels": {"batchknee.io/llmserving": owner}},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    runtime.pods[f"{ip}:8000"] = (
        {"api": "runtime-config", "cap": ceiling, "ceiling": ceiling} if ceiling is not None else None
    )


def generation(world: World) -> int:
    return int(world.kube.deployment("default", "chat")["metadata"]["generation"])


def shift(world: World, ctx: int, evaluations: int = 8) -> None:
    for _ in range(evaluations):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx, pods=2))
        world.reconcile()
        world.clock.advance(30)


def test_caps_follow_the_knee_live_with_no_restart(world: World) -> None:
    runtime = live_world(world)
    dep = deployment_state(world.kube.get_deployment("default", "chat"))
    assert dep is not None and dep.max_num_seqs == 224  # the KV pool's bound at the initial 2,048 tokens
    world.reconcile()
    assert {cap["cap"] for cap in runtime.pods.values() if cap} == {64}  # the knee, set live on both pods
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 64 and status["ceilingMaxNumSeqs"] == 224
    assert world.kube.condition("default", "chat", "Actuation")["status"] == "True"
    before = generation(world)

    world.clock.advance(121)
    shift(world, 8192)
    assert {cap["cap"] for cap in runtime.pods.values() if cap} == {16}
    assert generation(world) == before  # no pod template change: no restart
    assert world.kube.status("default", "chat")["history"][-1]["to"] == 16
    assert "Retuned" in [e["reason"] for e in world.kube.events]


def test_a_restarted_pod_gets_its_cap_back_within_one_evaluation(world: World) -> None:
    runtime = live_world(world)
    world.reconcile()
    runtime.pods["127.0.9.1:8000"]["cap"] = 224  # type: ignore[index]  # restarted: back at the ceiling
    world.clock.advance(30)
    world.reconcile()
    assert runtime.pods["127.0.9.1:8000"]["cap"] == 64  # type: ignore[index]


def test_a_pod_gone_between_its_read_and_its_set_is_not_called(world: World) -> None:
    """Caps are set after Prometheus and the apply: a pod deleted meanwhile (its tenant scaled down)
    may have left its address to another team's pod, which the set would have patched."""
    runtime = live_world(world)
    read_cap = runtime.read_cap

    def read_then_deleted(address: str) -> Any:
        found = read_cap(address)
        if address == "127.0.9.2:8000":  # deleted after its read; its address now another pod's
            del world.kube.objects[("Pod", "default", "chat-abc-1")]
        return found

    runtime.read_cap = read_then_deleted  # type: ignore[method-assign]
    listed = world.kube.list_pods("default", {"batchknee.io/llmserving": "chat"})
    stored_list = world.kube.list_pods

    def cached_unless_fresh(namespace: str, labels: dict[str, str], *, fresh: bool = False) -> Any:
        # an apiserver's watch cache that has not seen the delete yet; a consistent read has
        return stored_list(namespace, labels) if fresh else listed

    world.kube.list_pods = cached_unless_fresh  # type: ignore[method-assign]
    world.reconcile()
    assert runtime.sets == [("127.0.9.1:8000", 64)]
    world.kube.list_pods = stored_list  # type: ignore[method-assign]
    stored = world.kube.objects[("Pod", "default", "chat-abc-0")]
    runtime.pods["127.0.9.1:8000"]["cap"] = 224  # type: ignore[index]

    def changed_after_its_read(field: str, value: str) -> None:
        def read_then_changed(address: str) -> Any:
            found = read_cap(address)
            stored["metadata"][field] = value
            return found

        runtime.read_cap = read_then_changed  # type: ignore[method-assign]
        world.clock.advance(30)
        world.reconcile()
        assert runtime.sets == [("127.0.9.1:8000", 64)], field

    # replaced under the same name (a StatefulSet's pod): a new uid, maybe a new address
    changed_after_its_read("uid", "another")
    # terminating after its read (same uid and address)
    changed_after_its_read("deletionTimestamp", "2026-03-01T12:00:00Z")
    runtime.read_cap = read_cap  # type: ignore[method-assign]
    del stored["metadata"]["deletionTimestamp"]
    # a pod whose phase has ended is not one to call at all, Ready or not
    world.kube.objects[("Pod", "default", "chat-abc-0")]["status"]["phase"] = "Failed"
    runtime.pods["127.0.9.1:8000"]["cap"] = 224  # type: ignore[index]
    world.clock.advance(30)
    world.reconcile()
    assert runtime.sets == [("127.0.9.1:8000", 64)]


def test_one_replica_takes_caps_live_but_is_not_restarted_above_its_ceiling(world: World) -> None:
    """A single replica without a surge or a serving gap: a cap under its ceiling is set live (no
    restart, nothing stops serving), a value above it would restart the only replica — held."""
    runtime = live_world(world, pods=1, rollout={"allowServingGap": False})
    world.reconcile()
    assert runtime.pods["127.0.9.1:8000"]["cap"] == 64  # type: ignore[index]
    before = generation(world)
    world.clock.advance(121)
    shift(world, 512)  # the knee at 512 tokens is 240, above the pod's ceiling of 224
    assert generation(world) == before
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "single-replica" and status["maxNumSeqs"] == 64, status["reason"]


def test_a_pod_that_does_not_answer_is_named_and_the_others_get_their_cap(world: World) -> None:
    runtime = live_world(world)
    silent = "did not answer within 2 s: not called again for 30 s"
    runtime.pods["127.0.9.2:8000"]["silent"] = silent  # type: ignore[index]
    world.reconcile()
    assert runtime.pods["127.0.9.1:8000"]["cap"] == 64  # type: ignore[index]
    assert runtime.pods["127.0.9.2:8000"]["cap"] == 224  # type: ignore[index]  # not set: unread
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert actuation["status"] == "False" and actuation["reason"] == "LiveCapUnread"
    assert actuation["message"] == f"1 pods take their batch cap live; could not read 1: chat-abc-1: {silent}"
    del runtime.pods["127.0.9.2:8000"]["silent"]  # type: ignore[attr-defined]  # it answers again
    world.clock.advance(30)
    world.reconcile()
    assert runtime.pods["127.0.9.2:8000"]["cap"] == 64  # type: ignore[index]
    assert world.kube.condition("default", "chat", "Actuation")["reason"] == "Live"


def test_a_pod_reporting_a_lower_startup_limit_is_named_not_left_silently(world: World) -> None:
    """A pod whose engine says it started below the cap (no rollout replaces it) is not set, and the
    condition says so instead of Live."""
    runtime = live_world(world)
    runtime.pods["127.0.9.2:8000"] = {"api": "runtime-config", "cap": 32, "ceiling": 32}
    world.reconcile()
    assert runtime.pods["127.0.9.1:8000"]["cap"] == 64  # type: ignore[index]
    assert runtime.pods["127.0.9.2:8000"]["cap"] == 32  # type: ignore[index]
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert (actuation["status"], actuation["reason"]) == ("False", "LiveCapRefused")
    assert actuation["message"].startswith("pods chat-abc-1 report a startup limit below the cap 64")


def test_pods_without_a_runtime_endpoint_fall_back_to_a_restart(world: World) -> None:
    live_world(world, supported=False)
    world.reconcile()
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert actuation["status"] == "False" and actuation["reason"] == "LiveUnsupported"
    assert "chat-abc-0" in actuation["message"] and "restart" in actuation["message"]
    assert deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs == 64  # type: ignore[union-attr]


def test_a_value_above_the_ceiling_restarts_with_a_higher_ceiling(world: World) -> None:
    live_world(world)
    world.reconcile()
    before = generation(world)
    world.clock.advance(121)
    shift(world, 512)  # the knee at 512 tokens is 240, above the pods' ceiling of 224
    assert deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs == 240  # type: ignore[union-attr]
    assert generation(world) == before + 1  # one restart, to the higher ceiling
    [raised] = [e for e in world.kube.events if e["reason"] == "AboveCeiling"]
    assert "240 is above the pods' startup ceiling 224" in raised["message"]
    world.clock.advance(30)
    world.reconcile()  # the old pods, at 224, wait for the rollout that replaces them: no refusal
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert (actuation["status"], actuation["reason"]) == ("True", "Live")
    assert actuation["message"].endswith("; 2 started below 240 wait for the rollout that replaces them")
    world.kube.finish_rollout("default", "chat")
    world.clock.advance(30)
    world.reconcile()  # the rollout is done and they still say 224: named
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert actuation["reason"] == "LiveCapRefused" and "chat-abc-0, chat-abc-1" in actuation["message"]


def test_switched_to_restart_the_pods_are_restarted_at_their_live_cap_not_held_at_the_ceiling(
    world: World,
) -> None:
    """Live caps of 16 under a ceiling of 224, then actuation Restart: the Deployment is rendered at
    16 at once (one restart; a pod restarted meanwhile would come back uncapped at 224), and the live
    change, which restarted nothing, starts no cooldown for the retune after it."""
    live_world(world, tuning={"cooldownSeconds": 3600})
    world.reconcile()
    world.clock.advance(121)
    shift(world, 8192)
    live_change = world.kube.status("default", "chat")["history"][-1]
    assert live_change["to"] == 16 and live_change["reason"].endswith("(live)")
    before = generation(world)

    world.kube.edit_spec("default", "chat", {"tuning": {"actuation": "Restart"}})
    shift(world, 8192, evaluations=1)
    status = world.kube.status("default", "chat")
    assert deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs == 16  # type: ignore[union-attr]
    assert status["maxNumSeqs"] == 16 and status["holdReason"] != "cooldown", status["reason"]
    world.kube.finish_rollout("default", "chat")
    shift(world, 8192, evaluations=4)
    assert generation(world) == before + 1

    shift(
        world, 2048, evaluations=10
    )  # the knee is 64 again, well inside the hour's cooldown of the live change
    assert deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs == 64  # type: ignore[union-attr]
    history = world.kube.status("default", "chat")["history"]
    assert history[-1]["from"] == 16 and history[-1]["to"] == 64
    retuned = datetime.fromisoformat(history[-1]["time"]) - datetime.fromisoformat(live_change["time"])
    assert retuned < timedelta(seconds=3600)
    assert generation(world) == before + 2


def test_tensorrt_llm_live_says_why_not_and_restarts(world: World) -> None:
    world.ports.runtime = MemoryRuntime()
    world.kube.create(llmserving(engine="TensorRTLLM", tuning={"actuation": "Live"}))
    world.reconcile()
    actuation = world.kube.condition("default", "chat", "Actuation")
    assert actuation["reason"] == "LiveUnsupported" and "TensorRTLLM" in actuation["message"]


@pytest.mark.parametrize("supported", [True, False])
def test_a_safety_decrease_lowers_the_cap_live_inside_the_cooldown(world: World, supported: bool) -> None:
    """Lowering a live cap restarts nothing, so a TPOT target broken right after a retune is met at
    once; pods that cannot take a cap live restart, and the cooldown holds them."""
    runtime = live_world(
        world, supported=supported, tuning={"cooldownSeconds": 3600, "tpotP99TargetMilliseconds": 30}
    )
    world.reconcile()
    world.kube.finish_rollout("default", "chat")  # (unsupported: the restart to the knee)
    world.clock.advance(301)
    shift(world, 4096, evaluations=6)  # a retune to the knee at 4,096 tokens: 64 → 32
    world.kube.finish_rollout("default", "chat")  # (a restart's rollout; nothing to do live)
    world.reconcile()
    assert world.kube.status("default", "chat")["maxNumSeqs"] == 32
    world.clock.advance(301)  # past the settle window, deep in the cooldown
    shift(world, 4096, evaluations=2)  # the check after the change: kept
    assert world.kube.status("default", "chat")["maxNumSeqs"] == 32
    world.observer.set(
        "default", "chat", observation(world.clock.now, ctx=4096, pods=2, running=64, tpot_p99_ms=60.0)
    )
    world.reconcile()
    status = world.kube.status("default", "chat")
    if supported:
        assert status["maxNumSeqs"] < 32, status["reason"]
        assert {cap["cap"] for cap in runtime.pods.values() if cap} == {status["maxNumSeqs"]}
    else:
        assert status["maxNumSeqs"] == 32 and status["holdReason"] == "cooldown", status["reason"]


def test_an_evaluation_launched_without_engine_calls_leaves_a_live_spec_to_the_next(world: World) -> None:
    """Its spec flipped to Live after the evaluation was launched on the shared worker: it calls no
    pod, rolls nothing and writes no status (a restart would undo what Live set); the next one,
    launched as Live, acts."""
    runtime = live_world(world)
    reads: list[str] = []
    read_cap = runtime.read_cap

    def counted(address: str) -> Any:
        reads.append(address)
        return read_cap(address)

    runtime.read_cap = counted  # type: ignore[method-assign]
    before = (generation(world), world.kube.status("default", "chat"))
    outcome = reconcile("default", "chat", world.ports, world.clock.now, engine_calls=False)
    assert outcome.decision is None and not outcome.status_written
    assert (reads, runtime.sets) == ([], [])
    assert (generation(world), world.kube.status("default", "chat")) == before
    world.reconcile()
    assert len(reads) == 2 and {cap["cap"] for cap in runtime.pods.values() if cap} == {64}


def test_a_budget_refused_beside_does_not_keep_the_caps_from_the_pods(world: World) -> None:
    # the Deployment is not written for a live cap; a refused PodDisruptionBudget (a quota) used
    # to leave the caps at 64 for good while status said 16
    runtime = live_world(world)
    world.reconcile()
    del world.kube.objects[("PodDisruptionBudget", "default", "chat")]
    world.kube.fail_apply = {"PodDisruptionBudget"}
    world.clock.advance(121)
    shift(world, 8192)
    assert {cap["cap"] for cap in runtime.pods.values() if cap} == {16}
    assert world.kube.status("default", "chat")["maxNumSeqs"] == 16
    assert world.kube.condition("default", "chat", "Degraded")["reason"] == "ApplyFailed"
