"""A hostile tenant on the local control plane: a user whose Role allows LLMServings in their
namespace and nothing else (no pods, no Deployments, no Secrets) must not get through the operator
what RBAC denies them.

Each hostile spec of the issue is refused at admission by the apiserver (the CRD schema and CEL, or
the requester ValidatingAdmissionPolicy from crds/), or by the operator with Degraded reason
Forbidden naming the field; either way no Deployment and no pod. The operator's pods pass the
`restricted` Pod Security Standard, enforced on the namespace by the apiserver's PodSecurity plugin.
The tenant is the user "tenant", reached through impersonation (`kubectl --as`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from test_operator import ROOT, Harness, crds, wait_for, world

from batchknee.api.crd import REQUESTER_POLICY_FILE, REQUESTER_POLICY_NAME
from batchknee.api.models import MAX_NAME_LENGTH
from batchknee.devcluster import DevCluster

__all__ = ["crds", "world"]  # the fixtures of test_operator.py, shared

TENANT = "tenant"


@pytest.fixture(scope="module")
def requester_policy(crds: None, cluster: DevCluster) -> None:
    # the same policy may be there from the chart's install (field manager helm): take it over
    path = str(ROOT / REQUESTER_POLICY_FILE)
    done = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", path, check=False)
    assert done.returncode == 0, done.stderr
    # the apiserver compiles a new policy a moment after it is stored: wait until it denies
    wait_for(
        lambda: (
            cluster.kubectl("get", "validatingadmissionpolicy", REQUESTER_POLICY_NAME, check=False).returncode
            == 0
        ),
        30,
        "the requester policy",
    )


def grant(world: Harness, name: str, rule: dict[str, Any], can_i: tuple[str, str]) -> None:
    """A Role with `rule` bound to the tenant; returns once the authorizer answers `can-i` yes."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name},
        "rules": [rule],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT}],
    }
    for obj in (role, binding):
        world.kubectl("apply", "-f", "-", input=json.dumps(obj))
    wait_for(
        lambda: world.kubectl("auth", "can-i", *can_i, f"--as={TENANT}", check=False).stdout.strip() == "yes",
        30,
        f"the tenant's {' '.join(can_i)}",
    )


@pytest.fixture
def tenant(world: Harness, requester_policy: None) -> Harness:
    """The namespace's tenant: LLMServings only."""
    every = ["get", "list", "watch", "create", "update", "patch", "delete"]
    rule = {"apiGroups": ["batchknee.io"], "resources": ["llmservings"], "verbs": every}
    grant(world, "llmserving-author", rule, ("create", "llmservings.batchknee.io"))
    denied = [("create", "pods"), ("create", "deployments.apps"), ("patch", "deployments.apps")]
    for verb, resource in [*denied, ("get", "secrets"), ("get", "configmaps")]:
        assert (
            world.kubectl("auth", "can-i", verb, resource, f"--as={TENANT}", check=False).stdout.strip()
            == "no"
        )
    return world


def manifest(world: Harness, name: str, **spec: Any) -> str:
    body: dict[str, Any] = {
        "engine": "VLLM",
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "gpu": {"type": "a100-80gb", "count": 1},
        "args": ["--state", str(world.state)],
        "tuning": {"evaluationIntervalSeconds": 5, "windowSeconds": 30},
        **spec,
    }
    return json.dumps(
        {
            "apiVersion": "batchknee.io/v1alpha1",
            "kind": "LLMServing",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def apply_as(world: Harness, user: str | None, name: str, *flags: str, **spec: Any) -> Any:
    who = [f"--as={user}"] if user else []
    return world.kubectl("apply", *who, *flags, "-f", "-", input=manifest(world, name, **spec), check=False)


SECRET_VOLUME = {
    "volumes": [{"name": "creds", "secret": {"secretName": "db"}}],
    "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
}
HOST_PATH = {
    "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
    "volumeMounts": [{"name": "root", "mountPath": "/host"}],
}
SECRET_ENV = {"env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]}
ROOT_USER = {"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}
PAYMENTS_PODS = {"labelSelector": {"matchLabels": {"app": "payments"}}, "topologyKey": "kubernetes.io/os"}
# no pod labelled app=payments, in any namespace, on any node of the engine's OS (every node)
KEEP_OUT = {
    "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{**PAYMENTS_PODS, "namespaceSelector": {}}]
    }
}
# (name, template, the field the operator names when an admin writes it)
GATED = [
    ("sa", {"serviceAccountName": "admin"}, "spec.template.serviceAccountName"),
    ("hostpath", HOST_PATH, "spec.template.volumes[0].hostPath"),
    ("secretvol", SECRET_VOLUME, "spec.template.volumes[0].secret"),
    ("secretenv", SECRET_ENV, "spec.template.env[0].valueFrom.secretKeyRef"),
    ("root", ROOT_USER, "spec.template.securityContext.runAsUser"),
    (
        "keepout",
        {"affinity": KEEP_OUT},
        "spec.template.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].namespaceSelector",
    ),
    (
        "nearpay",
        {
            "affinity": {
                "podAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "podAffinityTerm": {**PAYMENTS_PODS, "namespaces": ["payments"]}}
                    ]
                }
            }
        },
        "spec.template.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
        ".podAffinityTerm.namespaces",
    ),
    (
        "apparmor",
        {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}},
        "spec.template.annotations[container.apparmor.security.beta.kubernetes.io/engine]",
    ),
    ("allgpus", {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}, "spec.template.env[0].name"),
    # the same through a ConfigMap's keys (no prefix rules NVIDIA_VISIBLE_DEVICES out)
    ("cmgpus", {"envFrom": [{"configMapRef": {"name": "gpus"}}]}, "spec.template.envFrom[0].configMapRef"),
]

