"""The scale benchmark (`make bench-scale`): one operator, N LLMServings, the real control plane and
the real Prometheus. Prints figures; asserts nothing (the machine may be shared and noisy).

    python tests/bench/scale.py [--sizes 200,1000] [--interval 30] [--window 60] [--mid-rollout]

Per N: a fresh set of 10 namespaces with N LLMServings (every tenth with a 46-character name, the
longest allowed, whose pod names reach 63 characters), created before the operator starts; one light exporter
(tests/bench/fleet_exporter.py) serves one engine pod's series per LLMServing with its namespace,
pod and llmserving labels — no pods run (the Deployment and ReplicaSet controllers are off). The
bench stands in for what those controllers report once a fleet's pods run: each Deployment the
operator applies is marked rolled out (updated, ready and available), so the steady state is a
fleet holding at its targets (`--mid-rollout` leaves them as applied, every one mid-rollout, as in
docs/scale.md). The operator runs as its own process (`batchknee operator`) with the
token of the chart's ServiceAccount and the chart's RBAC (as in a cluster), its Prometheus URL a
counting proxy in front of the real Prometheus. Progress is followed with a watch.

Printed per N: seconds from the operator's start until every LLMServing has a status and until
every one has an observation (status.observed), Prometheus queries per evaluation interval and the
largest query (bytes of the POST body or GET URL) in a steady stretch of two intervals, the
operator's RSS and CPU share (and the apiserver's and etcd's) and its status writes per interval
over that stretch, reconcile p50/p95 from its own /metrics histogram
(since the operator's start, and over the steady stretch alone; the time a reconcile runs in its
worker thread, not its wait for one), the operator's full Python collections over the steady
stretch (how many, and how long each held it), the apiserver's own timing of the status writes
over that stretch (its request histogram) and its requests there by verb and resource, the
reconciles' p50/p95 and the apiserver's requests from the operator's start until every status, and
what each process of the machine (the control plane,
Prometheus, the exporter, the operator, the bench itself) spent of the cores until every
LLMServing had a status. Then (the fleet rolled out) the operator is stopped and started again, as
in an upgrade: the seconds until the new process has evaluated every LLMServing, its reconciles'
p50/p95 until then, the rollouts it made (none is right: nothing changed) and the apiserver's
requests meanwhile.
The last line is one JSON object with the figures of the largest N.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.cluster import DEFAULT_CONTROLLERS, free_port
from batchknee.reconcile import STEADY_HOLDS

ROOT = Path(__file__).resolve().parents[2]
CRDS = [ROOT / "crds" / "batchknee.io_llmservings.yaml", ROOT / "crds" / "kopf.dev_peerings.yaml"]
EXPORTER = Path(__file__).with_name("fleet_exporter.py")
NAMESPACES = 10
SCRAPE_S = 5  # the fleet exporter's scrape interval (and timeout)
RECONCILES = "batchknee_reconcile_duration_seconds"
FULL_COLLECTIONS = "batchknee_python_full_collection_seconds"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- a counting proxy in front of Prometheus ----------------------------------------------------------


@dataclass
class QueryLog:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sizes: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, bytes)

    def since(self, start: float) -> list[int]:
        with self.lock:
            return [size for at, size in self.sizes if at >= start]


@contextmanager
def counting_proxy(upstream_port: int, log: QueryLog) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.path.startswith("/api/v1/query"):
                with log.lock:
                    size = len(body) if self.command == "POST" else len(self.path)
                    log.sizes.append((time.monotonic(), size))
            upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            finally:
                upstream.close()

        do_GET = do_POST = forward

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# --- the objects ---------------------------------------------------------------------------------------


def llmserving_names(n: int) -> list[str]:
    names = []
    for i in range(n):
        if i % 10 == 0:  # 46 characters, the longest name admission allows (its pod names are 63)
            names.append(f"support-assistant-llama-3-1-8b-instruct-{i:06d}")
        else:
            names.append(f"chat-{i:05d}")
    return names


def manifests(n: int, size_tag: str, interval_s: int, window_s: int) -> list[dict[str, Any]]:
    found = []
    for i, name in enumerate(llmserving_names(n)):
        found.append(
            {
                "apiVersion": "batchknee.io/v1alpha1",
                "kind": "LLMServing",
                "metadata": {"name": name, "namespace": f"bench{size_tag}-{i % NAMESPACES}"},
                "spec": {
                    "engine": "VLLM",
                    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                    "gpu": {"type": "a100-80gb", "count": 1},
                    "tuning": {"evaluationIntervalSeconds": interval_s, "windowSeconds": window_s},
                },
            }
        )
    return found


def create_all(cluster: DevCluster, objects: list[dict[str, Any]], namespaces: list[str]) -> None:
    for namespace in namespaces:
        cluster.kubectl("create", "namespace", namespace)
    api = client.CustomObjectsApi(cluster.api_client())

    def create(obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        api.create_namespaced_custom_object(
            "batchknee.io", "v1alpha1", meta["namespace"], "llmservings", obj, _request_timeout=30
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, objects))


# --- the operator's own figures ------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


class CpuSplit:
    """What each process spent of the machine's cores from `start()` to `stop()`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.started: dict[str, float] = {}
        self.shares: dict[str, float] = {}
        self.start_time = 0.0

    def _now(self) -> dict[str, float]:
        seconds = {}
        for name, pid in self.pids.items():
            try:
                seconds[name] = cpu_seconds(pid)
            except (OSError, IndexError, ValueError):  # gone
                continue
        return seconds

    def start(self) -> None:
        self.start_time, self.started = time.monotonic(), self._now()

    def stop(self) -> None:
        elapsed, ended = time.monotonic() - self.start_time, self._now()
        self.shares = {
            name: round((ended[name] - self.started[name]) / elapsed, 2)
            for name in ended
            if name in self.started
        }


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def operator_metrics(metrics_url: str) -> str:
    return urllib.request.urlopen(metrics_url, timeout=10).read().decode()


