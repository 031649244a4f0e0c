"""Adoption on the local control plane with real tools: a team's own Helm chart deploys the engine,
an LLMServing with spec.targetRef retunes it as traffic shifts by one env entry, `helm upgrade` and
another field manager's server-side apply keep it, and deleting the LLMServing leaves the workload.
Also: the scale subresource, read by the real controller-manager's HPA controller."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_chart import helm
from test_operator import Harness, crds, retuned_for_8192, state_for, wait_for, world

from batchknee.api.models import TARGET_ENV_VAR
from batchknee.devcluster import DevCluster

__all__ = ["crds", "world"]

USER_CHART = Path(__file__).parents[1] / "charts" / "user-vllm"
FAST = {"evaluationIntervalSeconds": 5, "windowSeconds": 30, "cooldownSeconds": 0, "deadBandPercent": 10}


def env_of(world: Harness, kind: str, name: str) -> dict[str, str]:
    workload = world.get(kind, name)
    assert workload is not None
    [container] = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def adopt(world: Harness, name: str, target: dict[str, Any], **tuning: Any) -> None:
    manifest = {
        "apiVersion": "batchknee.io/v1alpha1",
        "kind": "LLMServing",
        "metadata": {"name": name},
        "spec": {
            "engine": "VLLM",
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "gpu": {"type": "a100-80gb", "count": 1},
            "targetRef": {"apiVersion": "apps/v1", **target},
            "tuning": {**FAST, **tuning},
        },
    }
    done = world.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
    assert done.returncode == 0, done.stderr


def managers(world: Harness, kind: str, name: str) -> dict[str, str]:
    """Each field manager of the workload and what it owns of the engine container's env."""
    workload = json.loads(world.kubectl("get", kind, name, "-o", "json", "--show-managed-fields").stdout)
    owned = {}
    for entry in workload["metadata"]["managedFields"]:
        fields = json.dumps(entry.get("fieldsV1", {}))
        owned[entry["manager"]] = fields
    return owned


@pytest.mark.timeout(420)
def test_a_helm_installed_engine_is_retuned_and_keeps_its_value(
    world: Harness, cluster: DevCluster, tmp_path: Path
) -> None:
    def install(*values: str, command: str = "install") -> None:
        helm(
            cluster,
            tmp_path,
            command,
            "chat",
            str(USER_CHART),
            "-n",
            world.ns,
            "--set",
            f"statePath={world.state}",
            *values,
        )

    install()
    world.start_operator()
    adopt(world, "chat-tuner", {"kind": "Deployment", "name": "chat"})

    wait_for(
        lambda: env_of(world, "deployment", "chat").get(TARGET_ENV_VAR) == "64",
        60,
        "the env at 64",
        world.log,
    )
    wired = world.condition("chat-tuner", "Wired")
    assert wired["status"] == "True", wired
    # a second LLMServing for the same workload writes nothing and names the first (read from the
    # operator's index of adopted workloads, kept from its watch)
    adopt(world, "chat-tuner-too", {"kind": "Deployment", "name": "chat"})
    second = wait_for(
        lambda: (c := world.condition("chat-tuner-too", "Wired")).get("reason") == "AlreadyTargeted" and c,
        60,
        "the second LLMServing refused",
        world.log,
    )
    assert second["status"] == "False" and "already tuned by LLMServing chat-tuner" in second["message"]
    world.kubectl("delete", "llms", "chat-tuner-too", "--wait=true")
    wait_for(lambda: world.condition("chat-tuner", "Ready").get("status") == "True", 120, "Ready", world.log)

    # observed through the workload's own selector: its pods are `chat-<hash>-<hash>`, counted as 2
    # once Prometheus scrapes both pods of the roll to 64 (an observation taken mid-roll sees one)
    def both_pods_observed() -> dict[str, Any] | None:
        observed = world.status("chat-tuner").get("observed") or {}
        return observed if observed.get("pods") == 2 else None

    observed = wait_for(both_pods_observed, 120, "an observation of both pods", world.log)
    assert observed["pods"] == 2 and observed["avgContextLength"] == 2048

    world.set_state(state_for(8192))
    final = wait_for(
        lambda: retuned_for_8192(world.status("chat-tuner")), 150, "the retune for 8,192", world.log
    )
    assert env_of(world, "deployment", "chat").get(TARGET_ENV_VAR) == str(final)
    deployment = world.get("deployment", "chat")
    assert deployment is not None
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)" in args  # the user's args, untouched
    assert not deployment["metadata"].get("ownerReferences")  # the workload stays the user's
    assert TARGET_ENV_VAR in managers(world, "deployment", "chat")["batchknee"]
    assert "VLLM_LOGGING_LEVEL" not in managers(world, "deployment", "chat")["batchknee"]
    world.stop_operator()  # from here on, what other tools do to the value

    # helm upgrade with an unrelated change: helm's three-way merge patches only what the chart
    # changed (the log level); the env entry the chart never rendered is kept
    install("--set", "logLevel=debug", command="upgrade")
    env = env_of(world, "deployment", "chat")
    assert env == {"VLLM_LOGGING_LEVEL": "DEBUG", TARGET_ENV_VAR: str(final)}, env

    # another field manager (GitOps) applies server-side: no conflict, the value stays
    gitops = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "annotations": {"example.com/owner": "ml-platform"}},
    }
    done = world.kubectl(
        "apply",
        "--server-side",
        "--field-manager=argocd-controller",
        "-f",
        "-",
        input=json.dumps(gitops),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert env_of(world, "deployment", "chat")[TARGET_ENV_VAR] == str(final)

    # deleting the LLMServing leaves the workload running with its last value
    world.start_operator()
    world.kubectl("delete", "llms", "chat-tuner", "--wait=true")
    assert env_of(world, "deployment", "chat")[TARGET_ENV_VAR] == str(final)
    assert world.get("deployment", "chat")["spec"]["replicas"] == 2  # type: ignore[index]


def test_an_unwired_chart_gets_the_exact_argument_and_no_write(
    world: Harness, cluster: DevCluster, tmp_path: Path
) -> None:
    helm(
        cluster,
        tmp_path,
        "install",
        "plain",
        str(USER_CHART),
        "-n",
        world.ns,
        "--set",
        f"statePath={world.state}",
        "--set",
        "wireBatchknee=false",
    )
    before = world.get("deployment", "plain")
    world.start_operator()
    adopt(world, "plain-tuner", {"kind": "Deployment", "name": "plain"})
    wired = wait_for(
        lambda: (c := world.condition("plain-tuner", "Wired")).get("status") == "False" and c,
        60,
        "Wired=False",
        world.log,
    )
    assert wired["reason"] == "ArgsDoNotReferenceVariable"
    assert "--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)" in wired["message"]
    wait_for(lambda: world.status("plain-tuner").get("recommendedMaxNumSeqs") == 64, 60, "a recommendation")
    after = world.get("deployment", "plain")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]  # type: ignore[index]
    assert TARGET_ENV_VAR not in env_of(world, "deployment", "plain")


