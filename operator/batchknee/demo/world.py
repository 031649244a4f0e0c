"""Everything the demo runs, started in order and torn down in reverse: the local control plane
with the test kubelet running `batchknee emulate` for engine pods, a real Prometheus scraping them,
the CRD (generated from the API models, as `batchknee crd` prints it), the operator as its own
process, and the demo's LLMServings (package data: nothing is read from a checkout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from batchknee.adapters.kubernetes import KubernetesAdapter
from batchknee.api.crd import crd_yaml, peering_crd_yaml
from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.cluster import free_port
from batchknee.devcluster.procs import wait_until

NAMESPACE = "demo"
LLMSERVING_LABEL = "batchknee.io/llmserving"  # on every engine pod (render.LABEL)
PLURAL_GROUP = "llmservings.batchknee.io"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # on each EndpointSlice of a Service


class DemoWorld:
    def __init__(self, out_dir: Path, *, gpu: str, speedup: float, examples: list[Path]) -> None:
        self.out_dir = out_dir
        self.gpu = gpu
        self.speedup = speedup
        self.examples = examples
        self.load_file = (out_dir / "load.json").resolve()
        self._stack = ExitStack()
        self.cluster: DevCluster
        self.prometheus: LocalPrometheus
        self.operator: subprocess.Popen[bytes]
        self.kube: KubernetesAdapter
        self.names: list[str] = []
        self._endpoints_api: ApiClient | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()

    def _start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.set_load({"concurrency": 0, "requestRate": 0})

        def emulate(engine: str) -> list[str]:
            return [
                sys.executable, "-m", "batchknee", "emulate", "--engine", engine, "--gpu", self.gpu,
                "--speedup", str(self.speedup), "--load-file", str(self.load_file),
                "--drain-grace-s", "60",  # finish what is in flight: the pods' grace period is 90 s
                "--drain-linger-s", "3",  # let Prometheus scrape the final counters of a drained pod
            ]  # fmt: skip

        # vLLM pods run `vllm serve …`; SGLang pods `python -m sglang.launch_server …` (the emulator
        # skips the `-m sglang.launch_server` words)
        runtimes = {"vllm": emulate("vllm"), "python": emulate("sglang")}
        self.cluster = self._stack.enter_context(DevCluster(runtimes=runtimes))
        self.prometheus = self._stack.enter_context(
            LocalPrometheus(self.cluster.file_sd_path, scrape_interval_s=1)
        )
        self.kube = KubernetesAdapter(self.cluster.api_client())
        crds = self.out_dir / "crds"
        crds.mkdir(exist_ok=True)
        (crds / "batchknee.io_llmservings.yaml").write_text(crd_yaml())
        (crds / "kopf.dev_peerings.yaml").write_text(peering_crd_yaml())
        self.cluster.kubectl("apply", "-f", str(crds))
        self.cluster.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL_GROUP}", "--timeout=180s")
        self.cluster.kubectl("create", "namespace", NAMESPACE)
        wait_until(
            lambda: (
                self.cluster.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0
            ),
            30,
            "the demo namespace's default service account",
        )
        self._start_operator()
        for example in self.examples:
            self.add(example)

    def remove(self, name: str) -> None:
        """Delete an LLMServing (its children go with it); the demo stops sampling it."""
        self.cluster.kubectl("delete", "llms", name, "-n", NAMESPACE, "--wait=false")
        self.names.remove(name)

    def add(self, example: Path) -> None:
        """Apply a manifest's LLMServings; the demo samples them from now on."""
        self.cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(example))
        self.names += [doc["metadata"]["name"] for doc in yaml.safe_load_all(example.read_text()) if doc]

    def _start_operator(self) -> None:
        env = self.cluster.env(os.environ)
        env.update(
            {
                "BATCHKNEE_PROMETHEUS_URL": self.prometheus.url,
                "BATCHKNEE_NAMESPACES": NAMESPACE,
                "BATCHKNEE_METRICS_PORT": str(free_port()),
                "BATCHKNEE_HEALTH_PORT": str(free_port()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        log = (self.out_dir / "operator.log").open("ab")
        self._stack.callback(log.close)
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "batchknee", "operator"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self._stack.callback(self._stop_operator)

    def _stop_operator(self) -> None:
        if self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(20)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(5)

    # --- what the demo drives and reads ---------------------------------------------------------

    def set_load(self, load: dict[str, Any]) -> None:
        """Every engine pod follows this file, pods created by a rollout too."""
        temporary = self.load_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(load))
        temporary.replace(self.load_file)
        time.sleep(0)  # the emulators poll the file's mtime

    def llmserving(self, name: str) -> dict[str, Any]:
        found = self.kube.get_llmserving(NAMESPACE, name)
        if found is None:
            raise LookupError(f"LLMServing {NAMESPACE}/{name} is gone")
        return found

    def deployment(self, name: str) -> dict[str, Any] | None:
        """The engine Deployment as JSON, or None before the operator has created it."""
        return self.kube.get_deployment(NAMESPACE, name)

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The LLMServing's pods as JSON, terminating ones too."""
        return self.kube.list_pods(NAMESPACE, {LLMSERVING_LABEL: name})

    @property
    def routing(self) -> str:
        """How a client outside the pods finds them: "EndpointSlice" (the engine Service's Ready
        endpoints, published by the controller-manager) or "Ready pods" (read directly, on loopback
        pod addresses, where Services get no endpoints)."""
        return "EndpointSlice" if self.cluster.services_have_endpoints else "Ready pods"

    def client_endpoints(self, name: str) -> list[tuple[str, str]]:
        """(pod, base URL) of where the LLMServing's Service routes now, as `routing` finds them."""
        if self.cluster.services_have_endpoints:
            return self.service_endpoints(name)
        return self.ready_endpoints(name)

    def _client_api(self) -> ApiClient:
        """One connection pool for the external client's thread, kept for the world's life."""
        if self._endpoints_api is None:
            self._endpoints_api = self.cluster.api_client()
            self._stack.callback(self._endpoints_api.close)
        return self._endpoints_api

    def service_endpoints(self, name: str) -> list[tuple[str, str]]:
        """(pod, base URL) of the engine Service's Ready endpoints in its EndpointSlices — what a
        router without kube-proxy balances over. A terminating pod's endpoint is not Ready (the
        kubelet drops readiness before the preStop hook), so it leaves here first."""
        discovery: Any = client.DiscoveryV1Api(self._client_api())  # Any: the raw response
        raw = discovery.list_namespaced_endpoint_slice(
            NAMESPACE,
            label_selector=f"{SERVICE_NAME_LABEL}={name}",
            _preload_content=False,
            _request_timeout=(5, 10),
        )
        found: set[tuple[str, str]] = set()
        for endpoint_slice in json.loads(raw.data)["items"]:
            ports = [p["port"] for p in endpoint_slice.get("ports") or [] if p.get("name") == "http"]
            if not ports:
                continue
            for endpoint in endpoint_slice.get("endpoints") or []:
                if not (endpoint.get("conditions") or {}).get("ready"):
                    continue
                pod = (endpoint.get("targetRef") or {}).get("name", "")
                for address in endpoint.get("addresses") or []:
                    found.add((pod, f"http://{address}:{ports[0]}"))
        return sorted(found)

    def ready_endpoints(self, name: str) -> list[tuple[str, str]]:
        """(pod, base URL) of the LLMServing's pods that are Ready and not terminating — where a
        Service would route. Called from the external client's thread: its own API client."""
        core: Any = client.CoreV1Api(self._client_api())  # Any: the raw response (_preload_content=False)
        raw = core.list_namespaced_pod(
            NAMESPACE,
            label_selector=f"{LLMSERVING_LABEL}={name}",
            _preload_content=False,
            _request_timeout=(5, 10),
        )
        found: list[tuple[str, str]] = []
        for pod in json.loads(raw.data)["items"]:
            status = pod.get("status") or {}
            conditions = status.get("conditions") or []
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
            ip = status.get("podIP")
            if not ready or pod["metadata"].get("deletionTimestamp") or not ip:
                continue
            ports = [
                p["containerPort"]
                for c in pod["spec"]["containers"]
                for p in c.get("ports") or []
                if p.get("name") == "http"
            ]
            if ports:
                found.append((pod["metadata"]["name"], f"http://{ip}:{ports[0]}"))
        return sorted(found)

    def query(self, promql: str) -> float | None:
        """One number from Prometheus (the first series), or None when there is none."""
        result = self.prometheus.query(promql)
        return float(result[0]["value"][1]) if result else None
