"""Pod templates the operator renders anew of its own (an upgrade, a new default image) roll at most
`templateRolloutsAtOnce` engines at a time, alone: a waiting engine's retunes wait with it, but for
a safety decrease, which rolls with the template and takes a place; spec changes (the batch limit's
too) and edits put back do not wait."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from conftest import World, llmserving
from fakes import observation
from test_live_caps import generation, live_world
from test_rollout_safety import stall

from batchknee.adapters.observing import RoutedObserver
from batchknee.handlers import Runtime
from batchknee.operator_metrics import OperatorMetrics
from batchknee.pacing import Place, RolloutPacer
from batchknee.render import RenderDefaults

NAMES = ("a", "b", "c")
NEW_IMAGE = "vllm/vllm-openai:v9.9.9"


def image(world: World, name: str) -> str:
    return str(world.kube.deployment("default", name)["spec"]["template"]["spec"]["containers"][0]["image"])


def progressing(world: World, name: str) -> dict[str, str]:
    return world.kube.condition("default", name, "Progressing")


def queued_events(world: World, name: str) -> int:
    return sum(1 for e in world.kube.events if e["reason"] == "RolloutQueued" and e["object"] == name)


def rolled_out(world: World, namespace: str, name: str) -> None:
    """An engine created and rolled out under the old operator."""
    body = llmserving(name)
    body["metadata"]["namespace"] = namespace
    world.kube.create(body)
    world.reconcile(name, namespace)
    world.kube.finish_rollout(namespace, name)
    world.reconcile(name, namespace)


def fleet(world: World) -> str:
    """Three engines, created and rolled out under the old operator; returns the image they run."""
    for name in NAMES:
        rolled_out(world, "default", name)
    return image(world, "a")


def gauges(metrics: OperatorMetrics) -> tuple[float | None, float | None]:
    return (
        metrics.registry.get_sample_value("batchknee_template_rollouts_under_way"),
        metrics.registry.get_sample_value("batchknee_template_rollouts_waiting"),
    )


def test_a_new_default_image_rolls_one_engine_at_a_time(world: World) -> None:
    old_image = fleet(world)
    assert old_image != NEW_IMAGE
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    metrics = OperatorMetrics()
    metrics.track_pacer(world.ports.pacer)
    world.clock.advance(30)
    for name in NAMES:
        world.reconcile(name)
    assert gauges(metrics) == (1, 2)
    assert [image(world, name) for name in NAMES] == [NEW_IMAGE, old_image, old_image]
    assert progressing(world, "a")["reason"] == "TemplateRollout"
    for name in ("b", "c"):
        held = progressing(world, name)
        assert held["status"] == "False" and held["reason"] == "RolloutQueued"
        assert "at most 1 engines at a time" in held["message"]
        assert "templateRolloutsAtOnce" in held["message"]
        assert queued_events(world, name) == 1
        assert world.kube.status("default", name)["maxNumSeqs"] == 64

    # a's rollout is under way (or stalled): its place is kept, whoever asks
    world.clock.advance(30)
    for name in NAMES:
        world.reconcile(name)
    assert [image(world, name) for name in NAMES] == [NEW_IMAGE, old_image, old_image]
    assert queued_events(world, "b") == 1  # said once, not at every evaluation

    # a's rollout completes: its evaluation frees the place, and the next engine takes it
    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    assert progressing(world, "a")["reason"] == "RolloutComplete"
    assert progressing(world, "b")["reason"] == "RolloutQueued"  # until its next evaluation
    world.reconcile("b")
    world.reconcile("c")
    assert [image(world, name) for name in NAMES] == [NEW_IMAGE, NEW_IMAGE, old_image]
    assert gauges(metrics) == (1, 1)

    # a spec change is its writer's own: it rolls now, place or not (the new image with it)
    world.kube.edit_spec("default", "c", {"template": {"env": [{"name": "LOG_LEVEL", "value": "debug"}]}})
    world.reconcile("c")
    assert image(world, "c") == NEW_IMAGE
    assert progressing(world, "c")["reason"] == "TemplateRollout"
    assert progressing(world, "c")["message"] == "rolling out a new pod template"
    world.reconcile("c")
    assert progressing(world, "c")["reason"] == "RolloutInProgress"


def test_an_edit_put_back_and_a_spec_change_of_the_batch_limit_do_not_wait_for_a_place(world: World) -> None:
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    assert image(world, "a") == NEW_IMAGE  # a holds the one place
    world.reconcile("b")
    assert progressing(world, "b")["reason"] == "RolloutQueued"

    # someone edits b's Deployment by hand: it is put back at once (its pods are rolling to the
    # edit already), as the operator renders it now
    edited = world.kube.deployment("default", "b")
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "attacker/vllm:latest"
    edited["metadata"]["generation"] += 1
    world.reconcile("b")
    assert image(world, "b") == NEW_IMAGE
    assert progressing(world, "b")["reason"] == "RolloutInProgress"

    # d runs an image of its own spec: its rendering is unchanged. An edit whose rollout has finished
    # is put back at once too (the operator's rendering did not change: nothing of its own to pace)
    world.kube.create(llmserving("d", image="vllm/vllm-openai:pinned"))
    world.reconcile("d")
    world.kube.finish_rollout("default", "d")
    world.reconcile("d")
    edited = world.kube.deployment("default", "d")
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "attacker/vllm:latest"
    world.kube.finish_rollout("default", "d")
    world.reconcile("d")
    assert image(world, "d") == "vllm/vllm-openai:pinned"

    # c's spec asks for another batch limit: the decision rolls, whatever the places
    world.kube.edit_spec("default", "c", {"tuning": {"mode": "Pinned", "pinnedMaxNumSeqs": 100}})
    world.reconcile("c")
    args = world.args("c")
    assert args[args.index("--max-num-seqs") + 1] == "100"


def test_no_limit_rolls_every_engine_at_once(world: World) -> None:
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(0))
    for name in NAMES:
        world.reconcile(name)
    assert [image(world, name) for name in NAMES] == [NEW_IMAGE] * 3


def test_an_llmserving_gone_frees_its_place(world: World) -> None:
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    router = RoutedObserver(world.observer, "http://127.0.0.1:9090", [])
    runtime = Runtime(world.ports, router, OperatorMetrics())
    world.reconcile("a")
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE
    runtime.forget("default", "a")  # deleted mid-rollout: its rollout no longer counts
    world.reconcile("b")
    assert image(world, "b") == NEW_IMAGE


def test_a_place_frees_whatever_the_spec_now_says_and_when_the_apply_fails(world: World) -> None:
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    assert world.ports.pacer.place(("default", "a")) is not None
    # a's writer makes the spec one the operator refuses; a's rollout completes meanwhile
    world.kube.edit_spec(
        "default", "a", {"template": {"volumes": [{"name": "n", "hostPath": {"path": "/"}}]}}
    )
    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    assert world.kube.condition("default", "a", "Degraded")["reason"] == "Forbidden"
    assert world.ports.pacer.place(("default", "a")) is None

    # b takes the place, and its apply is refused (an admission webhook): nothing rolls, the place
    # frees for c in the same turn
    world.kube.fail_apply = {"Deployment"}
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE
    assert world.kube.condition("default", "b", "Degraded")["reason"] == "ApplyFailed"
    assert world.ports.pacer.under_way() == 0
    world.kube.fail_apply = set()
    world.reconcile("c")
    assert image(world, "c") == NEW_IMAGE


def test_a_retune_waits_for_the_operators_template_which_rolls_out_alone(world: World) -> None:
    """An engine whose new template of the operator's own waits holds its batch limit: one rollout
    of both would leave a stall that is no one's. With its place, the template
    rolls out alone at the limit it runs; the retune follows."""
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    world.clock.advance(181)  # b has settled since its creation
    for _ in range(4):  # b's traffic moves to 8k tokens: the knee wants 16
        world.observer.set("default", "b", observation(world.clock.now, ctx=8192))
        world.reconcile("b")
        world.clock.advance(30)
    status = world.kube.status("default", "b")
    assert status["holdReason"] == "template-first" and status["recommendedMaxNumSeqs"] == 16
    assert "rolls out first, alone" in status["reason"]
    assert world.args("b")[world.args("b").index("--max-num-seqs") + 1] == "64"
    assert image(world, "b") != NEW_IMAGE and progressing(world, "b")["reason"] == "RolloutQueued"

    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    world.observer.set("default", "b", observation(world.clock.now, ctx=8192))
    world.reconcile("b")  # its turn: the template alone, at 64
    assert image(world, "b") == NEW_IMAGE
    assert world.args("b")[world.args("b").index("--max-num-seqs") + 1] == "64"
    world.kube.finish_rollout("default", "b")
    for _ in range(8):
        world.clock.advance(30)
        world.observer.set("default", "b", observation(world.clock.now, ctx=8192))
        world.reconcile("b")
    assert world.args("b")[world.args("b").index("--max-num-seqs") + 1] == "16"


def test_a_read_that_does_not_show_the_apply_yet_keeps_the_place_for_a_minute(world: World) -> None:
    fleet(world)
    before = copy.deepcopy(world.kube.deployment("default", "a"))
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    given = world.ports.pacer.place(("default", "a"))
    assert given is not None and given.since == world.clock.now
    stale = copy.deepcopy(before)  # the watch behind the write: the Deployment as it was
    stale["metadata"]["resourceVersion"] = world.kube.deployment("default", "a")["metadata"][
        "resourceVersion"
    ]
    world.kube.objects[("Deployment", "default", "a")] = stale
    world.clock.advance(30)
    world.reconcile("a")
    assert world.ports.pacer.place(("default", "a")) == given  # kept, not freed and taken anew
    world.kube.objects[("Deployment", "default", "a")] = copy.deepcopy(stale)
    world.clock.advance(40)
    world.reconcile("a")  # past a minute: freed, and taken again for the apply it makes now
    again = world.ports.pacer.place(("default", "a"))
    assert again is not None and again.since == world.clock.now


def test_a_place_frees_with_as_many_pods_available_as_before_and_not_with_fewer(world: World) -> None:
    """Two replicas, one pending for reasons of its own (no GPU for a scale-up): the template's
    rollout that leaves one available frees its place. One whose new pods do not start keeps it:
    the template stops there."""
    for name in ("a", "b"):
        world.kube.create(llmserving(name, replicas=2))
        world.reconcile(name)
        world.kube.finish_rollout("default", name, available=1)
        world.reconcile(name)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    assert image(world, "a") == NEW_IMAGE
    world.kube.finish_rollout("default", "a", available=0)  # the new template's pods do not start
    world.reconcile("a")
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE and progressing(world, "b")["reason"] == "RolloutQueued"
    world.kube.finish_rollout("default", "a", available=1)  # as many as before: one pending still, as it was
    world.reconcile("a")
    world.reconcile("b")
    assert image(world, "b") == NEW_IMAGE


def test_a_spec_change_whose_apply_failed_does_not_wait_when_it_goes_through(world: World) -> None:
    """The status saw the new generation when the apply was refused; the Deployment still says which
    spec it was rendered from, so the writer's change is still theirs when the apply goes through."""
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")  # holds the one place
    world.kube.edit_spec("default", "c", {"template": {"env": [{"name": "LOG_LEVEL", "value": "debug"}]}})
    world.kube.fail_apply = {"Deployment"}
    world.reconcile("c")
    assert world.kube.status("default", "c")["observedGeneration"] == 2
    world.kube.fail_apply = set()
    world.clock.advance(30)
    world.reconcile("c")
    container = world.kube.deployment("default", "c")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "LOG_LEVEL", "value": "debug"} in container["env"] and container["image"] == NEW_IMAGE