CLUSTER_WIDE = [
    ("prio", {"priorityClassName": "system-node-critical"}, "spec.template.priorityClassName"),
    ("tolerall", {"tolerations": [{"operator": "Exists"}]}, "spec.template.tolerations[0].key"),
    (
        "kvm",
        {"resources": {"limits": {"devices.kubevirt.io/kvm": "1"}}},
        "spec.template.resources.limits[devices.kubevirt.io/kvm]",
    ),
    ("label", {"labels": {"role": "db-client"}}, "spec.template.labels[role]"),
    (
        "multus",
        {"annotations": {"k8s.v1.cni.cncf.io/networks": "payments/payments-net"}},
        "spec.template.annotations[k8s.v1.cni.cncf.io/networks]",
    ),
]


def test_hostile_specs_are_refused_and_nothing_runs(tenant: Harness) -> None:
    world = tenant
    world.kubectl("create", "secret", "generic", "db", "--from-literal=password=hunter2")
    world.kubectl("create", "serviceaccount", "admin")
    world.start_operator()

    # The requester policy: the tenant may not write what they could not run as a pod themselves.
    for name, template, _ in GATED:
        done = apply_as(world, TENANT, f"t-{name}", template=template)
        assert done.returncode != 0, name
        assert "must be allowed to create pods" in done.stderr and TENANT in done.stderr, done.stderr

    # ...and the same anti-affinity within the namespace is the tenant's to write
    within = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [PAYMENTS_PODS]}}
    done = apply_as(world, TENANT, "within", "--dry-run=server", template={"affinity": within})
    assert done.returncode == 0, done.stderr

    # The schema and CEL: never expressible, for anyone.
    done = apply_as(world, TENANT, "priv", template={"containerSecurityContext": {"privileged": True}})
    assert done.returncode != 0 and "never runs privileged containers" in done.stderr, done.stderr
    done = apply_as(world, TENANT, "envnum", template={"env": [{"name": "WORKERS", "value": 5}]})
    assert done.returncode != 0 and "spec.template.env[0].value" in done.stderr, done.stderr
    done = apply_as(world, TENANT, "x" * (MAX_NAME_LENGTH + 1))
    assert done.returncode != 0 and f"at most {MAX_NAME_LENGTH} characters" in done.stderr, done.stderr
    done = apply_as(world, TENANT, "args", args=["--x"] * 65)
    assert done.returncode != 0 and "spec.args" in done.stderr, done.stderr
    done = apply_as(world, TENANT, "pinned", tuning={"mode": "Pinned", "pinnedMaxNumSeqs": 4})
    assert done.returncode != 0 and "spec.tuning.pinnedMaxNumSeqs" in done.stderr, done.stderr
    done = apply_as(world, TENANT, "ownkey", template={"labels": {"batchknee.io/llmserving": "chat"}})
    assert done.returncode != 0 and "spec.template.labels" in done.stderr, done.stderr
    assert "keys under batchknee.io/ (or spelled so" in done.stderr, done.stderr
    # ...spelled so that Prometheus reads it as the operator's (`-`, `.`, `/` all become `_`)
    done = apply_as(world, TENANT, "lookalike", template={"labels": {"batchknee-io/llmserving": "chat"}})
    assert done.returncode != 0 and "batchknee.io/ (or spelled so" in done.stderr, done.stderr
    # the engine Service takes the name: `kubernetes` would replace the API server's address in the
    # variables the kubelet gives the namespace's other pods, `vllm` set VLLM_PORT=tcp://… there
    for reserved in ("kubernetes", "vllm"):
        done = apply_as(world, TENANT, reserved)
        assert done.returncode != 0 and "must not be one of kubernetes" in done.stderr, done.stderr
        assert world.get("service", reserved) is None
    # affinity is typed like Kubernetes' own: a malformed term is refused where it is
    no_domain = {
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}
    }
    done = apply_as(world, TENANT, "nodomain", template={"affinity": no_domain})
    assert done.returncode != 0
    assert "requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey" in done.stderr, done.stderr
    no_values = {**PAYMENTS_PODS, "labelSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}}
    near = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [no_values]}}
    done = apply_as(world, TENANT, "novalues", template={"affinity": near})
    assert done.returncode != 0 and "operators In and NotIn need at least one value" in done.stderr, (
        done.stderr
    )
    # ...and label keys and values in Kubernetes' syntax (map keys through CEL, values by pattern)
    spaced = {**PAYMENTS_PODS, "labelSelector": {"matchLabels": {"app name": "payments"}}}
    done = apply_as(
        world,
        TENANT,
        "spaced",
        template={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spaced]}}},
    )
    assert (
        done.returncode != 0 and "each matchLabels key is an optional DNS-subdomain prefix" in done.stderr
    ), done.stderr
    done = apply_as(world, TENANT, "nodesel", template={"nodeSelector": {"gpu": "h100 80gb"}})
    assert done.returncode != 0 and "spec.template.nodeSelector.gpu" in done.stderr, done.stderr
    # a key's prefix is a DNS subdomain of at most 253 characters (the regex cannot bound it: CEL does)
    long_prefix = "a." * 126 + "ab/team"
    done = apply_as(world, TENANT, "longprefix", template={"labels": {long_prefix: "ml"}})
    assert done.returncode != 0 and "each spec.template.labels key" in done.stderr, done.stderr
    far = {**PAYMENTS_PODS, "topologyKey": long_prefix}
    done = apply_as(
        world,
        TENANT,
        "longtopology",
        template={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [far]}}},
    )
    assert done.returncode != 0 and "topologyKey: Invalid value" in done.stderr, done.stderr
    # host namespaces are not in the schema: a strict client is refused, a lax one is pruned
    done = apply_as(world, TENANT, "hostnet", template={"hostNetwork": True, "hostPID": True})
    assert done.returncode != 0 and "hostNetwork" in done.stderr, done.stderr
    assert (
        apply_as(world, TENANT, "hostnet", "--validate=false", template={"hostNetwork": True}).returncode == 0
    )

    # The operator: an image outside the allowed list (the tenant), and the gated fields written by a
    # namespace admin (admitted by the policy, refused by the operator's default settings).
    assert apply_as(world, TENANT, "image", image="evil.example/miner:latest").returncode == 0
    # Names outside the admin's patterns: a priority class that preempts everyone, a toleration of every
    # taint, a device, a pod label or annotation key (the requester policy admits them; the operator's
    # lists refuse them).
    for name, template, _ in CLUSTER_WIDE:
        assert apply_as(world, TENANT, name, template=template).returncode == 0, name
    for name, template, _ in GATED:
        done = apply_as(world, None, f"a-{name}", template=template)
        assert done.returncode == 0, done.stderr
    forbidden = [("image", "spec.image")] + [(name, field) for name, _, field in CLUSTER_WIDE]
    forbidden += [(f"a-{name}", field) for name, _, field in GATED]
    for name, field in forbidden:
        degraded = wait_for(
            lambda n=name: (c := world.condition(n, "Degraded")).get("reason") == "Forbidden" and c,
            60,
            f"{name} Degraded/Forbidden",
            world.log,
        )
        assert degraded["status"] == "True" and degraded["message"].startswith(f"{field}:"), degraded
    assert {e["involvedObject"]["name"] for e in world.events("Forbidden")} >= {n for n, _ in forbidden}

    # The allow-list still works for the tenant; its pod runs without host namespaces.
    assert wait_for(lambda: world.get("deployment", "hostnet"), 60, "the pruned spec's Deployment", world.log)
    stored = world.get("llmserving", "hostnet")
    assert stored is not None and "hostNetwork" not in stored["spec"]["template"]
    pod_spec = world.get("deployment", "hostnet")["spec"]["template"]["spec"]  # type: ignore[index]
    assert "hostNetwork" not in pod_spec and pod_spec["automountServiceAccountToken"] is False

    deployments = json.loads(world.kubectl("get", "deployments", "-o", "json").stdout)["items"]
    assert [d["metadata"]["name"] for d in deployments] == ["hostnet"]
    pods = json.loads(world.kubectl("get", "pods", "-o", "json").stdout)["items"]
    assert all(p["metadata"]["labels"].get("batchknee.io/llmserving") == "hostnet" for p in pods)