def test_a_statefulset_is_adopted_and_observed_by_its_selector(world: Harness) -> None:
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 1,
            "serviceName": "engine",
            "selector": {"matchLabels": {"app": "engine"}},
            "template": {
                "metadata": {"labels": {"app": "engine"}},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"],
                            "args": ["--state", str(world.state), "--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)"],
                            "ports": [{"name": "http", "containerPort": 8000}],  # what a PodMonitor scrapes
                        }
                    ]
                },
            },
        },
    }
    world.kubectl("apply", "-f", "-", input=json.dumps(statefulset))
    world.start_operator()
    adopt(world, "engine-tuner", {"kind": "StatefulSet", "name": "engine"})
    wait_for(
        lambda: env_of(world, "statefulset", "engine").get(TARGET_ENV_VAR) == "64", 60, "the env", world.log
    )
    observed = wait_for(
        lambda: world.status("engine-tuner").get("observed"),
        120,
        "an observation of engine-0",
        lambda: json.dumps(world.status("engine-tuner"), indent=1) + world.log(),
    )
    assert observed["pods"] == 1


def test_kubectl_scale_and_an_hpa_use_the_scale_subresource(world: Harness) -> None:
    world.start_operator()
    assert world.apply("scaled", replicas=1).returncode == 0
    wait_for(lambda: world.get("deployment", "scaled"), 60, "the Deployment", world.log)
    world.kubectl("scale", "llms/scaled", "--replicas=2")
    wait_for(lambda: world.get("deployment", "scaled")["spec"]["replicas"] == 2, 60, "2 replicas", world.log)  # type: ignore[index]
    wait_for(
        lambda: world.status("scaled").get("selector") == "batchknee.io/llmserving=scaled",
        60,
        "status.selector",
    )

    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "scaled"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "batchknee.io/v1alpha1", "kind": "LLMServing", "name": "scaled"},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
                }
            ],
        },
    }
    world.kubectl("apply", "-f", "-", input=json.dumps(hpa))

    def able_to_scale() -> dict[str, Any] | None:
        found = world.get("hpa", "scaled") or {}
        return next(
            (c for c in (found.get("status") or {}).get("conditions", []) if c["type"] == "AbleToScale"), None
        )

    condition = wait_for(able_to_scale, 90, "the HPA's AbleToScale condition")
    assert condition["status"] == "True", condition


def test_replicas_left_to_another_manager_are_never_reverted(world: Harness) -> None:
    world.start_operator()
    assert world.apply("free").returncode == 0  # no spec.replicas: whoever scales the Deployment owns it
    wait_for(lambda: world.get("deployment", "free"), 60, "the Deployment", world.log)
    world.kubectl("scale", "deployment/free", "--replicas=3")
    world.set_state(state_for(8192))  # a retune re-applies the Deployment
    final = wait_for(lambda: retuned_for_8192(world.status("free")), 150, "the retune", world.log)
    assert world.max_num_seqs("free") == final
    assert world.get("deployment", "free")["spec"]["replicas"] == 3  # type: ignore[index]
