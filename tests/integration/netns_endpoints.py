"""Run by test_pod_network.py inside a private network namespace (`python -m
batchknee.devcluster.in_netns python netns_endpoints.py OUT.json`): a local cluster, a Service and one
fake-engine pod with a preStop hook; records what the Service's EndpointSlices said as the pod
turned Ready and as it was deleted, and whether its address answered from this namespace."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client

from batchknee.devcluster import DevCluster, netns
from batchknee.devcluster.procs import wait_until

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
NAMESPACE = "default"


def endpoints(discovery: Any) -> list[dict[str, Any]]:
    slices = discovery.list_namespaced_endpoint_slice(
        NAMESPACE, label_selector="kubernetes.io/service-name=engine", _preload_content=False
    )
    return [e for s in json.loads(slices.data)["items"] for e in s.get("endpoints") or []]


def main(out: Path) -> None:
    seen: dict[str, Any] = {"private": netns.private()}
    with DevCluster(runtimes={"fake-engine": [sys.executable, str(FAKE_ENGINE)]}) as cluster:
        seen["podNetwork"] = cluster.pod_network
        with cluster.api_client() as api:
            core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
            service = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "engine"},
                "spec": {
                    "selector": {"app": "engine"},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
                },
            }
            hook = ["sh", "-c", "sleep 3; date +%s.%N > prestop-end"]
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "engine", "labels": {"app": "engine"}},
                "spec": {
                    "terminationGracePeriodSeconds": 20,
                    "containers": [
                        {
                            "name": "engine",
                            "image": "example.invalid/fake-engine:1",
                            "command": ["fake-engine"],
                            "args": ["--port", "8000"],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 1,
                            },
                            "lifecycle": {"preStop": {"exec": {"command": hook}}},
                        }
                    ],
                },
            }
            core.create_namespaced_service(NAMESPACE, service)
            core.create_namespaced_pod(NAMESPACE, pod)

            def ready_endpoint() -> bool:
                found = endpoints(discovery)
                return bool(found) and bool(found[0]["conditions"].get("ready"))

            wait_until(ready_endpoint, 60, "the pod's endpoint Ready in the Service's EndpointSlice")
            [endpoint] = endpoints(discovery)
            seen["readyEndpoint"] = endpoint
            seen["podIP"] = core.read_namespaced_pod("engine", NAMESPACE).status.pod_ip
            address = endpoint["addresses"][0]
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy
            with opener.open(f"http://{address}:8000/args", timeout=5) as response:
                seen["cwd"] = json.loads(response.read())["cwd"]

            core.delete_namespaced_pod("engine", NAMESPACE)

            def not_ready() -> bool:  # still listed (its preStop hook runs), no longer Ready
                found = endpoints(discovery)
                return bool(found) and not found[0]["conditions"].get("ready")

            wait_until(not_ready, 20, "the endpoint listed, not Ready, after the delete")
            seen["afterDelete"] = endpoints(discovery)
            seen["hookEndedBeforeNotReady"] = (Path(seen["cwd"]) / "prestop-end").exists()
            wait_until(lambda: not endpoints(discovery), 30, "the endpoint gone with the pod")
            seen["gone"] = True
    out.write_text(json.dumps(seen, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
