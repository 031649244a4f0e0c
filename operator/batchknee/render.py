"""The engine's Kubernetes objects from an LLMServing and the decided batch limit (pure), and the
reverse: what a Deployment in the cluster runs (`deployment_state`).

The objects are plain dicts for server-side apply (field manager "batchknee"): a Deployment named
exactly like the LLMServing (the Prometheus adapter finds its pods as `<name>-<rs hash>-<pod hash>`),
a Service on the OpenAI port 8000, and for TensorRT-LLM a ConfigMap with the LLM API options file.

Restart safety: the rollout history (time, from, to, reason) is an annotation on the Deployment,
written in the same apply as the new batch limit, so the change and its record land together.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import yaml

from batchknee.api.models import (
    API_VERSION,
    KIND,
    REASON_CHARS,
    Engine,
    LLMServing,
    LLMServingSpec,
    format_timestamp,
)
from batchknee.api.resolve import progress_deadline_seconds, trtllm_kv_cache
from batchknee.core.engine_args import (
    ENGINE_CONFIG_DIR,
    ENGINE_CONFIG_FILE,
    SGLANG_MANAGED,
    TRTLLM_MANAGED,
    VLLM_MANAGED,
    VLLM_PORT,
    flag_value,
    int_flag,
    overridden_flags,
    sglang_args,
    sglang_command,
    trtllm_args,
    trtllm_command,
    vllm_args,
    vllm_command,
)
from batchknee.core.policy import HISTORY_KEPT, Rollout
from batchknee.engines import sglang, trtllm, vllm

FIELD_MANAGER = "batchknee"
CONTAINER = "engine"
LABEL = "batchknee.io/llmserving"
ROLLOUTS_ANNOTATION = "batchknee.io/rollouts"
LAST_ROLLOUT_ANNOTATION = "batchknee.io/last-rollout-time"
# when a new pod template not of a batch-limit change (the spec's, the operator's own) was last
# applied: a stall after it is that template's, not the last batch limit's
TEMPLATE_CHANGED_ANNOTATION = "batchknee.io/template-changed-time"
# the LLMServing generation the Deployment was last rendered from: a template the spec changed
# since rolls as its writer asked, without a place from the pacer
SPEC_GENERATION_ANNOTATION = "batchknee.io/spec-generation"
# the pod template (its hash) that last rolled out with a place from the pacer: an operator started
# while that rollout is still under way takes the place again
PACED_TEMPLATE_ANNOTATION = "batchknee.io/paced-template"
MAX_NUM_SEQS_ANNOTATION = "batchknee.io/max-num-seqs"
MAX_TOKENS_ANNOTATION = "batchknee.io/max-tokens"
CHECKSUM_ANNOTATION = "batchknee.io/engine-config-checksum"
CONFIG_VOLUME = "batchknee-engine-config"
ENGINE_CONFIG_COMPONENT = "engine-config"
ENGINE_CONFIGS_KEPT = 3  # the current options ConfigMap and the two before it
ENGINE_MODULES = {Engine.VLLM: vllm, Engine.TensorRTLLM: trtllm, Engine.SGLang: sglang}
METRICS_PATH = {engine: module.HTTP.metrics_path for engine, module in ENGINE_MODULES.items()}
HEALTH_PATH = {engine: module.HTTP.health_path for engine, module in ENGINE_MODULES.items()}
APP_NAME = {engine: module.APP_NAME for engine, module in ENGINE_MODULES.items()}
GPU_RESOURCE = "nvidia.com/gpu"
# The engine images run as root by default; the restricted profile wants a non-root user (1000 is
# the first ordinary user of the Debian/Ubuntu bases the engine images build on).
RESTRICTED_POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# That user has no entry in the images' /etc/passwd, so the runtime gives it HOME=/, where it may
# write nothing: Hugging Face downloads, vLLM's compile cache, Triton's and FlashInfer's kernels all
# go under HOME. A pod-lifetime folder is its home (HF_HOME on a volume of yours keeps downloads).
ENGINE_HOME = "/home/engine"
HOME_VOLUME = "batchknee-home"
# Tensor parallelism's workers and NCCL share memory through /dev/shm, which a container gets at
# 64 MiB: far too little (a bus error at the first all-reduce); a memory-backed folder takes its place.
SHM_VOLUME = "batchknee-shm"
SHM_PATH = "/dev/shm"
# What vLLM is given to finish requests in flight after SIGTERM: the grace period left after the
# preStop drain, less a margin for its own exit before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_S = 5
# SGLang's /health generates a token and waits for the scheduler (at least a second, longer behind a
# long prefill): a 2-s probe timeout took busy pods out of their Service.
PROBE_TIMEOUT_S = {Engine.VLLM: 2, Engine.TensorRTLLM: 2, Engine.SGLang: 10}


@dataclass(frozen=True)
class RenderDefaults:
    """Operator-wide defaults (from its settings)."""

    vllm_image: str = f"vllm/vllm-openai:v{vllm.VERSION}"
    trtllm_image: str = f"nvcr.io/nvidia/tensorrt-llm/release:{trtllm.VERSION}"
    sglang_image: str = f"lmsysorg/sglang:v{sglang.VERSION}"
    # a PodDisruptionBudget per LLMServing (settings.disruption_budgets says when to turn it off)
    disruption_budgets: bool = True

    def image(self, engine: Engine) -> str:
        if engine == Engine.SGLang:
            return self.sglang_image
        return self.vllm_image if engine == Engine.VLLM else self.trtllm_image


@dataclass(frozen=True)
class Desired:
    """What to run: the batch limit, and the rollout record. `max_tokens` (B × context) is the
    policy's figure of the KV the batch holds; it is not rendered (see `engine_config`)."""

    max_num_seqs: int
    max_tokens: int
    rollouts: tuple[Rollout, ...] = ()
    template_changed_at: datetime | None = None
    paced_template: str | None = None


