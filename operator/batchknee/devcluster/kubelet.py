"""The test kubelet: the one fake in the local cluster (there is no container runtime here).

Run as a child process of `DevCluster` (`python -m batchknee.devcluster.kubelet CONFIG.json`). It

- registers a Node with `nvidia.com/gpu` capacity and keeps it Ready (status heartbeat + Lease);
- for every pod the real kube-scheduler binds to the node: gives it its own pod IP from a /16
  block that this kubelet holds a lock on — 10.N.0.0/16 inside the run's private network namespace
  (`batchknee.devcluster.netns`), else 127.N.0.0/16 machine-wide — materialises ConfigMap, Secret
  and emptyDir volumes under the pod's folder, and runs each container whose `command[0]` names a
  configured runtime as a local process: `prefix + command[1:] + args + ["--host", podIP]`, with the
  pod's env (plus POD_IP, POD_NAME, POD_NAMESPACE), paths under a volumeMount rewritten to the host
  folder, cwd in the pod folder, output to <pod folder>/<container>.log. Other containers are marked
  running without a process;
- marks pods Running, and Ready once every container passes its httpGet/tcpSocket readiness probe
  (or has started, without one); restarts exited processes under restartPolicy (bounded backoff);
- on deletion does what a kubelet does, in its order: the pod turns Ready=False at once (so whatever
  routes by readiness stops sending it traffic), the containers' preStop hooks run (`exec`: the
  command as a local process in the pod folder with the container's env; `sleep`: a wait), then
  SIGTERM, and SIGKILL when the grace period (`deletionGracePeriodSeconds`, else
  `terminationGracePeriodSeconds`) runs out — hooks included, with at least 2 s left for SIGTERM, as
  a kubelet allows; then it deletes the pod with grace period 0 (else it stays Terminating forever);
- writes a Prometheus file_sd JSON of running pods' container ports (kept while they drain), labelled as a PodMonitor
  would (namespace, pod, container, and llmserving from the pod's batchknee.io/llmserving label) plus
  the pod's own labels.

Services: in the private namespace the controller-manager's EndpointSlice controller publishes the
pods' 10.x addresses as they turn Ready (and drops them when readiness does). On loopback addresses
it cannot (the apiserver's `ValidateNonSpecialIP` rejects them in EndpointSlices and Endpoints
alike), and readiness alone is the routing signal.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import fcntl
import http.client
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from batchknee.devcluster import netns
from batchknee.devcluster.kube import api_client_for, new_watch
from batchknee.devcluster.procs import Spawner, signal_group, stop_process
from batchknee.engines import sglang, trtllm, vllm

log = logging.getLogger("batchknee.kubelet")

API_TIMEOUT = (5, 15)  # connect, read seconds for every API call
HEARTBEAT_S = 10.0
TICK_S = 0.25
LLMSERVING_POD_LABEL = "batchknee.io/llmserving"  # copied to the `llmserving` target label
ENGINE_POD_LABEL = "app.kubernetes.io/name"
# Each engine's metrics path by its pod label, as the chart's PodMonitors select and scrape them.
METRICS_PATHS = {module.APP_NAME: module.HTTP.metrics_path for module in (vllm, trtllm, sglang)}
MAX_BACKOFF_S = 10.0
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
SHUTDOWN_GRACE_S = 3.0
MIN_KILL_GRACE_S = 2.0  # a kubelet's minimum grace for SIGTERM after the preStop hooks


@dataclass
class KubeletConfig:
    kubeconfig: str
    node_name: str
    workdir: str
    file_sd_path: str
    runtimes: dict[str, list[str]] = field(default_factory=dict)
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    max_pods: int = 110
    node_labels: dict[str, str] = field(default_factory=dict)
    kubernetes_version: str = "v1.36.3"
    pod_network: str = "loopback"  # or "netns": 10.x addresses in the run's private namespace

    @classmethod
    def load(cls, path: str | Path) -> KubeletConfig:
        return cls(**json.loads(Path(path).read_text()))

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.__dict__, indent=2))


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------
# Pod IPs: a /16 block per kubelet, exclusive through a lock file, so two clusters (parallel test
# sessions) never hand out the same address: 10.N.0.0/16 inside the run's private network namespace
# (locked per namespace), else 127.N.0.0/16 (locked machine-wide).

POD_NETWORKS = ("loopback", "netns")
SERVICE_BLOCK = 96  # 10.96.0.0/16 is the Service CIDR (DevCluster.SERVICE_CIDR): no pods there


class PodNetwork:
    LOCK_DIR = Path(tempfile.gettempdir()) / "batchknee-devcluster-podnet"

    def __init__(self, kind: str = "loopback") -> None:
        if kind not in POD_NETWORKS:
            raise ValueError(f"pod_network: {kind!r} is not one of {', '.join(POD_NETWORKS)}")
        if kind == "netns" and not netns.private():
            raise RuntimeError(
                "pod_network: netns needs the run's own network namespace "
                "(run under `python -m batchknee.devcluster.in_netns`)"
            )
        self.first_octet = 10 if kind == "netns" else 127
        # a namespace's 10.x addresses are its own: lock them per namespace
        scope = f"{netns.namespace_id().strip('net:[]')}-" if kind == "netns" else ""
        self.LOCK_DIR.mkdir(parents=True, exist_ok=True)
        octets = [o for o in range(1, 255) if not (kind == "netns" and o == SERVICE_BLOCK)]
        random.shuffle(octets)
        self._lock: IO[str] | None = None
        for octet in octets:
            f = (self.LOCK_DIR / f"{scope}{self.first_octet}.{octet}.lock").open("w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            f.write(f"{os.getpid()}\n")
            f.flush()
            self._lock, self.octet = f, octet
            break
        else:
            raise RuntimeError(
                f"no free {self.first_octet}.N.0.0/16 pod network: 254 local clusters running?"
            )
        self._next = 1
        self._used: set[str] = set()
        self._mutex = threading.Lock()

    def allocate(self) -> str:
        """The next unused address A.N.x.y (never .0 or .255), round-robin so an IP is not reused soon."""
        with self._mutex:
            for _ in range(65536):
                n = self._next
                self._next = self._next % 65534 + 1
                hi, lo = divmod(n, 256)
                if lo in (0, 255):
                    continue
                ip = f"{self.first_octet}.{self.octet}.{hi}.{lo}"
                if ip not in self._used:
                    self._used.add(ip)
                    return ip
        raise RuntimeError("pod network exhausted")

    def release(self, ip: str) -> None:
        with self._mutex:
            self._used.discard(ip)


# ---------------------------------------------------------------------------------------------------
# Container command lines, env and volumes.

_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined vars are replaced, $$ escapes, others stay literal."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(sub, text)


def rewrite_paths(text: str, mounts: list[tuple[str, str]]) -> str:
    """Map a path under a volumeMount's mountPath (also in `--flag=/path`) to the host folder."""

    def one(value: str) -> str:
        for mount_path, host_path in mounts:
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return host_path + value[len(mount_path.rstrip("/")) :]
        return value

    if text.startswith("-") and "=" in text:
        flag, value = text.split("=", 1)
        return f"{flag}={one(value)}"
    return one(text)


