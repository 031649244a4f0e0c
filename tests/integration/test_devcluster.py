"""The local control plane is the real Kubernetes machinery: controllers, CEL, RBAC, and the test
kubelet runs pods' processes with their own args."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.procs import pid_alive, wait_until

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture(scope="module")
def api(cluster: DevCluster) -> Iterator[client.ApiClient]:
    with cluster.api_client() as api_client:
        yield api_client


def http_get(ip: str, port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=2) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def engine_container(name: str, args: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "example.invalid/fake-engine:1",
        "command": ["fake-engine"],
        "args": args,
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
        **extra,
    }


def ready_pods(core: client.CoreV1Api, namespace: str, selector: str) -> list[client.V1Pod]:
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [
        p
        for p in pods
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
    ]


def test_kubectl_reports_v1_36_server(cluster: DevCluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"].startswith("v1.36."), out
    assert out["clientVersion"]["gitVersion"].startswith("v1.36."), out
    node = json.loads(cluster.kubectl("get", "node", cluster.node_name, "-o", "json").stdout)
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"


def test_kubectl_keeps_the_clusters_own_cache_and_fails_with_its_error(cluster: DevCluster) -> None:
    """Discovery is cached per cluster (a reused loopback port must not serve another cluster's),
    and a failing kubectl says why, not only its exit status."""
    cluster.kubectl("get", "namespaces")
    assert any((cluster.workdir / "kube-cache" / "discovery").iterdir())
    with pytest.raises(subprocess.CalledProcessError) as failed:
        cluster.kubectl("get", "no-such-kind")
    assert 'doesn\'t have a resource type "no-such-kind"' in str(failed.value), str(failed.value)


def test_deployment_rolls_out_to_ready_pods_and_rolls_again(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    labels = {"app": "engine"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        engine_container(
                            "engine",
                            ["--port", "8000", "--max-num-seqs", "64"],
                            resources={"limits": {"nvidia.com/gpu": "1"}},
                        )
                    ],
                },
            },
        },
    }
    apps.create_namespaced_deployment(namespace, deployment)
    wait_until(lambda: len(ready_pods(core, namespace, "app=engine")) == 2, 60, "2 ready pods")
    sets = apps.list_namespaced_replica_set(namespace).items
    assert len(sets) == 1
    first_rs = sets[0].metadata.name
    pods = ready_pods(core, namespace, "app=engine")
    assert {p.metadata.owner_references[0].name for p in pods} == {first_rs}
    ips = {p.status.pod_ip for p in pods}
    assert len(ips) == 2
    assert all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
    for pod in pods:
        status, body = http_get(pod.status.pod_ip, 8000, "/args")
        assert status == 200
        assert "64" in json.loads(body)["argv"]

    # A new pod template (the operator's --max-num-seqs change) rolls a new ReplicaSet.
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "args": ["--port", "8000", "--max-num-seqs", "96"]}
    ]}}}}  # fmt: skip
    apps.patch_namespaced_deployment("engine", namespace, patch)
    cluster.kubectl("rollout", "status", "deployment/engine", "-n", namespace, "--timeout=90s", timeout=100)
    sets = apps.list_namespaced_replica_set(namespace).items
    assert len(sets) == 2
    new_rs = next(s for s in sets if s.metadata.name != first_rs)
    assert new_rs.status.ready_replicas == 2
    wait_until(lambda: len(core.list_namespaced_pod(namespace).items) == 2, 30, "old pods to go")
    for pod in ready_pods(core, namespace, "app=engine"):
        assert pod.metadata.owner_references[0].name == new_rs.metadata.name
        status, body = http_get(pod.status.pod_ip, 8000, "/args")
        assert "96" in json.loads(body)["argv"]


def test_crd_cel_rule_rejects_bad_object(cluster: DevCluster, api: client.ApiClient, namespace: str) -> None:
    ext = client.ApiextensionsV1Api(api)
    message = "spec.minReplicas must not exceed spec.maxReplicas"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.test.batchknee.io"},
        "spec": {
            "group": "test.batchknee.io",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "minReplicas": {"type": "integer"},
                                        "maxReplicas": {"type": "integer"},
                                    },
                                    "x-kubernetes-validations": [
                                        {"rule": "self.minReplicas <= self.maxReplicas", "message": message}
                                    ],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    ext.create_custom_resource_definition(crd)

    def established() -> bool:
        got = ext.read_custom_resource_definition("widgets.test.batchknee.io")
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])

    wait_until(established, 30, "CRD Established")
    custom = client.CustomObjectsApi(api)

    def widget(name: str, lo: int, hi: int) -> dict[str, Any]:
        return {
            "apiVersion": "test.batchknee.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": lo, "maxReplicas": hi},
        }

    # Discovery of a fresh CRD can lag a moment behind Established.
    wait_until(
        lambda: cluster.kubectl("get", "widgets", "-n", namespace, check=False).returncode == 0, 30, "widgets"
    )
    custom.create_namespaced_custom_object(
        "test.batchknee.io", "v1", namespace, "widgets", widget("ok", 1, 2)
    )
    with pytest.raises(ApiException) as bad:
        custom.create_namespaced_custom_object(
            "test.batchknee.io", "v1", namespace, "widgets", widget("bad", 3, 2)
        )
    assert bad.value.status == 422
    assert message in str(bad.value.body)
    ext.delete_custom_resource_definition("widgets.test.batchknee.io")


def test_rbac_refuses_service_account_until_granted(
    cluster: DevCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    token = core.create_namespaced_service_account_token(
        "reader", namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token
    # A kubeconfig with only the bearer token (the admin's client certificate would win otherwise).
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    token_kubeconfig = tmp_path / "reader.kubeconfig"
    token_kubeconfig.write_text(yaml.safe_dump(config))
    as_reader = ["--kubeconfig", str(token_kubeconfig), "-n", namespace]
    refused = cluster.kubectl("get", "pods", *as_reader, check=False)
    assert refused.returncode != 0
    assert "forbidden" in refused.stderr.lower(), refused.stderr

    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    wait_until(
        lambda: cluster.kubectl("get", "pods", *as_reader, check=False).returncode == 0, 30, "the grant"
    )
    still_refused = cluster.kubectl("get", "secrets", *as_reader, check=False)
    assert still_refused.returncode != 0
    assert "forbidden" in still_refused.stderr.lower()


def test_pod_process_gets_args_volumes_env_and_stops_gracefully(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "engine-config"}, "data": {"engine.yaml": "max_batch_size: 64\n"}}
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine-0", "labels": {"app": "engine"}},
        "spec": {
            "terminationGracePeriodSeconds": 20,
            "volumes": [{"name": "config", "configMap": {"name": "engine-config"}}],
            "containers": [
                engine_container(
                    "engine",
                    ["--port", "8000", "--config", "/etc/batchknee/engine.yaml", "--tag", "$(FOO)"],
                    env=[
                        {"name": "FOO", "value": "foo-value"},
                        {"name": "BAR", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    ],
                    volumeMounts=[{"name": "config", "mountPath": "/etc/batchknee"}],
                )
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    wait_until(lambda: len(ready_pods(core, namespace, "app=engine")) == 1, 60, "the pod Ready")
    live = core.read_namespaced_pod("engine-0", namespace)
    ip = live.status.pod_ip
    assert live.status.phase == "Running"
    assert live.status.container_statuses[0].ready
    status, body = http_get(ip, 8000, "/args")
    assert status == 200
    info = json.loads(body)
    argv = info["argv"]
    assert argv[-2:] == ["--host", ip]
    assert argv[argv.index("--tag") + 1] == "foo-value"
    config_path = argv[argv.index("--config") + 1]
    assert config_path != "/etc/batchknee/engine.yaml"
    assert config_path.endswith("/volumes/config/engine.yaml")
    assert info["config"] == "max_batch_size: 64\n"
    assert info["env"] == {
        "POD_IP": ip,
        "POD_NAME": "engine-0",
        "POD_NAMESPACE": namespace,
        "FOO": "foo-value",
        "BAR": "engine",
    }
    pod_dir = Path(info["cwd"])
    assert pod_dir.parent == cluster.pods_dir
    pids = [pid for name, pid in cluster.pids().items() if "engine-0" in name]
    assert len(pids) == 1
    assert pid_alive(pids[0])

    started = time.monotonic()
    core.delete_namespaced_pod("engine-0", namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod("engine-0", namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_until(gone, 30, "the pod deleted")
    took = time.monotonic() - started
    assert (pod_dir / "sigterm").is_file(), "the engine never saw SIGTERM"
    assert took < 15, f"deletion waited {took:.1f} s: the process was SIGKILLed, not stopped gracefully"
    assert not pid_alive(pids[0])


def pod_ready(core: client.CoreV1Api, name: str, namespace: str) -> bool | None:
    """The pod's Ready condition; None once the pod is gone."""
    try:
        pod = core.read_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_deletion_drops_readiness_then_runs_the_prestop_hook_then_sigterm(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    """A kubelet's order on deletion: Ready=False at once (what routes by readiness stops), the
    preStop exec hook, then SIGTERM, the process gone within the grace period."""
    core = client.CoreV1Api(api)
    hook = ["sh", "-c", "date +%s.%N > prestop-start; sleep 2; date +%s.%N > prestop-end"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "drained", "labels": {"app": "drained"}},
        "spec": {
            "terminationGracePeriodSeconds": 20,
            "containers": [
                engine_container(
                    "engine", ["--port", "8000"], lifecycle={"preStop": {"exec": {"command": hook}}}
                )
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    wait_until(lambda: bool(pod_ready(core, "drained", namespace)), 60, "the pod Ready")
    ip = core.read_namespaced_pod("drained", namespace).status.pod_ip
    pod_dir = Path(json.loads(http_get(ip, 8000, "/args")[1])["cwd"])

    core.delete_namespaced_pod("drained", namespace)
    wait_until(lambda: pod_ready(core, "drained", namespace) is False, 10, "Ready=False after the delete")
    not_ready_seen = time.time()
    # Not ready while the hook still runs and before SIGTERM: the engine keeps serving meanwhile.
    assert not (pod_dir / "sigterm").exists(), "SIGTERM came before readiness dropped"
    assert not (pod_dir / "prestop-end").exists(), "the preStop hook ended before readiness dropped"
    assert http_get(ip, 8000, "/health")[0] == 200

    started = time.monotonic()
    wait_until(lambda: pod_ready(core, "drained", namespace) is None, 30, "the pod deleted")
    took = time.monotonic() - started
    hook_start = float((pod_dir / "prestop-start").read_text())
    hook_end = float((pod_dir / "prestop-end").read_text())
    sigterm = float((pod_dir / "sigterm").read_text())
    assert hook_start < hook_end <= sigterm, "SIGTERM before the preStop hook finished"
    assert not_ready_seen < hook_end
    assert took < 20, f"the pod outlived its grace period: {took:.1f} s"


def test_the_grace_period_cuts_a_long_prestop_hook_and_sigterm_still_comes(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hasty"},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                engine_container(
                    "engine",
                    ["--port", "8000"],
                    lifecycle={"preStop": {"exec": {"command": ["sleep", "120"]}}},
                )
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    wait_until(lambda: bool(pod_ready(core, "hasty", namespace)), 60, "the pod Ready")
    ip = core.read_namespaced_pod("hasty", namespace).status.pod_ip
    pod_dir = Path(json.loads(http_get(ip, 8000, "/args")[1])["cwd"])
    started = time.monotonic()
    core.delete_namespaced_pod("hasty", namespace)
    wait_until(lambda: pod_ready(core, "hasty", namespace) is None, 60, "the pod deleted")
    took = time.monotonic() - started
    assert (pod_dir / "sigterm").is_file(), "the engine never saw SIGTERM"
    # 2 s for the hook, at least 2 s more for SIGTERM (a kubelet's minimum), nowhere near 120 s.
    assert took < 20, f"the 120 s preStop hook held the pod {took:.1f} s"


def test_endpointslices_refuse_loopback_pod_addresses(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    """Why no controller publishes this cluster's pods on loopback addresses: the apiserver
    validates EndpointSlice addresses like Endpoints (no loopback), and outside a private network
    namespace the test kubelet's pod IPs are 127.N.x.y (test_pod_network.py covers the other case)."""
    discovery = client.DiscoveryV1Api(api)

    def slice_with(address: str) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"generateName": "engine-", "labels": {"kubernetes.io/service-name": "engine"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        }

    with pytest.raises(ApiException) as refused:
        discovery.create_namespaced_endpoint_slice(namespace, slice_with("127.1.0.5"))
    assert refused.value.status == 422
    assert "loopback" in refused.value.body
    discovery.create_namespaced_endpoint_slice(namespace, slice_with("10.1.0.5"))


def test_crashing_process_restarts_and_pod_not_ready_meanwhile(
    cluster: DevCluster, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crasher"},
        "spec": {"containers": [engine_container("engine", ["--port", "8000", "--exit-after", "1.5"])]},
    }
    core.create_namespaced_pod(namespace, pod)

    def restarted() -> bool:
        statuses = core.read_namespaced_pod("crasher", namespace).status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count >= 1

    wait_until(restarted, 30, "a restart")
    status = core.read_namespaced_pod("crasher", namespace).status.container_statuses[0]
    assert status.last_state.terminated.exit_code == 3


def test_prometheus_scrapes_kubelet_pods_with_podmonitor_labels(
    cluster: DevCluster, api: client.ApiClient, prometheus: LocalPrometheus, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "scraped",
            "labels": {"app.kubernetes.io/name": "engine", "tier": "gpu", "batchknee.io/llmserving": "chat"},
            "annotations": {"prometheus.io/path": "/metrics"},
        },
        "spec": {"containers": [engine_container("engine", ["--port", "8000"])]},
    }
    core.create_namespaced_pod(namespace, pod)
    wait_until(lambda: len(ready_pods(core, namespace, "tier=gpu")) == 1, 60, "the pod Ready")
    sd = json.loads(cluster.file_sd_path.read_text())
    mine = [t for t in sd if t["labels"]["namespace"] == namespace]
    assert len(mine) == 1
    assert mine[0]["labels"]["app_kubernetes_io_name"] == "engine"

    query = f'fake_engine_up{{namespace="{namespace}",pod="scraped"}}'
    result = prometheus.wait_for(query, timeout_s=30)
    labels = result[0]["metric"]
    assert labels["container"] == "engine"
    assert labels["tier"] == "gpu"
    assert labels["llmserving"] == "chat"  # as the chart's PodMonitor relabels it
    ip = core.read_namespaced_pod("scraped", namespace).status.pod_ip
    assert labels["instance"] == f"{ip}:8000"

    # Tests stop Prometheus to see the operator hold; it comes back on the same URL with its data.
    url = prometheus.url
    prometheus.stop()
    assert prometheus.query("up") == []
    prometheus.start()
    assert prometheus.url == url
    prometheus.wait_for(query, timeout_s=30)


def _engine_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [engine_container("engine", ["--port", "8000"])]},
    }


def test_teardown_leaves_no_process() -> None:
    with DevCluster(runtimes={"fake-engine": [sys.executable, str(FAKE_ENGINE)]}) as dev:
        dev.kubectl("apply", "-f", "-", input=json.dumps(_engine_pod("lonely")))
        dev.kubectl("wait", "--for=condition=Ready", "pod/lonely", "--timeout=60s", timeout=70)
        pids = dev.pids()
        workdir = dev.workdir
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"} <= set(pids)
    assert any("lonely" in name for name in pids), pids
    alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert alive == {}
    assert not workdir.exists()


def test_killed_harness_leaves_no_process(tmp_path: Path) -> None:
    """SIGKILL the process holding a cluster: PR_SET_PDEATHSIG takes every child down with it."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import json, sys, time\n"
        "from batchknee.devcluster import DevCluster\n"
        f"dev = DevCluster(runtimes={{'fake-engine': [sys.executable, {str(FAKE_ENGINE)!r}]}}).start()\n"
        f"dev.kubectl('apply', '-f', '-', input={json.dumps(json.dumps(_engine_pod('orphan')))})\n"
        "dev.kubectl('wait', '--for=condition=Ready', 'pod/orphan', '--timeout=60s', timeout=70)\n"
        "print(json.dumps({'pids': dev.pids(), 'workdir': str(dev.workdir)}), flush=True)\n"
        "time.sleep(300)\n"
    )
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    line = ""
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line, "the holder died before its cluster was up"
        state = json.loads(line)
        pids: dict[str, int] = state["pids"]
        assert any("orphan" in name for name in pids), pids
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        wait_until(lambda: not any(pid_alive(p) for p in pids.values()), 15, "all cluster processes to die")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if line:
            shutil.rmtree(json.loads(line)["workdir"], ignore_errors=True)
