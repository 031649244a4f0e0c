"""Rollouts that keep serving and undo themselves: a single replica is not restarted without
consent, a rollout whose pods never become Ready is rolled back, and its value is quarantined."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import observation
from test_live_caps import live_world

from batchknee.api.models import format_timestamp
from batchknee.pacing import Place, RolloutPacer
from batchknee.render import TEMPLATE_CHANGED_ANNOTATION, RenderDefaults, deployment_state


def applied(world: World) -> int | None:
    state = deployment_state(world.kube.get_deployment("default", "chat"))
    return state.max_num_seqs if state else None


def shift(world: World, ctx: int, evaluations: int = 6) -> None:
    for _ in range(evaluations):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))
        world.reconcile()
        world.clock.advance(30)


def started(world: World, **spec: object) -> None:
    world.kube.create(llmserving(tuning={"cooldownSeconds": 0}, **spec))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)


def test_a_single_replica_without_surge_holds_and_says_how_to_allow_it(world: World) -> None:
    started(world, rollout={"allowServingGap": False})
    assert applied(world) == 64  # creating it is not a restart
    shift(world, 8192)
    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "single-replica"
    assert "spec.rollout.maxSurge: 1" in status["reason"] and "allowServingGap: true" in status["reason"]
    assert status["recommendedMaxNumSeqs"] == 16


def test_a_surge_pod_lets_a_single_replica_retune(world: World) -> None:
    started(world, rollout={"maxSurge": 1, "maxUnavailable": 0})
    shift(world, 8192)
    assert applied(world) == 16


def stall(world: World, name: str = "chat") -> None:
    """What the Deployment controller reports when the new pods never become Ready."""
    dep = world.kube.objects[("Deployment", "default", name)]
    dep["status"] = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": 2,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
        "conditions": [
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "lastUpdateTime": world.clock.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        ],
    }
    dep["metadata"]["resourceVersion"] += "-stalled"


def observed_but_not_progressed(world: World) -> None:
    """The controller has seen the rolled-back template, and keeps the stall's condition until its
    pods make progress."""
    dep = world.kube.objects[("Deployment", "default", "chat")]
    dep["status"]["observedGeneration"] = dep["metadata"]["generation"]
    dep["metadata"]["resourceVersion"] += "-observed"


def test_a_rollout_that_never_gets_ready_is_rolled_back_and_quarantined(world: World) -> None:
    started(world)
    shift(world, 512)  # the knee at 512 tokens: 240
    assert applied(world) == 240
    stall(world)  # 240 does not fit: the new pods crash
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()

    assert applied(world) == 64  # back to the last good value
    status = world.kube.status("default", "chat")
    [entry] = status["quarantine"]
    # at every context: pods that do not start at 240 do not start at shorter traffic either
    assert entry["maxNumSeqs"] == 240 and "contextTokens" not in entry
    assert "not Ready by the progress deadline" in entry["reason"]
    assert [h["to"] for h in status["history"]] == [64, 240, 64]
    assert status["history"][-1]["reason"].startswith("rollback 240→64")
    assert "RolledBack" in [e["reason"] for e in world.kube.events]

    # the stall's condition outlives the rollback until 64's pods progress: it is not 64's failure
    for _ in range(3):
        world.clock.advance(5)
        observed_but_not_progressed(world)
        world.reconcile()
    assert applied(world) == 64
    assert [h["to"] for h in world.kube.status("default", "chat")["history"]] == [64, 240, 64]

    # the same traffic: the quarantined value (or more) is not tried again
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    shift(world, 512, evaluations=8)
    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "quarantined" and "quarantined 240" in status["reason"]

    # nor at a shorter context, where the knee wants more (it was keyed by context, and an 11 %
    # shorter one rolled 272 straight into another progress deadline)
    shift(world, 400, evaluations=8)
    assert applied(world) == 64
    # other traffic is not blocked: 8k tokens wants 16, below the failed value
    shift(world, 8192, evaluations=8)
    assert applied(world) == 16

    # and the quarantine expires
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(3700)
    shift(world, 512, evaluations=8)
    assert applied(world) == 240
    assert world.kube.status("default", "chat").get("quarantine", []) == []


def test_a_stall_of_a_new_template_is_not_blamed_on_the_batch_limit(world: World) -> None:
    """A retune settles, then the spec names an image whose pods never get Ready: the stall is the
    template's. The batch limit is not rolled back (which would render the same broken image and
    flip the limit at every progress deadline) nor quarantined; Degraded says the rollout stalled."""
    started(world)
    shift(world, 512)
    assert applied(world) == 240
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(300)
    world.kube.edit_spec("default", "chat", {"image": "vllm/vllm-openai:does-not-exist"})
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    world.clock.advance(600)
    stall(world)
    for _ in range(3):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
        world.reconcile()
        world.clock.advance(30)

    assert applied(world) == 240
    status = world.kube.status("default", "chat")
    assert [h["to"] for h in status["history"]] == [64, 240]
    assert status.get("quarantine", []) == []
    assert world.kube.condition("default", "chat", "Degraded")["reason"] == "RolloutStalled"
    assert "RolledBack" not in [e["reason"] for e in world.kube.events]


def test_a_new_template_during_a_retune_still_lets_the_retunes_stall_roll_back(world: World) -> None:
    """The operator's new template lands while a retune's pods are still coming up: the stall that
    follows is the retune's too (its pods never got Ready), so it is rolled back as before."""
    started(world)
    shift(world, 512)
    assert applied(world) == 240  # rolling, not finished
    pacer = RolloutPacer(1)
    assert pacer.admit(("default", "elsewhere"), Place("another template", world.clock.now))  # no place free
    world.ports = replace(
        world.ports, defaults=RenderDefaults(vllm_image="vllm/vllm-openai:v99"), pacer=pacer
    )
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    container = world.kube.deployment("default", "chat")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "vllm/vllm-openai:v99"  # replacing pods already: no place needed
    world.clock.advance(600)
    stall(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    assert applied(world) == 64
    assert [q["maxNumSeqs"] for q in world.kube.status("default", "chat")["quarantine"]] == [240]


def test_a_template_change_time_from_the_future_does_not_stop_a_rollback(world: World) -> None:
    """Someone writes a template-changed time past now on the Deployment: it is not believed, and a
    stall of the retune is rolled back as before."""
    started(world)
    shift(world, 512)
    assert applied(world) == 240
    deployment = world.kube.deployment("default", "chat")
    deployment["metadata"]["annotations"][TEMPLATE_CHANGED_ANNOTATION] = "2099-01-01T00:00:00Z"
    stall(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    assert applied(world) == 64


def test_a_rollout_that_stalls_while_no_context_is_seen_is_quarantined_at_every_context(
    world: World,
) -> None:
    """The metrics are gone when the stall shows (the new pods never serve): the failed value's
    context is unknown, not 0 tokens, so it is held wherever the traffic goes, until it expires."""
    started(world)
    shift(world, 512)
    assert applied(world) == 240
    stall(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=None))
    world.reconcile()

    assert applied(world) == 64
    [entry] = world.kube.status("default", "chat")["quarantine"]
    assert entry["maxNumSeqs"] == 240 and "contextTokens" not in entry

    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    shift(world, 384, evaluations=8)  # the knee there is above 240: held, though 384 < 512
    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "quarantined"
    assert "failed at an unobserved context" in status["reason"]

    shift(world, 8192, evaluations=8)  # below the failed value: not held
    assert applied(world) == 16


def steady_traffic(world: World, ctx: int, **figures: float) -> None:
    """Six evaluations, 30 s apart, of traffic with these figures (enough for a retune to roll)."""
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx, **figures))  # type: ignore[arg-type]
        world.reconcile()
        world.clock.advance(30)