def stop_operator(operator: subprocess.Popen[bytes]) -> None:
    if operator.poll() is None:
        operator.terminate()
        try:
            operator.wait(30)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait(10)


def sum_samples(text: str, name: str) -> float:
    """The sum of every sample of `name` in /metrics `text`, over its labels if any (0 when there is
    none, as before a counter's first increment)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def wait_all_evaluated(
    operator: subprocess.Popen[bytes], metrics_url: str, n: int, limit_s: float
) -> tuple[float | None, str]:
    """When this operator process had evaluated all `n` LLMServings (each has its applied-limit
    series, set by its first evaluation), by its /metrics every second; and that last /metrics."""
    deadline, text = time.monotonic() + limit_s, ""
    while time.monotonic() < deadline and operator.poll() is None:
        try:
            text = operator_metrics(metrics_url)
        except OSError:  # not serving yet
            time.sleep(1)
            continue
        if sum(line.startswith("batchknee_max_num_seqs{") for line in text.splitlines()) >= n:
            return time.monotonic(), text
        time.sleep(1)
    return None, text


def histogram_buckets(text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the unlabelled histogram `name` in /metrics `text`."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(buckets)


def apiserver_metrics(cluster: DevCluster) -> list[Metric]:
    return list(text_string_to_metric_families(cluster.kubectl("get", "--raw", "/metrics").stdout))


def status_write_buckets(families: list[Metric]) -> list[tuple[float, float]]:
    """The apiserver's own histogram of its answers to the operator's status writes (server-side
    applies of llmservings/status): what the operator's writing reconciles wait for."""
    buckets: dict[float, float] = {}
    for family in families:
        if family.name != "apiserver_request_duration_seconds":
            continue
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name.endswith("_bucket")
                and labels.get("verb") == "APPLY"
                and labels.get("resource") == "llmservings"
                and labels.get("subresource") == "status"
            ):
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return sorted(buckets.items())


def request_counts(families: list[Metric]) -> Counter[str]:
    """The apiserver's requests so far by verb and resource (e.g. `APPLY llmservings/status`)."""
    counts: Counter[str] = Counter()
    for family in families:
        if family.name != "apiserver_request":  # the parser drops a counter's _total
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                labels = sample.labels
                resource = "/".join(filter(None, (labels.get("resource"), labels.get("subresource"))))
                counts[f"{labels.get('verb')} {resource or labels.get('path', '?')}"] += sample.value
    return counts