# --- labels, owners --------------------------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL: name}


def labels(obj: LLMServing) -> dict[str, str]:
    """The labels of the engine pods and of every object the operator makes for them. No
    `app.kubernetes.io/instance`: its value would be the tenant's choice of name, and with
    `app.kubernetes.io/name` it is how a Helm-installed engine's Service, NetworkPolicy or
    ServiceMonitor selects, and how Argo CD (by default before 3.0) tells an application's objects —
    the tenant's pods would join another team's Service, their Service another team's scrape job, and
    their Deployment another team's application (pruned by its sync). The pods are found by
    `batchknee.io/llmserving`, whose value no other LLMServing in the namespace can take."""
    return {
        "app.kubernetes.io/name": APP_NAME[obj.spec.engine],
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": "batchknee",
        LABEL: obj.metadata.name,
    }


def owner_reference(obj: LLMServing) -> dict[str, Any]:
    if not obj.metadata.uid:
        raise ValueError("the LLMServing has no uid: read it from the cluster before rendering")
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": obj.metadata.name,
        "uid": obj.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controlled_by(existing: Mapping[str, Any], uid: str | None) -> bool:
    """Is `existing` (an object as stored) controlled by the LLMServing with this uid? Only such an
    object may be applied over: anything else of the same name belongs to someone else."""
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    return uid is not None and any(r.get("controller") and r.get("uid") == uid for r in refs)


