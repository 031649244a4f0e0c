"""reconcile never takes over objects it does not own, never rolls on a stale read, and writes
only bounded, printable text into status — whatever upstreams send."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import observation

from batchknee.core.observation import Observation
from batchknee.render import deployment_state


def foreign_service(name: str = "chat") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "labels": {"team": "payments"}},
        "spec": {"selector": {"app": "payments"}, "ports": [{"port": 443}]},
    }


def test_a_foreign_service_of_the_same_name_is_left_alone(world: World) -> None:
    world.kube.apply(foreign_service())
    before = copy.deepcopy(world.kube.get("Service", "default", "chat"))
    world.kube.create(llmserving())
    world.reconcile()

    assert world.kube.get("Service", "default", "chat") == before
    assert world.kube.get("Deployment", "default", "chat") is None  # nothing at all was applied
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "NameConflict"
    assert "Service default/chat" in degraded["message"] and "rename" in degraded["message"]
    assert [e["reason"] for e in world.kube.events] == ["NameConflict"]
    assert world.kube.status("default", "chat")["holdReason"] == "name-conflict"

    world.reconcile()  # the same conflict again: no second event
    assert [e["reason"] for e in world.kube.events] == ["NameConflict"]


def test_a_foreign_deployment_is_neither_read_as_ours_nor_applied_over(world: World) -> None:
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"template": {"spec": {"containers": [{"name": "engine", "args": ["--max-num-seqs", "8"]}]}}},
    }
    world.kube.apply(foreign)
    before = copy.deepcopy(world.kube.get("Deployment", "default", "chat"))
    world.kube.create(llmserving())
    world.reconcile()

    assert world.kube.get("Deployment", "default", "chat") == before
    assert world.kube.get("Service", "default", "chat") is None
    status = world.kube.status("default", "chat")
    assert "maxNumSeqs" not in status  # the foreign --max-num-seqs 8 is not "applied"
    assert world.kube.condition("default", "chat", "Degraded")["reason"] == "NameConflict"


def test_the_conflict_clears_once_the_foreign_object_is_gone(world: World) -> None:
    world.kube.apply(foreign_service())
    world.kube.create(llmserving())
    world.reconcile()
    del world.kube.objects[("Service", "default", "chat")]
    world.reconcile()
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
    assert world.kube.get("Service", "default", "chat")["spec"]["selector"] == {
        "batchknee.io/llmserving": "chat"
    }


class StaleReads:
    """A second operator (or one restarted) that read the Deployment before someone changed it."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.stale: dict[str, Any] | None = None
        self.reads = 0

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.stale is not None and self.reads == 1:
            return copy.deepcopy(self.stale)
        return self.world.kube.get_deployment(namespace, name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.world.kube, attribute)


def test_a_rollout_decided_on_a_stale_deployment_never_lands(world: World) -> None:
    world.kube.create(llmserving(tuning={"cooldownSeconds": 0}))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    stale = world.kube.get_deployment("default", "chat")
    # meanwhile another writer rolled the Deployment to 16 (and recorded it)
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
        world.reconcile()
        world.clock.advance(30)
    assert deployment_state(world.kube.get_deployment("default", "chat")).max_num_seqs == 16  # type: ignore[union-attr]
    generation = world.kube.deployment("default", "chat")["metadata"]["generation"]

    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(600)  # settled long ago: on the stale read, 64 would roll to 16 again
    reads = StaleReads(world)
    reads.stale = stale  # says 64, rolled long ago: a decision on it would roll to 16 again
    world.ports.kube = reads  # type: ignore[assignment]
    outcome = world.reconcile()

    assert reads.reads >= 2  # refused by the precondition, decided again from a fresh read
    assert not outcome.conflict
    assert world.kube.deployment("default", "chat")["metadata"]["generation"] == generation
    assert [e["reason"] for e in world.kube.events].count("Retuned") == 1
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"


