"""The engine's Kubernetes objects from an LLMServing and the decided batch limit (pure), and the
reverse: what a Deployment in the cluster runs (`deployment_state`).

The objects are plain dicts for server-side apply (field manager "batchknee"): a Deployment named
exactly like the LLMServing (the Prometheus adapter finds its pods as `<name>-<rs hash>-<pod hash>`),
a Service on the OpenAI port 8000, and for TensorRT-LLM a ConfigMap with the LLM API options file.

Restart safety: the rollout history (time, from, to, reason) is an annotation on the Deployment,
written in the same apply as the new batch limit, so the change and its record land together.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml

from batchknee.api.models import API_VERSION, KIND, Engine, LLMServing, format_timestamp
from batchknee.core.engine_args import (
    ENGINE_CONFIG_DIR,
    ENGINE_CONFIG_FILE,
    VLLM_PORT,
    int_flag,
    trtllm_args,
    trtllm_command,
    vllm_args,
    vllm_command,
)
from batchknee.core.policy import Rollout

FIELD_MANAGER = "batchknee"
CONTAINER = "engine"
LABEL = "batchknee.io/llmserving"
ROLLOUTS_ANNOTATION = "batchknee.io/rollouts"
LAST_ROLLOUT_ANNOTATION = "batchknee.io/last-rollout-time"
MAX_NUM_SEQS_ANNOTATION = "batchknee.io/max-num-seqs"
MAX_TOKENS_ANNOTATION = "batchknee.io/max-tokens"
CHECKSUM_ANNOTATION = "batchknee.io/engine-config-checksum"
CONFIG_VOLUME = "batchknee-engine-config"
METRICS_PATH = {Engine.VLLM: "/metrics", Engine.TensorRTLLM: "/prometheus/metrics"}
APP_NAME = {Engine.VLLM: "vllm", Engine.TensorRTLLM: "tensorrt-llm"}
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


@dataclass(frozen=True)
class RenderDefaults:
    """Operator-wide defaults (from its settings)."""

    vllm_image: str = "vllm/vllm-openai:v0.11.0"
    trtllm_image: str = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"

    def image(self, engine: Engine) -> str:
        return self.vllm_image if engine == Engine.VLLM else self.trtllm_image


# TensorRT-LLM keeps kv_cache_config.max_tokens as a 32-bit signed integer (SizeType32).
TRTLLM_MAX_TOKENS_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Desired:
    """What to run: the batch limit, TensorRT-LLM's KV token cap, and the rollout record."""

    max_num_seqs: int
    max_tokens: int
    rollouts: tuple[Rollout, ...] = ()

    @property
    def trtllm_max_tokens(self) -> int:
        """The KV token cap within TensorRT-LLM's integer range (a cap that large binds nothing)."""
        return max(0, min(self.max_tokens, TRTLLM_MAX_TOKENS_LIMIT))


# --- labels, owners --------------------------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    return {LABEL: name}


def labels(obj: LLMServing) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": APP_NAME[obj.spec.engine],
        "app.kubernetes.io/instance": obj.metadata.name,
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
    return json.dumps(
        [
            {"time": format_timestamp(r.time), "from": r.from_value, "to": r.to_value, "reason": r.reason}
            for r in rollouts
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )


def decode_rollouts(text: str | None) -> tuple[Rollout, ...]:
    """The rollout record; a damaged annotation reads as no record (never an exception)."""
    if not text:
        return ()
    try:
        entries = json.loads(text)
        rollouts = []
        for entry in entries:
            moment = datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00"))
            before = entry.get("from")
            rollouts.append(
                Rollout(
                    moment,
                    int(before) if before is not None else None,
                    int(entry["to"]),
                    str(entry["reason"]),
                )
            )
        return tuple(sorted(rollouts, key=lambda r: r.time))
    except (ValueError, TypeError, KeyError):
        return ()


# --- the engine objects ----------------------------------------------------------------------------


def engine_config(obj: LLMServing, desired: Desired) -> str:
    """TensorRT-LLM's LLM API options file: the user's extra options under the managed keys."""
    options: dict[str, Any] = copy.deepcopy(obj.spec.extra_llm_api_options or {})
    kv = options.get("kv_cache_config")
    kv = dict(kv) if isinstance(kv, dict) else {}
    kv.setdefault("free_gpu_memory_fraction", 0.9)
    kv["max_tokens"] = desired.trtllm_max_tokens
    options["kv_cache_config"] = kv
    options["max_batch_size"] = desired.max_num_seqs
    return yaml.safe_dump(options, sort_keys=True)


def config_map(obj: LLMServing, desired: Desired) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(obj, config_map_name(obj.metadata.name)),
        "data": {ENGINE_CONFIG_FILE: engine_config(obj, desired)},
    }


def config_map_name(name: str) -> str:
    return f"{name}-engine"


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
    given = obj.spec.template.resources
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
    given = obj.spec.template.security_context
    return {**RESTRICTED_POD_SECURITY_CONTEXT, **(given.dump() if given is not None else {})}


def container_security_context(obj: LLMServing) -> dict[str, Any]:
    """No privilege escalation and every capability dropped (plus what the spec adds, admin-gated)."""
    given = obj.spec.template.container_security_context
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        **(given.dump() if given is not None else {}),
    }
    drop = list(dict.fromkeys(["ALL", *context.get("capabilities", {}).get("drop", [])]))
    context["capabilities"] = {**context.get("capabilities", {}), "drop": drop}
    return context