def test_an_enabled_field_still_needs_a_requester_who_could_create_the_pod(
    tenant: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = tenant
    world.kubectl("create", "serviceaccount", "engine")
    monkeypatch.setenv("BATCHKNEE_ALLOW_SERVICE_ACCOUNT", "true")
    world.start_operator()
    done = apply_as(world, TENANT, "sa", template={"serviceAccountName": "engine"})
    assert done.returncode != 0 and "must be allowed to create pods" in done.stderr, done.stderr
    assert apply_as(world, None, "sa", template={"serviceAccountName": "engine"}).returncode == 0
    dep = wait_for(lambda: world.get("deployment", "sa"), 60, "the Deployment", world.log)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "engine"
    # any edit of that spec by the tenant asks for the same pod again: refused
    patch = json.dumps({"spec": {"replicas": 2}})
    done = world.kubectl("patch", "llms", "sa", f"--as={TENANT}", "--type=merge", "-p", patch, check=False)
    assert done.returncode != 0 and "must be allowed to create pods" in done.stderr, done.stderr


def test_engine_pods_are_admitted_in_a_restricted_namespace(world: Harness) -> None:
    world.kubectl(
        "label",
        "namespace",
        world.ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    world.start_operator()
    assert world.apply("chat").returncode == 0

    def pods() -> list[dict[str, Any]]:
        done = world.kubectl("get", "pods", "-l", "batchknee.io/llmserving=chat", "-o", "json")
        return list(json.loads(done.stdout)["items"])

    def refusals() -> str:
        done = world.kubectl("get", "events", "--field-selector", "reason=FailedCreate", "-o", "json")
        return "\n".join(e["message"] for e in json.loads(done.stdout)["items"])

    wait_for(pods, 90, "an engine pod admitted under the restricted profile", refusals)
    wait_for(lambda: world.condition("chat", "Ready").get("status") == "True", 90, "Ready", world.log)
    assert refusals() == ""


SHARED_CONFIG = "platform-config"
CONFIG_MAP_READS = {
    "env": {
        "env": [{"name": "TOKEN", "valueFrom": {"configMapKeyRef": {"name": SHARED_CONFIG, "key": "token"}}}]
    },
    "envfrom": {"envFrom": [{"prefix": "PLATFORM_", "configMapRef": {"name": SHARED_CONFIG}}]},
    "volume": {
        "volumes": [{"name": "config", "configMap": {"name": SHARED_CONFIG}}],
        "volumeMounts": [{"name": "config", "mountPath": "/config"}],
    },
}


def test_a_configmap_the_requester_may_not_read_is_refused(tenant: Harness) -> None:
    """The engine pod reads a ConfigMap for whoever wrote its spec, and the value could come back to
    them through the engine's args (`$(TOKEN)` in a served model name) or API: a tenant who may not get
    a ConfigMap is refused a spec that reads it, naming it; granted get on that one ConfigMap, the
    same specs are admitted and deployed, and one more reference, to another, is refused again."""
    world = tenant
    world.kubectl("create", "configmap", SHARED_CONFIG, "--from-literal=token=abc")
    world.kubectl("create", "configmap", "other", "--from-literal=x=y")
    world.start_operator()
    for name, template in CONFIG_MAP_READS.items():
        done = apply_as(world, TENANT, f"cm-{name}", template=template)
        assert done.returncode != 0, name
        assert f"read ConfigMap(s) {SHARED_CONFIG} (" in done.stderr and TENANT in done.stderr, done.stderr
    assert not world.get("llmserving", "cm-env")

    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [SHARED_CONFIG],
        "verbs": ["get"],
    }
    grant(world, "platform-config-reader", rule, ("get", f"configmap/{SHARED_CONFIG}"))
    for name, template in CONFIG_MAP_READS.items():
        done = apply_as(world, TENANT, f"cm-{name}", template=template)
        assert done.returncode == 0, done.stderr
    other = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "other", "key": "x"}}}
    both = {"env": [*CONFIG_MAP_READS["env"]["env"], other]}
    done = apply_as(world, TENANT, "cm-both", template=both)
    assert done.returncode != 0 and f"read ConfigMap(s) {SHARED_CONFIG}, other (" in done.stderr, done.stderr

    dep = wait_for(lambda: world.get("deployment", "cm-env"), 60, "the Deployment", world.log)
    engine = dep["spec"]["template"]["spec"]["containers"][0]
    token = {"name": "TOKEN", "valueFrom": {"configMapKeyRef": {"name": SHARED_CONFIG, "key": "token"}}}
    assert token in engine["env"], engine["env"]


