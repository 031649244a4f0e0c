"""The operator never takes over what is not its own, on the real apiserver: a Service or Deployment
named like an LLMServing stays untouched (and survives the LLMServing's deletion), a write decided on
a stale Deployment is refused by its resourceVersion precondition, and an engine that crash-loops
after a change is reported Degraded."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from test_operator import Harness, crds, state_for, wait_for, world

from batchknee.adapters.kubernetes import KubernetesAdapter
from batchknee.api.models import API_VERSION
from batchknee.devcluster import DevCluster
from batchknee.handlers import prometheus_observer
from batchknee.ports import ApplyConflict, ObjectGone
from batchknee.reconcile import Ports, reconcile
from batchknee.settings import OperatorSettings

__all__ = ["crds", "world"]


def foreign_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {"team": "payments"}},
        "spec": {"selector": {"app": "payments"}, "ports": [{"name": "https", "port": 443}]},
    }


def strip_volatile(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    if obj is None:
        return None
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("managedFields",)}
    return {**obj, "metadata": meta}


def test_a_service_named_like_the_llmserving_is_never_hijacked(world: Harness) -> None:
    """The reported attack: an LLMServing named like an existing Service force-applied over it,
    re-pointed its selector at the attacker's pods, and deleting the LLMServing deleted it."""
    world.kubectl("apply", "-f", "-", input=json.dumps(foreign_service("payments")))
    before = strip_volatile(world.get("service", "payments"))
    world.start_operator()
    assert world.apply("payments").returncode == 0  # (a foreign image is refused on its own: admission)

    degraded = wait_for(
        lambda: (c := world.condition("payments", "Degraded")).get("reason") == "NameConflict" and c,
        60,
        "Degraded=NameConflict",
        world.log,
    )
    assert "Service" in degraded["message"] and "payments" in degraded["message"]
    assert world.events("NameConflict"), "a Warning event names the conflict"
    assert world.get("deployment", "payments") is None  # nothing applied: no attacker pods either
    after = world.get("service", "payments")
    assert strip_volatile(after) == before
    assert not after["metadata"].get("ownerReferences")  # type: ignore[index]
    shown = world.kubectl("get", "service", "payments", "-o", "json", "--show-managed-fields").stdout
    managers = {f["manager"] for f in json.loads(shown)["metadata"]["managedFields"]}
    assert "batchknee" not in managers

    world.kubectl("delete", "llms", "payments", "--wait=true")
    assert strip_volatile(world.get("service", "payments")) == before


def test_a_foreign_deployment_is_not_rolled(world: Harness) -> None:
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ledger"},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "ledger"}},
            "template": {
                "metadata": {"labels": {"app": "ledger"}},
                "spec": {"containers": [{"name": "app", "image": "registry.example/ledger:1"}]},
            },
        },
    }
    world.kubectl("apply", "-f", "-", input=json.dumps(foreign))
    before = world.get("deployment", "ledger")
    world.start_operator()
    assert world.apply("ledger").returncode == 0
    wait_for(
        lambda: world.condition("ledger", "Degraded").get("reason") == "NameConflict",
        60,
        "Degraded=NameConflict",
        world.log,
    )
    after = world.get("deployment", "ledger")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # type: ignore[index]
    assert after["spec"]["template"] == before["spec"]["template"]  # type: ignore[index]
    assert world.get("service", "ledger") is None


