"""reconcile against in-memory adapters: the resulting objects and status, not call sequences."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import observation

from batchknee.core.policy import HISTORY_KEPT
from batchknee.core.spread import same_slot
from batchknee.reconcile import refresh_offset_s
from batchknee.render import RenderDefaults, deployment_state


def max_num_seqs(world: World, name: str = "chat") -> int | None:
    state = deployment_state(world.kube.get_deployment("default", name))
    return state.max_num_seqs if state else None


def conditions(world: World) -> set[str]:
    return {c["type"] for c in world.kube.status("default", "chat")["conditions"]}


def settle(world: World, seconds: float = 181) -> None:
    """The rollout completes; then time passes beyond the window (120 s) and the time a change
    must hold before it rolls (1.5 windows)."""
    world.kube.finish_rollout("default", "chat")
    world.reconcile()  # sees the rollout complete: the settle window starts now
    world.clock.advance(seconds)


def shift_context(world: World, ctx: int) -> None:
    """Traffic moves to `ctx` and evaluations every 30 s see it for a minute (they hold while the
    change is younger than a third of the 120 s window); the next evaluation may roll (the engines
    run the initial context's guess, not a setting tuned to traffic, so a third of a window is
    enough)."""
    for _ in range(2):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))
        world.reconcile()
        assert world.kube.status("default", "chat")["holdReason"] == "unsteady"
        world.clock.advance(30)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))


def test_creation_renders_the_engine_at_the_initial_context(world: World) -> None:
    world.kube.create(llmserving())
    outcome = world.reconcile()

    args = world.args()
    assert args.count("--max-num-seqs") == 1
    assert args[args.index("--max-num-seqs") + 1] == "64"  # llama-3-8b, ctx 2048: B_knee 59.6 → 64
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    dep = world.kube.deployment("default", "chat")
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "LLMServing" and owner["controller"] and owner["blockOwnerDeletion"]
    assert world.kube.get("Service", "default", "chat") is not None

    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 64
    assert status["recommendedMaxNumSeqs"] == 64
    assert status["bKnee"] == 59.8  # 8.03 B parameters (the seed rounds to 8.0 B: 59.6)
    assert status["observedGeneration"] == 1
    assert (
        len(status["history"]) == 1
        and status["history"][0]["to"] == 64
        and "from" not in status["history"][0]
    )
    assert "initial context" in status["reason"]
    assert world.kube.condition("default", "chat", "Ready")["status"] == "False"
    assert world.kube.condition("default", "chat", "MetricsAvailable")["status"] == "Unknown"
    assert [e["reason"] for e in world.kube.events] == ["Deployed"]
    assert outcome.decision is not None and outcome.decision.rolls


def test_context_shift_rolls_to_the_new_knee_and_says_why(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, tpot_p99_ms=31))
    settle(world)
    world.reconcile()
    assert max_num_seqs(world) == 64
    assert world.kube.status("default", "chat")["holdReason"] == "at-target"
    assert world.kube.condition("default", "chat", "Ready")["status"] == "True"

    world.clock.advance(600)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=31))
    world.reconcile()
    assert max_num_seqs(world) == 64  # one evaluation is not a trend: the window may be mid-shift
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "unsteady"
    assert status["reason"].endswith(
        "holding 64: the recommendation is still moving (59.8 at 12:03:01Z → 15.0)"
    )
    assert status["recommendedMaxNumSeqs"] == 16

    # from the initial context's guess: it rolls once the change has lasted a third of a window (40 s)
    for _ in range(1):
        world.clock.advance(30)
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=31))
        world.reconcile()
        assert world.kube.status("default", "chat")["holdReason"] == "unsteady"
    world.clock.advance(30)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192, tpot_p99_ms=31))
    world.reconcile()
    assert max_num_seqs(world) == 16
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 16 and status["recommendedMaxNumSeqs"] == 16
    assert status["observed"]["avgContextLength"] == 8192
    assert status["reason"].startswith("max-num-seqs 64→16: avg ctx 8192 tok → B_knee 15.0 → 16")
    assert [h["to"] for h in status["history"]] == [64, 16]
    retuned = world.kube.events[-1]
    assert retuned["reason"] == "Retuned"
    assert retuned["message"] == "max-num-seqs 64→16: avg ctx 8192 tokens, B_knee 15.0, TPOT p99 31 ms"
    assert world.kube.condition("default", "chat", "Progressing")["status"] == "True"

    # while the rollout runs, nothing else moves even if the context moves back
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    world.reconcile()
    assert max_num_seqs(world) == 16
    assert world.kube.status("default", "chat")["holdReason"] == "rollout-in-progress"


def test_second_reconcile_changes_nothing(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    before = world.kube.deployment("default", "chat")
    writes, events = world.kube.status_writes, len(world.kube.events)
    outcome = world.reconcile()
    assert world.kube.deployment("default", "chat") == before
    assert not outcome.status_written and world.kube.status_writes == writes
    assert len(world.kube.events) == events


def test_a_steady_hold_refreshes_its_figures_once_a_window_and_anything_else_at_once(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    stored = world.kube.status("default", "chat")
    assert stored["holdReason"] == "at-target"
    writes = world.kube.status_writes

    def evaluate(seconds: float, ctx: float, running: float = 48, pods: int = 1) -> bool:
        world.clock.advance(seconds)
        world.observer.set(
            "default", "chat", observation(world.clock.now, ctx=ctx, running=running, pods=pods)
        )
        return world.reconcile().status_written

    # new figures inside the dead band, nothing else: not written until this object's next refresh
    # slot (slots of a window, 120 s, each object's starting at its own point)
    window = 120
    offset = refresh_offset_s("default", "chat", window)
    sampled = datetime.fromisoformat(stored["observed"]["sampledAt"])
    held: list[bool] = []
    while same_slot(sampled, world.clock.now + timedelta(seconds=30), window, offset):
        held.append(evaluate(30, 2060 + 10 * len(held)))
    assert held and not any(held)
    assert world.kube.status_writes == writes
    assert world.kube.status("default", "chat") == stored
    assert evaluate(30, 2090, running=52)  # the first evaluation in the next slot
    refreshed = world.kube.status("default", "chat")
    assert refreshed["observed"]["avgContextLength"] == 2090 and refreshed["observed"]["running"] == 52
    assert refreshed["holdReason"] == "at-target"
    assert not evaluate(30, 2070)  # the same slot again
    # another pod reporting is more than a figure: written at once
    assert evaluate(5, 2070, pods=2)
    assert world.kube.status("default", "chat")["observed"]["pods"] == 2
    # a target out of the dead band is written at once, with the recent targets it holds on
    assert evaluate(5, 8192, pods=2)
    moved = world.kube.status("default", "chat")
    assert moved["holdReason"] == "unsteady" and moved["observed"]["avgContextLength"] == 8192
    assert moved["recentTargets"][-1]["batch"] == 14.957  # B_knee at 8,192 tokens


def test_a_steady_hold_writes_once_a_slot_with_that_slots_calibration_sample(world: World) -> None:
    """Holding steady, evaluated every 30 s (observations sampled up to 4 s before): one status
    write per refresh slot (a 120 s window), each carrying the slot's calibration sample, never a
    second write for a sample on its own."""
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    assert world.kube.status("default", "chat")["holdReason"] == "at-target"
    writes = world.kube.status_writes
    samples = len(world.kube.status("default", "chat")["calibration"]["samples"])
    offset = refresh_offset_s("default", "chat", 120)
    sampled: list[datetime] = [
        datetime.fromisoformat(world.kube.status("default", "chat")["observed"]["sampledAt"])
    ]
    for i in range(24):  # six windows
        world.clock.advance(30)
        at = (world.clock.now - timedelta(seconds=i % 5)).replace(microsecond=0)
        world.observer.set("default", "chat", observation(at, ctx=2048 + 10 * (i % 3), running=48 + i % 2))
        world.reconcile()
        sampled.append(at)
    slots = sum(not same_slot(a, b, 120, offset) for a, b in itertools.pairwise(sampled))
    assert slots in (5, 6, 7)
    assert world.kube.status_writes - writes == slots
    assert len(world.kube.status("default", "chat")["calibration"]["samples"]) - samples == slots


def test_metrics_unavailable_holds_the_last_good_setting(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    good = world.kube.status("default", "chat")["observed"]

    world.observer.down = True
    world.clock.advance(600)
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert max_num_seqs(world) == 64
    assert status["holdReason"] == "metrics-unavailable"
    assert "unreachable" in status["reason"] and "holding 64" in status["reason"]
    assert status["observed"] == good  # the last good observation, never zeros
    metrics = world.kube.condition("default", "chat", "MetricsAvailable")
    assert metrics["status"] == "False" and metrics["reason"] == "MetricsUnavailable"
    assert world.kube.events[-1]["reason"] == "MetricsUnavailable"


def test_recommend_mode_never_changes_the_deployment(world: World) -> None:
    world.kube.create(llmserving(tuning={"mode": "Recommend"}, args=["--max-num-seqs=256"]))
    world.reconcile()
    assert max_num_seqs(world) == 256
    settle(world)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
    template = world.kube.deployment("default", "chat")["spec"]["template"]
    world.clock.advance(3600)
    world.reconcile()
    assert world.kube.deployment("default", "chat")["spec"]["template"] == template
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 256 and status["recommendedMaxNumSeqs"] == 16
    assert status["action"] == "recommend"
    assert world.kube.events[-1]["reason"] == "Recommended"


def test_invalid_spec_is_degraded_and_changes_nothing(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    before = world.kube.deployment("default", "chat")
    world.kube.edit_spec("default", "chat", {"tuning": {"minMaxNumSeqs": 64, "maxMaxNumSeqs": 16}})
    world.reconcile()
    assert world.kube.deployment("default", "chat") == before
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.tuning" in degraded["message"] and "minMaxNumSeqs" in degraded["message"]
    assert degraded["observedGeneration"] == 2
    assert world.kube.events[-1]["reason"] == "InvalidSpec"


def test_model_outside_the_catalog_names_the_fix(world: World) -> None:
    world.kube.create(llmserving(model={"name": "acme/secret-13b"}))
    world.reconcile()
    assert world.kube.get("Deployment", "default", "chat") is None
    message = world.kube.condition("default", "chat", "Degraded")["message"]
    assert message.startswith("spec.model.name:") and "spec.model.architecture" in message


def crash_after_the_apply(world: World, *, event_sent: bool) -> None:
    """A retune 64→16 written to the Deployment by an operator that dies before its status write
    (and, unless `event_sent`, before its Event)."""
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    world.clock.advance(600)
    shift_context(world, 8192)
    world.kube.fail_status = True
    world.kube.fail_events = not event_sent
    with contextlib.suppress(RuntimeError):
        world.reconcile()
    world.kube.fail_status = world.kube.fail_events = False
    assert max_num_seqs(world) == 16


def test_restart_after_the_roll_before_the_status_does_not_roll_twice(world: World) -> None:
    crash_after_the_apply(world, event_sent=True)
    generation = world.kube.deployment("default", "chat")["metadata"]["generation"]

    # a fresh operator: status still says 64, the cluster says 16 with its rollout record
    world.clock.advance(5)
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.clock.advance(5)
    world.reconcile()
    assert world.kube.deployment("default", "chat")["metadata"]["generation"] == generation
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 16 and [h["to"] for h in status["history"]] == [64, 16]
    # the new operator announces the retune the status lacked under the same Event name: one Event
    retuned = [e for e in world.kube.events if e["reason"] == "Retuned"]
    assert len(retuned) == 1 and retuned[0]["message"].startswith("max-num-seqs 64→16: avg ctx 8192")
    assert world.kube.event_repeats == 1  # sent once more, then the status holds it: never again


def test_a_retune_whose_event_died_with_the_operator_is_announced_by_the_next(world: World) -> None:
    crash_after_the_apply(world, event_sent=False)
    assert [e["reason"] for e in world.kube.events] == ["Deployed"]

    rollout = deployment_state(world.kube.deployment("default", "chat")).rollouts[-1]  # type: ignore[union-attr]
    world.clock.advance(5)
    world.reconcile()  # a fresh operator: the Deployment's record has 64→16, the status does not
    world.clock.advance(30)
    world.reconcile()
    retuned = [e for e in world.kube.events if e["reason"] == "Retuned"]
    assert [(e["type"], e["message"]) for e in retuned] == [("Normal", rollout.reason)]
    assert rollout.reason.startswith("max-num-seqs 64→16: avg ctx 8192 tok")
    assert [h["to"] for h in world.kube.status("default", "chat")["history"]] == [64, 16]
    assert world.kube.event_repeats == 0


def test_an_old_rollout_a_lost_status_forgot_is_not_news(world: World) -> None:
    crash_after_the_apply(world, event_sent=False)
    world.clock.advance(31 * 60)  # the operator comes back after more than half an hour
    world.reconcile()
    assert [e["reason"] for e in world.kube.events] == ["Deployed"]
    assert [h["to"] for h in world.kube.status("default", "chat")["history"]] == [64, 16]


def test_the_first_deployment_lost_with_its_status_is_announced_once(world: World) -> None:
    world.kube.create(llmserving())
    world.kube.fail_status = world.kube.fail_events = True  # dies right after creating the Deployment
    with contextlib.suppress(RuntimeError):
        world.reconcile()
    world.kube.fail_status = world.kube.fail_events = False
    assert world.kube.events == [] and max_num_seqs(world) == 64

    for _ in range(3):
        world.clock.advance(30)
        world.reconcile()
    assert [(e["type"], e["reason"]) for e in world.kube.events] == [("Normal", "Deployed")]
    assert world.kube.events[0]["message"].startswith("max-num-seqs ∅→64: ")
    assert world.kube.events[0]["message"].count("max-num-seqs") == 1
    assert world.kube.event_repeats == 0


def test_apply_refused_is_degraded_and_not_recorded(world: World) -> None:
    world.kube.create(llmserving())
    world.kube.fail_apply = {"Deployment"}
    world.reconcile()
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "denied" in degraded["message"]
    status = world.kube.status("default", "chat")
    assert status.get("history", []) == [] and "maxNumSeqs" not in status


def test_a_budget_refused_beside_the_deployment_does_not_hide_the_rollout(world: World) -> None:
    """A quota refusing the PodDisruptionBudget while the Deployment is written: the pods roll, so the
    rollout is recorded as one (its before-figures for the check after it, its Event, the pods' new
    limit in status) and the refusal is Degraded; it used to read "apply failed; holding 64"."""
    world.kube.create(llmserving())
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, tpot_p99_ms=31))
    settle(world)
    world.reconcile()
    del world.kube.objects[("PodDisruptionBudget", "default", "chat")]
    world.kube.fail_apply = {"PodDisruptionBudget"}
    world.clock.advance(600)
    shift_context(world, 8192)
    outcome = world.reconcile()
    assert max_num_seqs(world) == 16 and outcome.rolled
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 16 and status["reason"].startswith("max-num-seqs 64→16")
    assert [(h.get("from"), h["to"], "before" in h) for h in status["history"]][-1] == (64, 16, True)
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "PodDisruptionBudget" in degraded["message"]
    assert [e["reason"] for e in world.kube.events][-2:] == ["ApplyFailed", "Retuned"]


def engine_configs(world: World) -> list[dict[str, Any]]:
    return [obj for (kind, _, _), obj in world.kube.objects.items() if kind == "ConfigMap"]


def mounted_config(world: World) -> str:
    volumes = world.kube.deployment("default", "chat")["spec"]["template"]["spec"]["volumes"]
    return next(v["configMap"]["name"] for v in volumes if "configMap" in v)


def test_tensorrt_llm_gets_an_immutable_options_file_per_revision(world: World) -> None:
    world.kube.create(llmserving(engine="TensorRTLLM"))
    world.reconcile()
    [config] = engine_configs(world)
    assert config["immutable"] is True and config["metadata"]["name"] == mounted_config(world)
    assert "max_batch_size: 64" in config["data"]["engine.yaml"]
    assert "max_tokens" not in config["data"]["engine.yaml"]  # max_batch_size carries the knee
    template = world.kube.deployment("default", "chat")["spec"]["template"]
    checksum = template["metadata"]["annotations"]["batchknee.io/engine-config-checksum"]
    assert template["spec"]["containers"][0]["command"][0] == "trtllm-serve"

    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.clock.advance(600)
    shift_context(world, 8192)
    world.reconcile()
    template = world.kube.deployment("default", "chat")["spec"]["template"]
    assert template["metadata"]["annotations"]["batchknee.io/engine-config-checksum"] != checksum
    assert max_num_seqs(world) == 16
    assert "maxTokens" not in world.kube.status("default", "chat")
    # a new file under a new name; the old one stays for the old pods of the rollout
    names = {c["metadata"]["name"] for c in engine_configs(world)}
    assert len(names) == 2 and mounted_config(world) in names and config["metadata"]["name"] in names
    assert (
        "max_batch_size: 16"
        in world.kube.get("ConfigMap", "default", mounted_config(world))["data"]["engine.yaml"]
    )

    # spec changes make more files; only the newest three are kept, the mounted one among them
    for fraction in (0.5, 0.6, 0.7):
        world.kube.edit_spec(
            "default",
            "chat",
            {"extraLlmApiOptions": {"kv_cache_config": {"free_gpu_memory_fraction": fraction}}},
        )
        world.reconcile()
        world.kube.finish_rollout("default", "chat")
    names = {c["metadata"]["name"] for c in engine_configs(world)}
    assert len(names) == 3 and mounted_config(world) in names
    assert config["metadata"]["name"] not in names
    assert (
        "free_gpu_memory_fraction: 0.7"
        in world.kube.get("ConfigMap", "default", mounted_config(world))["data"]["engine.yaml"]
    )


def test_with_budgets_turned_off_its_own_budget_goes_and_no_one_elses(world: World) -> None:
    """settings.disruption_budgets off (where a tenant's template could pin its replicas to one node
    and so block that node's drain): the budget an earlier evaluation made is deleted, even while the
    spec is refused (the tenant's next move), another owner's of the same name stays, the engine is
    left as it runs; on again, it comes back."""
    world.kube.create(llmserving())
    world.kube.create(llmserving("other"))
    world.reconcile()
    world.reconcile("other")
    ours = world.kube.get("PodDisruptionBudget", "default", "chat")
    assert ours is not None and ours["spec"]["maxUnavailable"] == 1
    foreign = {
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "other", "namespace": "default", "uid": "u"},
    }
    world.kube.objects[("PodDisruptionBudget", "default", "other")] = foreign
    deployment = world.kube.deployment("default", "chat")

    world.ports = replace(world.ports, defaults=RenderDefaults(disruption_budgets=False))
    host_path = {"volumes": [{"name": "node", "hostPath": {"path": "/"}}]}
    world.kube.edit_spec("default", "chat", {"template": host_path})
    for _ in range(2):  # and nothing to delete the second time
        world.reconcile()
        world.reconcile("other")
        assert world.kube.get("PodDisruptionBudget", "default", "chat") is None
        assert world.kube.get("PodDisruptionBudget", "default", "other") is foreign
        assert world.kube.deployment("default", "chat") == deployment  # held as it runs
        assert world.kube.condition("default", "chat", "Degraded")["reason"] == "Forbidden"

    world.kube.edit_spec("default", "chat", {"template": {"volumes": []}})
    world.ports = replace(world.ports, defaults=RenderDefaults())
    world.reconcile()
    assert world.kube.get("PodDisruptionBudget", "default", "chat") is not None


def test_pinned_runs_the_pinned_value(world: World) -> None:
    world.kube.create(llmserving(tuning={"mode": "Pinned", "pinnedMaxNumSeqs": 100}))
    world.reconcile()
    assert max_num_seqs(world) == 100
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
    settle(world, 4000)
    world.reconcile()
    assert max_num_seqs(world) == 100
    assert world.kube.status("default", "chat")["holdReason"] == "pinned"


def test_tpot_over_target_steps_down_without_calibration(world: World) -> None:
    world.kube.create(llmserving(tuning={"tpotP99TargetMilliseconds": 25}))
    world.reconcile()
    world.observer.set(
        "default", "chat", observation(world.clock.now, ctx=2048, tpot_p99_ms=40, with_mean=False)
    )
    settle(world)
    world.clock.advance(600)
    world.reconcile()
    assert max_num_seqs(world) == 48
    assert "step 64 → 48" in world.kube.status("default", "chat")["reason"]
    assert world.kube.status("default", "chat")["limitedBy"] == "tpot-target"


def test_tpot_mean_over_target_caps_at_the_one_window_estimate(world: World) -> None:
    """With the exact mean TPOT (36 ms at 48 running), the cap is what that window implies for a
    25 ms target — below the ×3/4 step — and status reports it as the SLO bound."""
    world.kube.create(llmserving(tuning={"tpotP99TargetMilliseconds": 25}))
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, tpot_p99_ms=40))
    settle(world)
    world.clock.advance(600)
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert max_num_seqs(world) < 48
    assert status["limitedBy"] == "tpot-target" and "estimated from TPOT mean 36.0 ms" in status["reason"]
    assert status["sloBoundMaxNumSeqs"] < 48


def test_a_spec_change_rerenders_without_a_retune(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.kube.edit_spec("default", "chat", {"image": "vllm/vllm-openai:v0.12.0", "replicas": 2})
    world.reconcile()
    dep = world.kube.deployment("default", "chat")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.12.0"
    assert max_num_seqs(world) == 64
    status = world.kube.status("default", "chat")
    assert len(status["history"]) == 1 and status["observedGeneration"] == 2
    assert "maxTokens" not in status  # a TensorRT-LLM figure


def test_cooldown_and_budget_hold_with_their_reason(world: World) -> None:
    world.kube.create(llmserving(tuning={"cooldownSeconds": 3000}))
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
    settle(world)
    world.reconcile()  # the creation is not a retune: no cooldown yet
    assert max_num_seqs(world) == 16
    retuned_at = world.clock.now
    world.clock.advance(5)  # the next reading comes later (one at the same instant would be this one)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    status = world.kube.status("default", "chat")
    until = (retuned_at + timedelta(seconds=3000)).strftime("%H:%M:%SZ")
    assert status["holdReason"] == "cooldown" and f"cooldown until {until}" in status["reason"]
    assert max_num_seqs(world) == 16

    world.kube.edit_spec("default", "chat", {"tuning": {"cooldownSeconds": 0, "maxRolloutsPerHour": 1}})
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "rollout-budget" and "1 rollouts in the last hour" in status["reason"]
    world.clock.advance(3600)
    world.reconcile()
    assert max_num_seqs(world) == 64


def test_a_hand_edited_rollout_record_loses_its_damaged_entry_not_the_cooldown(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """One entry of the Deployment's record edited by hand (a time without its zone): the others
    still hold the cooldown (the whole record read as none rolled at once, budget and stall rollback
    reset); the operator says so once and writes the record back without it."""
    world.kube.create(llmserving(tuning={"cooldownSeconds": 3000}))
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
    settle(world)
    world.reconcile()
    assert max_num_seqs(world) == 16  # the retune the cooldown runs from
    annotations = world.kube.deployment("default", "chat")["metadata"]["annotations"]
    record = json.loads(annotations["batchknee.io/rollouts"])
    record[0]["time"] = record[0]["time"].rstrip("Z")  # the creation's entry
    annotations["batchknee.io/rollouts"] = json.dumps(record)
    world.clock.advance(5)
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    with caplog.at_level(logging.WARNING, logger="batchknee.reconcile"):
        settle(world)
        world.reconcile()
    status = world.kube.status("default", "chat")
    assert status.get("holdReason") == "cooldown" and max_num_seqs(world) == 16, status["reason"]
    assert [(h["from"], h["to"]) for h in status["history"]] == [(64, 16)]
    [said] = [r.getMessage() for r in caplog.records if "batchknee.io/rollouts" in r.getMessage()]
    assert (
        said
        == "default/chat: Deployment annotation batchknee.io/rollouts: 1 of its 2 entries unreadable: skipped"
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text.replace('"to":64', '"to":1e999'),  # int(inf) raised OverflowError
        lambda text: "[" * 100_000 + "]" * 100_000,  # json raised RecursionError
        lambda text: text.replace('"to":64', '"to":' + "[" * 100_000 + "]" * 100_000),
    ],
    ids=["infinite", "nested-record", "nested-value"],
)
def test_a_rollout_record_no_parser_can_read_does_not_wedge_the_object(world: World, edit: Any) -> None:
    """Every evaluation raised, the status froze and no condition said why."""
    world.kube.create(llmserving())
    world.reconcile()
    annotations = world.kube.deployment("default", "chat")["metadata"]["annotations"]
    annotations["batchknee.io/rollouts"] = edit(annotations["batchknee.io/rollouts"])
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert status["observedGeneration"] == 1 and status["holdReason"] == "at-target", status["reason"]
    assert max_num_seqs(world) == 64


def _tomorrow_in_recent_targets(world: World) -> None:
    status = world.kube.status("default", "chat")
    status["recentTargets"].append({"time": "2026-03-02T12:00:00Z", "batch": 59.8})


def _tomorrow_as_rollout_complete_time(world: World) -> None:
    world.kube.status("default", "chat")["rolloutCompleteTime"] = "2026-03-02T12:00:00Z"


@pytest.mark.parametrize(
    "edit",
    [_tomorrow_in_recent_targets, _tomorrow_as_rollout_complete_time],
    ids=["recent-targets", "rollout-complete-time"],
)
def test_a_time_from_tomorrow_read_back_does_not_freeze_retuning(world: World, edit: Any) -> None:
    """A node's clock a day fast, or an edit: a recent target from tomorrow kept newer ones from
    being remembered ("unsteady" for good), a rollout completed tomorrow kept the object settling
    until then."""
    world.kube.create(llmserving(tuning={"cooldownSeconds": 0}))
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.reconcile()
    edit(world)
    for _ in range(12):  # six minutes of traffic that wants 16
        world.observer.set("default", "chat", observation(world.clock.now, ctx=8192))
        world.reconcile()
        world.clock.advance(30)
    status = world.kube.status("default", "chat")
    assert max_num_seqs(world) == 16, status["reason"]
    assert all(t["time"] < "2026-03-02" for t in status.get("recentTargets") or [])
    assert all(h["time"] < "2026-03-02" for h in status["history"])


def test_an_observer_that_raises_is_unavailable_not_a_crash(world: World) -> None:
    class Broken:
        def observation(self, target: object, now: object) -> object:
            raise TimeoutError("read timed out after 5 s")

    world.kube.create(llmserving())
    world.reconcile()
    settle(world)
    world.ports.observer = Broken()  # type: ignore[assignment]
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert status["holdReason"] == "metrics-unavailable" and "timed out" in status["reason"]


def test_calibration_samples_accumulate_and_reset_on_a_new_model(world: World) -> None:
    world.kube.create(llmserving(tuning={"tpotP99TargetMilliseconds": 60, "windowSeconds": 60}))
    world.reconcile()
    settle(world, 61)
    for running in (8, 16, 32, 48, 56, 64, 40):
        world.observer.set(
            "default",
            "chat",
            observation(world.clock.now, ctx=2048, running=running, tpot_p99_ms=10 + running * 0.2),
        )
        world.reconcile()
        world.clock.advance(61)
    calibration = world.kube.status("default", "chat")["calibration"]
    assert len(calibration["samples"]) == 7
    assert (
        calibration["overheadMilliseconds"] is not None
        and calibration["bandwidthEfficiencyPercent"] is not None
    )
    world.kube.edit_spec("default", "chat", {"model": {"name": "qwen3-8b"}})
    world.reconcile()
    assert world.kube.status("default", "chat")["calibration"]["samples"] == []


def test_calibration_samples_reset_when_the_operators_default_image_changes(world: World) -> None:
    """The spec names no image: the engine runs the operator's default, and an upgrade that changes
    it changes the engine the samples were fitted to."""
    from dataclasses import replace

    from batchknee.render import RenderDefaults

    world.kube.create(llmserving(tuning={"tpotP99TargetMilliseconds": 60, "windowSeconds": 60}))
    world.reconcile()
    settle(world, 61)
    for running in (8, 16, 32):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, running=running))
        world.reconcile()
        world.clock.advance(61)
    before = {s["time"] for s in world.kube.status("default", "chat")["calibration"]["samples"]}
    assert len(before) == 3
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image="vllm/vllm-openai:v9.9.9"))
    world.reconcile()
    after = {s["time"] for s in world.kube.status("default", "chat")["calibration"]["samples"]}
    assert not before & after


def test_a_window_read_before_the_settle_ended_is_no_calibration_sample(world: World) -> None:
    """A cached reading older than the clock (a slow Prometheus a spec chose is read at most a
    tenth of the time) may be a window that still holds the pods before the rollout: not a sample."""
    world.kube.create(llmserving(tuning={"windowSeconds": 60}))
    world.reconcile()
    settle(world, 61)
    world.observer.lag_s = 5  # sampled 56 s into the 60-s settle
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, running=32))
    world.reconcile()
    assert world.kube.status("default", "chat")["calibration"]["samples"] == []
    world.observer.lag_s = 0
    world.reconcile()
    assert len(world.kube.status("default", "chat")["calibration"]["samples"]) == 1


def test_a_window_without_a_prefix_cache_reading_is_calibrated_as_unknown_not_as_no_hits(
    world: World,
) -> None:
    """An engine that does not count prefix-cache hits (TensorRT-LLM, caching off) leaves the hit
    ratio unknown in the sample status shows, and it stays unknown when the next evaluation reads
    the samples back (it was written as 0 %)."""
    world.kube.create(llmserving(tuning={"windowSeconds": 60}))
    world.reconcile()
    settle(world, 61)
    for prefix_hit in (None, 0.3, None):
        world.observer.set("default", "chat", observation(world.clock.now, prefix_hit=prefix_hit))
        world.reconcile()
        world.clock.advance(61)
    samples = world.kube.status("default", "chat")["calibration"]["samples"]
    assert [s.get("prefixHitPercent") for s in samples] == [None, 30.0, None]


def test_a_damaged_status_is_rebuilt(world: World) -> None:
    world.kube.create(llmserving())
    world.reconcile()
    world.kube.objects[("LLMServing", "default", "chat")]["status"] = {"history": "garbage", "bKnee": "x"}
    world.reconcile()
    status = world.kube.status("default", "chat")
    assert status["maxNumSeqs"] == 64 and [h["to"] for h in status["history"]] == [64]


def test_a_managed_flag_in_spec_args_is_replaced_and_reported(world: World) -> None:
    world.kube.create(llmserving(args=["--max-num-seqs", "999", "-tp", "2", "--enforce-eager"]))
    world.reconcile()
    args = world.args()
    assert max_num_seqs(world) == 64 and "999" not in args
    assert "-tp" not in args and args[args.index("--tensor-parallel-size") + 1] == "1"
    assert args[-1] == "--enforce-eager"
    condition = world.kube.condition("default", "chat", "ArgsOverridden")
    assert condition["status"] == "True"
    assert "--max-num-seqs 999 → 64" in condition["message"] and "-tp 2 → 1" in condition["message"]
    assert [e["reason"] for e in world.kube.events].count("ArgsOverridden") == 1
    world.reconcile()  # said once, not every tick
    assert [e["reason"] for e in world.kube.events].count("ArgsOverridden") == 1

    world.kube.edit_spec("default", "chat", {"args": ["--enforce-eager"]})
    world.reconcile()
    assert "ArgsOverridden" not in conditions(world)


def test_recommend_mode_keeps_the_users_limit_without_reporting_it(world: World) -> None:
    world.kube.create(llmserving(tuning={"mode": "Recommend"}, args=["--max-num-seqs=256"]))
    world.reconcile()
    assert max_num_seqs(world) == 256
    assert "ArgsOverridden" not in conditions(world)


def test_a_setting_tuned_to_traffic_changes_only_for_a_change_that_holds(world: World) -> None:
    world.kube.create(llmserving(tuning={"cooldownSeconds": 0}))
    world.reconcile()
    world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
    settle(world)
    world.clock.advance(600)
    shift_context(world, 8192)
    world.reconcile()
    assert max_num_seqs(world) == 16  # from the initial context's 64: a third of a window
    settle(world)
    world.reconcile()
    assert world.kube.status("default", "chat")["holdReason"] == "at-target"

    def evaluate(ctx: int) -> str:
        world.clock.advance(30)
        world.observer.set("default", "chat", observation(world.clock.now, ctx=ctx))
        world.reconcile()
        return str(world.kube.status("default", "chat").get("holdReason"))

    # a swing to 2,048 tokens for two minutes, then back: held, never rolled
    swing = [evaluate(2048) for _ in range(4)] + [evaluate(8192) for _ in range(4)]
    assert max_num_seqs(world) == 16 and "unsteady" in swing and swing[-1] == "at-target"
    reasons = world.kube.status("default", "chat")["reason"]
    assert "at target" in reasons
    # the same change that stays rolls once it has held for 1.5 windows (180 s)
    held = [evaluate(2048) for _ in range(6)]
    assert set(held) == {"unsteady"} and max_num_seqs(world) == 16
    evaluate(2048)
    assert max_num_seqs(world) == 64


def test_a_refused_spec_is_validated_once_per_generation_and_labels(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's 1.7-MB extraLlmApiOptions is refused (InvalidSpec); walking and validating it
    took 0.6 s at every evaluation on the worker every tenant shares. The refusal is remembered
    until the spec (its generation) or the labels change, and says the same thing meanwhile."""
    from batchknee import reconcile as reconciling

    parsed: list[int] = []
    parse = reconciling.parse_llmserving

    def counted(raw: dict[str, Any]) -> Any:
        parsed.append(raw["metadata"]["generation"])
        return parse(raw)

    monkeypatch.setattr(reconciling, "parse_llmserving", counted)
    world.kube.create(llmserving(engine="TensorRTLLM", extraLlmApiOptions={"x": [[0]] * 350_000}))
    for _ in range(3):
        world.reconcile()
        world.clock.advance(30)
    degraded = world.kube.condition("default", "chat", "Degraded")
    assert degraded["reason"] == "InvalidSpec" and degraded["message"].startswith(
        "spec.extraLlmApiOptions: more than 1024 values"
    )
    assert parsed == [1]
    world.kube.objects[("LLMServing", "default", "chat")]["metadata"]["labels"] = {"team": "a"}
    world.reconcile()
    world.kube.edit_spec("default", "chat", {"extraLlmApiOptions": {"x": [[0]] * 2_000}})
    world.reconcile()
    world.kube.edit_spec("default", "chat", {"extraLlmApiOptions": {"x": [0]}})
    world.reconcile()
    assert parsed == [1, 1, 2, 3]
    assert world.kube.condition("default", "chat", "Degraded")["status"] == "False"
    assert deployment_state(world.kube.get_deployment("default", "chat")) is not None


def test_a_stored_list_longer_than_this_version_keeps_its_newest_entries() -> None:
    """A newer operator kept more history (then was rolled back): the list failed as a whole and
    went, with the cooldown and the budget an adopted workload's history carries."""
    from batchknee.reconcile import _old_status

    history = [
        {"time": f"2026-03-01T{hour:02d}:00:00Z", "to": 8 * (hour + 1), "reason": "retune"}
        for hour in range(HISTORY_KEPT + 1)
    ]
    raw = {"metadata": {"name": "chat", "namespace": "default"}, "status": {"history": history}}
    old = _old_status(raw, datetime(2026, 3, 2, tzinfo=UTC))
    assert [h.to for h in old.history] == [h["to"] for h in history[1:]]