def restarted_a_holds_its_place_until_it_recovers(world: World) -> None:
    """A new process (no places in memory) gives a's rollout its place again: b waits, until a's
    pods are all available."""
    world.ports = replace(world.ports, pacer=RolloutPacer(1))
    world.clock.advance(30)
    world.reconcile("a")
    assert world.ports.pacer.place(("default", "a")) is not None
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE and progressing(world, "b")["reason"] == "RolloutQueued"
    world.kube.finish_rollout("default", "a")  # it recovers: the place frees, b goes
    world.reconcile("a")
    world.reconcile("b")
    assert image(world, "b") == NEW_IMAGE


def test_an_operator_started_mid_rollout_gives_the_place_again(world: World) -> None:
    """The operator restarts while a template that got a place is still replacing pods (its new pod
    does not start; the old one serves): the new process gives that rollout its place again, so the
    template does not reach another engine."""
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    assert image(world, "a") == NEW_IMAGE
    dep = world.kube.deployment("default", "a")
    dep["status"] = {  # a surge pod of the new template that never gets Ready, the old pod serving
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": 2,
        "updatedReplicas": 1,
        "availableReplicas": 1,
    }
    restarted_a_holds_its_place_until_it_recovers(world)


def test_an_operator_started_while_the_new_pods_do_not_start_gives_the_place_again(world: World) -> None:
    """One replica, replaced, its new pod not Ready, the progress deadline not passed: neither
    replacing pods nor stalled, yet the template's. A new process gives it its place again; a pod
    lost past the deadline is not the template's and takes none."""
    fleet(world)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(1))
    world.reconcile("a")
    assert image(world, "a") == NEW_IMAGE
    world.kube.finish_rollout("default", "a", available=0)
    restarted_a_holds_its_place_until_it_recovers(world)

    world.kube.finish_rollout("default", "b")
    world.reconcile("b")
    world.kube.finish_rollout("default", "a", available=0)  # long after: a node lost
    world.ports = replace(world.ports, pacer=RolloutPacer(1))
    world.clock.advance(3600)
    world.reconcile("a")
    assert world.ports.pacer.place(("default", "a")) is None