def test_upstream_text_in_status_is_bounded_and_printable(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    page = "<html>\x1b[31m" + "proxy error " * 500 + "</html>"  # 6 KB
    world.observer.set(
        "default",
        "chat",
        Observation.unavailable(world.clock.now, f"Prometheus answered 502: {page}"),
    )
    world.reconcile()  # the status write must not fail on the schema's limits

    status = world.kube.status("default", "chat")
    assert len(status["reason"]) <= 2048
    for condition in status["conditions"]:
        assert len(condition["message"]) <= 32768 and "\x1b" not in condition["message"]
    assert "\x1b" not in status["reason"]


def test_a_crash_looping_engine_is_degraded_naming_the_pod(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    # a container waiting in CrashLoopBackOff leaves its pod unready, and the Deployment counts it so
    world.kube.deployment("default", "chat")["status"].update(readyReplicas=0, availableReplicas=0)
    world.kube.objects[("Pod", "default", "chat-7d9f-abcde")] = {
        "metadata": {
            "name": "chat-7d9f-abcde",
            "namespace": "default",
            "labels": {"batchknee.io/llmserving": "chat"},
        },
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1}},
                }
            ]
        },
    }
    world.reconcile()
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "EngineCrashLooping"
    assert "chat-7d9f-abcde/engine (exit 1)" in degraded["message"]
    assert "EngineCrashLooping" in [e["reason"] for e in world.kube.events]


def test_an_object_whose_taking_back_failed_is_applied_to_however_in_place_it_reads(world: World) -> None:
    """A create that met someone else's Service merged into it (the apiserver does so where no field
    conflicts), and taking that back failed: the Service now carries the operator's content stamp
    and reads as in place. The adapter retries the taking back only when asked to apply it, so it
    is asked, and the failure shows."""
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.not_taken_back.add(("Service", "default", "chat"))
    world.reconcile()
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "taking back" in degraded["message"]


HUGE = "9" * 400  # under the 1,024 characters admission allows an argument


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("VLLM", ["--kv-cache-memory-bytes", HUGE + "k"]),  # a float infinity
        ("VLLM", ["--kv-cache-memory-bytes", HUGE + "K"]),  # an int no float holds
        ("VLLM", ["--kv-cache-memory-bytes", HUGE]),
        ("VLLM", ["--max-num-batched-tokens", HUGE + "k"]),
        ("VLLM", ["--gpu-memory-utilization", "1e999"]),
        ("VLLM", ["--gpu-memory-utilization", "nan"]),
        ("SGLang", ["--chunked-prefill-size", HUGE]),
        ("SGLang", ["--mem-fraction-static", "inf"]),
        ("TensorRTLLM", ["--max_num_tokens", HUGE]),
    ],
)
def test_a_number_in_args_past_any_setting_is_read_as_no_setting_not_a_crash(
    world: World, engine: str, args: list[str]
) -> None:
    """Every reconcile of such a spec raised (an OverflowError from the float math the value fed):
    no status, a traceback each evaluation. Read as garbage is, the plan is the default's."""
    world.kube.create(llmserving(engine=engine, args=args))
    world.kube.create(llmserving("plain", engine=engine))
    world.reconcile()
    world.reconcile("plain")
    status, plain = world.kube.status("default", "chat"), world.kube.status("default", "plain")
    assert status["maxNumSeqs"] == plain["maxNumSeqs"] and status["bKnee"] == plain["bKnee"]
    assert world.kube.condition("default", "chat", "Degraded")["reason"] == "AsExpected"


@pytest.mark.parametrize("fraction", ["nan", "inf", "1e400", "most"])
def test_a_tensorrt_llm_memory_fraction_that_is_no_number_is_an_invalid_spec(
    world: World, fraction: str
) -> None:
    """trtllm-serve refuses it: read as absent, the operator would plan a pool from the default
    and deploy an engine that cannot start."""
    world.kube.create(
        llmserving(engine="TensorRTLLM", args=["--kv_cache_free_gpu_memory_fraction", fraction])
    )
    world.reconcile()
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "InvalidSpec", degraded
    assert degraded["message"].startswith(
        f"spec.args --kv_cache_free_gpu_memory_fraction: must be a number in (0, 1], got '{fraction}'"
    )
    assert world.kube.get("Deployment", "default", "chat") is None