def deployment(obj: LLMServing, desired: Desired, defaults: RenderDefaults) -> dict[str, Any]:
    spec, name = obj.spec, obj.metadata.name
    template = spec.template
    served = spec.model.served_model_name or spec.model.name

    pod_annotations: dict[str, str] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(VLLM_PORT),
        "prometheus.io/path": METRICS_PATH[spec.engine],
    }
    pod_annotations.update(template.annotations or {})
    pod_annotations[MAX_NUM_SEQS_ANNOTATION] = str(desired.max_num_seqs)

    volume_mounts = [mount.dump() for mount in template.volume_mounts or []]
    volumes = [volume.dump() for volume in template.volumes or []]
    if spec.engine == Engine.VLLM:
        command = vllm_command(spec.model.name)
        args = vllm_args(
            spec.args,
            served_model_name=served,
            tensor_parallel=spec.gpu.count,
            max_num_seqs=desired.max_num_seqs,
            kv_cache_dtype=spec.model.kv_cache_dtype,
        )
    else:
        command = trtllm_command(spec.model.name)
        args = trtllm_args(spec.args, tensor_parallel=spec.gpu.count)
        text = engine_config(obj, desired)
        pod_annotations[MAX_TOKENS_ANNOTATION] = str(desired.trtllm_max_tokens)
        pod_annotations[CHECKSUM_ANNOTATION] = hashlib.sha256(text.encode()).hexdigest()
        volume_mounts.append({"name": CONFIG_VOLUME, "mountPath": ENGINE_CONFIG_DIR, "readOnly": True})
        volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(name)}})

    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image or defaults.image(spec.engine),
        "command": command,
        "args": args,
        "ports": [{"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(template.drain_seconds)]}}},
        "resources": _resources(obj),
        "securityContext": container_security_context(obj),
    }
    for key, value in (
        ("env", [env.dump() for env in template.env or []]),
        ("envFrom", [source.dump() for source in template.env_from or []]),
        ("volumeMounts", volume_mounts),
    ):
        if value:
            container[key] = value

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": max(
            template.termination_grace_period_seconds, template.drain_seconds
        ),
        "securityContext": pod_security_context(obj),
        # the engine needs no API access; a token is mounted only for a ServiceAccount the admin allowed
        "automountServiceAccountToken": template.service_account_name is not None,
    }
    for key, pod_value in (
        ("volumes", volumes),
        ("nodeSelector", template.node_selector),
        ("tolerations", [toleration.dump() for toleration in template.tolerations or []]),
        ("affinity", template.affinity),
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

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(obj, name, annotations),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec.rollout.max_surge,
                    "maxUnavailable": spec.rollout.max_unavailable,
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


def render(obj: LLMServing, desired: Desired, defaults: RenderDefaults | None = None) -> list[dict[str, Any]]:
    """Every object the LLMServing owns, in apply order (the options file before the pods that read it)."""
    defaults = defaults or RenderDefaults()
    objects = [config_map(obj, desired)] if obj.spec.engine == Engine.TensorRTLLM else []
    return [*objects, service(obj), deployment(obj, desired, defaults)]


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

    @property
    def available(self) -> bool:
        return not self.rolling and self.available_replicas >= self.replicas


def _container(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
    return next((c for c in containers if c.get("name") == CONTAINER), containers[0])


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def deployment_state(deployment: Mapping[str, Any] | None) -> DeploymentState | None:
    """None when there is no Deployment. The applied batch limit is parsed from the engine
    container's args (vLLM) or the pod template's annotation (TensorRT-LLM's options file)."""
    if deployment is None:
        return None
    meta = deployment.get("metadata", {})
    spec = deployment.get("spec", {})
    status = deployment.get("status") or {}
    template_annotations = spec.get("template", {}).get("metadata", {}).get("annotations") or {}
    container = _container(deployment)
    command = [str(part) for part in (container.get("command") or [])]
    args = [str(part) for part in (container.get("args") or [])]
    if command[:1] == ["trtllm-serve"]:
        max_num_seqs = _int(template_annotations.get(MAX_NUM_SEQS_ANNOTATION))
        max_tokens = _int(template_annotations.get(MAX_TOKENS_ANNOTATION))
    else:
        max_num_seqs = int_flag([*command, *args], "--max-num-seqs")
        max_tokens = None

    replicas = _int(spec.get("replicas"))
    replicas = 1 if replicas is None else replicas
    generation = _int(meta.get("generation")) or 0
    observed = _int(status.get("observedGeneration")) or 0
    updated = _int(status.get("updatedReplicas")) or 0
    total = _int(status.get("replicas")) or 0
    ready = _int(status.get("readyReplicas")) or 0
    available = _int(status.get("availableReplicas")) or 0

    if observed < generation:
        rolling, message = True, "waiting for the Deployment controller to observe the new spec"
    elif updated < replicas:
        rolling, message = True, f"{updated} of {replicas} pods updated"
    elif total > updated:
        rolling, message = True, f"{total - updated} old pods terminating"
    elif available < updated:
        rolling, message = True, f"{available} of {updated} updated pods available"
    else:
        rolling, message = False, f"{available} of {replicas} pods available"
    stalled = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions") or []
    )
    if stalled:
        message = "rollout stalled: progress deadline exceeded"
    return DeploymentState(
        max_num_seqs=max_num_seqs,
        max_tokens=max_tokens,
        rollouts=decode_rollouts((meta.get("annotations") or {}).get(ROLLOUTS_ANNOTATION)),
        replicas=replicas,
        updated_replicas=updated,
        ready_replicas=ready,
        available_replicas=available,
        rolling=rolling,
        stalled=stalled,
        message=message,
    )
