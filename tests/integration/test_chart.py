"""The Helm chart on the local control plane, and the operator running with the chart's identity.

There is no container runtime for the operator's image, so the chart's operator pods are scheduled
and marked running by the test kubelet without a process; the operator runs here as a local process
with the environment of the chart's Deployment and the token of the chart's ServiceAccount (a
kubeconfig from `kubectl create token`). Its RBAC is proven three ways: `kubectl auth can-i
--as=<the ServiceAccount>` for every call in tests/support/operator_rbac.py (yes) and for calls the
operator never makes (no); the operator through a retune with Prometheus; and the apiserver's audit log
of that identity: no request denied, none outside the table, every entry used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_rbac import (
    ADMISSION_CHECKED,
    CLUSTER_SCOPED,
    Permission,
    granted,
    operator_calls,
    required,
    wildcards,
)
from test_operator import KOPF_FINALIZER, Harness, retuned_for_8192, state_for, wait_for

from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "batchknee"
CRDS = ROOT / "crds"
RELEASE = "bk"
FULLNAME = f"{RELEASE}-batchknee"

# Calls the operator never makes: the chart must not allow them (a sample, namespaced and cluster-wide).
NEVER: list[tuple[str, str, str | None]] = [  # (verb, resource, subresource)
    ("delete", "deployments.apps", None),
    ("patch", "pods", None),
    ("update", "deployments.apps", None),
    ("deletecollection", "deployments.apps", None),
    ("delete", "llmservings.batchknee.io", None),
    ("create", "llmservings.batchknee.io", None),
    ("update", "llmservings.batchknee.io", "status"),
    ("get", "secrets", None),
    ("list", "secrets", None),
    ("get", "pods", None),
    ("create", "pods", "exec"),
    ("watch", "pods", None),
    ("delete", "services", None),
    ("create", "serviceaccounts", "token"),
    ("list", "nodes", None),
    ("list", "namespaces", None),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", None),
    ("impersonate", "users", None),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io", None),
    ("delete", "clusterkopfpeerings.kopf.dev", None),
]


# --- helm, identities, audit -----------------------------------------------------------------------


def trt_options(harness: Harness) -> list[str]:
    """The options ConfigMaps of the LLMServing `trt`."""
    selector = "batchknee.io/llmserving=trt,app.kubernetes.io/component=engine-config"
    done = harness.kubectl("get", "configmap", "-l", selector, "-o", "json", check=False)
    return [i["metadata"]["name"] for i in json.loads(done.stdout)["items"]] if done.returncode == 0 else []


def mounted_options(harness: Harness, name: str) -> str:
    """The options file the Deployment's current revision mounts ('' until there is one)."""
    dep = harness.get("deployment", name)
    volumes = dep["spec"]["template"]["spec"].get("volumes", []) if dep else []
    config = next((v["configMap"]["name"] for v in volumes if "configMap" in v), None)
    found = harness.get("configmap", config) if config else None
    return str(found["data"]["engine.yaml"]) if found else ""