def test_a_write_decided_on_a_stale_read_is_refused(world: Harness, cluster: DevCluster) -> None:
    """What makes two operators (or a restarted one) unable to both roll: the apply carries the
    resourceVersion the decision was made on, and the apiserver refuses it once the object moved."""
    world.start_operator()
    assert world.apply("stale").returncode == 0
    wait_for(lambda: world.max_num_seqs("stale") == 64, 60, "the Deployment", world.log)
    world.stop_operator()
    kube = KubernetesAdapter(cluster.api_client())
    read = kube.get_deployment(world.ns, "stale")
    assert read is not None
    # someone else writes meanwhile (a user's scale, another operator's rollout)
    world.kubectl("annotate", "deployment", "stale", "example.com/touched=yes")

    mine = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "stale",
            "namespace": world.ns,
            "resourceVersion": read["metadata"]["resourceVersion"],
        },
        "spec": {
            "selector": read["spec"]["selector"],
            "template": {
                "metadata": read["spec"]["template"]["metadata"],
                "spec": {"containers": [{"name": "engine", "args": ["--max-num-seqs", "16"]}]},
            },
        },
    }
    with pytest.raises(ApplyConflict):
        kube.apply(mine)
    assert world.max_num_seqs("stale") == 64

    # and a create is never forced: an object that appeared meanwhile is not taken over
    world.kubectl("apply", "-f", "-", input=json.dumps(foreign_service("raced")))
    raced = {**foreign_service("raced"), "metadata": {"name": "raced", "namespace": world.ns}}
    raced["spec"] = {
        "selector": {"batchknee.io/llmserving": "raced"},
        "ports": [{"name": "https", "port": 443}],
    }
    with pytest.raises(ApplyConflict):
        kube.apply(raced)
    assert world.get("service", "raced")["spec"]["selector"] == {"app": "payments"}  # type: ignore[index]

    # nor one whose fields an unforced apply would merge with, none conflicting: a selector-less
    # Service (an external database behind hand-made EndpointSlices) took the operator's selector,
    # port, labels and controller reference, and was the LLMServing's from then on (deleted with it)
    external = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "raced-open", "labels": {"team": "payments"}},
        "spec": {"ports": [{"name": "postgres", "port": 5432}]},
    }
    world.kubectl("apply", "-f", "-", input=json.dumps(external))
    before = strip_volatile(world.get("service", "raced-open"))
    llms = world.get("llmserving", "stale")
    assert llms is not None
    owner = {
        "apiVersion": llms["apiVersion"],
        "kind": "LLMServing",
        "name": "stale",
        "uid": llms["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    ours = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "raced-open",
            "namespace": world.ns,
            "labels": {"batchknee.io/llmserving": "stale"},
            "ownerReferences": [owner],
        },
        "spec": {"selector": {"batchknee.io/llmserving": "stale"}, "ports": [{"name": "http", "port": 8000}]},
    }
    with pytest.raises(ApplyConflict, match="created by someone else"):
        kube.apply(ours)
    after = strip_volatile(world.get("service", "raced-open"))
    assert after is not None and before is not None
    # as it was (its resourceVersion moved: the apply and the taking back each wrote it)
    assert after["spec"] == before["spec"] and "selector" not in after["spec"]
    assert {**after["metadata"], "resourceVersion": ""} == {**before["metadata"], "resourceVersion": ""}
    # a create the operator's own retry finds made (its first try's answer lost) is no stranger
    mine = {**ours, "metadata": {**ours["metadata"], "name": "fresh"}}
    kube.apply(mine)
    kube.apply(mine)
    assert world.get("service", "fresh")["spec"]["selector"] == {"batchknee.io/llmserving": "stale"}  # type: ignore[index]


def test_a_rollouts_event_sent_twice_is_recorded_once(world: Harness, cluster: DevCluster) -> None:
    """A rollout's Event is named after it: sent again (by the operator that took over after a
    crash, or a retry whose first try was made), the apiserver keeps the first."""
    kube = KubernetesAdapter(cluster.api_client())
    involved = {
        "apiVersion": API_VERSION,
        "kind": "LLMServing",
        "metadata": {"name": "announced", "namespace": world.ns, "uid": "0f3c"},
    }
    now = datetime.now(UTC)
    for message in ("max-num-seqs 64→16: the first", "max-num-seqs 64→16: again"):
        kube.emit_event(involved, "Normal", "Retuned", message, now, name="announced.5e1f2a")
    kube.emit_event(involved, "Normal", "Retuned", "max-num-seqs 16→32: unnamed", now)
    events = [e for e in world.events("Retuned") if e["involvedObject"]["name"] == "announced"]
    assert sorted((e["message"], e["count"]) for e in events) == [
        ("max-num-seqs 16→32: unnamed", 1),
        ("max-num-seqs 64→16: the first", 1),
    ]
    assert "announced.5e1f2a" in {e["metadata"]["name"] for e in events}


def test_an_engine_that_crash_loops_is_degraded(world: Harness) -> None:
    world.start_operator()
    missing = world.tmp / "no-such-state.json"  # the test engine exits 1 without its state file
    assert world.apply("crashy", args=["--state", str(missing)]).returncode == 0
    degraded = wait_for(
        lambda: (
            (c := world.condition("crashy", "Degraded")).get("reason") == "EngineCrashLooping"
            and "exit 1" in c.get("message", "")
            and c
        ),
        120,
        "Degraded=EngineCrashLooping naming the exit code",
        world.log,
    )
    assert "crashy-" in degraded["message"]
    assert world.events("EngineCrashLooping")