def test_a_namespace_whose_new_pods_never_start_does_not_stop_the_others(world: World) -> None:
    """Two places; a tenant's engines evaluate first and their new pods never start (a quota with no
    room for a surge pod). The namespace holds one place at most: the other namespace's engines
    roll through the other, one after another."""

    def rolled(namespace: str, name: str) -> bool:
        container = world.kube.deployment(namespace, name)["spec"]["template"]["spec"]["containers"][0]
        return bool(container["image"] == NEW_IMAGE)

    for name in ("s0", "s1"):
        rolled_out(world, "stuck", name)
    for name in ("o0", "o1", "o2"):
        rolled_out(world, "other", name)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(2))
    world.clock.advance(30)
    for name in ("s0", "s1"):
        world.reconcile(name, "stuck")
    assert rolled("stuck", "s0") and not rolled("stuck", "s1")
    assert world.kube.condition("stuck", "s1", "Progressing")["reason"] == "RolloutQueued"
    world.kube.finish_rollout("stuck", "s0", available=0)
    for name in ("o0", "o1", "o2"):
        world.clock.advance(30)
        for other in ("o0", "o1", "o2"):
            world.reconcile(other, "other")
        world.reconcile("s0", "stuck")
        world.reconcile("s1", "stuck")
        assert rolled("other", name) and not rolled("stuck", "s1")
        world.kube.finish_rollout("other", name)
    assert world.ports.pacer.place(("stuck", "s0")) is not None