def crash_looping(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """`pod/container (exit N: message)` for each engine container the kubelet reports waiting in
    CrashLoopBackOff (or failing to start): the engine cannot run what it was given."""
    found = []
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (status.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") not in ("CrashLoopBackOff", "RunContainerError"):
                continue
            last = (status.get("lastState") or {}).get("terminated") or {}
            detail = f"exit {last['exitCode']}" if "exitCode" in last else str(waiting["reason"])
            found.append(f"{pod['metadata']['name']}/{status.get('name')} ({detail})")
    return found


# How long past its deletionTimestamp a terminating pod still counts as draining. The apiserver sets
# that time to the delete's plus the pod's grace period: the kubelet has killed it by then (its
# preStop and SIGTERM included), and deletes it a few seconds later. One still there past the margin
# is stuck (its node gone, a finalizer): it no longer counts, so it cannot hold retuning forever.
DRAIN_MARGIN_S = 60
MAX_DRAIN = timedelta(days=1)  # a grace period longer than this is no drain to wait for (stuck)


def draining(pods: Sequence[Mapping[str, Any]], now: datetime) -> list[str]:
    """The pods still terminating (`metadata.deletionTimestamp`), within their grace period plus
    DRAIN_MARGIN_S: Prometheus scrapes them until they are deleted, serving fewer and fewer requests
    as they drain. One whose phase has ended runs nothing and is not scraped."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        deadline = parse_timestamp(meta.get("deletionTimestamp"))
        if deadline is not None and deadline - MAX_DRAIN <= now < deadline + timedelta(
            seconds=DRAIN_MARGIN_S
        ):
            found.append(str(meta.get("name")))
    return found


def ready_since(pods: Sequence[Mapping[str, Any]]) -> datetime | None:
    """When the newest of the pods not terminating turned Ready: a rollout's last new pod, about
    when the Deployment counted it complete (None: no such time)."""
    times = [
        condition_time(condition)
        for pod in pods
        if not (pod.get("metadata") or {}).get("deletionTimestamp")
        for condition in (pod.get("status") or {}).get("conditions") or []
        if condition.get("type") == "Ready" and condition.get("status") == "True"
    ]
    return max((t for t in times if t is not None), default=None)


def _metadata(obj: LLMServing, name: str, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": obj.metadata.namespace,
        "labels": labels(obj),
        "ownerReferences": [owner_reference(obj)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


# --- rollout record --------------------------------------------------------------------------------


def encode_rollouts(rollouts: Sequence[Rollout]) -> str:
    entries = []
    for r in rollouts:
        entry: dict[str, Any] = {
            "time": format_timestamp(r.time),
            "from": r.from_value,
            "to": r.to_value,
            "reason": r.reason,
        }
        if r.target is not None:
            entry["target"] = round(r.target, 3)
        if r.live:
            entry["live"] = True
        entries.append(entry)
    return json.dumps(entries, ensure_ascii=False, separators=(",", ":"))


def decode_rollouts(text: str | None) -> tuple[Rollout, ...]:
    """The rollout record (`read_rollouts` without its note). Never an exception."""
    return read_rollouts(text)[0]


def read_rollouts(text: Any) -> tuple[tuple[Rollout, ...], str | None]:
    """The rollout record, its newest `HISTORY_KEPT` readable entries by time, and what was damaged
    in it (None: nothing). An entry edited by hand into something unreadable (a time without its
    zone, a limit of 1e999, a nested value) is skipped, not the whole record: the rest still holds
    the cooldown, the budget and the stall rollback. Never an exception."""
    if not text:
        return (), None
    try:
        entries = json.loads(text)
    except (TypeError, ValueError, RecursionError):  # RecursionError: a deeply nested value
        return (), "not JSON: read as no record"
    if not isinstance(entries, list):
        return (), "not a JSON list: read as no record"
    rollouts = [rollout for rollout in map(_rollout, entries) if rollout is not None]
    note = None
    if len(rollouts) < len(entries):
        note = f"{len(entries) - len(rollouts)} of its {len(entries)} entries unreadable: skipped"
    return tuple(sorted(rollouts, key=lambda r: r.time)[-HISTORY_KEPT:]), note


def _rollout(entry: Any) -> Rollout | None:
    """One entry of the record; None when any field is not what `encode_rollouts` writes."""
    if not isinstance(entry, dict):
        return None
    time, before, reason, target = (entry.get(key) for key in ("time", "from", "reason", "target"))
    # a time without its zone would make every comparison with an aware time raise
    moment = parse_timestamp(time) if isinstance(time, str) else None
    after = _batch_limit(entry.get("to"))
    if moment is None or after is None or not isinstance(reason, str):
        return None
    if before is not None and (before := _batch_limit(before)) is None:
        return None
    if not (isinstance(target, int | float) and not isinstance(target, bool) and math.isfinite(target)):
        target = None
    return Rollout(
        moment,
        before,
        after,
        reason[:REASON_CHARS],  # as status holds it (a hand-edited one may be any length)
        float(target) if target is not None and target > 0 else None,
        live=entry.get("live") is True,
    )


def _batch_limit(value: Any) -> int | None:
    """A batch limit as the record writes it: a positive integer, none past `MAX_READ_INT`."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_READ_INT:
        return value
    return None


# --- the engine objects ----------------------------------------------------------------------------


def engine_config(obj: LLMServing, desired: Desired) -> str:
    """TensorRT-LLM's LLM API options file: the user's extra options under the managed keys.

    The batch limit is `max_batch_size`. No `kv_cache_config.max_tokens` is set for it: under
    TensorRT-LLM's default GUARANTEED_NO_EVICT scheduler a request is admitted only when its whole
    prompt + maximum output fits, so a token cap of B × the average context admits fewer than B
    (10.7 running instead of 15.9 at B 16, context 8,192) — and the per-request maximum output,
    which sets the reservation, is the clients' to choose. The pool stays sized by the free-memory
    fraction (or the user's own cap), the same figures the math uses (`trtllm_kv_cache`)."""
    memory = trtllm_kv_cache(obj.spec)
    options: dict[str, Any] = dict(obj.spec.extra_llm_api_options or {})  # only its top and kv change
    kv = options.get("kv_cache_config")
    kv = dict(kv) if isinstance(kv, dict) else {}
    kv["free_gpu_memory_fraction"] = memory.free_gpu_memory_fraction
    if memory.max_tokens is not None:
        kv["max_tokens"] = memory.max_tokens
    if memory.dtype is not None:
        kv["dtype"] = memory.dtype
    options["kv_cache_config"] = kv
    options["max_batch_size"] = desired.max_num_seqs
    options[trtllm.TP_OPTION] = obj.spec.gpu.count  # the pod holds that many GPUs
    options.update(trtllm.metrics_options(trtllm_backend(obj.spec)))
    try:
        text = json.dumps(options, sort_keys=True)
        cached = json.loads(text) == options
    except (TypeError, ValueError):
        cached = False
    # what JSON does not carry as it is (a manifest read from YAML outside a cluster) is dumped as is
    return _OPTIONS_FILES.yaml(text) if cached else yaml.safe_dump(options, sort_keys=True)


class _YamlCache:
    """Options files by the digest of their JSON, the most recently used within `max_chars` in all.
    PyYAML's dumper is pure Python, a hundred times slower than json: an object's file is rendered
    several times an evaluation, and alike until it changes."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.texts: OrderedDict[bytes, str] = OrderedDict()
        self.chars = 0
        self.lock = threading.Lock()  # the reconcile workers render at once

    def yaml(self, options: str) -> str:
        key = hashlib.sha256(options.encode()).digest()
        with self.lock:
            text = self.texts.get(key)
            if text is not None:
                self.texts.move_to_end(key)
                return text
        text = yaml.safe_dump(json.loads(options), sort_keys=True)
        with self.lock:
            if key not in self.texts and len(text) <= self.max_chars:
                self.texts[key] = text
                self.chars += len(text)
            while self.chars > self.max_chars:
                self.chars -= len(self.texts.popitem(last=False)[1])
        return text


# A thousand TensorRT-LLM objects' files of a few hundred characters each, or a dozen of the largest
# spec.extraLlmApiOptions admits (64 Ki emoji are 700 KB of YAML escapes).
_OPTIONS_FILES = _YamlCache(max_chars=8 * 2**20)


def trtllm_backend(spec: LLMServingSpec) -> str | None:
    """The LLM API backend the pods run: the options file's `backend` (it overrides the flags), else
    `--backend` in spec.args; None: trtllm-serve's default."""
    options = spec.extra_llm_api_options if isinstance(spec.extra_llm_api_options, dict) else {}
    given = options.get("backend") or flag_value(spec.args, "--backend", trtllm.COMMAND_LINE)
    return str(given) if given else None


def config_map(obj: LLMServing, desired: Desired) -> dict[str, Any]:
    """The options file as an immutable ConfigMap named after its content: a pod (re)started at any
    point of a rollout mounts exactly the file its Deployment revision names."""
    text = engine_config(obj, desired)
    meta = _metadata(obj, config_map_name(obj.metadata.name, text))
    meta["labels"]["app.kubernetes.io/component"] = ENGINE_CONFIG_COMPONENT
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "immutable": True,
        "data": {ENGINE_CONFIG_FILE: text},
    }


def config_map_name(name: str, text: str) -> str:
    """`<name>-engine-<8 hex of the content's sha256>` (adds 16 characters to the LLMServing name)."""
    return f"{name}-engine-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def engine_config_selector(name: str) -> dict[str, str]:
    """The labels of one LLMServing's options ConfigMaps (to find the old ones)."""
    return {LABEL: name, "app.kubernetes.io/component": ENGINE_CONFIG_COMPONENT}


def stale_engine_configs(
    obj: LLMServing, found: Sequence[Mapping[str, Any]], current: str, keep: int = ENGINE_CONFIGS_KEPT
) -> list[tuple[str, str]]:
    """(name, uid) of this LLMServing's options ConfigMaps past the newest `keep` (the current one
    always kept): old ReplicaSets' pods of a rollout still under way mount the previous ones. Only
    ConfigMaps this LLMServing controls are ever named."""
    ours = [
        item
        for item in found
        if any(
            ref.get("controller") and ref.get("uid") == obj.metadata.uid
            for ref in item.get("metadata", {}).get("ownerReferences") or []
        )
    ]
    ours.sort(key=lambda item: str(item["metadata"].get("creationTimestamp") or ""), reverse=True)
    others = [item for item in ours if item["metadata"].get("name") != current]
    return [(str(i["metadata"]["name"]), str(i["metadata"].get("uid") or "")) for i in others[keep - 1 :]]


def service(obj: LLMServing) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(obj, obj.metadata.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(obj.metadata.name),
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _resources(obj: LLMServing) -> dict[str, Any]:
    given = obj.spec.pod_template.resources
    resources: dict[str, Any] = given.dump() if given is not None else {}
    count = str(obj.spec.gpu.count)
    limits = dict(resources.get("limits") or {})
    limits[GPU_RESOURCE] = count
    resources["limits"] = limits
    if isinstance(resources.get("requests"), dict) and GPU_RESOURCE in resources["requests"]:
        resources["requests"] = {**resources["requests"], GPU_RESOURCE: count}
    return resources


def pod_security_context(obj: LLMServing) -> dict[str, Any]:
    """The restricted Pod Security Standard unless the spec says otherwise (loosening it is
    admin-gated in batchknee.api.admission): a non-root user, the runtime's seccomp profile."""
    given = obj.spec.pod_template.security_context
    return {**RESTRICTED_POD_SECURITY_CONTEXT, **(given.dump() if given is not None else {})}


def container_security_context(obj: LLMServing) -> dict[str, Any]:
    """No privilege escalation and every capability dropped (plus what the spec adds, admin-gated)."""
    given = obj.spec.pod_template.container_security_context
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        **(given.dump() if given is not None else {}),
    }
    drop = list(dict.fromkeys(["ALL", *context.get("capabilities", {}).get("drop", [])]))
    context["capabilities"] = {**context.get("capabilities", {}), "drop": drop}
    return context


def deployment(obj: LLMServing, desired: Desired, defaults: RenderDefaults) -> dict[str, Any]:
    spec, name = obj.spec, obj.metadata.name
    template = spec.pod_template
    served = spec.model.served_model_name or spec.model.name

    # No `prometheus.io/scrape`: it opts the pods into annotation-based scrape jobs, which commonly
    # honour the series' own labels (the prometheus-community chart's `kubernetes-pods`), where an
    # engine running a tenant's code could write another LLMServing's `namespace` and `llmserving`.
    # The chart's PodMonitors select the pods by label and set those labels themselves.
    pod_annotations: dict[str, str] = dict(template.annotations or {})
    pod_annotations[MAX_NUM_SEQS_ANNOTATION] = str(desired.max_num_seqs)

    volume_mounts = [mount.dump() for mount in template.volume_mounts or []]
    volumes = [volume.dump() for volume in template.volumes or []]
    env = [entry.dump() for entry in template.env or []]
    grace = max(template.termination_grace_period_seconds, template.drain_seconds)
    taken_names = {volume["name"] for volume in volumes}
    taken_paths = {mount["mountPath"].rstrip("/") for mount in volume_mounts}
    runs_as = pod_security_context(obj).get("runAsUser")
    if (
        runs_as == RESTRICTED_POD_SECURITY_CONTEXT["runAsUser"]
        and HOME_VOLUME not in taken_names
        and ENGINE_HOME not in taken_paths
        and not any(entry["name"] == "HOME" for entry in env)
    ):
        volumes.append({"name": HOME_VOLUME, "emptyDir": {}})
        volume_mounts.append({"name": HOME_VOLUME, "mountPath": ENGINE_HOME})
        env.insert(0, {"name": "HOME", "value": ENGINE_HOME})
    if spec.gpu.count > 1 and SHM_VOLUME not in taken_names and SHM_PATH not in taken_paths:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        volume_mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    if spec.engine == Engine.VLLM:
        command = vllm_command(spec.model.name)
        args = vllm_args(
            spec.args,
            served_model_name=served,
            tensor_parallel=spec.gpu.count,
            max_num_seqs=desired.max_num_seqs,
            kv_cache_dtype=spec.model.kv_cache_dtype,
            shutdown_timeout=max(0, grace - template.drain_seconds - SHUTDOWN_MARGIN_S),
        )
    elif spec.engine == Engine.SGLang:
        command = sglang_command()
        args = sglang_args(
            spec.args,
            model=spec.model.name,
            tensor_parallel=spec.gpu.count,
            max_running_requests=desired.max_num_seqs,
        )
    else:
        command = trtllm_command(spec.model.name)
        args = trtllm_args(spec.args, tensor_parallel=spec.gpu.count)
        text = engine_config(obj, desired)
        config_name = config_map_name(name, text)
        max_tokens = trtllm_kv_cache(spec).max_tokens
        if max_tokens is not None:
            pod_annotations[MAX_TOKENS_ANNOTATION] = str(max_tokens)
        pod_annotations[CHECKSUM_ANNOTATION] = hashlib.sha256(text.encode()).hexdigest()
        volume_mounts.append({"name": CONFIG_VOLUME, "mountPath": ENGINE_CONFIG_DIR, "readOnly": True})
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": config_name}})

    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image or defaults.image(spec.engine),
        "command": command,
        "args": args,
        "ports": [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": HEALTH_PATH[spec.engine], "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_S[spec.engine],
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(template.drain_seconds)]}}},
        "resources": _resources(obj),
        "securityContext": container_security_context(obj),
    }
    for key, value in (
        ("env", env),
        ("envFrom", [source.dump() for source in template.env_from or []]),
        ("volumeMounts", volume_mounts),
    ):
        if value:
            container[key] = value

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security_context(obj),
        # the engine needs no API access; a token is mounted only for a ServiceAccount the admin allowed
        "automountServiceAccountToken": template.service_account_name is not None,
        # nor the namespace's Services as variables: they would show the engine's code every Service of
        # the namespace, and one named `vllm` (an LLMServing's own) sets VLLM_PORT=tcp://…, which stops vLLM
        "enableServiceLinks": False,
    }
    for key, pod_value in (
        ("volumes", volumes),
        ("nodeSelector", template.node_selector),
        ("tolerations", [toleration.dump() for toleration in template.tolerations or []]),
        ("affinity", template.affinity.dump() if template.affinity else None),
        ("serviceAccountName", template.service_account_name),
        ("imagePullSecrets", [secret.dump() for secret in template.image_pull_secrets or []]),
        ("priorityClassName", template.priority_class_name),
        ("runtimeClassName", template.runtime_class_name),
    ):
        if pod_value:
            pod_spec[key] = pod_value

    annotations = {ROLLOUTS_ANNOTATION: encode_rollouts(desired.rollouts)}
    if desired.rollouts:
        annotations[LAST_ROLLOUT_ANNOTATION] = format_timestamp(desired.rollouts[-1].time)
    if desired.template_changed_at is not None:
        annotations[TEMPLATE_CHANGED_ANNOTATION] = format_timestamp(desired.template_changed_at)
    if obj.metadata.generation is not None:
        annotations[SPEC_GENERATION_ANNOTATION] = str(obj.metadata.generation)
    if desired.paced_template is not None:
        annotations[PACED_TEMPLATE_ANNOTATION] = desired.paced_template

    replicas = {} if spec.replicas is None else {"replicas": spec.replicas}  # omitted: whoever scales it
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(obj, name, annotations),
        "spec": {
            **replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "progressDeadlineSeconds": progress_deadline_seconds(spec),
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rolling_update.max_surge,
                    "maxUnavailable": spec.rolling_update.max_unavailable,
                },
            },
            "template": {
                "metadata": {
                    "labels": {**(template.labels or {}), **labels(obj)},
                    "annotations": pod_annotations,
                },
                "spec": pod_spec,
            },
        },
    }