@pytest.mark.timeout(600)
def test_a_value_that_does_not_fit_is_rolled_back_and_quarantined(world: Harness) -> None:
    """The engine cannot start with the new batch limit: the Deployment controller reports
    ProgressDeadlineExceeded, the operator rolls back to the last good value and quarantines it."""
    world.start_operator()
    assert (
        world.apply("tight", rollout={"allowServingGap": True, "progressDeadlineSeconds": 10}).returncode == 0
    )
    wait_for(lambda: world.condition("tight", "Ready").get("status") == "True", 90, "Ready", world.log)
    wait_for(lambda: world.status("tight").get("observed", {}).get("avgContextLength"), 90, "an observation")
    world.set_state({**state_for(512), "fitsMaxNumSeqs": 100})  # the knee at 512 tokens, 240, will not fit
    wait_for(lambda: world.max_num_seqs("tight") == 240, 120, "the retune to 240", world.log)
    wait_for(lambda: world.max_num_seqs("tight") == 64, 180, "the rollback to 64", world.log)
    quarantine = wait_for(lambda: world.status("tight").get("quarantine"), 60, "the quarantine")
    assert quarantine[0]["maxNumSeqs"] == 240
    assert world.events("RolledBack")
    wait_for(lambda: world.condition("tight", "Ready").get("status") == "True", 120, "Ready again", world.log)
    # once the metrics window has settled, the same traffic asks for 240 again: it is not tried
    # (the settle window after the rollback, then the hold time; a loaded machine scrapes late)
    deadline = time.monotonic() + 240
    while world.status("tight").get("holdReason") != "quarantined":
        assert world.max_num_seqs("tight") == 64
        status = world.status("tight")
        assert time.monotonic() < deadline, (status.get("holdReason"), status.get("reason"), world.log())
        time.sleep(1)
    assert "quarantined 240" in world.status("tight")["reason"]
    assert world.max_num_seqs("tight") == 64


class CountingKube(KubernetesAdapter):
    """The real adapter, noting what it applies."""

    applied: list[str]

    def apply(self, obj: dict[str, Any]) -> None:
        self.applied.append(obj["kind"])
        super().apply(obj)


def test_a_steady_reconcile_applies_nothing_and_an_edit_is_put_back(
    world: Harness, cluster: DevCluster
) -> None:
    """What the apiserver stores reads back as rendered (its defaults around it), so a reconcile
    that changes nothing writes nothing; a field of ours someone edited is still put back."""
    assert world.apply("steady").returncode == 0
    kube = CountingKube(cluster.api_client())
    kube.applied = []
    ports = Ports(kube, prometheus_observer(OperatorSettings(prometheus_url=world.prometheus.url)))
    reconcile(world.ns, "steady", ports, datetime.now(UTC))
    assert sorted(kube.applied) == ["Deployment", "PodDisruptionBudget", "Service"]
    kube.applied.clear()
    reconcile(world.ns, "steady", ports, datetime.now(UTC))
    assert kube.applied == []

    world.kubectl(
        "patch",
        "service",
        "steady",
        "--type=merge",
        "-p",
        '{"spec":{"selector":{"batchknee.io/llmserving":"x"}}}',
    )
    reconcile(world.ns, "steady", ports, datetime.now(UTC))
    assert kube.applied == ["Service"]
    assert world.get("service", "steady")["spec"]["selector"] == {"batchknee.io/llmserving": "steady"}  # type: ignore[index]


def test_a_status_write_after_the_llmserving_went_finds_it_gone(world: Harness, cluster: DevCluster) -> None:
    """The apiserver's 404 for a deleted LLMServing names it (what the adapter tells apart from a
    404 for a missing resource): the write is "gone", no error, no object made again."""
    assert world.apply("brief").returncode == 0
    world.kubectl("delete", "llms", "brief", "--wait=true")
    kube = KubernetesAdapter(cluster.api_client())
    with pytest.raises(ObjectGone):
        kube.patch_status(world.ns, "brief", {"action": "hold"})
    assert world.get("llmserving", "brief") is None