def settled_window(world: World, ctx: int, **figures: float) -> None:
    """The rollout completes, then a whole settle window of traffic with these figures."""
    world.kube.finish_rollout("default", "chat")
    world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx, **figures))  # type: ignore[arg-type]
    world.reconcile()
    world.clock.advance(121)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx, **figures))  # type: ignore[arg-type]
    world.reconcile()


def engine_pod(world: World, name: str, *, deleted_in_s: float | None = None, grace_s: int = 60) -> None:
    """A pod of the engine Deployment; `deleted_in_s`: terminating, its deletionTimestamp that far
    from now (the apiserver sets it to the delete's time plus the grace period)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "default",
        "labels": {"batchknee.io/llmserving": "chat"},
    }
    if deleted_in_s is not None:
        meta["deletionTimestamp"] = format_timestamp(world.clock.now + timedelta(seconds=deleted_in_s))
        meta["deletionGracePeriodSeconds"] = grace_s
    ready = [
        {
            "type": "Ready",
            "status": "False" if deleted_in_s is not None else "True",
            "lastTransitionTime": format_timestamp(world.clock.now),
        }
    ]
    world.kube.objects[("Pod", "default", name)] = {
        "metadata": meta,
        "status": {"phase": "Running", "podIP": "10.0.0.9", "conditions": ready},
    }


def pod_lists(world: World) -> list[str]:
    """The pod LISTs made from now on (each one's namespace)."""
    calls: list[str] = []
    listed = world.kube.list_pods

    def counted(namespace: str, labels: dict[str, str], *, fresh: bool = False) -> Any:
        calls.append(namespace)
        return listed(namespace, labels, fresh=fresh)

    world.kube.list_pods = counted  # type: ignore[method-assign]
    return calls


def settle_time(world: World) -> str | None:
    return world.kube.status("default", "chat").get("rolloutCompleteTime")


def test_the_settle_window_starts_once_the_replaced_pods_are_gone(world: World) -> None:
    """The Deployment counts a rollout complete while the pods it replaced still drain (preStop,
    grace period), and Prometheus scrapes them until they are deleted: a window with them reads the
    batch and the throughput per pod low. The settle time is the first evaluation that sees none."""
    started(world)
    steady_traffic(world, 8192, tpot_p99_ms=40, tokens_per_s=1500)
    assert applied(world) == 16
    engine_pod(world, "chat-new-0")
    engine_pod(world, "chat-old-0", deleted_in_s=75, grace_s=90)  # 75 s left of its grace period
    samples = len(world.kube.status("default", "chat")["calibration"]["samples"])
    lists = pod_lists(world)
    world.kube.finish_rollout("default", "chat")
    for _ in range(3):  # 0, 30 and 60 s later
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=25))
        world.reconcile()
        status = world.kube.status("default", "chat")
        assert settle_time(world) is None
        assert status["holdReason"] == "rollout-in-progress"
        assert status["reason"].endswith("holding 16: rollout in progress: 1 old pod draining")
        assert len(status["calibration"]["samples"]) == samples
        world.clock.advance(30)
    assert len(lists) == 3  # one LIST an evaluation, only while the settle time is new

    del world.kube.objects[("Pod", "default", "chat-old-0")]  # drained and deleted
    settled_at = world.clock.now
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=25))
    world.reconcile()
    assert settle_time(world) == format_timestamp(settled_at)
    assert world.kube.status("default", "chat")["holdReason"] == "settling"
    assert len(lists) == 4

    # stored: the settle window, the check after it and the steady evaluations list no pods
    for _ in range(8):
        world.clock.advance(30)
        world.observer.set(
            "default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=25, tokens_per_s=1450)
        )
        world.reconcile()
    assert settle_time(world) == format_timestamp(settled_at)
    assert world.kube.status("default", "chat")["history"][-1]["verdict"] == "Kept"
    assert len(world.kube.status("default", "chat")["calibration"]["samples"]) > samples
    assert len(lists) == 4


