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