def test_a_waiter_whose_spec_turns_invalid_keeps_no_place_for_its_namespace(world: World) -> None:
    """A waiting engine's next evaluation ends before pacing (its spec is refused now): it no longer
    waits, so the places that free are not kept for its namespace."""
    for namespace, name in (("big", "b0"), ("big", "b1"), ("big", "b2"), ("y", "y0"), ("x", "x0")):
        rolled_out(world, namespace, name)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=RolloutPacer(3))
    world.clock.advance(30)
    for namespace, name in (("big", "b0"), ("big", "b1"), ("y", "y0"), ("x", "x0")):
        world.reconcile(name, namespace)
    assert world.ports.pacer.waiting() == 1  # x0
    world.kube.edit_spec("x", "x0", {"gpu": {"count": 0}})
    world.clock.advance(30)
    assert world.reconcile("x0", "x").error is not None
    for namespace, name in (("y", "y0"), ("big", "b0")):
        world.kube.finish_rollout(namespace, name)
        world.reconcile(name, namespace)
    world.reconcile("b2", "big")  # two places free, nobody else waiting: it rolls
    container = world.kube.deployment("big", "b2")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == NEW_IMAGE and world.ports.pacer.waiting() == 0


def test_a_batch_flag_edited_by_hand_is_not_queued_as_the_operators_template(world: World) -> None:
    """`kubectl edit` set --max-num-seqs 256 on a tuned engine while another engine held the one
    place: rendered at the edited value the template differed from the one recorded, and the edit
    stuck as "the operator's new pod template … rolls out first", queued for as long as the place
    was taken. Rendered at the value the operator last wrote, it is no change of the operator's own."""
    world.ports = replace(world.ports, pacer=RolloutPacer(1))
    world.kube.create(llmserving(tuning={"cooldownSeconds": 600}))
    world.reconcile()
    world.kube.finish_rollout("default", "chat")
    world.reconcile()
    world.clock.advance(121)
    world.ports.pacer.admit(("other", "x"), Place("t", world.clock.now, 1))  # another engine's rollout
    edited = world.kube.deployment("default", "chat")
    args = edited["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--max-num-seqs") + 1] = "256"
    edited["metadata"]["generation"] += 1
    world.kube.finish_rollout("default", "chat")
    for _ in range(3):  # a third of the window: the edit, a setting not tuned to traffic, is replaced
        world.observer.set("default", "chat", observation(world.clock.now, ctx=2048))
        world.reconcile()
        status = world.kube.status("default", "chat")
        assert status.get("holdReason") != "template-first", status["reason"]
        world.clock.advance(30)
    args = world.args("chat")
    assert args[args.index("--max-num-seqs") + 1] == "64", status["reason"]