def test_a_pod_stuck_terminating_holds_the_settle_time_only_to_its_grace_period_and_a_margin(
    world: World,
) -> None:
    """A pod whose node is gone, or whose finalizer is never removed, stays Terminating forever: it
    holds the settle window until its deletionTimestamp (the end of its grace period) plus
    render.DRAIN_MARGIN_S (60 s), not longer."""
    started(world)
    steady_traffic(world, 8192, tpot_p99_ms=40, tokens_per_s=1500)
    assert applied(world) == 16
    engine_pod(world, "chat-new-0")
    engine_pod(world, "chat-stuck-0", deleted_in_s=30, grace_s=30)
    deadline = world.clock.now + timedelta(seconds=30 + 60)
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    assert settle_time(world) is None
    world.clock.now = deadline - timedelta(seconds=1)
    world.reconcile()
    assert settle_time(world) is None
    world.clock.now = deadline
    world.reconcile()
    assert settle_time(world) == format_timestamp(deadline)
    assert world.kube.status("default", "chat")["holdReason"] == "settling"
    assert ("Pod", "default", "chat-stuck-0") in world.kube.objects


def test_a_change_that_did_what_the_model_said_is_kept(world: World) -> None:
    started(world)
    steady_traffic(world, 8192, tpot_p99_ms=40, tokens_per_s=1500)
    assert applied(world) == 16
    settled_window(world, 8192, tpot_p99_ms=25, tokens_per_s=1450)  # TPOT halves, throughput holds

    entry = world.kube.status("default", "chat")["history"][-1]
    assert entry["verdict"] == "Kept"
    assert entry["before"]["tpotP99Milliseconds"] == 40 and entry["after"]["tpotP99Milliseconds"] == 25
    assert (
        entry["before"]["tokensPerSecondPerPod"] == 1500 and entry["after"]["tokensPerSecondPerPod"] == 1450
    )
    assert "ChangeKept" in [e["reason"] for e in world.kube.events]
    assert applied(world) == 16