def helm(cluster: DevCluster, tmp: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = cluster.helm(*args, home=tmp / "helm", check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def adopt_crds(cluster: DevCluster, namespace: str) -> None:
    """CRDs (and the requester policy) another test applied with kubectl: mark them as this release's so helm adopts them (helm's
    documented adoption: the managed-by label and the release annotations)."""
    for path in CRDS.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            name = f"{doc['kind'].lower()}/{doc['metadata']['name']}"  # the CRDs and the requester policy
            if cluster.kubectl("get", name, check=False).returncode != 0:
                continue
            cluster.kubectl("label", "--overwrite", name, "app.kubernetes.io/managed-by=Helm")
            cluster.kubectl(
                "annotate",
                "--overwrite",
                name,
                f"meta.helm.sh/release-name={RELEASE}",
                f"meta.helm.sh/release-namespace={namespace}",
            )


def can_i(
    cluster: DevCluster, user: str, verb: str, resource: str, namespace: str | None, sub: str | None = None
) -> bool:
    argv = ["auth", "can-i", verb, resource, f"--as={user}"]
    argv += ["-n", namespace] if namespace else []
    argv += [f"--subresource={sub}"] if sub else []
    done = cluster.kubectl(*argv, check=False)
    answer = done.stdout.strip()
    assert answer in ("yes", "no"), done.stderr
    return answer == "yes"


def resource_arg(permission: Permission) -> tuple[str, str | None]:
    """kubectl's spelling: resource.group[/name], and the subresource."""
    resource, _, sub = permission.resource.partition("/")
    qualified = f"{resource}.{permission.group}" if permission.group else resource
    if permission.name:
        qualified += f"/{permission.name}"
    return qualified, sub or None


# With OwnerReferencesPermissionEnforcement on, the apiserver maps each owner reference's kind to its
# resource through a cache it refreshes on its own: for the seconds after the chart installs the CRD,
# an owner reference to an LLMServing is refused with this (a 403 that is not about permissions;
# the operator applies again at its next evaluation).
MAPPER_LAG = "cannot set blockOwnerDeletion in this case because cannot find RESTMapping"


def mapper_lag(event: dict[str, Any]) -> bool:
    return MAPPER_LAG in event.get("responseStatus", {}).get("message", "")


def audited(cluster: DevCluster, user: str) -> list[dict[str, Any]]:
    """The identity's resource requests from the audit log (discovery and /version left out)."""
    return [e for e in cluster.audit_events(user) if e.get("objectRef", {}).get("resource")]


def permission_of(event: dict[str, Any]) -> Permission:
    ref = event["objectRef"]
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return Permission(ref.get("apiGroup", ""), resource, event["verb"], "", ref["resource"] in CLUSTER_SCOPED)


def covered(event: dict[str, Any], allowed: set[Permission]) -> Permission | None:
    """The table entry that allows this request (a name-restricted one only for that name)."""
    base = permission_of(event)
    name = event["objectRef"].get("name", "")
    for candidate in (base, Permission(base.group, base.resource, base.verb, name, base.cluster_scoped)):
        if candidate in allowed and (not candidate.name or candidate.name == name):
            return candidate
    return None


def used(events: list[dict[str, Any]], allowed: set[Permission]) -> set[Permission]:
    """The table entries the requests exercised. A server-side apply that created its object (a PATCH
    answered 201) exercised `create` as well: the apiserver authorizes both."""
    found = {covered(e, allowed) for e in events}
    for event in events:
        if event["verb"] == "patch" and event.get("responseStatus", {}).get("code") == 201:
            base = permission_of(event)
            found.add(Permission(base.group, base.resource, "create", "", base.cluster_scoped))
    return {p for p in found if p is not None}


# --- the installed chart and its operator ----------------------------------------------------------


@dataclass
class Installed:
    cluster: DevCluster
    namespace: str
    tmp: Path
    notes: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{FULLNAME}"

    def deployment_env(self) -> dict[str, str]:
        dep = json.loads(
            self.cluster.kubectl("get", "deployment", FULLNAME, "-n", self.namespace, "-o", "json").stdout
        )
        [container] = dep["spec"]["template"]["spec"]["containers"]
        assert container["args"] == ["operator"]
        return {e["name"]: e.get("value", "") for e in container["env"]}  # "" comes back absent

    def start_operator(self, harness: Harness, prometheus: LocalPrometheus) -> tuple[int, int]:
        """The chart's operator as a local process: the Deployment's env, the ServiceAccount's token;
        /metrics and /healthz on loopback ports instead of 0.0.0.0. Returns (metrics, health) ports."""
        env = dict(os.environ)
        env.pop("KUBECONFIG", None)
        env.update(self.deployment_env())
        metrics_port, health_port = free_port(), free_port()
        env.update(
            KUBECONFIG=str(
                self.cluster.service_account_kubeconfig(self.namespace, FULLNAME, self.tmp / "sa.kubeconfig")
            ),
            BATCHKNEE_PROMETHEUS_URL=prometheus.url,
            BATCHKNEE_METRICS_ADDRESS="127.0.0.1",
            BATCHKNEE_METRICS_PORT=str(metrics_port),
            BATCHKNEE_HEALTH_ADDRESS="127.0.0.1",
            BATCHKNEE_HEALTH_PORT=str(health_port),
        )
        log = (self.tmp / "operator.log").open("ab")
        harness.operator = subprocess.Popen(
            [sys.executable, "-m", "batchknee", "operator"],  # the image's ENTRYPOINT + the chart's args
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.tmp,
        )
        return metrics_port, health_port


def install(cluster: DevCluster, namespace: str, tmp: Path, values: dict[str, Any]) -> Installed:
    if values.get("crds", {}).get("enabled", True):
        adopt_crds(cluster, namespace)
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm(
        cluster, tmp, "install", RELEASE, str(CHART), "--namespace", namespace, "--values", str(path),
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    return Installed(cluster, namespace, tmp, done.stdout.split("NOTES:", 1)[-1])


@pytest.fixture
def uninstall(cluster: DevCluster, tmp_path: Path) -> Iterator[list[str]]:
    """Namespaces whose release to uninstall afterwards (the CRDs stay: helm.sh/resource-policy keep)."""
    namespaces: list[str] = []
    yield namespaces
    for namespace in namespaces:
        helm(cluster, tmp_path, "uninstall", RELEASE, "--namespace", namespace, "--wait", check=False)


def monitoring_crds(cluster: DevCluster) -> None:
    """Stand-ins for the Prometheus Operator's ServiceMonitor and PodMonitor CRDs (schema-less: the
    chart's monitors are checked field by field in tests/package); enough for helm to install them."""
    for kind in ("ServiceMonitor", "PodMonitor"):
        plural = f"{kind.lower()}s"
        crd = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com"},
            "spec": {
                "group": "monitoring.coreos.com",
                "names": {
                    "kind": kind,
                    "plural": plural,
                    "singular": kind.lower(),
                    "listKind": f"{kind}List",
                },
                "scope": "Namespaced",
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                ],
            },
        }
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd))
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{plural}.monitoring.coreos.com", "--timeout=180s"
        )


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as response:  # loopback only
        return response.status, response.read().decode()