def limit(world: World, name: str) -> int:
    args = world.args(name)
    return int(args[args.index("--max-num-seqs") + 1])


def upgraded_with_every_place_taken(world: World, **spec: Any) -> None:
    """Engine a (of `spec`) and b, rolled out and settled under the old operator; then the operator
    renders a new template (a new default image) while another engine holds the one place: b waits."""
    world.kube.create(llmserving("a", **spec))
    world.reconcile("a")
    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    rolled_out(world, "default", "b")
    world.clock.advance(121)  # a has settled since its creation
    pacer = RolloutPacer(1)
    assert pacer.admit(("other", "x"), Place("another template", world.clock.now, 1))
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=pacer)
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE and progressing(world, "b")["reason"] == "RolloutQueued"


TPOT_TARGET = {"tuning": {"cooldownSeconds": 0, "tpotP99TargetMilliseconds": 25}}
# an A10G's KV pool holds 17 sequences of 2,048 tokens, 8 of 4,000: the knee (×1.5) is far above
SMALL_KV_POOL = {
    "gpu": {"type": "a10g", "count": 1},
    "tuning": {"cooldownSeconds": 0, "kneeFactorPercent": 150},
}


def broke_the_tpot_target(world: World) -> None:
    """a's TPOT p99 is 40 ms against its 25-ms target: the guard steps 64 down to 48."""
    world.observer.set(
        "default", "a", observation(world.clock.now, ctx=2048, tpot_p99_ms=40, with_mean=False)
    )
    world.reconcile("a")


