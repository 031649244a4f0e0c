"""A real local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler (built by `make tools`) as separate processes on 127.0.0.1, plus the test kubelet.

    with DevCluster(runtimes={"vllm": [sys.executable, "-m", "batchknee.emulator", "vllm"]}) as cluster:
        cluster.kubectl("get", "nodes")
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from batchknee.devcluster import netns, procs, tools
from batchknee.devcluster.kube import api_client_for
from batchknee.devcluster.kubelet import KubeletConfig
from batchknee.devcluster.pki import ClusterPKI, KeyPair, write_kubeconfig

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger("batchknee.devcluster")


class CommandFailed(subprocess.CalledProcessError):
    """A bundled tool (kubectl, helm) that failed, its message the tool's own error: a traceback of
    `make demo` names what went wrong, not only an exit status."""

    def __str__(self) -> str:
        said = (self.stderr or self.stdout or "").strip()
        return f"{super().__str__()}: {said[-2000:]}" if said else super().__str__()


# The controllers the tests and the operator need. Node lifecycle and taint eviction stay off: the
# test kubelet heartbeats, but nothing here should ever evict a pod behind a test's back.
DEFAULT_CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "statefulset-controller",  # adopted StatefulSets (spec.targetRef)
    "horizontal-pod-autoscaler-controller",  # an HPA scaling an LLMServing through its scale subresource
)
SERVICE_CIDR = "10.96.0.0/16"  # allocation only (the `kubernetes` Service, the scale benchmark's thousands); nothing routes there
# With routable pod addresses (the run's private network namespace): Services get endpoints.
POD_NETWORK_CONTROLLERS = ("endpointslice-controller",)
KEEP_ENV = "BATCHKNEE_KEEP_DEVCLUSTER"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _https_ok(port: int, path: str, context: ssl.SSLContext) -> bool:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


class DevCluster:
    """A throwaway local Kubernetes cluster. Use as a context manager (or `start()`/`stop()`).

    runtimes: maps a container's command[0] (e.g. "vllm") to a local argv prefix; the test kubelet
        runs `prefix + command[1:] + args + ["--host", podIP]` for such containers.
    workdir: where certificates, etcd data, logs and pod folders go; a temporary folder (removed on
        stop unless $BATCHKNEE_KEEP_DEVCLUSTER=1 or keep_workdir) when not given.
    audit: write the apiserver's audit log (JSON lines, `audit_log_path`) of every request made by a
        service account outside kube-system, at Metadata level: which calls an operator running
        with a service account's token really makes (the controllers' own accounts are left out).
    """

    def __init__(
        self,
        runtimes: Mapping[str, Sequence[str]] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        *,
        node_name: str = "batchknee-node",
        gpus: int = 8,
        node_labels: Mapping[str, str] | None = None,
        controllers: Sequence[str] = DEFAULT_CONTROLLERS,
        keep_workdir: bool | None = None,
        start_timeout_s: float = 120.0,
        verbosity: int = 1,
        audit: bool = False,
    ) -> None:
        self.runtimes = {k: list(v) for k, v in (runtimes or {}).items()}
        self._given_workdir = Path(workdir) if workdir is not None else None
        self.node_name = node_name
        self.gpus = gpus
        self.node_labels = dict(node_labels or {})
        # 10.x pod addresses inside the run's own network namespace (see devcluster.netns), where
        # EndpointSlices can hold them; 127.x otherwise
        self.pod_network = "netns" if netns.private() else "loopback"
        extra = POD_NETWORK_CONTROLLERS if self.pod_network == "netns" else ()
        self.controllers = tuple(controllers) + tuple(c for c in extra if c not in controllers)
        self.keep_workdir = (
            keep_workdir if keep_workdir is not None else os.environ.get(KEEP_ENV, "") not in ("", "0")
        )
        self.start_timeout_s = start_timeout_s
        self.verbosity = verbosity
        self.audit = audit
        self.tools_bin = tools.tools_bin()  # fail early, with the `make tools` hint
        self.workdir = Path()
        self.server = ""
        self.start_seconds: float | None = None
        self._components: dict[str, procs.Component] = {}
        self._spawner: procs.Spawner | None = None
        self._started = False
        self._atexit: Any = None
        self._ports: dict[str, int] = {}
        self._ca_cert = Path()

    # -- public API ---------------------------------------------------------------------------------

    @property
    def services_have_endpoints(self) -> bool:
        """Whether the EndpointSlice controller publishes Ready pods (routable pod addresses)."""
        return self.pod_network == "netns"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (client certificate in system:masters)."""
        return self.workdir / "kubeconfig"

    @property
    def file_sd_path(self) -> Path:
        """Prometheus file_sd JSON the test kubelet keeps current."""
        return self.workdir / "prometheus" / "file_sd.json"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def audit_log_path(self) -> Path:
        """The apiserver's audit log (with `audit=True`): one JSON event per line."""
        return self.logs_dir / "audit.log"

    def audit_events(self, username: str | None = None) -> list[dict[str, Any]]:
        """The audit log's events (stage ResponseComplete), those of `username` when given."""
        try:
            lines = self.audit_log_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:  # a line still being written
                continue
            if event.get("stage") != "ResponseComplete":
                continue
            if username is None or event.get("user", {}).get("username") == username:
                events.append(event)
        return events

    @property
    def pods_dir(self) -> Path:
        """Per-pod folders <namespace>_<name>_<uid8>/ with each container's log and volumes/."""
        return self.workdir / "pods"

    def api_client(self) -> ApiClient:
        """A new kubernetes.client.ApiClient for the admin kubeconfig."""
        return api_client_for(self.kubeconfig)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default os.environ) with KUBECONFIG set and the bundled tools first on PATH."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        # kubectl's discovery cache, the cluster's own: ~/.kube/cache is keyed by host and port, and a
        # loopback port is reused by the next cluster (whose resources another cluster's cache named)
        env["KUBECACHEDIR"] = str(self.workdir / "kube-cache")
        env["PATH"] = os.pathsep.join([str(self.tools_bin), env.get("PATH", "")]).rstrip(os.pathsep)
        return env

    def service_account_kubeconfig(
        self, namespace: str, account: str, path: Path, duration: str = "2h"
    ) -> Path:
        """A kubeconfig that authenticates with a token of ServiceAccount `namespace/account`, as an
        operator in a pod does (the admin's client certificate would otherwise win)."""
        token = self.kubectl("create", "token", account, "-n", namespace, f"--duration={duration}").stdout
        return write_kubeconfig(path, self.server, self._ca_cert, token.strip(), f"{namespace}-{account}")

    def helm(
        self, *args: str, home: Path, check: bool = True, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        """Run the bundled helm against this cluster, its cache, config and data under `home` (not
        the user's); output captured as text."""
        env = self.env()
        env.update(
            HELM_CACHE_HOME=str(home / "cache"),
            HELM_CONFIG_HOME=str(home / "config"),
            HELM_DATA_HOME=str(home / "data"),
        )
        argv = [str(self.tools_bin / "helm"), *args]
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the bundled kubectl against this cluster; output captured as text."""
        argv = [str(self.tools_bin / "kubectl"), *args]
        result = subprocess.run(
            argv, env=self.env(), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, argv, result.stdout, result.stderr)
        return result

    def pids(self) -> dict[str, int]:
        """PIDs of every process of the cluster: components, the kubelet and pod processes."""
        out = {name: c.pid for name, c in self._components.items()}
        out.update(self._pod_pids())
        return out

    def log_tail(self, component: str, lines: int = 40) -> str:
        comp = self._components.get(component)
        return comp.log_tail(lines) if comp else ""

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> Self:
        if self._started:
            return self
        t0 = time.monotonic()
        self._started = True
        self._atexit = functools.partial(_stop_at_exit, weakref.WeakMethod(self.stop))
        atexit.register(self._atexit)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        log.info("local cluster ready in %.1f s: %s", self.start_seconds, self.server)
        return self

    def _start(self) -> None:
        if self._given_workdir is not None:
            self.workdir = self._given_workdir.resolve()
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="batchknee-devcluster-"))
        for sub in ("logs", "pki", "prometheus", "pods", "certs"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self._spawner = procs.Spawner("devcluster-spawner")

        pki = ClusterPKI(self.workdir / "pki")
        self._ca_cert = pki.ca.cert
        ports = {n: free_port() for n in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler")}
        self._ports = ports
        self.server = f"https://127.0.0.1:{ports['apiserver']}"
        serving = pki.serving(
            "apiserver",
            dns=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=("127.0.0.1", "10.96.0.1"),
        )
        admin = pki.client("admin", "batchknee-admin", ("system:masters",))
        front_proxy = pki.client("front-proxy-client", "front-proxy-client")
        write_kubeconfig(self.kubeconfig, self.server, pki.ca.cert, admin, "batchknee-admin")
        kcm_kubeconfig = self._identity_kubeconfig(
            pki, "kube-controller-manager", "system:kube-controller-manager"
        )
        sched_kubeconfig = self._identity_kubeconfig(pki, "kube-scheduler", "system:kube-scheduler")
        kubelet_client = pki.client("kubelet", "batchknee-test-kubelet", ("system:masters",))
        kubelet_kubeconfig = write_kubeconfig(
            self.workdir / "pki" / "kubelet.kubeconfig",
            self.server,
            pki.ca.cert,
            kubelet_client,
            "batchknee-test-kubelet",
        )

        self._run("etcd", self._etcd_argv(ports), stop_grace_s=5)
        self._run("kube-apiserver", self._apiserver_argv(ports, pki, serving, front_proxy), stop_grace_s=10)

        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        ctx.load_cert_chain(str(admin.cert), str(admin.key))
        self._wait("kube-apiserver /readyz", lambda: _https_ok(ports["apiserver"], "/readyz", ctx))

        self._run("kube-controller-manager", self._kcm_argv(ports, pki, kcm_kubeconfig), stop_grace_s=5)
        self._run("kube-scheduler", self._scheduler_argv(ports, sched_kubeconfig), stop_grace_s=5)
        self._start_kubelet(kubelet_kubeconfig)

        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # their self-signed serving certs; loopback only
        self._wait("kube-controller-manager /healthz", lambda: _https_ok(ports["kcm"], "/healthz", insecure))
        self._wait("kube-scheduler /healthz", lambda: _https_ok(ports["scheduler"], "/healthz", insecure))
        self._wait_api_ready()

    def _identity_kubeconfig(self, pki: ClusterPKI, stem: str, user: str) -> Path:
        pair: KeyPair = pki.client(stem, user)
        return write_kubeconfig(
            self.workdir / "pki" / f"{stem}.kubeconfig", self.server, pki.ca.cert, pair, user
        )

    def _etcd_argv(self, ports: Mapping[str, int]) -> list[str]:
        client_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        return [
            str(self.tools_bin / "etcd"),
            "--name=devcluster",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=devcluster={peer_url}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",  # throwaway data; fsync dominates start time on small disks
            "--quota-backend-bytes=2147483648",
            "--log-level=warn",
        ]

    def _apiserver_argv(
        self, ports: Mapping[str, int], pki: ClusterPKI, serving: KeyPair, front_proxy: KeyPair
    ) -> list[str]:
        return [
            str(self.tools_bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",
            f"--secure-port={ports['apiserver']}",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--authorization-mode=RBAC",
            # OpenShift's default, off in upstream's: an object whose owner reference blocks the
            # owner's deletion may be written only by who may update the owner's finalizers
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--service-account-key-file={pki.service_account.cert}",
            f"--service-account-signing-key-file={pki.service_account.key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Front-proxy (aggregation) identity, as kubeadm sets it up; also lets the controllers'
            # delegated authentication find a request-header CA instead of logging errors.
            f"--requestheader-client-ca-file={pki.ca.cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy.cert}",
            f"--proxy-client-key-file={front_proxy.key}",
            "--allow-privileged=true",
            "--profiling=false",
            f"--v={self.verbosity}",
            *self._audit_argv(),
        ]

    def _audit_argv(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [
                        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
                        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                        {"level": "None"},
                    ],
                }
            )
        )
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log_path}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
        ]

    def _kcm_argv(self, ports: Mapping[str, int], pki: ClusterPKI, kubeconfig: Path) -> list[str]:
        return [
            str(self.tools_bin / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['kcm']}",
            f"--cert-dir={self.workdir / 'certs'}",
            "--leader-elect=false",
            f"--controllers={','.join(self.controllers)}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.service_account.key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--kube-api-qps=200",
            "--kube-api-burst=400",
            "--profiling=false",
            f"--v={self.verbosity}",
        ]

    def _scheduler_argv(self, ports: Mapping[str, int], kubeconfig: Path) -> list[str]:
        return [
            str(self.tools_bin / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports['scheduler']}",
            f"--cert-dir={self.workdir / 'certs'}",
            "--leader-elect=false",
            "--profiling=false",
            f"--v={self.verbosity}",
        ]

    def _start_kubelet(self, kubeconfig: Path) -> None:
        version = (self.tools_bin / "KUBERNETES_VERSION").resolve()
        cfg = KubeletConfig(
            kubeconfig=str(kubeconfig),
            node_name=self.node_name,
            workdir=str(self.workdir),
            file_sd_path=str(self.file_sd_path),
            runtimes=self.runtimes,
            gpus=self.gpus,
            node_labels=self.node_labels,
            pod_network=self.pod_network,
            kubernetes_version=version.read_text().strip() if version.is_file() else "v1.36.3",
        )
        cfg_path = self.workdir / "kubelet.json"
        cfg.dump(cfg_path)
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._run(
            "kubelet",
            [
                sys.executable,
                "-c",
                "import sys; from batchknee.devcluster.kubelet import main; sys.exit(main())",
                str(cfg_path),
            ],
            env=env,
            stop_grace_s=25,
        )

    def _run(
        self, name: str, argv: list[str], env: Mapping[str, str] | None = None, stop_grace_s: float = 10
    ) -> None:
        assert self._spawner is not None
        self._components[name] = procs.start_component(
            self._spawner, name, argv, self.logs_dir, env=env, cwd=self.workdir, stop_grace_s=stop_grace_s
        )

    def _check_alive(self) -> None:
        for name, comp in self._components.items():
            if not comp.alive():
                raise RuntimeError(
                    f"{name} exited with status {comp.proc.returncode} while the cluster started; "
                    f"last lines of {comp.log_path}:\n{comp.log_tail()}"
                )

    def _wait(self, what: str, predicate: Any) -> None:
        def check() -> bool:
            self._check_alive()
            return bool(predicate())

        procs.wait_until(check, self.start_timeout_s, what, interval_s=0.1, on_timeout=self._diagnostics)

    def _diagnostics(self) -> str:
        return "\n".join(f"--- {n} ({c.log_path}):\n{c.log_tail(15)}" for n, c in self._components.items())

    def _wait_api_ready(self) -> None:
        """The node is Ready and pods can be created (the `default` service account exists)."""
        from kubernetes import client

        with self.api_client() as api:
            core = client.CoreV1Api(api)

            def node_ready() -> bool:
                try:
                    node = core.read_node(self.node_name, _request_timeout=5)
                except client.ApiException:
                    return False
                conditions = node.status.conditions if node.status else None
                taints = node.spec.taints if node.spec else None
                return any(c.type == "Ready" and c.status == "True" for c in conditions or []) and not any(
                    t.key == "node.kubernetes.io/not-ready" for t in taints or []
                )

            def default_sa() -> bool:
                try:
                    core.read_namespaced_service_account("default", "default", _request_timeout=5)
                except client.ApiException:
                    return False
                return True

            self._wait(f"node {self.node_name} Ready and untainted", node_ready)
            self._wait("the default service account", default_sa)

    def _pod_pids(self) -> dict[str, int]:
        try:
            state = json.loads((self.workdir / "kubelet-pids.json").read_text())
        except (OSError, ValueError):
            return {}
        out: dict[str, int] = {}
        for worker, pids in state.get("pods", {}).items():
            for i, pid in enumerate(pids):
                out[f"{worker}#{i}"] = int(pid)
        return out

    def stop(self) -> None:
        """Stop every process (kubelet and its pods first, etcd last) and remove the temp workdir."""
        if not self._started:
            return
        self._started = False
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        pod_pids = self._pod_pids()
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            comp = self._components.get(name)
            if comp is not None:
                with contextlib.suppress(Exception):
                    comp.stop()
        # Anything the kubelet left (it was killed mid-way?) — its pods lead their own groups.
        for pid in {**pod_pids, **self._pod_pids()}.values():
            if procs.pid_alive(pid):
                procs.signal_group(pid, signal.SIGKILL)
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self._given_workdir is None and not self.keep_workdir and self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.workdir != Path():
            log.info("kept the cluster's folder %s", self.workdir)


def _stop_at_exit(ref: weakref.WeakMethod[Any]) -> None:
    stop = ref()
    if stop is not None:
        stop()