def dashboard_queries() -> list[str]:
    board = json.loads((CHART / "dashboards" / "batchknee.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_the_chart_installs_and_its_service_account_runs_the_operator_through_a_retune(
    cluster: DevCluster, namespace: str, prometheus: LocalPrometheus, tmp_path: Path, uninstall: list[str]
) -> None:
    values = {"replicaCount": 2, "operator": {"prometheusUrl": prometheus.url}}
    installed = install(cluster, namespace, tmp_path, values)
    uninstall.append(namespace)
    assert "peering mandatory" in installed.notes and "watching the whole cluster" in installed.notes

    # the objects, as the apiserver stores them
    crd = json.loads(cluster.kubectl("get", "crd", "llmservings.batchknee.io", "-o", "json").stdout)
    committed = yaml.safe_load((CRDS / "batchknee.io_llmservings.yaml").read_text())
    assert crd["spec"]["versions"] == committed["spec"]["versions"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev", "--timeout=180s"
    )
    role = json.loads(cluster.kubectl("get", "clusterrole", FULLNAME, "-o", "json").stdout)
    assert wildcards(role["rules"]) == []
    assert granted(role["rules"]) == required(cluster_wide=True, peering=True)

    # the apiserver's answers for the chart's ServiceAccount
    user = installed.user
    calls = operator_calls(cluster_wide=True, peering=True)
    wait_for(
        lambda: can_i(cluster, user, "list", "llmservings.batchknee.io", namespace), 30, "RBAC in effect"
    )
    for call in calls:
        resource, sub = resource_arg(call.permission)
        scope = None if call.permission.cluster_scoped else namespace
        assert can_i(cluster, user, call.permission.verb, resource, scope, sub), (call.permission, call.who)
        if not call.permission.cluster_scoped:  # cluster-wide: every namespace
            assert can_i(cluster, user, call.permission.verb, resource, "default", sub), call.permission
    for verb, resource, sub in NEVER:
        assert not can_i(cluster, user, verb, resource, namespace, sub), (verb, resource, sub)
    assert not can_i(cluster, user, "patch", "clusterkopfpeerings.kopf.dev/someone-else", None)

    # the operator with that identity, through one retune
    harness = Harness(cluster, namespace, prometheus, tmp_path)
    # an object an older build left with its kopf finalizer: the one patch of an LLMServing left
    # to the operator (kopf removes a finalizer no handler needs) — an upgrade must not 403
    assert harness.apply("upgraded", tuning={"mode": "Recommend"}).returncode == 0
    harness.kubectl(
        "patch",
        "llms",
        "upgraded",
        "--type=merge",
        "-p",
        json.dumps({"metadata": {"finalizers": [KOPF_FINALIZER]}}),
    )
    try:
        metrics_port, health_port = installed.start_operator(harness, prometheus)
        assert harness.apply("chat").returncode == 0
        wait_for(
            lambda: (
                KOPF_FINALIZER
                not in ((harness.get("llmserving", "upgraded") or {})["metadata"].get("finalizers") or [])
            ),
            90,
            "the older build's finalizer removed",
            harness.log,
        )
        wait_for(lambda: harness.max_num_seqs("chat") == 64, 90, "the Deployment at 64", harness.log)
        wait_for(lambda: harness.condition("chat", "Ready").get("status") == "True", 90, "Ready", harness.log)
        wait_for(
            lambda: harness.status("chat").get("observed", {}).get("avgContextLength"), 90, "an observation"
        )
        # TensorRT-LLM: the options ConfigMap (the only call of its kind); Recommend: never rolls
        trt = harness.apply("trt", engine="TensorRTLLM", tuning={"mode": "Recommend"})
        assert trt.returncode == 0, trt.stderr
        harness.set_state(state_for(8192))
        final = wait_for(
            lambda: retuned_for_8192(harness.status("chat")), 180, "the retune for 8,192", harness.log
        )
        assert harness.max_num_seqs("chat") == final
        wait_for(lambda: len(trt_options(harness)) == 1, 60, "the TensorRT-LLM options", harness.log)
        for fraction in (0.5, 0.6, 0.7):  # each spec change a new immutable file; past three, the oldest go
            changed = harness.apply(
                "trt",
                engine="TensorRTLLM",
                tuning={"mode": "Recommend"},
                extraLlmApiOptions={"kv_cache_config": {"free_gpu_memory_fraction": fraction}},
            )
            assert changed.returncode == 0, changed.stderr
            wait_for(
                lambda f=fraction: f"free_gpu_memory_fraction: {f}" in mounted_options(harness, "trt"),
                60,
                f"the TensorRT-LLM options at {fraction}",
                harness.log,
            )
        wait_for(
            lambda: len(trt_options(harness)) == 3, 60, "three TensorRT-LLM option files kept", harness.log
        )
        # an adopted StatefulSet (spec.targetRef): read, and its one env entry applied
        adopted = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "own"},
            "spec": {
                "replicas": 0,
                "serviceName": "own",
                "selector": {"matchLabels": {"app": "own"}},
                "template": {
                    "metadata": {"labels": {"app": "own"}},
                    "spec": {
                        "containers": [
                            {
                                "name": "vllm",
                                "image": "vllm/vllm-openai:v0.11.0",
                                "args": ["--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)"],
                            }
                        ]
                    },
                },
            },
        }
        harness.kubectl("apply", "-f", "-", input=json.dumps(adopted))
        tuner = {
            "apiVersion": "batchknee.io/v1alpha1",
            "kind": "LLMServing",
            "metadata": {"name": "own-tuner"},
            "spec": {
                "engine": "VLLM",
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                "gpu": {"type": "a100-80gb"},
                "targetRef": {"kind": "StatefulSet", "name": "own"},
            },
        }
        harness.kubectl("apply", "-f", "-", input=json.dumps(tuner))
        wait_for(
            lambda: "BATCHKNEE_MAX_NUM_SEQS" in json.dumps(harness.get("statefulset", "own")),
            60,
            "the adopted StatefulSet's env",
            harness.log,
        )
        assert harness.events("Retuned")

        assert get(f"http://127.0.0.1:{health_port}/healthz")[0] == 200
        applied = f'batchknee_max_num_seqs{{name="chat",namespace="{namespace}"}} 16.0'
        text = wait_for(
            lambda: applied in (page := get(f"http://127.0.0.1:{metrics_port}/metrics")[1]) and page,
            30,
            applied,
        )
        assert f'batchknee_observed_context_tokens{{name="chat",namespace="{namespace}"}}' in text
        log = (tmp_path / "operator.log").read_text(errors="replace")
        # RBAC denials only: a cluster-wide operator also meets other tests' namespaces being deleted,
        # where the apiserver refuses new content with a 403 that is not about permissions
        assert "is forbidden: User" not in log and "Not enough permissions" not in log, log[-3000:]
    finally:
        harness.stop_operator()

    # the audit log of that identity: nothing denied, nothing outside the table, every entry used
    events = audited(cluster, user)
    denied = [
        (e["verb"], e["requestURI"])
        for e in events
        if e.get("responseStatus", {}).get("code") == 403
        and "being terminated" not in e.get("responseStatus", {}).get("message", "")
        and not mapper_lag(e)
    ]
    assert denied == []
    table = {c.permission for c in calls}
    outside = sorted(
        {(e["verb"], e["requestURI"].split("?")[0]) for e in events if covered(e, table) is None}
    )
    assert outside == [], outside
    unused = table - used(events, table) - ADMISSION_CHECKED
    assert unused == set(), f"granted but never used: {sorted(unused)}"
    assert reads_after_the_last_write(events, namespace, "chat") == {"services": 0, "poddisruptionbudgets": 0}

    # every dashboard query is valid PromQL on a real Prometheus
    for expr in dashboard_queries():
        query = re.sub(r"\$\{?(namespace|llmserving)\}?", ".*", expr).replace("$__rate_interval", "1m")
        query = re.sub(r"^label_values\((.*), \w+\)$", r"\1", query)
        status, body = get(f"{prometheus.url}/api/v1/query?{urllib.parse.urlencode({'query': query})}")
        assert status == 200 and json.loads(body)["status"] == "success", (query, body)


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def reads_after_the_last_write(events: list[dict[str, Any]], namespace: str, name: str) -> dict[str, int]:
    """GETs of the engine Service and budget that reached the apiserver once the watch had had time to
    bring the operator's last write of each back (the cache's write wait, 10 s, and 5 s more): a steady
    reconcile reads them from the watch. Checked only where reconciles went on after that."""
    found = {}
    for resource in ("services", "poddisruptionbudgets"):
        mine = [
            e
            for e in events
            if e["objectRef"].get("resource") == resource
            and e["objectRef"].get("namespace") == namespace
            and e["objectRef"].get("name") == name
        ]
        writes = [_time(e["requestReceivedTimestamp"]) for e in mine if e["verb"] == "patch"]
        assert writes, f"the operator never applied its {resource}"
        quiet = max(writes) + timedelta(seconds=15)
        later_status_writes = [
            e
            for e in events
            if e["objectRef"].get("subresource") == "status"
            and e["objectRef"].get("name") == name
            and _time(e["requestReceivedTimestamp"]) > quiet
        ]
        assert len(later_status_writes) >= 3, "too few reconciles after the last write to tell"
        found[resource] = sum(
            1 for e in mine if e["verb"] == "get" and _time(e["requestReceivedTimestamp"]) > quiet
        )
    return found