@pytest.mark.parametrize(
    ("spec", "seen", "before", "after", "limited_by"),
    [
        (TPOT_TARGET, {"ctx": 2048, "tpot_p99_ms": 40, "with_mean": False}, 64, 48, "tpot-target"),
        (SMALL_KV_POOL, {"ctx": 4000}, 16, 8, "kv-capacity"),
    ],
)
def test_a_safety_decrease_does_not_wait_for_a_place_it_rolls_with_the_operators_template(
    world: World, spec: dict[str, Any], seen: dict[str, Any], before: int, after: int, limited_by: str
) -> None:
    """Every place is taken and another engine waits; a's running limit breaks its TPOT target, or
    outgrows its KV pool (the engine preempts): the decrease does not wait hours for a place. It
    rolls at once with the operator's new template, in one restart, and takes a place over the
    limit — the waiting engine waits while it runs."""
    upgraded_with_every_place_taken(world, **spec)
    assert limit(world, "a") == before
    world.observer.set("default", "a", observation(world.clock.now, **seen))
    world.reconcile("a")
    assert limit(world, "a") == after and image(world, "a") == NEW_IMAGE  # one rollout of both
    status = world.kube.status("default", "a")
    assert status["limitedBy"] == limited_by and status.get("holdReason") is None, status["reason"]
    assert status["reason"].endswith("; the operator's new pod template rolls with this safety decrease")
    [retuned] = [e for e in world.kube.events if e["reason"] == "Retuned" and e["object"] == "a"]
    assert "the operator's new pod template rolls with this safety decrease" in retuned["message"]
    assert [h["to"] for h in status["history"]] == [before, after]
    assert "before" not in status["history"][-1]  # its window before ran on the old template

    # a holds a place over the limit: the limit's one place is still the other engine's, b waits
    pacer = world.ports.pacer
    assert pacer.place(("default", "a")) is not None and pacer.under_way() == 2
    world.clock.advance(30)
    world.reconcile("b")
    assert image(world, "b") != NEW_IMAGE and progressing(world, "b")["reason"] == "RolloutQueued"

    # a's rollout completes: its place frees as any; the limit's place freeing lets b's template go
    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    assert pacer.place(("default", "a")) is None
    pacer.done(("other", "x"))
    world.reconcile("b")
    assert image(world, "b") == NEW_IMAGE and limit(world, "b") == 64


def test_a_raise_still_waits_for_the_operators_template(world: World) -> None:
    """Not a safety decrease (a raise to the knee of shorter traffic): it holds its batch limit
    while its engine waits for a place, as any retune does, and takes none."""
    upgraded_with_every_place_taken(world, **TPOT_TARGET)
    for _ in range(6):
        world.observer.set("default", "a", observation(world.clock.now, ctx=1024))
        world.reconcile("a")
        world.clock.advance(30)
    status = world.kube.status("default", "a")
    assert status["holdReason"] == "template-first" and status["recommendedMaxNumSeqs"] > 64
    assert "rolls out first, alone" in status["reason"]
    assert limit(world, "a") == 64 and image(world, "a") != NEW_IMAGE
    assert progressing(world, "a")["reason"] == "RolloutQueued"
    assert world.ports.pacer.place(("default", "a")) is None


def test_a_stall_of_a_safety_decrease_with_the_operators_template_is_the_templates(world: World) -> None:
    """The new template's pods of the safety decrease's rollout never get Ready: the template may
    be what fails. The limit is not rolled back to the one that breaks the TPOT target, nor is
    the lower one quarantined; Degraded says the rollout stalled, and its place is kept."""
    upgraded_with_every_place_taken(world, **TPOT_TARGET)
    broke_the_tpot_target(world)
    assert limit(world, "a") == 48 and image(world, "a") == NEW_IMAGE
    world.clock.advance(600)
    stall(world, "a")
    for _ in range(3):
        world.observer.set(
            "default", "a", observation(world.clock.now, ctx=2048, tpot_p99_ms=40, with_mean=False)
        )
        world.reconcile("a")
        world.clock.advance(30)
    assert limit(world, "a") == 48
    status = world.kube.status("default", "a")
    assert [h["to"] for h in status["history"]] == [64, 48]
    assert status.get("quarantine", []) == []
    assert world.kube.condition("default", "a", "Degraded")["reason"] == "RolloutStalled"
    assert "RolledBack" not in [e["reason"] for e in world.kube.events]
    assert world.ports.pacer.place(("default", "a")) is not None


def broke_its_tpot_target(world: World, name: str, namespace: str = "default") -> None:
    world.observer.set(
        namespace, name, observation(world.clock.now, ctx=2048, tpot_p99_ms=40, with_mean=False)
    )
    world.reconcile(name, namespace)