def sanitize_label(name: str) -> str:
    """A Kubernetes label key as a Prometheus label name (what relabelling with labelmap yields)."""
    out = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return out if not out[:1].isdigit() else "_" + out


# ---------------------------------------------------------------------------------------------------


@dataclass
class ContainerRun:
    """One container of a pod: its process (if a runtime runs it) and its status."""

    name: str
    image: str
    argv: list[str] | None  # None: no runtime for this command, marked running without a process
    env: dict[str, str]
    cwd: Path
    log_path: Path
    probe: dict[str, Any] | None
    restart_count: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    ready: bool = False
    probe_failures: int = 0
    probe_successes: int = 0
    next_probe: float = 0.0
    terminated: dict[str, Any] | None = None  # the current terminated state, while waiting to restart
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None
    waiting_reason: str | None = "ContainerCreating"

    def state(self) -> dict[str, Any]:
        if self.terminated is not None and self.restart_at is None:
            return {"terminated": self.terminated}
        if self.waiting_reason is not None:
            return {"waiting": {"reason": self.waiting_reason}}
        return {"running": {"startedAt": self.started_at}}

    def status(self, pod_uid: str) -> dict[str, Any]:
        running = self.waiting_reason is None and self.terminated is None
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": running,
            "restartCount": self.restart_count,
            "state": self.state(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.started_at is not None:
            status["containerID"] = f"batchknee://{pod_uid}-{self.name}-{self.restart_count}"
        return status


class PodWorker(threading.Thread):
    """Owns one pod from binding to deletion. Forks its processes itself and lives until they are
    gone (PR_SET_PDEATHSIG is per forking thread)."""

    def __init__(self, kubelet: Kubelet, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kubelet = kubelet
        self.pod = pod
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self._update = threading.Condition()
        self._deleted = False  # the API object is gone (DELETED event)
        self._shutdown = False  # the kubelet is stopping
        self.ip: str | None = None
        self.containers: list[ContainerRun] = []
        self.dir = Path(kubelet.cfg.workdir) / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        self._conditions: dict[str, dict[str, Any]] = {}
        self._last_status: str | None = None
        self._start_time = now_rfc3339()
        self.spawner: Spawner | None = None
        self.interrupted = False

    # -- events from the watch ---------------------------------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        with self._update:
            self.pod = pod
            self._update.notify_all()

    def deleted(self) -> None:
        with self._update:
            self._deleted = True
            self._update.notify_all()

    def shutdown(self) -> None:
        with self._update:
            self._shutdown = True
            self._update.notify_all()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.containers if c.proc is not None and c.proc.poll() is None]

    # -- lifecycle ---------------------------------------------------------------------------------

    def run(self) -> None:
        self.spawner = Spawner(name=f"spawn-{self.pod_name}")
        try:
            self._run()
        except Exception:
            log.exception("pod %s/%s: worker failed", self.namespace, self.pod_name)
            self.interrupted = True  # a later event for this pod may start a fresh worker
            self._kill_all(0)
        finally:
            self.kubelet.forget(self)
            if self.ip:
                self.kubelet.net.release(self.ip)
            self.spawner.close()

    def _run(self) -> None:
        self.ip = self.kubelet.net.allocate()
        self.dir.mkdir(parents=True, exist_ok=True)
        log.info("pod %s/%s: ip %s, dir %s", self.namespace, self.pod_name, self.ip, self.dir)
        if self._deletion_requested() or self._deleted:
            self._finish_deletion()
            return
        if not self._prepare_all():
            return
        self._push_status(force=True)
        for run in self.containers:
            self._start(run)
        self._push_status()
        while True:
            with self._update:
                self._update.wait(TICK_S)
                deleted, shutdown = self._deleted, self._shutdown
            if shutdown:
                self._kill_all(SHUTDOWN_GRACE_S)
                return
            if deleted:  # force-deleted: nothing to report back to
                self._kill_all(0)
                return
            if self._deletion_requested():
                self._finish_deletion()
                return
            self._tick()
            if self._all_terminated_for_good():
                self._push_status()
                return

    def _prepare_all(self) -> bool:
        """Volumes, env and command lines; retried (like a kubelet's FailedMount) while a ConfigMap
        or Secret is missing. False when the pod went away meanwhile."""
        spec = self.pod["spec"]
        attempt = 0
        while True:
            try:
                mounts = self._materialize_volumes()
                self.containers = [
                    self._prepare(c, mounts.get(c["name"], [])) for c in spec.get("containers", [])
                ]
                break
            except ApiException as exc:
                attempt += 1
                if attempt == 1 or attempt % 20 == 0:
                    log.warning(
                        "pod %s/%s: cannot prepare (%s), retrying", self.namespace, self.pod_name, exc.reason
                    )
            with self._update:
                self._update.wait(min(5.0, 0.5 * attempt))
                deleted, shutdown = self._deleted, self._shutdown
            if deleted or shutdown:
                return False
            if self._deletion_requested():
                self._finish_deletion()
                return False
        self._set_condition("PodReadyToStartContainers", True)
        self._set_condition("Initialized", True)
        return True

    def _deletion_requested(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def _grace_seconds(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    def _finish_deletion(self) -> None:
        deadline = time.monotonic() + self._grace_seconds()
        log.info("pod %s/%s: terminating: not ready, preStop, SIGTERM", self.namespace, self.pod_name)
        for run in self.containers:
            run.ready = False
        self._push_status()
        self._run_pre_stop_hooks(deadline)
        self._kill_all(max(MIN_KILL_GRACE_S, deadline - time.monotonic()))
        log.info("pod %s/%s: stopped, deleting", self.namespace, self.pod_name)
        self.kubelet.drop_target(self.uid)
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
        )
        try:
            self.kubelet.core.delete_namespaced_pod(
                self.pod_name, self.namespace, body=body, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s/%s: delete failed: %s", self.namespace, self.pod_name, exc.reason)

    def _run_pre_stop_hooks(self, deadline: float) -> None:
        """Every running container's preStop hook at once, cut off at `deadline`. A hook that fails
        or cannot start is logged and the termination goes on, as a kubelet's FailedPreStopHook."""
        hooks: list[tuple[ContainerRun, subprocess.Popen[bytes]]] = []
        sleep_until = time.monotonic()
        by_name = {c["name"]: c for c in self.pod["spec"].get("containers", [])}
        for run in self.containers:
            hook = ((by_name.get(run.name, {}).get("lifecycle") or {}).get("preStop")) or {}
            if run.proc is None or run.proc.poll() is not None:
                continue  # no process to run a hook for (a kubelet execs into a running container)
            if "sleep" in hook:
                sleep_until = max(sleep_until, time.monotonic() + float(hook["sleep"].get("seconds", 0)))
            command = (hook.get("exec") or {}).get("command")
            if not command:
                continue
            argv = [expand(str(a), run.env) for a in command]
            assert self.spawner is not None
            with run.log_path.open("ab") as out:
                out.write(f"--- {now_rfc3339()} preStop: {argv}\n".encode())
                out.flush()
                try:
                    proc = self.spawner.popen(
                        argv, env={**os.environ, **run.env}, cwd=run.cwd, stdout=out, stderr=out
                    )
                except OSError as exc:
                    out.write(f"--- preStop failed to start: {exc}\n".encode())
                    log.warning(
                        "pod %s/%s: preStop hook of %s: %s", self.namespace, self.pod_name, run.name, exc
                    )
                    continue
            hooks.append((run, proc))
        for run, proc in hooks:
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "pod %s/%s: preStop hook of %s outlived the grace period",
                    self.namespace,
                    self.pod_name,
                    run.name,
                )
                stop_process(proc, 0.0)
                continue
            if code != 0:
                log.warning(
                    "pod %s/%s: preStop hook of %s exited %s", self.namespace, self.pod_name, run.name, code
                )
        time.sleep(max(0.0, min(sleep_until, deadline) - time.monotonic()))

    def _kill_all(self, grace_s: float) -> None:
        # The scrape target stays while the processes drain, as Kubernetes service discovery keeps
        # a terminating pod: the engine's final counters (drops during a drain) reach Prometheus.
        procs = [c.proc for c in self.containers if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            stop_process(proc, max(0.0, deadline - time.monotonic()))
        for c in self.containers:
            if c.proc is not None and c.terminated is None:
                code = c.proc.returncode
                c.terminated = {
                    "exitCode": code if code is not None and code >= 0 else 128 + -(code or 9),
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": c.started_at,
                    "finishedAt": now_rfc3339(),
                }
            c.ready = False

    # -- volumes and command lines -------------------------------------------------------------------

    def _materialize_volumes(self) -> dict[str, list[tuple[str, str]]]:
        """Write volumes under <pod dir>/volumes/<name>; per container, (mountPath, host path) pairs."""
        volumes_dir = self.dir / "volumes"
        host_of: dict[str, Path] = {}
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            target = volumes_dir / name
            if "hostPath" in vol:
                host_of[name] = Path(vol["hostPath"]["path"])
                continue
            target.mkdir(parents=True, exist_ok=True)
            host_of[name] = target
            if "configMap" in vol:
                self._write_keys(target, vol["configMap"], self._read_configmap(vol["configMap"]))
            elif "secret" in vol:
                src = dict(vol["secret"], name=vol["secret"].get("secretName"))
                self._write_keys(target, src, self._read_secret(src))
        mounts: dict[str, list[tuple[str, str]]] = {}
        for c in self.pod["spec"].get("containers", []):
            pairs = []
            for m in c.get("volumeMounts") or []:
                host = host_of.get(m["name"])
                if host is None:
                    host = volumes_dir / m["name"]
                    host.mkdir(parents=True, exist_ok=True)
                if m.get("subPath"):
                    host = host / m["subPath"]
                pairs.append((m["mountPath"], str(host)))
            pairs.sort(key=lambda p: len(p[0]), reverse=True)  # longest mountPath wins
            mounts[c["name"]] = pairs
        return mounts

    def _read_configmap(self, src: Mapping[str, Any]) -> dict[str, bytes]:
        try:
            cm = self.kubelet.core.read_namespaced_config_map(
                src["name"], self.namespace, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404 and src.get("optional"):
                return {}
            raise
        data = {k: v.encode() for k, v in (cm.data or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()})
        return data

    def _read_secret(self, src: Mapping[str, Any]) -> dict[str, bytes]:
        try:
            secret = self.kubelet.core.read_namespaced_secret(
                src["name"], self.namespace, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404 and src.get("optional"):
                return {}
            raise
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    @staticmethod
    def _write_keys(target: Path, src: Mapping[str, Any], data: Mapping[str, bytes]) -> None:
        items = src.get("items")
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                continue
            path = target / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[key])

    def _env(self, c: Mapping[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                values = self._read_configmap(dict(ref, optional=ref.get("optional")))
            elif "secretRef" in src:
                ref = src["secretRef"]
                values = self._read_secret(dict(ref, optional=ref.get("optional")))
            else:
                continue
            env.update({prefix + k: v.decode(errors="replace") for k, v in values.items()})
        for var in c.get("env") or []:
            name = var["name"]
            if "value" in var:
                env[name] = expand(var["value"] or "", env)
                continue
            source = var.get("valueFrom") or {}
            if "fieldRef" in source:
                env[name] = self._field(source["fieldRef"]["fieldPath"])
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[name] = self._read_configmap(dict(ref, optional=True)).get(ref["key"], b"").decode()
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[name] = self._read_secret(dict(ref, optional=True)).get(ref["key"], b"").decode()
        return env

    def _field(self, path: str) -> str:
        meta = self.pod["metadata"]
        simple: dict[str, str] = {
            "metadata.name": self.pod_name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "status.podIP": self.ip or "",
            "status.hostIP": "127.0.0.1",
            "spec.nodeName": self.kubelet.cfg.node_name,
            "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", ""),
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        return ""

    def _prepare(self, c: Mapping[str, Any], mounts: list[tuple[str, str]]) -> ContainerRun:
        name = c["name"]
        env = self._env(c)
        command = [expand(a, env) for a in c.get("command") or []]
        args = [expand(a, env) for a in c.get("args") or []]
        prefix = self.kubelet.runtime_for(command[0]) if command else None
        argv = None
        if prefix is not None:
            rest = [rewrite_paths(a, mounts) for a in [*command[1:], *args]]
            argv = [*prefix, *rest, "--host", str(self.ip)]
        env = {k: rewrite_paths(v, mounts) for k, v in env.items()}
        env.update({"POD_IP": str(self.ip), "POD_NAME": self.pod_name, "POD_NAMESPACE": self.namespace})
        probe = c.get("readinessProbe")
        if probe and not any(k in probe for k in ("httpGet", "tcpSocket")):
            probe = None  # exec/grpc probes are not run: ready once started
        if probe:
            probe = dict(probe)
            port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
            if isinstance(port, str) and not port.isdigit():
                named = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
                port = named.get(port)
            probe["_port"] = int(port) if port is not None else None
        return ContainerRun(
            name=name,
            image=c.get("image", ""),
            argv=argv,
            env=env,
            cwd=self.dir,
            log_path=self.dir / f"{name}.log",
            probe=probe if argv is not None else None,
        )

    # -- processes, probes, status -----------------------------------------------------------------

    def _start(self, run: ContainerRun) -> None:
        run.terminated, run.restart_at, run.waiting_reason = None, None, None
        run.started_at = now_rfc3339()
        run.probe_failures = run.probe_successes = 0
        run.next_probe = time.monotonic()
        if run.argv is None:
            run.ready = True
            return
        env = {**os.environ, **run.env}
        env.pop("KUBECONFIG", None)
        assert self.spawner is not None
        with run.log_path.open("ab") as out:
            out.write(f"--- {now_rfc3339()} start #{run.restart_count}: {run.argv}\n".encode())
            out.flush()
            try:
                run.proc = self.spawner.popen(run.argv, env=env, cwd=run.cwd, stdout=out, stderr=out)
            except OSError as exc:
                out.write(f"--- failed to start: {exc}\n".encode())
                run.proc = None
                run.terminated = {"exitCode": 128, "reason": "StartError", "message": str(exc)}
                run.waiting_reason = "RunContainerError"
                self._schedule_restart(run)
                return
        run.ready = run.probe is None
        log.info("pod %s/%s: container %s pid %s", self.namespace, self.pod_name, run.name, run.proc.pid)
        self.kubelet.write_pids()

    def _schedule_restart(self, run: ContainerRun) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        code = (run.terminated or {}).get("exitCode", 1)
        if policy == "Never" or (policy == "OnFailure" and code == 0):
            run.restart_at = None
            return
        delay = min(MAX_BACKOFF_S, 2.0 ** min(run.restart_count, 8) * 0.5)
        run.restart_at = time.monotonic() + delay
        run.waiting_reason = "CrashLoopBackOff"

    def _tick(self) -> None:
        now = time.monotonic()
        for run in self.containers:
            if run.proc is not None and run.terminated is None:
                code = run.proc.poll()
                if code is not None:
                    log.info(
                        "pod %s/%s: container %s exited %s", self.namespace, self.pod_name, run.name, code
                    )
                    run.terminated = {
                        "exitCode": code if code >= 0 else 128 - code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": run.started_at,
                        "finishedAt": now_rfc3339(),
                    }
                    run.ready = False
                    self._schedule_restart(run)
                    self.kubelet.write_pids()
            if run.restart_at is not None and now >= run.restart_at:
                run.last_terminated = run.terminated
                run.restart_count += 1
                self._start(run)
            if run.probe and run.terminated is None and run.proc is not None and now >= run.next_probe:
                self._probe(run)
        self._push_status()

    def _probe(self, run: ContainerRun) -> None:
        probe = run.probe or {}
        ok = self._probe_once(probe)
        period = float(probe.get("periodSeconds", 10))
        if ok:
            run.probe_failures = 0
            run.probe_successes += 1
            if run.probe_successes >= int(probe.get("successThreshold", 1)):
                run.ready = True
        else:
            run.probe_successes = 0
            run.probe_failures += 1
            if run.ready and run.probe_failures >= int(probe.get("failureThreshold", 3)):
                run.ready = False
        # Until the first success, probe quickly; afterwards at the pod's own period.
        run.next_probe = time.monotonic() + (period if run.ready else min(period, 0.5))

    def _probe_once(self, probe: Mapping[str, Any]) -> bool:
        port = probe.get("_port")
        if port is None or self.ip is None:
            return False
        timeout = float(probe.get("timeoutSeconds", 1))
        if "tcpSocket" in probe:
            try:
                with socket.create_connection((self.ip, port), timeout=timeout):
                    return True
            except OSError:
                return False
        get = probe["httpGet"]
        if get.get("scheme", "HTTP").upper() != "HTTP":
            return False
        conn = http.client.HTTPConnection(self.ip, port, timeout=timeout)
        try:
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            conn.request("GET", get.get("path", "/") or "/", headers=headers)
            status = conn.getresponse().status
            return 200 <= status < 400
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _all_terminated_for_good(self) -> bool:
        return (
            bool(self.containers)
            and all(
                r.terminated is not None and r.restart_at is None
                for r in self.containers
                if r.argv is not None
            )
            and any(r.argv is not None for r in self.containers)
        )

    def _set_condition(self, kind: str, value: bool) -> None:
        status = "True" if value else "False"
        cur = self._conditions.get(kind)
        if cur is None or cur["status"] != status:
            self._conditions[kind] = {
                "type": kind,
                "status": status,
                "lastProbeTime": None,
                "lastTransitionTime": now_rfc3339(),
            }

    def _phase(self) -> str:
        run_local = [r for r in self.containers if r.argv is not None]
        if run_local and all(r.terminated is not None and r.restart_at is None for r in run_local):
            return (
                "Succeeded"
                if all(r.terminated and r.terminated["exitCode"] == 0 for r in run_local)
                else "Failed"
            )
        return "Running"

    def _push_status(self, force: bool = False) -> None:
        all_ready = bool(self.containers) and all(r.ready for r in self.containers)
        self._set_condition("ContainersReady", all_ready)
        self._set_condition("Ready", all_ready)
        status = {
            "phase": self._phase(),
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self._start_time,
            "qosClass": self.pod.get("status", {}).get("qosClass", "BestEffort"),
            "conditions": list(self._conditions.values()),
            "containerStatuses": [r.status(self.uid) for r in self.containers],
        }
        # Like a PodMonitor (role: pod), scrape a running pod whether or not it is ready yet.
        if status["phase"] == "Running" and any(
            r.proc is not None and r.proc.poll() is None for r in self.containers
        ):
            self.kubelet.set_targets(self.uid, scrape_targets(self.pod, str(self.ip)))
        else:
            self.kubelet.drop_target(self.uid)
        encoded = json.dumps(status, sort_keys=True)
        if not force and encoded == self._last_status:
            return
        try:
            self.kubelet.core.patch_namespaced_pod_status(
                self.pod_name, self.namespace, {"status": status}, _request_timeout=API_TIMEOUT
            )
            self._last_status = encoded
        except ApiException as exc:
            if exc.status == 404:
                self.deleted()
            else:
                log.warning("pod %s/%s: status update failed: %s", self.namespace, self.pod_name, exc.reason)


def scrape_targets(pod: Mapping[str, Any], ip: str) -> list[dict[str, Any]]:
    """The file_sd entries of a running pod: each container port, labelled with the pod's labels
    (sanitized) and, as the chart's PodMonitors relabel them, `namespace`, `pod` and `llmserving`.
    The path is `prometheus.io/path` where a pod has it, else its engine's (by its
    `app.kubernetes.io/name`, as the PodMonitors scrape them: on the `http` port), else /metrics."""
    meta = pod["metadata"]
    annotations = meta.get("annotations") or {}
    pod_labels = meta.get("labels") or {}
    if annotations.get("prometheus.io/scrape") == "false":
        return []
    engine_path = METRICS_PATHS.get(str(pod_labels.get(ENGINE_POD_LABEL)))
    # an engine's pod: its `http` port only, as the PodMonitors scrape it
    only_port = annotations.get("prometheus.io/port") or ("http" if engine_path else None)
    labels = {sanitize_label(k): str(v) for k, v in pod_labels.items()}
    path = annotations.get("prometheus.io/path") or engine_path
    targets = []
    for c in pod["spec"].get("containers", []):
        for p in c.get("ports") or []:
            port = p.get("containerPort")
            if port is None or (only_port and str(port) != only_port and p.get("name") != only_port):
                continue
            entry = dict(labels)
            entry.update({"namespace": meta["namespace"], "pod": meta["name"], "container": c["name"]})
            # as the chart's PodMonitor relabels it: the operator selects and groups by it
            if LLMSERVING_POD_LABEL in pod_labels:
                entry["llmserving"] = str(pod_labels[LLMSERVING_POD_LABEL])
            if p.get("name"):
                entry["endpoint"] = p["name"]
            if path:
                entry["__metrics_path__"] = path
            targets.append({"targets": [f"{ip}:{port}"], "labels": entry})
    return targets


# ---------------------------------------------------------------------------------------------------


class Kubelet:
    def __init__(self, cfg: KubeletConfig) -> None:
        self.cfg = cfg
        self.api = api_client_for(cfg.kubeconfig)
        self.api.configuration.connection_pool_maxsize = 64
        # Any: the calls below pass plain dicts, which the generated signatures do not admit.
        self.core: Any = client.CoreV1Api(self.api)
        self.coordination: Any = client.CoordinationV1Api(self.api)
        self.net = PodNetwork(cfg.pod_network)
        self.stop_event = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self._finished: set[str] = set()  # pods whose worker ended: never start them again
        self._workers_lock = threading.Lock()
        self._targets: dict[str, list[dict[str, Any]]] = {}
        self._targets_lock = threading.Lock()
        self.file_sd = Path(cfg.file_sd_path)
        self.file_sd.parent.mkdir(parents=True, exist_ok=True)
        self.pids_file = Path(cfg.workdir) / "kubelet-pids.json"
        atomic_write(self.file_sd, "[]\n")
        self.write_pids()

    # -- shared state ------------------------------------------------------------------------------

    def runtime_for(self, command0: str) -> list[str] | None:
        runtimes = self.cfg.runtimes
        if command0 in runtimes:
            return list(runtimes[command0])
        base = os.path.basename(command0)
        return list(runtimes[base]) if base in runtimes else None

    def forget(self, worker: PodWorker) -> None:
        with self._workers_lock:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]
            if not worker.interrupted:
                self._finished.add(worker.uid)
        self.write_pids()

    def set_targets(self, uid: str, targets: list[dict[str, Any]]) -> None:
        with self._targets_lock:
            if self._targets.get(uid) == targets:
                return
            self._targets[uid] = targets
            self._write_file_sd()

    def drop_target(self, uid: str) -> None:
        with self._targets_lock:
            if self._targets.pop(uid, None) is not None:
                self._write_file_sd()

    def _write_file_sd(self) -> None:
        entries = [t for uid in sorted(self._targets) for t in self._targets[uid]]
        atomic_write(self.file_sd, json.dumps(entries, indent=1) + "\n")

    def write_pids(self) -> None:
        with self._workers_lock:
            pids = {w.name: w.pids() for w in self.workers.values()}
        atomic_write(self.pids_file, json.dumps({"kubelet": os.getpid(), "pods": pids}) + "\n")

    # -- node --------------------------------------------------------------------------------------

    def _node_status(self) -> dict[str, Any]:
        cfg = self.cfg
        resources = {
            "cpu": cfg.cpu,
            "memory": cfg.memory,
            "pods": str(cfg.max_pods),
            "ephemeral-storage": "1Ti",
            "nvidia.com/gpu": str(cfg.gpus),
        }
        now = now_rfc3339()

        def cond(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self._booted,
            }

        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "test kubelet"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "test kubelet"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "test kubelet"),
                cond("Ready", "True", "KubeletReady", "batchknee test kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": cfg.node_name},
            ],
            "nodeInfo": {
                "machineID": self._machine_id,
                "systemUUID": self._machine_id,
                "bootID": self._machine_id,
                "kernelVersion": os.uname().release,
                "osImage": "batchknee test kubelet",
                "containerRuntimeVersion": "batchknee://local-process",
                "kubeletVersion": cfg.kubernetes_version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def register_node(self) -> None:
        self._booted = now_rfc3339()
        self._machine_id = uuid.uuid4().hex
        name = self.cfg.node_name
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.cfg.node_labels,
        }
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
        try:
            node = self.core.create_node(body, _request_timeout=API_TIMEOUT)
        except ApiException as exc:
            if exc.status != 409:
                raise
            node = self.core.read_node(name, _request_timeout=API_TIMEOUT)
        self._node_uid = node.metadata.uid
        self.heartbeat()
        # The TaintNodesByCondition admission plugin taints a new node not-ready; the node lifecycle
        # controller (off here) would lift it once the node reports Ready. Lift it ourselves.
        raw = self.core.read_node(name, _preload_content=False, _request_timeout=API_TIMEOUT)
        taints = json.loads(raw.data).get("spec", {}).get("taints") or []
        kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
        if len(kept) != len(taints):
            self.core.patch_node(
                name,
                [{"op": "replace", "path": "/spec/taints", "value": kept}],
                _request_timeout=API_TIMEOUT,
            )
        log.info("node %s registered and ready", name)

    def heartbeat(self) -> None:
        name = self.cfg.node_name
        self.core.patch_node_status(name, {"status": self._node_status()}, _request_timeout=API_TIMEOUT)
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": name,
                "namespace": "kube-node-lease",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self._node_uid}
                ],
            },
            "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now_micro()},
        }
        try:
            self.coordination.patch_namespaced_lease(
                name, "kube-node-lease", {"spec": lease["spec"]}, _request_timeout=API_TIMEOUT
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", lease, _request_timeout=API_TIMEOUT)

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(HEARTBEAT_S):
            try:
                self.heartbeat()
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    # -- pods --------------------------------------------------------------------------------------

    def _dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._workers_lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.deleted()
                return
            if worker is not None:
                worker.update(pod)
                return
            if self.stop_event.is_set() or uid in self._finished:
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not meta.get("deletionTimestamp"):
                return
            worker = PodWorker(self, pod)
            self.workers[uid] = worker
        worker.start()

    def _pods(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every pod bound to this node, as (event type, pod dict); relists after watch errors."""
        selector = f"spec.nodeName={self.cfg.node_name}"
        while not self.stop_event.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(
                    field_selector=selector, _preload_content=False, _request_timeout=API_TIMEOUT
                )
                data = json.loads(listing.data)
                rv = data["metadata"]["resourceVersion"]
                seen = set()
                for pod in data["items"]:
                    seen.add(pod["metadata"]["uid"])
                    yield "ADDED", pod
                with self._workers_lock:
                    gone = [w for uid, w in self.workers.items() if uid not in seen]
                for w in gone:
                    w.deleted()
                while not self.stop_event.is_set():
                    watcher = new_watch()
                    for event in watcher.stream(
                        self.core.list_pod_for_all_namespaces,
                        field_selector=selector,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=30,
                        _request_timeout=(5, 45),
                    ):
                        if self.stop_event.is_set():
                            watcher.stop()
                            break
                        raw = event["raw_object"]
                        if event["type"] == "ERROR":
                            raise ApiException(status=raw.get("code", 500), reason=raw.get("message"))
                        rv = raw["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            yield event["type"], raw
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("pod watch: %s %s", exc.status, exc.reason)
                    self.stop_event.wait(1.0)
            except Exception as exc:
                log.warning("pod watch failed: %s", exc)
                self.stop_event.wait(1.0)

    def _watch_loop(self) -> None:
        for kind, pod in self._pods():
            try:
                self._dispatch(kind, pod)
            except Exception:
                log.exception("dispatching %s failed", pod["metadata"].get("name"))

    # -- main --------------------------------------------------------------------------------------

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                self.register_node()
                break
            except Exception as exc:
                if time.monotonic() > deadline or self.stop_event.is_set():
                    raise
                log.info("waiting for the apiserver: %s", exc)
                self.stop_event.wait(0.5)
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True).start()
        self.stop_event.wait()
        self.shutdown()

    def shutdown(self) -> None:
        log.info("shutting down: stopping pod processes")
        with self._workers_lock:
            workers = list(self.workers.values())
        for w in workers:
            w.shutdown()
        for w in workers:
            w.join(timeout=SHUTDOWN_GRACE_S + 15)
        self.write_pids()


def _install_signal_handlers(stop: Callable[[], None]) -> None:
    def handler(signum: int, frame: object) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m batchknee.devcluster.kubelet CONFIG.json", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s", stream=sys.stderr
    )
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    kubelet = Kubelet(KubeletConfig.load(args[0]))
    _install_signal_handlers(kubelet.stop_event.set)
    with contextlib.suppress(KeyboardInterrupt):
        kubelet.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
