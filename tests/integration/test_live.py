"""actuation: Live on the local control plane: the operator sets each ready pod's batch cap through
its runtime endpoint (vLLM PR #54816's /v1/runtime_config, served here by the test exporter) as
traffic shifts, with zero pod restarts; pods without the endpoint fall back to restarts and say so."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from test_operator import Harness, crds, retuned_for_8192, state_for, wait_for, world

__all__ = ["crds", "world"]

LIVE = {"evaluationIntervalSeconds": 5, "windowSeconds": 30, "cooldownSeconds": 0, "actuation": "Live"}


def pods(world: Harness, name: str) -> list[dict[str, Any]]:
    found = world.kubectl("get", "pods", "-l", f"batchknee.io/llmserving={name}", "-o", "json").stdout
    return [p for p in json.loads(found)["items"] if not p["metadata"].get("deletionTimestamp")]


def live_caps(world: Harness, name: str) -> dict[str, int]:
    caps = {}
    for pod in pods(world, name):
        ip = pod["status"].get("podIP")
        if not ip:
            continue
        try:
            with urllib.request.urlopen(f"http://{ip}:8000/v1/runtime_config", timeout=2) as answer:
                caps[pod["metadata"]["name"]] = json.loads(answer.read())["max_num_running_seqs"]
        except OSError:
            continue
    return caps


def test_live_caps_follow_the_traffic_without_a_restart(world: Harness) -> None:
    world.set_state({**state_for(2048), "runtimeConfig": True})
    world.start_operator()
    assert world.apply("live", replicas=2, tuning=LIVE).returncode == 0
    wait_for(lambda: world.condition("live", "Ready").get("status") == "True", 120, "Ready", world.log)
    ceiling = world.max_num_seqs("live")
    assert ceiling is not None and ceiling > 64  # the pods start at a ceiling
    caps = wait_for(
        lambda: (c := live_caps(world, "live")) and len(c) == 2 and set(c.values()) == {64} and c,
        90,
        "both pods' live caps at 64",
        world.log,
    )
    started = {p["metadata"]["name"] for p in pods(world, "live")}
    first = world.get("deployment", "live")
    assert first is not None
    revision = first["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
    assert world.condition("live", "Actuation")["status"] == "True"

    world.set_state({**state_for(8192), "runtimeConfig": True})
    final = wait_for(lambda: retuned_for_8192(world.status("live")), 180, "the retune for 8,192", world.log)
    wait_for(lambda: set(live_caps(world, "live").values()) == {final}, 30, "the live caps", world.log)
    assert {p["metadata"]["name"] for p in pods(world, "live")} == started  # zero restarts
    later = world.get("deployment", "live")
    assert later is not None
    # the pod template is untouched (the rollout record is a Deployment annotation: it bumps the
    # Deployment's generation, not its revision)
    assert later["spec"]["template"] == first["spec"]["template"]
    assert later["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == revision
    assert world.max_num_seqs("live") == ceiling
    status = world.status("live")
    assert status["maxNumSeqs"] == final and status["ceilingMaxNumSeqs"] == ceiling
    assert sorted(caps) == sorted(started)


def test_pods_without_the_endpoint_fall_back_to_a_restart(world: Harness) -> None:
    world.start_operator()  # the exporter serves no runtime endpoint: 404, as a released vLLM
    assert world.apply("plain", replicas=2, tuning=LIVE).returncode == 0
    condition = wait_for(
        lambda: (c := world.condition("plain", "Actuation")).get("reason") == "LiveUnsupported" and c,
        120,
        "Actuation=False LiveUnsupported",
        world.log,
    )
    assert "restart" in condition["message"]
    wait_for(lambda: world.max_num_seqs("plain") == 64, 120, "the Deployment restarted at the cap", world.log)


def test_a_wedged_pod_is_named_while_the_others_take_their_caps(world: Harness) -> None:
    """Pods that stop answering their runtime endpoint (a tenant's wedged engine) are named in
    Actuation=False LiveCapUnread; another LLMServing's pods take their caps meanwhile, nothing
    restarts, and once the pods answer again they get the cap decided while they were silent."""
    world.set_state({**state_for(2048), "runtimeConfig": True})
    world.start_operator()
    for name, replicas in (("wedged", 2), ("steady", 1)):
        assert world.apply(name, replicas=replicas, tuning=LIVE).returncode == 0
    for name, replicas in (("wedged", 2), ("steady", 1)):
        wait_for(
            lambda n=name, r=replicas: (c := live_caps(world, n)) and len(c) == r and set(c.values()) == {64},
            120,
            f"{name}'s live caps at 64",
            world.log,
        )
    wedged = {p["metadata"]["name"] for p in pods(world, "wedged")}

    world.set_state({**state_for(8192), "runtimeConfig": True, "runtimeConfigSilentPods": "wedged-"})
    final = wait_for(lambda: retuned_for_8192(world.status("steady")), 180, "steady's retune", world.log)
    wait_for(lambda: set(live_caps(world, "steady").values()) == {final}, 30, "steady's live cap", world.log)

    def silent_named() -> dict[str, Any] | None:
        # the first call times out (TimeoutError); the evaluations after it say the pod is backed off
        condition = world.condition("wedged", "Actuation")
        named = all(f"{pod}: did not answer within 2 s" in condition.get("message", "") for pod in wedged)
        return condition if condition.get("reason") == "LiveCapUnread" and named else None

    unread = wait_for(silent_named, 60, "Actuation=False LiveCapUnread naming both pods", world.log)
    assert unread["status"] == "False"
    assert unread["message"].startswith("0 pods take their batch cap live; could not read 2: ")
    decided = wait_for(lambda: retuned_for_8192(world.status("wedged")), 60, "wedged's decision", world.log)

    world.set_state({**state_for(8192), "runtimeConfig": True})
    # the pods are called again once their backoff (30 s, then 60 s while silent) runs out
    wait_for(
        lambda: (
            world.condition("wedged", "Actuation").get("reason") == "Live"
            and set(live_caps(world, "wedged").values()) == {decided}
        ),
        150,
        "the wedged pods' caps once they answer",
        world.log,
    )
    assert {p["metadata"]["name"] for p in pods(world, "wedged")} == wedged  # zero restarts