def test_safety_decreases_take_places_within_bounds(world: World) -> None:
    """A safety decrease goes ahead of the waiters, into a free place or one of `at_once` more that
    the waiters do not count — each within its namespace's share: one tenant's unsafe limits (a tiny
    TPOT target is theirs to set) can neither spread a template that does not start nor hold every
    place; and a fleet of one namespace, which holds its share with its own template rollouts, is
    not kept waiting."""
    names = ("a", "b", "c")
    for name in names:
        world.kube.create(llmserving(name, **TPOT_TARGET))
        world.reconcile(name)
        world.kube.finish_rollout("default", name)
        world.reconcile(name)
    world.clock.advance(121)
    pacer = RolloutPacer(2)  # a namespace's share: one place of the limit's, one of the two more
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=pacer)
    for name in names:
        broke_its_tpot_target(world, name)
    old_image = RenderDefaults().vllm_image
    assert [(limit(world, n), image(world, n)) for n in names] == [
        (48, NEW_IMAGE),  # a free place
        (48, NEW_IMAGE),  # one over the limit: its namespace held its share of the limit's
        (64, old_image),  # its namespace holds its share of both
    ]
    held = world.kube.status("default", "c")
    assert held["holdReason"] == "template-first"
    assert "this safety decrease too: its namespace holds its share of the places" in held["reason"]
    assert progressing(world, "c")["reason"] == "RolloutQueued"

    # the places over the limit are not the limit's: another namespace's rollout still gets one
    assert pacer.admit(("other", "x"), Place("template", world.clock.now, 1))
    assert not pacer.admit(("other", "y"), Place("template", world.clock.now, 1))
    # and as many again, at most: another namespace's safety decrease takes the last
    assert pacer.admit_safety(("third", "z"), Place("template", world.clock.now, 1))
    assert not pacer.admit_safety(("fourth", "w"), Place("template", world.clock.now, 1))
    assert pacer.under_way() == 4 == 2 * pacer.at_once


def test_a_live_safety_cap_waits_for_the_operators_template_and_restarts_nothing(world: World) -> None:
    """Under Live the cap goes down in place: rolled with the operator's new template it would
    restart the pods (the only one here, whose serving gap the spec refuses), so it waits for the
    template as any retune does."""
    runtime = live_world(
        world, pods=1, tuning={"tpotP99TargetMilliseconds": 25}, rollout={"allowServingGap": False}
    )
    for _ in range(6):
        world.observer.set("default", "chat", observation(world.clock.now, ctx=2048, tpot_p99_ms=20))
        world.reconcile()
        world.clock.advance(30)
    before, old_image, caps = generation(world), image(world, "chat"), list(runtime.sets)
    pacer = RolloutPacer(1)
    assert pacer.admit(("other", "x"), Place("another template", world.clock.now, 1))
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=pacer)
    broke_its_tpot_target(world, "chat")
    assert generation(world) == before and image(world, "chat") == old_image
    assert world.kube.status("default", "chat")["holdReason"] == "template-first"
    assert pacer.place(("default", "chat")) is None and runtime.sets == caps


def test_a_safety_decrease_that_meets_a_name_conflict_keeps_no_place(world: World) -> None:
    """The place a safety decrease took goes back when nothing rolls: another's Service of its name
    stops the apply before it is made."""
    world.kube.create(llmserving("a", **TPOT_TARGET))
    world.reconcile("a")
    world.kube.finish_rollout("default", "a")
    world.reconcile("a")
    world.clock.advance(121)
    pacer = RolloutPacer(2)
    world.ports = replace(world.ports, defaults=RenderDefaults(vllm_image=NEW_IMAGE), pacer=pacer)
    world.kube.objects[("Service", "default", "a")]["metadata"].pop("ownerReferences")
    for _ in range(3):
        broke_its_tpot_target(world, "a")
        assert pacer.place(("default", "a")) is None and pacer.under_way() == 0
        world.clock.advance(30)
    assert limit(world, "a") == 64 and world.kube.status("default", "a")["conditions"]