def test_the_check_waits_for_a_window_sampled_after_the_settle(world: World) -> None:
    """A cached reading (a slow Prometheus a spec chose is read at most a tenth of the time) can
    be older than the clock: the window after is the one sampled once the settle is over, not the
    first one read after it."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    assert applied(world) == 240
    world.observer.lag_s = 30  # sampled 30 s before each reconcile: 91 s into the 120-s settle
    settled_window(world, 512, tpot_p99_ms=60, tokens_per_s=2000)
    assert world.kube.status("default", "chat")["history"][-1].get("verdict") is None
    assert applied(world) == 240
    world.observer.lag_s = 0
    world.reconcile()
    checked = world.kube.status("default", "chat")["history"][-2]
    assert checked["to"] == 240 and checked["verdict"] == "Reverted" and applied(world) == 64


def test_a_change_that_lost_throughput_is_reverted_and_not_retried(world: World) -> None:
    """A kernel or memory cliff: 240 runs, but slower per pod than 64 did."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    assert applied(world) == 240
    settled_window(world, 512, tpot_p99_ms=60, tokens_per_s=2000)  # −33 % and TPOT worse

    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    checked = status["history"][-2]
    assert checked["to"] == 240 and checked["verdict"] == "Reverted"
    assert "throughput fell without a TPOT gain" in checked["verdictReason"]
    assert status["history"][-1]["reason"].startswith("revert 240→64")
    [entry] = status["quarantine"]
    assert entry["maxNumSeqs"] == 240 and entry["direction"] == "Above" and entry["contextTokens"] == 512
    reasons = [e["reason"] for e in world.kube.events]
    assert "ChangeReverted" in reasons and "Reverted" in reasons

    # the same traffic again: never retried while quarantined, and the revert itself is not "checked"
    settled_window(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    for _ in range(8):
        world.clock.advance(30)
        world.observer.set(
            "default", "chat", observation(world.clock.now, ctx=512, tpot_p99_ms=20, tokens_per_s=3000)
        )
        world.reconcile()
    assert applied(world) == 64
    assert world.kube.status("default", "chat")["holdReason"] == "quarantined"


def test_a_status_entry_this_version_cannot_read_keeps_the_quarantine_and_the_history(world: World) -> None:
    """A newer operator (then rolled back) or a hand edit left one condition of a type this version
    does not know: the rest of the stored status still counts. It used to be dropped whole: the
    quarantined 240 was rolled straight back into its progress deadline."""
    started(world)
    shift(world, 512)
    stall(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    assert applied(world) == 64
    stored = world.kube.status("default", "chat")
    stored["conditions"].append(
        {"type": "Scaled", "status": "True", "lastTransitionTime": "2026-03-01T12:00:00Z", "reason": "X"}
    )
    stored["history"].append({"time": "not a time", "to": 8})  # one bad entry, not the whole list
    world.clock.advance(121)
    shift(world, 512, evaluations=8)
    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "quarantined" and [q["maxNumSeqs"] for q in status["quarantine"]] == [240]
    assert [h["to"] for h in status["history"]] == [64, 240, 64]
    assert "Scaled" not in {c["type"] for c in status["conditions"]}


def test_a_quarantine_holds_where_the_context_grew_and_lifts_where_it_shrank(world: World) -> None:
    """A larger limit that did worse at 512 tokens is no better at 600, where each sequence holds
    more KV: bounded by maxMaxNumSeqs, the wanted value stays the failed one as the context grows
    past the dead band, and it is not retried. At a shorter context each sequence is lighter, and
    the value may be tried again."""
    world.kube.create(llmserving(tuning={"cooldownSeconds": 0, "maxMaxNumSeqs": 200}))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    good = {"tpot_p99_ms": 20.0, "tokens_per_s": 3000.0}
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=512, **good))  # type: ignore[arg-type]
        world.reconcile()
        world.clock.advance(30)
    assert applied(world) == 200
    settled_window(world, 512, tpot_p99_ms=60, tokens_per_s=2000)
    assert applied(world) == 64
    [entry] = world.kube.status("default", "chat")["quarantine"]
    assert (entry["maxNumSeqs"], entry["direction"], entry["contextTokens"]) == (200, "Above", 512)

    settled_window(world, 600, **good)  # 17 % longer: the knee is still past 200
    for _ in range(8):
        world.clock.advance(30)
        world.observer.set("default", "chat", observation(world.clock.now, ctx=600, **good))  # type: ignore[arg-type]
        world.reconcile()
    assert applied(world) == 64
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "quarantined" and "quarantined 200" in status["reason"]

    for _ in range(8):  # 14 % shorter
        world.clock.advance(30)
        world.observer.set("default", "chat", observation(world.clock.now, ctx=440, **good))  # type: ignore[arg-type]
        world.reconcile()
    assert applied(world) == 200