def test_adopting_a_workload_needs_a_requester_who_may_patch_it(tenant: Harness) -> None:
    """A workload wired for batchknee consents to the operator setting its batch limit, not to every
    LLMServing writer of the namespace doing so: a tenant who may not patch it is refused a
    targetRef to it, naming it; the namespace's admin, or the tenant once granted patch on that one
    Deployment, is admitted."""
    world = tenant
    target = {"kind": "Deployment", "name": "team-b-engine"}
    same_name = {"kind": "StatefulSet", "name": "team-b-engine"}
    done = apply_as(world, TENANT, "adopt", args=[], targetRef=target)
    assert done.returncode != 0, done.stdout
    assert "spec.targetRef hands the batch limit of Deployment team-b-engine" in done.stderr, done.stderr
    assert TENANT in done.stderr and not world.get("llmserving", "adopt")
    statefulset = apply_as(world, TENANT, "adopt-sts", args=[], targetRef=same_name)
    assert statefulset.returncode != 0 and "StatefulSet team-b-engine" in statefulset.stderr, (
        statefulset.stderr
    )

    rule = {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "resourceNames": ["team-b-engine"],
        "verbs": ["patch"],
    }
    grant(world, "team-b-engine-patcher", rule, ("patch", "deployment/team-b-engine"))
    done = apply_as(world, TENANT, "adopt", args=[], targetRef=target)
    assert done.returncode == 0, done.stderr
    # the grant is for the Deployment only, not a StatefulSet of the same name; the admin may
    assert apply_as(world, TENANT, "adopt-sts", args=[], targetRef=same_name).returncode != 0
    assert apply_as(world, None, "adopt-sts", args=[], targetRef=same_name).returncode == 0