@contextmanager
def watch_objects(
    cluster: DevCluster, group: str, version: str, plural: str, handle: Callable[[str, dict[str, Any]], None]
) -> Iterator[None]:
    """Feed every event of every object of `plural` to `handle(type, object)` in a thread, from a
    synthetic ADDED of each existing one on, until the context ends. Plain dicts (the generic
    custom-object calls serve any resource), not the client's models: decoding those would take the
    bench a good share of a core at a thousand objects, a core the operator shares."""
    api = client.CustomObjectsApi(cluster.api_client())
    stop = threading.Event()

    def run() -> None:
        version_seen: str | None = None
        while not stop.is_set():
            try:
                for event in watch.Watch().stream(
                    api.list_cluster_custom_object,
                    group,
                    version,
                    plural,
                    resource_version=version_seen,
                    timeout_seconds=5,
                ):
                    version_seen = event["object"]["metadata"]["resourceVersion"]
                    handle(event["type"], event["object"])
                    if stop.is_set():
                        break
            except ApiException as error:
                if error.status == 410:  # expired: start again from a fresh listing
                    version_seen = None
                elif not stop.is_set():
                    time.sleep(1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@contextmanager
def rolled_out(cluster: DevCluster, namespaces: set[str]) -> Iterator[None]:
    """Stand in for the Deployment controller of a fleet whose pods run: every Deployment in
    `namespaces` that is not marked rolled out at its generation is (status updated, ready and
    available at spec.replicas). Watches, so a steady fleet costs it nothing."""
    api = client.CustomObjectsApi(cluster.api_client())

    def mark(kind: str, deployment: dict[str, Any]) -> None:
        meta, status = deployment["metadata"], deployment.get("status") or {}
        replicas = deployment["spec"].get("replicas", 1)
        if (
            kind not in ("ADDED", "MODIFIED")
            or meta["namespace"] not in namespaces
            or (
                status.get("observedGeneration") == meta["generation"]
                and status.get("availableReplicas") == replicas
                and status.get("updatedReplicas") == replicas
            )
        ):
            return
        rolled = {"observedGeneration": meta["generation"], "replicas": replicas}
        rolled |= {"updatedReplicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}
        api.patch_namespaced_custom_object_status(
            "apps",
            "v1",
            meta["namespace"],
            "deployments",
            meta["name"],
            {"status": rolled},
            _request_timeout=30,
            _preload_content=False,
        )

    with watch_objects(cluster, "apps", "v1", "deployments", mark):
        yield


@dataclass
class Progress:
    """When every LLMServing in `namespaces` first had a status, an observation, and a steady
    hold all at once, in seconds from `start`: kept from a watch of their events (exact, and a
    thousand objects listed every few seconds would cost the apiserver and the bench a share of
    the cores the operator runs on)."""

    namespaces: set[str]
    n: int
    start: float = field(default_factory=time.monotonic)
    status: set[tuple[str, str]] = field(default_factory=set)
    observed: set[tuple[str, str]] = field(default_factory=set)
    steady: set[tuple[str, str]] = field(default_factory=set)
    all_status: float | None = None
    all_observed: float | None = None
    all_steady: float | None = None
    at_all_status: Callable[[], None] = lambda: None  # called once, when every status is there
    lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if meta["namespace"] not in self.namespaces:
            return
        key, status = (meta["namespace"], meta["name"]), obj.get("status") or {}
        elapsed = time.monotonic() - self.start
        with self.lock:
            if status.get("observedGeneration") is not None:
                self.status.add(key)
            if (status.get("observed") or {}).get("sampledAt"):
                self.observed.add(key)
            if kind != "DELETED" and status.get("holdReason") in STEADY_HOLDS:
                self.steady.add(key)
            else:
                self.steady.discard(key)
            if self.all_status is None and len(self.status) >= self.n:
                self.all_status = elapsed
                self.at_all_status()
            if self.all_observed is None and len(self.observed) >= self.n:
                self.all_observed = elapsed
            if self.all_steady is None and len(self.steady) >= self.n:
                self.all_steady = elapsed


def subtract(
    buckets: list[tuple[float, float]], earlier: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """A cumulative histogram's buckets over a stretch: now less what they held at its start."""
    before = dict(earlier)
    return [(bound, count - before.get(bound, 0.0)) for bound, count in buckets]


def longest_ms(buckets: list[tuple[float, float]]) -> float | None:
    """The upper bound of the highest bucket that holds an observation, in ms (None: none)."""
    longest = None
    previous = 0.0
    for bound, count in buckets:
        if count > previous:
            longest = bound
        previous = count
    return None if longest is None else round(longest * 1e3, 1)


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's histogram_quantile: linear inside the bucket the rank falls in."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)
        lower_bound, lower_count = bound, count
    return None


def quantile_ms(buckets: list[tuple[float, float]], q: float) -> float:
    """`quantile` in ms, rounded to 0.1 (NaN where there is none)."""
    return round((quantile(buckets, q) or float("nan")) * 1e3, 1)


def requests_between(later: list[Metric], earlier: list[Metric]) -> Counter[str]:
    """The apiserver's requests by verb and resource between two reads of its /metrics."""
    counts = request_counts(later)
    counts.subtract(request_counts(earlier))
    return counts


def chart_account_kubeconfig(cluster: DevCluster, namespaces: list[str], workdir: Path) -> Path:
    """A kubeconfig with the token of the chart's own ServiceAccount, with the chart's RBAC for
    `namespaces` (a Role per watched namespace), as the operator runs in a cluster: a token the
    apiserver authenticates from its cache, rather than the admin's client certificate, whose
    chain it verifies on every request (8 % of its CPU at a thousand objects here)."""
    release_namespace = "batchknee-bench"
    if cluster.kubectl("get", "namespace", release_namespace, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", release_namespace)  # once: the next size reuses it
    values = workdir / "chart-values.json"
    values.write_text(json.dumps({"operator": {"watchNamespaces": namespaces}}))
    rendered = cluster.helm(
        "template",
        "batchknee",
        str(ROOT / "charts" / "batchknee"),
        "--namespace",
        release_namespace,
        "--values",
        str(values),
        "--kube-version",
        json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"],
        "--show-only",
        "templates/serviceaccount.yaml",
        "--show-only",
        "templates/rbac.yaml",
        home=workdir / "helm",
    ).stdout
    manifest = workdir / "chart-rbac.yaml"
    manifest.write_text(rendered)
    cluster.kubectl("apply", "-f", str(manifest))
    account = next(
        doc["metadata"]["name"]
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] == "ServiceAccount"
    )
    return cluster.service_account_kubeconfig(release_namespace, account, workdir / f"{account}.kubeconfig")


# --- one size ------------------------------------------------------------------------------------------


def run_size(
    n: int,
    cluster: DevCluster,
    prom: LocalPrometheus,
    exporter_port: int,
    workdir: Path,
    interval_s: int,
    window_s: int,
    mid_rollout: bool = False,
) -> dict[str, Any]:
    tag = str(n)
    objects = manifests(n, tag, interval_s, window_s)
    namespaces = sorted({o["metadata"]["namespace"] for o in objects})
    fleet = [
        {
            "namespace": o["metadata"]["namespace"],
            "pod": f"{o['metadata']['name'][:52]}-5d8f9c7b6-x{i:04d}",
            "llmserving": o["metadata"]["name"],
        }
        for i, o in enumerate(objects)
    ]
    fleet_file = workdir / f"fleet-{n}.json"
    fleet_file.write_text(json.dumps(fleet))
    exporter = subprocess.Popen(
        [sys.executable, str(EXPORTER), "--fleet", str(fleet_file), "--port", str(exporter_port)]
    )
    operator: subprocess.Popen[bytes] | None = None
    log = QueryLog()
    try:
        started = time.monotonic()
        create_all(cluster, objects, namespaces)
        print(f"[{n}] created {n} LLMServings in {time.monotonic() - started:.0f} s", flush=True)
        time.sleep(4 * SCRAPE_S)  # a few scrapes of every engine series before the operator starts
        controllers = nullcontext() if mid_rollout else rolled_out(cluster, set(namespaces))
        with counting_proxy(prom.port, log) as proxy_url, controllers:
            metrics_port = free_port()
            env = cluster.env()
            env["KUBECONFIG"] = str(chart_account_kubeconfig(cluster, namespaces, workdir))
            env["BATCHKNEE_PROMETHEUS_URL"] = proxy_url
            operator_log = (workdir / f"operator-{n}.log").open("ab")

            def start_operator() -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "batchknee",
                        "operator",
                        *[flag for namespace in namespaces for flag in ("--namespace", namespace)],
                        "--peering",
                        "standalone",
                        "--metrics-port",
                        str(metrics_port),
                        "--health-port",
                        "0",
                    ],
                    env=env,
                    stdout=operator_log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )

            operator = start_operator()
            startup = CpuSplit(
                {
                    **{
                        name: pid
                        for name, pid in cluster.pids().items()
                        if name.startswith(("kube-", "etcd"))
                    },
                    **({"prometheus": prom.pid} if prom.pid is not None else {}),
                    "exporter": exporter.pid,
                    "operator": operator.pid,
                    "bench": os.getpid(),  # its stand-in controller, watch and query proxy
                }
            )
            startup.start()
            # the apiserver's requests and the operator's reconciles from its start until every status
            at_start = apiserver_metrics(cluster)
            at_all_status: dict[str, Any] = {}

            def all_status_reached() -> None:
                startup.stop()
                at_all_status["server"] = apiserver_metrics(cluster)
                at_all_status["operator"] = operator_metrics(f"http://127.0.0.1:{metrics_port}/metrics")

            progress = Progress(set(namespaces), n, at_all_status=all_status_reached)
            limit_s = max(10 * interval_s, 600)
            with watch_objects(cluster, "batchknee.io", "v1alpha1", "llmservings", progress.seen):
                while time.monotonic() - progress.start < limit_s and operator.poll() is None:
                    with progress.lock:
                        counts = len(progress.status), len(progress.observed), len(progress.steady)
                        done = progress.all_status is not None and progress.all_observed is not None
                        # a rolled-out fleet settles (a window after its rollouts) before the steady stretch
                        done = done and (mid_rollout or progress.all_steady is not None)
                    print(
                        f"[{n}] t={time.monotonic() - progress.start:5.0f}s status {counts[0]}/{n}, "
                        f"observed {counts[1]}/{n}, holding steady {counts[2]}/{n}, "
                        f"operator RSS {rss_mib(operator.pid):.0f} MiB",
                        flush=True,
                    )
                    if done:
                        break
                    time.sleep(5)
            all_status, all_observed, all_steady = (
                progress.all_status,
                progress.all_observed,
                progress.all_steady,
            )
            # A steady stretch of two evaluation intervals.
            steady_start = time.monotonic()
            cpu_start = cpu_seconds(operator.pid)
            # the control plane's share too: on one machine, what it leaves the operator
            plane = {name: pid for name, pid in cluster.pids().items() if name in ("kube-apiserver", "etcd")}
            plane_start = {name: cpu_seconds(pid) for name, pid in plane.items()}
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = operator_metrics(metrics_url)
            buckets_before = histogram_buckets(text, RECONCILES)
            collections_before = histogram_buckets(text, FULL_COLLECTIONS)
            writes_before = sum_samples(text, "batchknee_status_writes_total")
            server_before = apiserver_metrics(cluster)
            time.sleep(2 * interval_s)
            steady = time.monotonic() - steady_start
            cpu_share = (cpu_seconds(operator.pid) - cpu_start) / steady
            plane_share = {
                name: (cpu_seconds(pid) - plane_start[name]) / steady for name, pid in plane.items()
            }
            sizes = log.since(steady_start)
            all_sizes = log.since(0)
            text = operator_metrics(metrics_url)
            buckets = histogram_buckets(text, RECONCILES)
            writes = sum_samples(text, "batchknee_status_writes_total")
            server = apiserver_metrics(cluster)
            server_writes = subtract(status_write_buckets(server), status_write_buckets(server_before))
            requests = requests_between(server, server_before)
            steady_buckets = subtract(buckets, buckets_before)
            startup_requests = requests_between(at_all_status.get("server", at_start), at_start)
            startup_buckets = histogram_buckets(at_all_status.get("operator", ""), RECONCILES)
            collections = subtract(histogram_buckets(text, FULL_COLLECTIONS), collections_before)
            figures: dict[str, Any] = {
                "llmservings": n,
                "allStatusSeconds": None if all_status is None else round(all_status, 1),
                "allObservedSeconds": None if all_observed is None else round(all_observed, 1),
                "allSteadySeconds": None if all_steady is None else round(all_steady, 1),
                "evaluationIntervalSeconds": interval_s,
                "queriesPerInterval": round(len(sizes) / (steady / interval_s), 1),
                "maxQueryBytes": max(all_sizes, default=0),
                "rssMiB": round(rss_mib(operator.pid), 1),
                "cpuShare": round(cpu_share, 3),
                "apiserverCpuShare": round(plane_share.get("kube-apiserver", float("nan")), 3),
                "etcdCpuShare": round(plane_share.get("etcd", float("nan")), 3),
                "statusWritesPerInterval": round((writes - writes_before) / (steady / interval_s), 1),
                "deployments": "mid-rollout" if mid_rollout else "rolled-out",
                "reconcileP50Ms": quantile_ms(buckets, 0.5),
                "reconcileP95Ms": quantile_ms(buckets, 0.95),
                "reconciles": int(buckets[-1][1]) if buckets else 0,
                # the same over the steady stretch only (startup's first reconciles left out)
                "steadyReconcileP50Ms": quantile_ms(steady_buckets, 0.5),
                "steadyReconcileP95Ms": quantile_ms(steady_buckets, 0.95),
                "steadyReconciles": int(steady_buckets[-1][1]) if steady_buckets else 0,
                # Python's full collections in the operator over the steady stretch: each holds every thread
                "steadyFullCollections": int(collections[-1][1]) if collections else 0,
                "steadyFullCollectionP50Ms": quantile_ms(collections, 0.5),
                "steadyFullCollectionMaxMs": longest_ms(collections),
                # the apiserver's answer to each status write, timed by the apiserver
                "steadyStatusWriteServerP50Ms": quantile_ms(server_writes, 0.5),
                "steadyStatusWriteServerP95Ms": quantile_ms(server_writes, 0.95),
                "steadyApiserverRequests": {
                    what: int(count) for what, count in requests.most_common(8) if count > 0
                },
                # from the operator's start until every status: its reconciles, the apiserver's requests
                "startupReconcileP50Ms": quantile_ms(startup_buckets, 0.5),
                "startupReconcileP95Ms": quantile_ms(startup_buckets, 0.95),
                "startupReconciles": int(startup_buckets[-1][1]) if startup_buckets else 0,
                "startupApiserverRequests": {
                    what: int(count) for what, count in startup_requests.most_common(10) if count > 0
                },
                # cores each process spent until every status (of os.cpu_count())
                "startupCpuShares": startup.shares,
                "cpus": os.cpu_count(),
            }
            print(
                f"[{n}] every status {figures['allStatusSeconds']} s, every observation "
                f"{figures['allObservedSeconds']} s (interval {interval_s} s); "
                f"{figures['queriesPerInterval']} queries per interval, largest {figures['maxQueryBytes']} B; "
                f"RSS {figures['rssMiB']} MiB, CPU {cpu_share * 100:.0f} % (apiserver "
                f"{figures['apiserverCpuShare'] * 100:.0f} %, etcd {figures['etcdCpuShare'] * 100:.0f} %); "
                f"{figures['statusWritesPerInterval']} status writes per interval; reconcile p50 "
                f"{figures['reconcileP50Ms']} ms, p95 {figures['reconcileP95Ms']} ms "
                f"({figures['reconciles']} reconciles; in the steady stretch p50 "
                f"{figures['steadyReconcileP50Ms']} ms, p95 {figures['steadyReconcileP95Ms']} ms of "
                f"{figures['steadyReconciles']})",
                flush=True,
            )
            print(
                f"[{n}] in the steady stretch, {figures['steadyFullCollections']} full collections of "
                f"the operator's heap, p50 {figures['steadyFullCollectionP50Ms']} ms, the longest under "
                f"{figures['steadyFullCollectionMaxMs']} ms (its bucket's bound)",
                flush=True,
            )
            print(
                f"[{n}] in the steady stretch, the apiserver answered the status writes in p50 "
                f"{figures['steadyStatusWriteServerP50Ms']} ms, p95 {figures['steadyStatusWriteServerP95Ms']} ms "
                f"(its own histogram); its requests: "
                + ", ".join(f"{what} {count}" for what, count in figures["steadyApiserverRequests"].items()),
                flush=True,
            )
            print(
                f"[{n}] until every status, {figures['startupReconciles']} reconciles, p50 "
                f"{figures['startupReconcileP50Ms']} ms, p95 {figures['startupReconcileP95Ms']} ms; the "
                "apiserver's requests: "
                + ", ".join(f"{what} {count}" for what, count in figures["startupApiserverRequests"].items()),
                flush=True,
            )
            split = ", ".join(
                f"{name} {share * 100:.0f} %"
                for name, share in sorted(startup.shares.items(), key=lambda item: -item[1])
            )
            print(
                f"[{n}] until every status, of {os.cpu_count()} cores (100 % = one core): {split}; "
                f"{sum(startup.shares.values()) * 100:.0f} % in all",
                flush=True,
            )
            if not mid_rollout:
                # An operator upgrade: the same fleet, a new process with nothing in memory.
                stop_operator(operator)
                before_restart = apiserver_metrics(cluster)
                restart_start = time.monotonic()
                operator = start_operator()
                evaluated, text = wait_all_evaluated(operator, metrics_url, n, limit_s)
                restart = requests_between(apiserver_metrics(cluster), before_restart)
                restart_buckets = histogram_buckets(text, RECONCILES)
                figures |= {
                    "restartAllEvaluatedSeconds": None
                    if evaluated is None
                    else round(evaluated - restart_start, 1),
                    "restartReconcileP50Ms": quantile_ms(restart_buckets, 0.5),
                    "restartReconcileP95Ms": quantile_ms(restart_buckets, 0.95),
                    "restartReconciles": int(restart_buckets[-1][1]) if restart_buckets else 0,
                    "restartRetunes": int(sum_samples(text, "batchknee_retunes_total")),
                    "restartApiserverRequests": {
                        what: int(count) for what, count in restart.most_common(10) if count > 0
                    },
                }
                print(
                    f"[{n}] after a restart of the operator, every LLMServing evaluated in "
                    f"{figures['restartAllEvaluatedSeconds']} s, {figures['restartReconciles']} reconciles, "
                    f"p50 {figures['restartReconcileP50Ms']} ms, p95 {figures['restartReconcileP95Ms']} ms, "
                    f"{figures['restartRetunes']} rollouts; the apiserver's requests: "
                    + ", ".join(
                        f"{what} {count}" for what, count in figures["restartApiserverRequests"].items()
                    ),
                    flush=True,
                )
            return figures
    finally:
        if operator is not None:
            stop_operator(operator)
        exporter.terminate()
        exporter.wait(10)
        # The namespaces stay (the cluster is thrown away at the end): the next size's operator
        # watches only its own namespaces.


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200,1000", help="comma-separated numbers of LLMServings")
    parser.add_argument("--interval", type=int, default=30, help="evaluationIntervalSeconds")
    parser.add_argument("--window", type=int, default=60, help="windowSeconds")
    parser.add_argument(
        "--mid-rollout",
        action="store_true",
        help="leave every Deployment as applied (mid-rollout), not marked rolled out",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="batchknee-bench-scale-"))
    exporter_port = free_port()
    controllers = [
        c for c in DEFAULT_CONTROLLERS if c not in ("deployment-controller", "replicaset-controller")
    ]
    results = []
    with DevCluster(workdir=workdir / "cluster", controllers=controllers) as cluster:
        for crd in CRDS:
            cluster.kubectl("apply", "-f", str(crd))
        cluster.kubectl(
            "wait", "--for=condition=Established", "crd/llmservings.batchknee.io", "--timeout=180s"
        )
        fleet_job = {
            "job_name": "fleet",
            "honor_labels": True,
            "scrape_interval": f"{SCRAPE_S}s",
            "scrape_timeout": f"{SCRAPE_S}s",
            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}],
        }
        with LocalPrometheus(
            cluster.file_sd_path, scrape_interval_s=SCRAPE_S, extra_scrape_configs=[fleet_job]
        ) as prom:
            for n in sizes:
                results.append(
                    run_size(
                        n,
                        cluster,
                        prom,
                        exporter_port,
                        workdir,
                        args.interval,
                        args.window,
                        args.mid_rollout,
                    )
                )
    print(f"workdir (operator logs): {workdir}")
    print(json.dumps(results[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