def test_preemptions_appearing_revert_the_change(world: World) -> None:
    started(world)
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=512, tokens_per_s=3000))
        world.reconcile()
        world.clock.advance(30)
    settled_window(world, 512, tokens_per_s=3100, preemptions_per_s=2.0)
    assert applied(world) == 64
    assert "preemptions appeared" in world.kube.status("default", "chat")["history"][-2]["verdictReason"]


def test_traffic_that_moved_is_inconclusive_not_a_revert(world: World) -> None:
    started(world)
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=512, tokens_per_s=3000))
        world.reconcile()
        world.clock.advance(30)
    settled_window(world, 2048, tokens_per_s=1000)  # another workload now: nothing to compare
    history = world.kube.status("default", "chat")["history"]
    [checked] = [h for h in history if h["to"] == 240]
    assert checked["verdict"] == "Inconclusive" and "traffic moved" in checked["verdictReason"]
    assert world.kube.status("default", "chat").get("quarantine", []) == []


def test_a_change_still_unchecked_when_the_model_and_gpus_change_is_inconclusive(world: World) -> None:
    """64 → 240 on an 8B over one A100, then a 70B on four H100s before the check: the window
    after runs another model, and its lower throughput is no verdict on 240 (reverting would force
    the 70B to 64 and quarantine 240 for an hour)."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    assert applied(world) == 240
    world.kube.finish_rollout("default", "chat")
    world.kube.edit_spec(
        "default",
        "chat",
        {"model": {"name": "meta-llama/Llama-3.1-70B-Instruct"}, "gpu": {"type": "h100-sxm", "count": 4}},
    )
    world.reconcile()  # the new model's pods roll out
    settled_window(world, 512, tpot_p99_ms=30, tokens_per_s=1500)  # −50 % on the bigger model

    status = world.kube.status("default", "chat")
    [checked] = [h for h in status["history"] if h["to"] == 240]
    assert checked["verdict"] == "Inconclusive", checked
    assert checked["verdictReason"].startswith("the engine, model, GPU, image or engine args changed since")
    assert not status.get("quarantine") and applied(world) != 64
    assert not any(h["reason"].startswith("revert") for h in status["history"])
    assert "ChangeReverted" not in [e["reason"] for e in world.kube.events]


def test_a_quarantine_does_not_follow_the_object_to_another_engine_and_gpu(world: World) -> None:
    """240 failed under vLLM on an A100; under SGLang on two H200s it is another setup, and the
    knee's 240 goes."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    settled_window(world, 512, tpot_p99_ms=60, tokens_per_s=2000)
    assert applied(world) == 64 and world.kube.status("default", "chat")["quarantine"]
    world.kube.edit_spec("default", "chat", {"engine": "SGLang", "gpu": {"type": "h200", "count": 2}})
    world.reconcile()
    assert not world.kube.status("default", "chat").get("quarantine")
    settled_window(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    world.clock.advance(30)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    status = world.kube.status("default", "chat")
    assert applied(world) == 240 and status["recommendedMaxNumSeqs"] == 240, status["reason"]


def test_a_retune_in_the_evaluation_that_changes_the_gpu_keeps_no_window_before(world: World) -> None:
    """The spec moves from an A100 to an L4 and, in the same evaluation, the smaller KV pool takes
    240 down to 64: the window before ran on the A100 (3,000 tok/s), and compared with the L4's 800
    it reverted 64 back to 240 — a limit whose KV the L4 cannot hold."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    settled_window(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    assert applied(world) == 240
    world.clock.advance(700)
    world.kube.edit_spec("default", "chat", {"gpu": {"type": "l4", "count": 1}})
    world.observer.set(
        "default", "chat", observation(world.clock.now, ctx=512, tpot_p99_ms=20, tokens_per_s=3000)
    )
    world.reconcile()
    assert applied(world) == 64
    settled_window(world, 512, tpot_p99_ms=40, tokens_per_s=800)
    status = world.kube.status("default", "chat")
    assert applied(world) == 64 and not status.get("quarantine"), status["reason"]
    assert [(h.get("from"), h["to"], "before" in h) for h in status["history"]][-1] == (240, 64, False)
    assert "ChangeReverted" not in [e["reason"] for e in world.kube.events]


def test_a_limit_whose_p99_broke_the_target_past_any_bucket_is_not_gone_back_to(world: World) -> None:
    """A TPOT p99 of 200 ms at 64 against a 30-ms target (the window's mean healthy): the limit
    steps down to 48, and 64 is quarantined at that context — the mean that allowed 64 allows it
    again once the p99 is back under the target, and the limit flapped 64 → 48 → 64 each cooldown."""
    from batchknee.core.observation import Reading

    world.kube.create(llmserving(tuning={"cooldownSeconds": 0, "tpotP99TargetMilliseconds": 30}))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    assert applied(world) == 64

    def seen(p99_ms: float, running: float) -> None:
        healthy = replace(
            observation(world.clock.now, ctx=2048, tpot_p99_ms=p99_ms, running=running),
            tpot_mean_s=Reading.of(0.020),
        )
        world.observer.set("default", "chat", healthy)
        world.reconcile()
        world.clock.advance(30)

    for _ in range(6):
        seen(200.0, 64)
    assert applied(world) == 48
    [entry] = world.kube.status("default", "chat")["quarantine"]
    assert (entry["maxNumSeqs"], entry["direction"], entry["contextTokens"]) == (64, "Above", 2048)
    world.kube.finish_rollout("default", "chat")
    for _ in range(12):  # at 48 the p99 is 40 ms: over the target, not past any bucket
        seen(40.0, 48)
    assert applied(world) == 48


def test_recommend_mode_quarantines_nothing_its_writer_sets(world: World) -> None:
    """In Recommend mode a roll is the writer's own --max-num-seqs: a p99 past any bucket at 64,
    then the writer's 48 and 64 again — both go, nothing is quarantined."""
    from batchknee.core.observation import Reading

    def spec(limit: int) -> dict[str, object]:
        return {"args": ["--max-num-seqs", str(limit)]}

    world.kube.create(
        llmserving(
            tuning={"mode": "Recommend", "tpotP99TargetMilliseconds": 30, "cooldownSeconds": 0}, **spec(64)
        )
    )
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    for p99_ms, limit in ((200.0, 64), (200.0, 48), (20.0, 64)):
        if applied(world) != limit:
            world.kube.edit_spec("default", "chat", spec(limit))
        for _ in range(6):
            seen = observation(world.clock.now, ctx=2048, tpot_p99_ms=p99_ms, running=limit)
            world.observer.set("default", "chat", replace(seen, tpot_mean_s=Reading.of(0.020)))
            world.reconcile()
            world.clock.advance(30)
        world.kube.finish_rollout("default", "chat")
        assert applied(world) == limit
    assert not world.kube.status("default", "chat").get("quarantine")


def test_a_revert_that_stalls_is_not_rolled_back_again(world: World) -> None:
    """The revert's value ran before: its rollout stalling is the node's or the template's, and
    rolling it back would put the reverted value back and flip the limit at every deadline."""
    started(world)
    steady_traffic(world, 512, tpot_p99_ms=20, tokens_per_s=3000)
    settled_window(world, 512, tpot_p99_ms=60, tokens_per_s=2000)
    assert applied(world) == 64  # reverted 240 → 64
    world.clock.advance(60)
    stall(world)  # the revert's pods are not Ready by the deadline
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    assert applied(world) == 64
    history = world.kube.status("default", "chat")["history"]
    assert history[-1]["reason"].startswith("revert 240→64") and [h["to"] for h in history] == [64, 240, 64]


def test_a_stall_of_the_writers_own_value_in_recommend_mode_is_not_rolled_back(world: World) -> None:
    """In Recommend mode the limit is the writer's --max-num-seqs: its stall is reported, never
    rolled back over them, and nothing is quarantined."""
    world.kube.create(
        llmserving(tuning={"mode": "Recommend", "cooldownSeconds": 0}, args=["--max-num-seqs", "64"])
    )
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    world.kube.edit_spec("default", "chat", {"args": ["--max-num-seqs", "240"]})
    world.reconcile()
    assert applied(world) == 240
    world.clock.advance(60)
    stall(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=512))
    world.reconcile()
    assert applied(world) == 240
    assert not world.kube.status("default", "chat").get("quarantine")


@pytest.mark.parametrize("deleted_before_s", [0, 500])
def test_a_safety_decrease_does_not_wait_for_the_replaced_pods_to_drain(
    world: World, deleted_before_s: int
) -> None:
    """A KV-capacity decrease (the engine preempts) does not wait out a replaced pod's long grace
    period: it settles from when the newest pod serving turned Ready (the rollout's completion) —
    not from when the draining pod was deleted, which may be long before (an eviction, a serving
    gap while the new pod loaded), when the window held the previous limit's traffic."""
    world.kube.create(
        llmserving(gpu={"type": "a10g", "count": 1}, tuning={"cooldownSeconds": 0, "kneeFactorPercent": 150})
    )
    world.reconcile()
    grace = 600  # long generations to finish
    engine_pod(world, "chat-old-0", deleted_in_s=grace - deleted_before_s, grace_s=grace)
    engine_pod(world, "chat-new-0")
    world.kube.finish_rollout("default", "chat")
    completed = world.clock.now
    assert applied(world) == 16
    while world.clock.now < completed + timedelta(seconds=240):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=4000))  # the pool holds 8
        world.reconcile()
        if world.clock.now < completed + timedelta(seconds=120):  # the settle window
            assert applied(world) == 16, world.kube.status("default", "chat")["reason"]
        world.clock.advance(30)
    assert applied(world) == 8
    assert ("Pod", "default", "chat-old-0") in world.kube.objects