@pytest.fixture
def deep_json() -> Iterator[None]:
    """This test's own reads of the namespace's objects (kubectl -o json) parse the deep one too."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(12_000)
    yield
    sys.setrecursionlimit(limit)


def test_a_spec_nested_past_pythons_recursion_limit_stops_no_watch(tenant: Harness, deep_json: None) -> None:
    """Free-form JSON (extraLlmApiOptions) nested 5,000 levels: the apiserver stores it,
    and kopf's json.loads of that watch event used to raise RecursionError, which ended every
    watch — no LLMServing of any tenant reconciled, and the restarted operator failed again on its
    first list. Now the tenant's spec is InvalidSpec naming the field, and the others run."""
    world = tenant
    levels = 5_000
    deep = '{"a":' * levels + "1" + "}" * levels  # (json.dumps would recurse past the limit here)
    text = manifest(world, "deep", extraLlmApiOptions="@deep@").replace('"@deep@"', deep)
    done = world.kubectl("apply", f"--as={TENANT}", "-f", "-", input=text, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    world.start_operator()
    assert apply_as(world, TENANT, "chat").returncode == 0
    wait_for(lambda: world.get("deployment", "chat"), 60, "the other LLMServing's Deployment", world.log)
    invalid = wait_for(
        lambda: (c := world.condition("deep", "Degraded")).get("reason") == "InvalidSpec" and c,
        60,
        "deep Degraded/InvalidSpec",
        world.log,
    )
    assert invalid["message"].startswith("spec.extraLlmApiOptions: nested 5001 levels deep"), invalid
    assert world.get("deployment", "deep") is None
    assert world.operator is not None and world.operator.poll() is None  # still running