@pytest.mark.timeout(300)
def test_a_namespaced_install_needs_nothing_cluster_scoped(
    cluster: DevCluster, namespace: str, prometheus: LocalPrometheus, tmp_path: Path, uninstall: list[str]
) -> None:
    """watchNamespaces: a Role in the watched namespace, no ClusterRole; the operator (standalone,
    kopf's cluster scanning off) deploys an engine with only that, and its audit trail stays there."""
    cluster.kubectl(
        "apply", "--server-side", "-f", str(CRDS / "batchknee.io_llmservings.yaml")
    )  # installed once
    values = {
        "crds": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        # credentials in the URL (the chart's Deployment carries them; its NOTES must not print them)
        "operator": {
            "watchNamespaces": [namespace],
            "prometheusUrl": prometheus.url.replace("://", "://batchknee:notes-secret@", 1),
        },
    }
    installed = install(cluster, namespace, tmp_path, values)
    uninstall.append(namespace)
    assert f"Prometheus: {prometheus.url}\n" in installed.notes and "notes-secret" not in installed.notes
    assert (
        cluster.kubectl(
            "get", "clusterrole", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name"
        ).stdout
        == ""
    )
    role = json.loads(cluster.kubectl("get", "role", FULLNAME, "-n", namespace, "-o", "json").stdout)
    assert granted(role["rules"]) == required(cluster_wide=False, peering=False)

    user = installed.user
    calls = operator_calls(cluster_wide=False, peering=False)
    wait_for(
        lambda: can_i(cluster, user, "list", "llmservings.batchknee.io", namespace), 30, "RBAC in effect"
    )
    for call in calls:
        resource, sub = resource_arg(call.permission)
        assert can_i(cluster, user, call.permission.verb, resource, namespace, sub), call.permission
        assert not can_i(cluster, user, call.permission.verb, resource, "default", sub), call.permission
    for verb, resource in (
        ("list", "customresourcedefinitions.apiextensions.k8s.io"),
        ("list", "namespaces"),
    ):
        assert not can_i(cluster, user, verb, resource, None)

    harness = Harness(cluster, namespace, prometheus, tmp_path)
    try:
        installed.start_operator(harness, prometheus)
        assert installed.deployment_env()["BATCHKNEE_NAMESPACES"] == namespace
        assert harness.apply("solo").returncode == 0
        wait_for(lambda: harness.max_num_seqs("solo") == 64, 90, "the Deployment at 64", harness.log)
        wait_for(lambda: harness.status("solo").get("maxNumSeqs") == 64, 60, "the status", harness.log)
        assert harness.events("Deployed")
        log = (tmp_path / "operator.log").read_text(errors="replace")
        refused = [line for line in log.splitlines() if "403" in line and MAPPER_LAG not in line]
        assert refused == [] and "Not enough permissions" not in log, log[-3000:]
    finally:
        harness.stop_operator()

    events = audited(cluster, user)
    denied = [e for e in events if e.get("responseStatus", {}).get("code") == 403 and not mapper_lag(e)]
    assert [e["requestURI"] for e in denied] == []
    table = {c.permission for c in calls}
    assert sorted({e["requestURI"] for e in events if covered(e, table) is None}) == []
    elsewhere = sorted({e["requestURI"] for e in events if e["objectRef"].get("namespace") != namespace})
    assert elsewhere == [], "requests outside the watched namespace"