def test_a_retune_after_a_drain_waits_for_the_check_of_the_change_before(world: World) -> None:
    """Not a safety change (the context shrank: the knee is higher): it holds while the replaced
    pod drains, then for the settled window from when it was gone — the window the check of the
    last change reads — so that change is checked before the next one rolls."""
    started(world)
    steady_traffic(world, 8192, tpot_p99_ms=40, tokens_per_s=1500)
    assert applied(world) == 16
    engine_pod(world, "chat-new-0")
    engine_pod(world, "chat-old-0", deleted_in_s=90, grace_s=90)
    world.kube.finish_rollout("default", "chat")
    for evaluation in range(12):
        if evaluation == 4:  # drained and deleted
            del world.kube.objects[("Pod", "default", "chat-old-0")]
            drained = world.clock.now
        world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
        world.reconcile()
        history = world.kube.status("default", "chat")["history"]
        if applied(world) == 64:
            break
        assert history[-1]["to"] == 16 and "verdict" not in history[-1]
        world.clock.advance(30)
    assert applied(world) == 64 and world.clock.now >= drained + timedelta(seconds=120)
    assert [(h["to"], h.get("verdict")) for h in history[-2:]] == [(16, "Inconclusive"), (64, None)]


@pytest.mark.parametrize("drains", [False, True])
def test_a_safety_decrease_after_an_image_edits_rollout_settles_from_it(world: World, drains: bool) -> None:
    """An image edit rolls the pods with no batch-limit change of its own: a replaced pod draining
    after it must not date its completion by the last retune's, hours before (the guard would read
    a window of the rollout itself)."""
    world.kube.create(
        llmserving(gpu={"type": "a10g", "count": 1}, tuning={"cooldownSeconds": 0, "kneeFactorPercent": 150})
    )
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    assert applied(world) == 16
    world.clock.advance(7200)
    world.kube.edit_spec("default", "chat", {"image": "vllm/vllm-openai:v0.35.0"})
    world.reconcile()
    world.clock.advance(300)
    world.reconcile()  # seen rolling
    if drains:
        engine_pod(world, "chat-old-0", deleted_in_s=600, grace_s=600)
    engine_pod(world, "chat-new-0")
    world.kube.finish_rollout("default", "chat")
    world.observer.set("default", "chat", observation(world.clock.now, ctx=4000))  # the pool holds 8
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert applied(world) == 16 and status["holdReason"] == "settling", status["reason"]