def disruption_budget(obj: LLMServing) -> dict[str, Any]:
    """At most one engine pod evicted at a time (node drains, cluster upgrades): each one takes its
    GPUs' share of the serving capacity away for a warm restart. A pod that is not Ready serves
    nothing, so it may always be evicted: with the default policy, engines that never get Ready (a
    bad model, args that keep the probe out) would pin their nodes against every drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(obj, obj.metadata.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(obj.metadata.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def overridden_args(obj: LLMServing, desired: Desired) -> list[str]:
    """The user's `spec.args` the operator replaces with other values (managed flags in any
    spelling), as `<as written> <value> → <value run>`: for the ArgsOverridden condition."""
    spec = obj.spec
    user = list(spec.args)
    if spec.engine == Engine.VLLM:
        rendered = vllm_args(
            user,
            served_model_name=spec.model.served_model_name or spec.model.name,
            tensor_parallel=spec.gpu.count,
            max_num_seqs=desired.max_num_seqs,
            kv_cache_dtype=spec.model.kv_cache_dtype,
        )
        flags = [*VLLM_MANAGED, "--max-num-batched-tokens", *vllm.STRIPPED]
        cli = vllm.COMMAND_LINE
        if spec.model.kv_cache_dtype != "auto":
            flags.append("--kv-cache-dtype")
    elif spec.engine == Engine.SGLang:
        rendered = sglang_args(
            user,
            model=spec.model.name,
            tensor_parallel=spec.gpu.count,
            max_running_requests=desired.max_num_seqs,
        )
        flags, cli = list(SGLANG_MANAGED), sglang.COMMAND_LINE
    else:
        rendered = trtllm_args(user, tensor_parallel=spec.gpu.count)
        flags = [*TRTLLM_MANAGED, trtllm.KNOB_FLAG]
        rendered += [trtllm.KNOB_FLAG, str(desired.max_num_seqs)]  # it lives in the options file
        rendered += ["--tensor_parallel_size", str(spec.gpu.count)]  # --tp_size's other name
        cli = trtllm.COMMAND_LINE
        options = spec.extra_llm_api_options if isinstance(spec.extra_llm_api_options, dict) else {}
        managed_options = {
            trtllm.KNOB_OPTION: desired.max_num_seqs,
            trtllm.TP_OPTION: spec.gpu.count,
            **trtllm.metrics_options(trtllm_backend(spec)),
        }
        return [
            *overridden_flags(user, rendered, dict.fromkeys(flags), trtllm.COMMAND_LINE),
            *(
                f"extraLlmApiOptions.{key} {yaml_scalar(options[key])} → {yaml_scalar(value)}"
                for key, value in managed_options.items()
                if key in options and options[key] != value
            ),
        ]
    return overridden_flags(user, rendered, dict.fromkeys(flags), cli)


def yaml_scalar(value: Any) -> str:
    """A value as the options file spells it (`true`, `512`)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def render(obj: LLMServing, desired: Desired, defaults: RenderDefaults | None = None) -> list[dict[str, Any]]:
    """Every object the LLMServing owns, in apply order (the options file before the pods that read it)."""
    defaults = defaults or RenderDefaults()
    objects = [config_map(obj, desired)] if obj.spec.engine == Engine.TensorRTLLM else []
    objects.append(service(obj))
    if defaults.disruption_budgets:
        objects.append(disruption_budget(obj))
    return [*objects, deployment(obj, desired, defaults)]