def test_a_live_cap_changed_just_before_a_pod_terminates_still_settles(world: World) -> None:
    """A Live cap restarts no pod, so the pods' Ready times are older than the change: a pod that
    starts terminating then (a scale-down) must not let the guard read the previous cap's window
    as the new cap's."""
    live_world(world, pods=3, tuning={"cooldownSeconds": 0, "tpotP99TargetMilliseconds": 30})
    for pod in (o for (kind, _, _), o in world.kube.objects.items() if kind == "Pod"):
        for condition in pod["status"].get("conditions") or []:
            condition["lastTransitionTime"] = format_timestamp(world.clock.now)
    world.reconcile()
    world.clock.advance(3600)
    for _ in range(8):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=4096, pods=3))
        world.reconcile()
        world.clock.advance(30)
        if world.kube.status("default", "chat")["maxNumSeqs"] == 32:
            break
    assert world.kube.status("default", "chat")["maxNumSeqs"] == 32
    leaving = world.kube.objects[("Pod", "default", "chat-abc-2")]
    leaving["metadata"]["deletionTimestamp"] = format_timestamp(world.clock.now + timedelta(seconds=600))
    leaving["metadata"]["deletionGracePeriodSeconds"] = 600
    # the previous cap's traffic still fills the window: 64 running, p99 twice the target
    world.observer.set(
        "default", "chat", observation(world.clock.now, ctx=4096, pods=3, running=64, tpot_p99_ms=60.0)
    )
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 32 and status["holdReason"] == "settling", status["reason"]