# --- reading a Deployment back ---------------------------------------------------------------------


@dataclass(frozen=True)
class DeploymentState:
    """What the engine Deployment in the cluster runs, and how far its rollout is."""

    max_num_seqs: int | None
    max_tokens: int | None
    rollouts: tuple[Rollout, ...]
    replicas: int
    updated_replicas: int
    ready_replicas: int
    available_replicas: int
    rolling: bool
    stalled: bool
    message: str
    stalled_at: datetime | None = None  # when the controller gave up (None: not stalled, or no time)
    # the controller is replacing pods with a new template (not only waiting for pods to be available)
    template_progressing: bool = False
    template_changed_at: datetime | None = None  # TEMPLATE_CHANGED_ANNOTATION
    spec_generation: int | None = None  # SPEC_GENERATION_ANNOTATION
    paced_template: str | None = None  # PACED_TEMPLATE_ANNOTATION
    rollouts_damage: str | None = None  # what of ROLLOUTS_ANNOTATION could not be read (None: nothing)

    @property
    def available(self) -> bool:
        return not self.rolling and self.available_replicas >= self.replicas


def _container(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
    return next((c for c in containers if c.get("name") == CONTAINER), containers[0])


# The most words an engine container may have for its flags to be read: each word is matched
# against every flag the operator reads (190,000 `--ma` took 3.8 s at every evaluation); an
# engine's command line is a few dozen words.
MAX_ENGINE_WORDS = 4096
MAX_READ_INT = 2**53  # no count or limit read from an object is larger (vLLM's own parser stops there)


def as_int(value: Any) -> int | None:
    """An integer field or string of an object, None when it is none or past ±2^53 (a workload's
    env value of 4,000 digits overflowed every float the policy computes with)."""
    try:
        number = int(value) if value is not None else None
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number is None or abs(number) <= MAX_READ_INT else None


def stall_condition(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Deployment controller gave up waiting for new pods (its progress deadline passed)."""
    return next(
        (
            c
            for c in status.get("conditions") or []
            if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        ),
        None,
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse_timestamp(text: Any) -> datetime | None:
    """An RFC 3339 time an object carries; None when absent, damaged or without its zone (an edited
    annotation must not make a comparison with an aware time raise)."""
    try:
        moment = datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None
    return moment if moment is not None and moment.tzinfo is not None else None


def condition_time(condition: Mapping[str, Any]) -> datetime | None:
    return parse_timestamp(condition.get("lastUpdateTime") or condition.get("lastTransitionTime"))


def deployment_state(deployment: Mapping[str, Any] | None) -> DeploymentState | None:
    """None when there is no Deployment. The applied batch limit is parsed from the engine
    container's args (vLLM) or the pod template's annotation (TensorRT-LLM's options file)."""
    if deployment is None:
        return None
    meta = deployment.get("metadata", {})
    spec = deployment.get("spec", {})
    template_annotations = spec.get("template", {}).get("metadata", {}).get("annotations") or {}
    container = _container(deployment)
    command = [str(part) for part in (container.get("command") or [])]
    args = [str(part) for part in (container.get("args") or [])]
    if len(command) + len(args) > MAX_ENGINE_WORDS:  # not ours (an edit): the limit is not read
        max_num_seqs = max_tokens = None
    elif command[:1] == [trtllm.PROGRAM]:
        max_num_seqs = as_int(template_annotations.get(MAX_NUM_SEQS_ANNOTATION))
        max_tokens = as_int(template_annotations.get(MAX_TOKENS_ANNOTATION))
    elif sglang.MODULE in command or command[:1] == [sglang.CLI_PROGRAM]:
        max_num_seqs = int_flag([*command, *args], sglang.KNOB_FLAG, sglang.COMMAND_LINE)
        max_tokens = None
    else:
        max_num_seqs = int_flag([*command, *args], vllm.KNOB_FLAG)
        max_tokens = None

    rollouts, damage = read_rollouts((meta.get("annotations") or {}).get(ROLLOUTS_ANNOTATION))
    return replace(rollout_state(deployment, max_num_seqs, max_tokens, rollouts), rollouts_damage=damage)


def rollout_state(
    workload: Mapping[str, Any],
    max_num_seqs: int | None,
    max_tokens: int | None,
    rollouts: tuple[Rollout, ...],
) -> DeploymentState:
    """How far a Deployment's or StatefulSet's rollout is, with the batch limit it runs."""
    meta, spec = workload.get("metadata", {}), workload.get("spec", {})
    annotations = meta.get("annotations") or {}
    status = workload.get("status") or {}
    kind = str(workload.get("kind") or "Deployment")
    replicas = as_int(spec.get("replicas"))
    replicas = 1 if replicas is None else replicas
    generation = as_int(meta.get("generation")) or 0
    observed = as_int(status.get("observedGeneration")) or 0
    updated = as_int(status.get("updatedReplicas")) or 0
    total = as_int(status.get("replicas")) or 0
    ready = as_int(status.get("readyReplicas")) or 0
    available = as_int(status.get("availableReplicas"))
    if kind == "StatefulSet":
        available = ready if available is None else available
        revision = status.get("updateRevision")
        if revision and status.get("currentRevision") == revision:
            updated = max(updated, total)  # updated once its current revision is the update one
    available = available or 0

    if observed < generation:
        rolling, message = True, f"waiting for the {kind} controller to observe the new spec"
    elif updated < replicas:
        rolling, message = True, f"{updated} of {replicas} pods updated"
    elif total > updated:
        rolling, message = True, f"{total - updated} old pods terminating"
    elif available < updated:
        rolling, message = True, f"{available} of {updated} updated pods available"
    else:
        rolling, message = False, f"{available} of {replicas} pods available"
    # a condition from before the controller observed the spec speaks of an older template
    stall = stall_condition(status) if observed >= generation else None
    is_stalled = stall is not None
    if is_stalled:
        message = "rollout stalled: progress deadline exceeded"
    return DeploymentState(
        max_num_seqs=max_num_seqs,
        max_tokens=max_tokens,
        rollouts=rollouts,
        replicas=replicas,
        updated_replicas=updated,
        ready_replicas=ready,
        available_replicas=available,
        rolling=rolling,
        stalled=is_stalled,
        message=message,
        stalled_at=condition_time(stall) if stall is not None else None,
        template_progressing=observed < generation or updated < replicas or total > updated,
        template_changed_at=parse_timestamp(annotations.get(TEMPLATE_CHANGED_ANNOTATION)),
        spec_generation=as_int(annotations.get(SPEC_GENERATION_ANNOTATION)),
        paced_template=_text(annotations.get(PACED_TEMPLATE_ANNOTATION)),
    )
