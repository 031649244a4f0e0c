"""What an LLMServing may put into its engine pod: the typed allow-list, the admin-gated fields, the
image allow-list, the bounds on names, args and pinned values, and the restricted pods render makes."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchknee.api.admission import (
    DEFAULT_ALLOWED_IMAGES,
    DEFAULT_ALLOWED_TOLERATIONS,
    DEVICE_RUNTIME_ENV,
    AdmissionRules,
    Forbidden,
    check_admission,
    could_form,
    gated_uses,
    matches_any,
)
from batchknee.api.crd import (
    CHART_REQUESTER_POLICY_FILE,
    REQUESTER_POLICY_FILE,
    chart_requester_policy_template,
    crd_manifest,
    requester_policy,
    requester_policy_yaml,
)
from batchknee.api.models import (
    LABEL_KEY,
    LABEL_VALUE,
    LONG_LABEL_KEY_PREFIX,
    MAX_ARGS,
    MAX_NAME_LENGTH,
    MAX_OPTIONS_CHARACTERS,
    MAX_OPTIONS_VALUES,
    RESERVED_NAME_MESSAGE,
    LLMServing,
)
from batchknee.api.resolve import (
    MAX_SPEC_DEPTH,
    SpecError,
    deepest,
    kv_pool_bytes,
    parse_llmserving,
    resolve_roofline,
)
from batchknee.core.engine_args import ENGINE_CONFIG_FILE
from batchknee.render import (
    Desired,
    RenderDefaults,
    config_map,
    deployment,
)
from batchknee.settings import OperatorSettings


def manifest(name: str = "chat", **spec: Any) -> dict[str, Any]:
    body = {"engine": "VLLM", "model": {"name": "llama-3-8b"}, "gpu": {"type": "a100-80gb"}, **spec}
    return {"metadata": {"name": name, "namespace": "ml", "uid": "u1", "generation": 1}, "spec": body}


def parse(**spec: Any) -> LLMServing:
    return parse_llmserving(manifest(**spec))


def spec_error(**spec: Any) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse(**spec)
    return caught.value


SAME_NAMESPACE = {
    "labelSelector": {"matchLabels": {"app": "payments"}},
    "topologyKey": "topology.kubernetes.io/zone",
}
CROSS_NAMESPACE = {**SAME_NAMESPACE, "namespaceSelector": {}}
# The hostile specs of the issue, each with the field the refusal must name and the setting that allows it.
HOSTILE: list[tuple[dict[str, Any], str, str]] = [
    ({"serviceAccountName": "admin"}, "spec.template.serviceAccountName", "allowServiceAccount"),
    (
        {
            "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
            "volumeMounts": [{"name": "root", "mountPath": "/host"}],
        },
        "spec.template.volumes[0].hostPath",
        "allowHostPaths",
    ),
    (
        {"volumes": [{"name": "creds", "secret": {"secretName": "db"}}]},
        "spec.template.volumes[0].secret",
        "allowSecretReferences",
    ),
    (
        {"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]},
        "spec.template.env[0].valueFrom.secretKeyRef",
        "allowSecretReferences",
    ),
    (
        {"envFrom": [{"secretRef": {"name": "db"}}]},
        "spec.template.envFrom[0].secretRef",
        "allowSecretReferences",
    ),
    ({"imagePullSecrets": [{"name": "regcred"}]}, "spec.template.imagePullSecrets", "allowSecretReferences"),
    (
        {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "other-team"}}]},
        "spec.template.volumes[0].persistentVolumeClaim",
        "allowPersistentVolumeClaims",
    ),
    ({"securityContext": {"runAsUser": 0}}, "spec.template.securityContext.runAsUser", "allowUnrestricted"),
    (  # no payments pod may start in the engine's zone: the scheduler honours the term both ways
        {
            "affinity": {
                "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [CROSS_NAMESPACE]}
            }
        },
        "spec.template.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].namespaceSelector",
        "allowCrossNamespacePodAffinity",
    ),
    (  # where another team's pods run, by where the engine lands
        {
            "affinity": {
                "podAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "podAffinityTerm": {**SAME_NAMESPACE, "namespaces": ["payments"]}}
                    ]
                }
            }
        },
        "spec.template.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
        ".podAffinityTerm.namespaces",
        "allowCrossNamespacePodAffinity",
    ),
    (
        {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        "spec.template.securityContext.seccompProfile.type",
        "allowUnrestricted",
    ),
    (
        {"containerSecurityContext": {"allowPrivilegeEscalation": True}},
        "spec.template.containerSecurityContext.allowPrivilegeEscalation",
        "allowUnrestricted",
    ),
    (
        {"containerSecurityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
        "spec.template.containerSecurityContext.capabilities.add",
        "allowUnrestricted",
    ),
    (
        {"containerSecurityContext": {"runAsNonRoot": False}},
        "spec.template.containerSecurityContext.runAsNonRoot",
        "allowUnrestricted",
    ),
    (  # the kubelet honours it beside securityContext: the same loosening by another road
        {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}},
        "spec.template.annotations[container.apparmor.security.beta.kubernetes.io/engine]",
        "allowUnrestricted",
    ),
    (
        {"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}},
        "spec.template.annotations[seccomp.security.alpha.kubernetes.io/pod]",
        "allowUnrestricted",
    ),
    (  # a node's own profile, whatever it allows: not the runtime's default
        {"annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "localhost/permissive"}},
        "spec.template.annotations[container.apparmor.security.beta.kubernetes.io/engine]",
        "allowUnrestricted",
    ),
    (  # NVIDIA's toolkit mounts every GPU it names, other teams' too, whatever the pod requested
        {"env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
        "spec.template.env[1].name",
        "allowDeviceRuntimeEnv",
    ),
    (
        {
            "env": [
                {
                    "name": "NVIDIA_MIG_MONITOR_DEVICES",
                    "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}},
                }
            ]
        },
        "spec.template.env[0].name",
        "allowDeviceRuntimeEnv",
    ),
    (
        {"env": [{"name": "AMD_VISIBLE_DEVICES", "value": "all"}]},
        "spec.template.env[0].name",
        "allowDeviceRuntimeEnv",
    ),
    (
        {"env": [{"name": "HABANA_VISIBLE_MODULES", "value": "0,1"}]},
        "spec.template.env[0].name",
        "allowDeviceRuntimeEnv",
    ),
    (  # a key NVIDIA_VISIBLE_DEVICES in the ConfigMap, read by the kubelet out of the operator's sight
        {"envFrom": [{"prefix": "APP_", "configMapRef": {"name": "a"}}, {"configMapRef": {"name": "b"}}]},
        "spec.template.envFrom[1].configMapRef",
        "allowDeviceRuntimeEnv",
    ),
    (  # NV + IDIA_VISIBLE_DEVICES
        {"envFrom": [{"prefix": "NV", "configMapRef": {"name": "a"}}]},
        "spec.template.envFrom[0].configMapRef",
        "allowDeviceRuntimeEnv",
    ),
]
# A Secret's keys the same way, where the admin allows Secret references but not device variables.
DEVICE_SECRET = ({"envFrom": [{"secretRef": {"name": "s"}}]}, "spec.template.envFrom[0].secretRef")


def test_a_secrets_keys_as_variables_are_gated_as_device_variables_too() -> None:
    obj = parse(template=DEVICE_SECRET[0])
    with pytest.raises(Forbidden) as caught:
        check_admission(obj.spec, replace(ALL_ALLOWED, allow_device_runtime_env=False))
    assert caught.value.field == DEVICE_SECRET[1] and "allowDeviceRuntimeEnv" in str(caught.value)
    assert "a Secret's keys as variables" in str(caught.value)
    prefixed = parse(template={"envFrom": [{"prefix": "DB_", "secretRef": {"name": "s"}}]})
    check_admission(prefixed.spec, replace(ALL_ALLOWED, allow_device_runtime_env=False))


@pytest.mark.parametrize(
    ("prefix", "gated"),
    [
        ("", True),
        ("N", True),
        ("NVIDIA_", True),
        ("NVIDIA_X_", True),  # NVIDIA_X_<key> matches NVIDIA_*
        ("AMD_", True),
        ("AMD_VISIBLE_DEVICES", True),  # harmless (keys are never empty), and gated all the same
        ("AMD_VISIBLE_DEVICESX", False),
        ("HABANA_VISIBLE_FOO_", True),
        ("HABANA_", True),
        ("APP_", False),
        ("nvidia_", False),  # the runtime reads the exact, upper-case names
        ("CUDA_", False),
    ],
)
def test_which_envfrom_prefixes_could_form_a_device_variable(prefix: str, gated: bool) -> None:
    assert could_form(prefix, DEVICE_RUNTIME_ENV) is gated


ALL_ALLOWED = AdmissionRules(
    allow_service_account=True,
    allow_secret_references=True,
    allow_host_paths=True,
    allow_persistent_volume_claims=True,
    allow_unrestricted_security_context=True,
    allow_cross_namespace_pod_affinity=True,
    allow_device_runtime_env=True,
)


@pytest.mark.parametrize(("template", "field", "setting"), HOSTILE)
def test_each_gated_field_is_refused_by_default_naming_it_and_the_setting(
    template: dict[str, Any], field: str, setting: str
) -> None:
    obj = parse(template=template)
    with pytest.raises(Forbidden) as caught:
        check_admission(obj.spec, AdmissionRules())
    assert caught.value.field == field
    assert setting in str(caught.value) and "BATCHKNEE_ALLOW" in str(caught.value)
    check_admission(obj.spec, ALL_ALLOWED)  # what the admin enabled passes


def test_the_allow_list_needs_no_setting() -> None:
    obj = parse(
        template={
            "annotations": {"container.apparmor.security.beta.kubernetes.io/engine": "runtime/default"},
            "env": [
                {"name": "HF_HOME", "value": "/cache"},
                {"name": "CFG", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                # chooses among the devices the container was given; the runtime does not read it
                {"name": "CUDA_VISIBLE_DEVICES", "value": "0"},
                {"name": "nvidia_visible_devices", "value": "all"},  # the runtime reads the exact name
            ],
            # keys arrive as APP_<key>: none can name a variable the GPU runtime reads
            "envFrom": [{"prefix": "APP_", "configMapRef": {"name": "cfg"}}],
            "volumes": [
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {"name": "cfg", "configMap": {"name": "cfg"}},
            ],
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
            "resources": {"limits": {"memory": "64Gi"}},
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {}},
            "securityContext": {"runAsUser": 2000, "fsGroup": 2000},
            "containerSecurityContext": {
                "readOnlyRootFilesystem": True,
                "capabilities": {"add": ["NET_BIND_SERVICE"]},
            },
        },
        image="vllm/vllm-openai:v0.12.0",
    )
    assert gated_uses(obj.spec) == []
    check_admission(obj.spec, AdmissionRules())


def test_affinity_within_the_namespace_needs_no_setting() -> None:
    """Node affinity and pod terms without namespaces or a namespaceSelector (the pod's own namespace)
    place only the engine pods."""
    within = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [SAME_NAMESPACE],
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": SAME_NAMESPACE}
            ],
        },
    }
    spec = parse(template={"affinity": within}).spec
    assert gated_uses(spec) == []
    check_admission(spec, AdmissionRules())
    assert spec.pod_template.affinity is not None
    assert spec.pod_template.affinity.dump() == within  # what the Deployment gets: nothing lost


def preferred_nodes(term: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": term}]
        }
    }


def required_pods(selector: dict[str, Any]) -> dict[str, Any]:
    term = {**SAME_NAMESPACE, "labelSelector": selector}
    return {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


PREFERENCE = (
    "spec.template.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
)
SELECTOR = (
    "spec.template.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].labelSelector"
)
LONG_PREFIX_KEY = "a." * 126 + "ab/team"  # a well-formed DNS subdomain of 254 characters, then a name


@pytest.mark.parametrize(
    ("affinity", "field"),
    [
        ({"podAffinity": "x"}, "spec.template.affinity.podAffinity"),
        (
            {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"namespaces": ["a"]}}},
            "spec.template.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution",
        ),
        (
            {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}},
            "spec.template.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
            ".podAffinityTerm",
        ),
        (
            {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}},
            "spec.template.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",
        ),
        (
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}},
            "spec.template.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
        ),
        (
            {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 0, "preference": {}}]
                }
            },
            "spec.template.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight",
        ),
        # Kubernetes' rules for each operator's values, for matchFields and for label keys
        (
            required_pods({"matchExpressions": [{"key": "app", "operator": "In"}]}),
            f"{SELECTOR}.matchExpressions[0]",
        ),
        (
            preferred_nodes({"matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["h100"]}]}),
            f"{PREFERENCE}.matchExpressions[0]",
        ),
        (
            preferred_nodes({"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["four"]}]}),
            f"{PREFERENCE}.matchExpressions[0]",
        ),
        (
            preferred_nodes({"matchFields": [{"key": "metadata.labels", "operator": "In", "values": ["x"]}]}),
            PREFERENCE,
        ),
        (required_pods({"matchLabels": {"k" * 318: "v"}}), SELECTOR),
        # Kubernetes' label syntax: keys, values, topology keys
        (required_pods({"matchLabels": {"app name": "payments"}}), SELECTOR),
        (required_pods({"matchLabels": {"app": "-payments"}}), f"{SELECTOR}.matchLabels.app"),
        (
            required_pods({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a b"]}]}),
            f"{SELECTOR}.matchExpressions[0].values[0]",
        ),
        (
            {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "zone/"}]}},
            "spec.template.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",
        ),
        (
            preferred_nodes({"matchExpressions": [{"key": "-gpu", "operator": "Exists"}]}),
            f"{PREFERENCE}.matchExpressions[0].key",
        ),
        # a prefix is a DNS subdomain: at most 253 characters (here 254, the key within 317)
        (required_pods({"matchLabels": {LONG_PREFIX_KEY: "v"}}), SELECTOR),
        (
            {
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": LONG_PREFIX_KEY}]
                }
            },
            "spec.template.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey",
        ),
    ],
)
def test_a_malformed_affinity_is_invalid_naming_its_field(affinity: dict[str, Any], field: str) -> None:
    """Affinity is typed like Kubernetes' own: a malformed term is refused where it is (the CRD
    schema at admission, the operator for anything stored before), not passed to the Deployment."""
    assert spec_error(template={"affinity": affinity}).field == field


def test_the_crd_and_the_operator_check_the_same_operator_values() -> None:
    """Each operator's rule is in the CRD (CEL, at admission) and in the model (for what was stored
    before); value lists each accepts parse."""
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    affinity = schema["properties"]["spec"]["properties"]["template"]["properties"]["affinity"]["properties"]
    required = affinity["nodeAffinity"]["properties"]["requiredDuringSchedulingIgnoredDuringExecution"]
    term = required["properties"]["nodeSelectorTerms"]["items"]
    rules = [r["rule"] for r in term["properties"]["matchExpressions"]["items"]["x-kubernetes-validations"]]
    assert len(rules) == 3 and any("matches('^[-+]?[0-9]{1,18}$')" in r for r in rules)
    assert "metadata.name" in term["x-kubernetes-validations"][0]["rule"]
    fine = [
        {"key": "gpu", "operator": "In", "values": ["h100", "h200"]},
        {"key": "gpu", "operator": "DoesNotExist"},
        {"key": "gpus", "operator": "Lt", "values": ["-4"]},
        {"key": "gpus", "operator": "Gt", "values": ["+4"]},  # strconv.ParseInt's, as the scheduler reads it
    ]
    parse(template={"affinity": preferred_nodes({"matchExpressions": fine})})


def test_the_crd_schema_uses_only_fields_a_crd_schema_has() -> None:
    """pydantic writes propertyNames for a constrained dict key; a CRD schema has no such field (a
    strict client refuses the CRD, a lax one drops the constraint): generation refuses it."""
    from batchknee.api.crd import _check_structural

    labels = {"type": "object", "description": "Labels.", "propertyNames": {"maxLength": 63}}
    with pytest.raises(ValueError, match=r"\.labels: propertyNames is not a field of a CRD schema"):
        _check_structural({"type": "object", "properties": {"labels": labels}}, "")


def test_each_term_field_that_reaches_other_namespaces_is_named() -> None:
    both = parse(
        template={
            "affinity": {
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        SAME_NAMESPACE,
                        {**CROSS_NAMESPACE, "namespaces": ["payments"]},
                    ]
                }
            }
        }
    ).spec
    fields = [use.field.rsplit(".", 1)[-1] for use in gated_uses(both)]
    assert fields == ["namespaces", "namespaceSelector"]


def test_an_image_outside_the_allowed_patterns_is_refused_naming_spec_image() -> None:
    obj = parse(image="evil.example/miner:latest")
    with pytest.raises(Forbidden) as caught:
        check_admission(obj.spec, AdmissionRules())
    assert caught.value.field == "spec.image"
    assert "allowedImages" in str(caught.value) and "BATCHKNEE_ALLOWED_IMAGES" in str(caught.value)
    check_admission(obj.spec, AdmissionRules(allowed_images=("evil.example/*",)))
    with pytest.raises(Forbidden) as caught:
        check_admission(parse(image="r/" + "x" * 1020).spec, AdmissionRules(allowed_images=("p" * 900,) * 9))
    assert len(str(caught.value)) < 1024  # bounded for status and Events
    check_admission(parse().spec, AdmissionRules(allowed_images=()))  # the default image needs no pattern
    assert matches_any("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc14", DEFAULT_ALLOWED_IMAGES)
    assert matches_any("vllm/vllm-openai@sha256:" + "0" * 64, DEFAULT_ALLOWED_IMAGES)
    assert not matches_any("vllm/vllm-openai-fork:v1", DEFAULT_ALLOWED_IMAGES)


# (template, the field the refusal names, its setting, the patterns that admit it)
OUTSIDE_THE_ADMINS_PATTERNS: list[tuple[dict[str, Any], str, str, dict[str, tuple[str, ...]]]] = [
    (  # another team's dedicated nodes
        {
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "search", "effect": "NoSchedule"}
            ]
        },
        "spec.template.tolerations[0].key",
        "allowedTolerations",
        {"allowed_tolerations": ("dedicated",)},
    ),
    (  # the control plane, after an allowed one
        {
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists"},
                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
            ]
        },
        "spec.template.tolerations[1].key",
        "allowedTolerations",
        {"allowed_tolerations": (*DEFAULT_ALLOWED_TOLERATIONS, "node-role.kubernetes.io/*")},
    ),
    (  # no key with Exists: every taint of every node
        {"tolerations": [{"operator": "Exists"}]},
        "spec.template.tolerations[0].key",
        "allowedTolerations",
        {"allowed_tolerations": ("*",)},
    ),
    (  # preempts every pod under it
        {"priorityClassName": "system-node-critical"},
        "spec.template.priorityClassName",
        "allowedPriorityClasses",
        {"allowed_priority_classes": ("inference-*", "system-node-critical")},
    ),
    (
        {"runtimeClassName": "kata-dedicated"},
        "spec.template.runtimeClassName",
        "allowedRuntimeClasses",
        {"allowed_runtime_classes": ("nvidia", "kata-*")},
    ),
    (  # the node's /dev/kvm, handed out by a device plugin
        {"resources": {"limits": {"memory": "64Gi", "devices.kubevirt.io/kvm": "1"}}},
        "spec.template.resources.limits[devices.kubevirt.io/kvm]",
        "allowedResources",
        {"allowed_resources": ("nvidia.com/*", "devices.kubevirt.io/*")},
    ),
    (
        {"resources": {"requests": {"cpu": "8", "smarter-devices/fuse": "1"}}},
        "spec.template.resources.requests[smarter-devices/fuse]",
        "allowedResources",
        {"allowed_resources": ("smarter-devices/*",)},
    ),
    # Pod label and annotation keys: none by default.
    (  # the label a NetworkPolicy of the namespace allows egress to the database for
        {"labels": {"team": "ml", "role": "db-client"}},
        "spec.template.labels[role]",
        "allowedPodLabels",
        {"allowed_pod_labels": ("team", "role")},
    ),
    (  # a second network interface on another team's network
        {"annotations": {"k8s.v1.cni.cncf.io/networks": "payments/payments-net"}},
        "spec.template.annotations[k8s.v1.cni.cncf.io/networks]",
        "allowedPodAnnotations",
        {"allowed_pod_annotations": ("k8s.v1.cni.cncf.io/*",)},
    ),
    (  # another pod's address
        {"annotations": {"prometheus.io/scrape": "false", "cni.projectcalico.org/ipAddrs": '["10.1.2.3"]'}},
        "spec.template.annotations[cni.projectcalico.org/ipAddrs]",
        "allowedPodAnnotations",
        {"allowed_pod_annotations": ("prometheus.io/*", "cni.projectcalico.org/*")},
    ),
    (  # out of the mesh, and its mTLS-only policies
        {"annotations": {"sidecar.istio.io/inject": "false"}},
        "spec.template.annotations[sidecar.istio.io/inject]",
        "allowedPodAnnotations",
        {"allowed_pod_annotations": ("*",)},
    ),
]


@pytest.mark.parametrize(("template", "field", "setting", "allowing"), OUTSIDE_THE_ADMINS_PATTERNS)
def test_what_the_admins_patterns_do_not_match_is_refused(
    template: dict[str, Any], field: str, setting: str, allowing: dict[str, tuple[str, ...]]
) -> None:
    """Tolerations, priority classes, runtime classes and extended resources name what every
    namespace shares and RBAC guards none of; a pod label can match another pod's selector (a
    Service, a NetworkPolicy) and an annotation ask a network plugin or a mesh for another network,
    an address or no sidecar. Outside the admin's patterns each is refused, naming the field and the
    setting."""
    spec = parse(template=template).spec
    with pytest.raises(Forbidden) as caught:
        check_admission(spec, AdmissionRules())
    assert caught.value.field == field
    assert setting in str(caught.value) and "BATCHKNEE_ALLOWED_" in str(caught.value)
    with pytest.raises(Forbidden):  # the other gates allow everything: these lists are their own
        check_admission(spec, ALL_ALLOWED)
    check_admission(spec, AdmissionRules(**allowing))  # type: ignore[arg-type]


def test_confinement_annotations_follow_their_own_gate_not_the_annotation_patterns() -> None:
    """runtime/default needs no pattern; another profile needs allowUnrestrictedSecurityContext even
    where every annotation key is allowed, and no pattern where it is enabled."""
    confined = parse(
        template={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "runtime/default"}}
    )
    check_admission(confined.spec, AdmissionRules())
    loose = parse(template={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}).spec
    with pytest.raises(Forbidden) as caught:
        check_admission(loose, AdmissionRules(allowed_pod_annotations=("*",)))
    assert "allowUnrestrictedSecurityContext" in str(caught.value)
    check_admission(loose, AdmissionRules(allow_unrestricted_security_context=True))


@pytest.mark.parametrize("kind", ["labels", "annotations"])
def test_the_operators_own_keys_are_refused_in_the_template(kind: str) -> None:
    """batchknee.io/ keys steer the operator (its selector label, the applied max-num-seqs and
    max-tokens it reads back): a spec that sets one is invalid, whatever the admin allows. So are
    keys Prometheus reads as theirs: its discovery writes `-`, `.` and `/` in a key all as `_`, and
    `batchknee-io/llmserving` would race the engine pods' own label for the PodMonitors' `llmserving`."""
    for key in (
        "batchknee.io/max-tokens",
        "batchknee-io/llmserving",
        "batchknee_io_llmserving",
        "batchknee.io.x/y",
    ):
        error = spec_error(template={kind: {key: "1"}})
        assert (
            error.field == "spec.template" and "batchknee.io/" in error.message and "rename" in error.message
        )
    allowed = AdmissionRules(allowed_pod_labels=("*",), allowed_pod_annotations=("*",))
    for key in ("batchknee/llmserving", "batchkneeio/x", "team.batchknee.io/x"):
        check_admission(parse(template={kind: {key: "1"}}).spec, allowed)
    rule = next(
        r
        for r in crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
            "properties"
        ]["template"]["x-kubernetes-validations"]
        if r.get("fieldPath") == f".{kind}"
    )
    assert "matches('^batchknee[^a-zA-Z0-9]io[^a-zA-Z0-9]')" in rule["rule"]


def test_a_keyless_toleration_needs_a_pattern_that_matches_every_key() -> None:
    spec = parse(template={"tolerations": [{"operator": "Exists", "effect": "NoSchedule"}]}).spec
    with pytest.raises(Forbidden) as caught:
        check_admission(spec, AdmissionRules(allowed_tolerations=("nvidia.com/*", "dedicated")))
    assert "every taint (no key)" in str(caught.value)
    check_admission(spec, AdmissionRules(allowed_tolerations=("*",)))


def test_the_default_gpu_toleration_and_runtime_class_need_no_setting() -> None:
    spec = parse(
        template={
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
            "resources": {
                "limits": {"memory": "64Gi", "hugepages-2Mi": "1Gi", "nvidia.com/mig-3g.40gb": "1"},
                "requests": {"cpu": "8", "ephemeral-storage": "100Gi"},
            },
        }
    ).spec
    check_admission(spec, AdmissionRules())
    with pytest.raises(Forbidden) as caught:
        check_admission(spec, AdmissionRules(allowed_tolerations=()))
    assert "(none)" in str(caught.value)


def test_settings_read_the_admission_rules_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OperatorSettings().admission_rules() == AdmissionRules()
    monkeypatch.setenv("BATCHKNEE_ALLOWED_IMAGES", "registry.local/*, vllm/vllm-openai:*")
    monkeypatch.setenv("BATCHKNEE_ALLOW_HOST_PATHS", "true")
    monkeypatch.setenv("BATCHKNEE_ALLOW_CROSS_NAMESPACE_POD_AFFINITY", "true")
    monkeypatch.setenv("BATCHKNEE_ALLOWED_TOLERATIONS", "")
    monkeypatch.setenv("BATCHKNEE_ALLOWED_PRIORITY_CLASSES", "inference-high, inference-low")
    rules = OperatorSettings().admission_rules()
    assert rules.allowed_images == ("registry.local/*", "vllm/vllm-openai:*")
    assert rules.allow_host_paths and not rules.allow_service_account
    assert rules.allow_cross_namespace_pod_affinity
    assert rules.allowed_tolerations == () and rules.allowed_runtime_classes == ("nvidia",)
    assert rules.allowed_priority_classes == ("inference-high", "inference-low")
    assert rules.allowed_resources == ("nvidia.com/*",)
    monkeypatch.setenv("BATCHKNEE_ALLOWED_RESOURCES", "nvidia.com/*, rdma/*")
    assert OperatorSettings().admission_rules().allowed_resources == ("nvidia.com/*", "rdma/*")
    assert rules.allowed_pod_labels == () and rules.allowed_pod_annotations == ()
    monkeypatch.setenv("BATCHKNEE_ALLOWED_POD_LABELS", "team, cost-center")
    monkeypatch.setenv("BATCHKNEE_ALLOWED_POD_ANNOTATIONS", "prometheus.io/*")
    rules = OperatorSettings().admission_rules()
    assert rules.allowed_pod_labels == ("team", "cost-center")
    assert rules.allowed_pod_annotations == ("prometheus.io/*",)


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ({"labels": {"team name": "ml"}}, "labels key 'team name' is an optional DNS-subdomain prefix"),
        ({"labels": {"Example.com/team": "ml"}}, "labels key 'Example.com/team'"),  # a prefix is lower case
        ({"annotations": {"a/b/c": "x"}}, "annotations key 'a/b/c'"),
        ({"nodeSelector": {"x" * 64: "h100"}}, "nodeSelector key"),  # a name has at most 63
        ({"annotations": {LONG_PREFIX_KEY: "x"}}, "annotations key"),  # a prefix has at most 253
        ({"labels": {"team": "ml team"}}, "String should match pattern"),
        ({"nodeSelector": {"gpu": "h100_"}}, "String should match pattern"),
    ],
)
def test_label_keys_and_values_have_kubernetes_syntax(template: dict[str, Any], words: str) -> None:
    """A pod's labels, annotations and node selector are refused at admission in a shape the
    Deployment write would refuse (there it was a Degraded condition after the fact)."""
    assert words in spec_error(template=template).message
    fine = {
        "labels": {"example.com/team": "ml", "tier": "", "v": "1.2_a-b"},
        "annotations": {"Example.COM/Note": "any text at all"},  # Kubernetes case-folds annotation keys
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    }
    assert parse(template=fine).spec.pod_template.dump()["nodeSelector"] == fine["nodeSelector"]


def test_the_crd_checks_map_keys_with_the_models_syntax() -> None:
    """A CRD schema constrains map keys only in CEL: each map of label keys carries the one regex
    the model uses (annotations case-folded)."""
    template = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["template"]["properties"]
    rules = {
        name: template[name]["x-kubernetes-validations"][0]["rule"] for name in ("labels", "nodeSelector")
    }
    assert all(f"k.matches('{LABEL_KEY}')" in rule for rule in rules.values())
    assert (
        f"k.lowerAscii().matches('{LABEL_KEY}')"
        in template["annotations"]["x-kubernetes-validations"][0]["rule"]
    )
    assert template["labels"]["additionalProperties"]["pattern"] == LABEL_VALUE
    # the prefix's length, which the regex cannot bound
    assert all(f"!k.matches('{LONG_LABEL_KEY_PREFIX}')" in rule for rule in rules.values())
    assert re.match(LONG_LABEL_KEY_PREFIX, LONG_PREFIX_KEY) and not re.match(
        LONG_LABEL_KEY_PREFIX, "a" * 253 + "/b"
    )


def test_a_label_key_prefix_of_253_characters_is_allowed() -> None:
    """The bound is Kubernetes' own: a DNS subdomain of 253 characters is a valid prefix."""
    key = "a." * 125 + "abc/team"  # a 253-character prefix
    assert len(key.split("/")[0]) == 253
    term = {"topologyKey": key, "labelSelector": {"matchLabels": {key: "v"}}, "matchLabelKeys": [key]}
    spec = parse(
        template={
            "labels": {key: "ml"},
            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}},
        }
    ).spec
    assert spec.pod_template.dump()["labels"] == {key: "ml"}


@pytest.mark.parametrize(
    ("template", "field", "words"),
    [
        ({"env": [{"name": "N", "value": 5}]}, "spec.template.env[0].value", "string"),
        (
            {"containerSecurityContext": {"privileged": True}},
            "spec.template.containerSecurityContext",
            "privileged",
        ),
        ({"volumes": [{"name": "x", "nfs": {"server": "a"}}]}, "spec.template.volumes[0]", "exactly one"),
        (
            {"volumes": [{"name": "x", "emptyDir": {}, "secret": {"secretName": "s"}}]},
            "spec.template.volumes[0]",
            "exactly one",
        ),
        ({"volumeMounts": [{"name": "nowhere", "mountPath": "/x"}]}, "spec.template", "names no volume"),
        (
            {"volumes": [{"name": "batchknee-engine-config", "emptyDir": {}}]},
            "spec.template.volumes[0]",
            "operator's own",
        ),
    ],
)
def test_malformed_templates_name_the_field(template: dict[str, Any], field: str, words: str) -> None:
    error = spec_error(template=template)
    assert error.field == field and words in error.message


def test_unknown_pod_fields_are_not_rendered() -> None:
    """hostNetwork, hostPID and the like are not in the allow-list: the apiserver prunes them, and
    the operator never reads them."""
    obj = parse(template={"hostNetwork": True, "hostPID": True, "nodeName": "control-plane"})
    pod = deployment(obj, Desired(64, 0), RenderDefaults())["spec"]["template"]["spec"]
    assert not {"hostNetwork", "hostPID", "nodeName"} & pod.keys()


def nested(levels: int, leaf: Any = 1) -> Any:
    """{"a": {"a": … leaf}} built without recursion."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"engine": "TensorRTLLM", "extraLlmApiOptions": nested(10_000)}, "spec.extraLlmApiOptions"),
        ({"template": {"affinity": {"podAffinity": [nested(2_000)]}}}, "spec.template"),
    ],
)
def test_a_free_form_field_nested_past_the_bound_is_invalid_not_a_recursion_error(
    spec: dict[str, Any], field: str
) -> None:
    """The apiserver stores free-form JSON nested up to 10,000 levels; Python's json and pydantic
    recurse once per level. The operator measures the depth first, without recursing, and refuses it
    naming the field; at the bound it parses."""
    error = spec_error(**spec)
    assert (
        error.field == field and f"at most {MAX_SPEC_DEPTH}" in error.message and "flatten" in error.message
    )
    # spec(1) template(2) affinity(3) … : the whole spec within the bound parses
    fits = nested(MAX_SPEC_DEPTH - 3, leaf="x")
    parse(template={"affinity": {"nodeAffinity": fits}})
    assert deepest({"template": {"affinity": {"nodeAffinity": fits}}})[0] == MAX_SPEC_DEPTH
    with pytest.raises(SpecError):
        parse(template={"affinity": {"nodeAffinity": {"b": fits}}})
    assert deepest({"c": 2, "a": [1, {"b": [[]]}], "d": {}}) == (5, "a")
    assert deepest("scalar") == (0, "")


def test_measuring_a_wide_spec_holds_no_path_per_node() -> None:
    """A long key over a long list (110 KB of JSON) made the walk hold a 20,000-character path for
    each of 30,000 entries (612 MB); now it holds the nodes it has yet to visit, and no scalar."""
    import tracemalloc

    spec = {"template": {"affinity": {"k" * 20_000: [[0]] * 30_000}}}
    tracemalloc.start()
    try:
        assert deepest(spec) == (5, "template")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak


def test_bounds_on_name_args_and_pinned() -> None:
    assert parse_llmserving(manifest(name="a" * MAX_NAME_LENGTH)).metadata.name
    error = spec_error_name("a" * (MAX_NAME_LENGTH + 1))
    assert error.field == "metadata.name" and str(MAX_NAME_LENGTH) in error.message
    assert spec_error_name("1chat").field == "metadata.name"  # the Service name must start with a letter
    assert spec_error(args=["--x"] * (MAX_ARGS + 1)).field == "spec.args"
    assert spec_error(args=["x" * 1025]).field == "spec.args[0]"
    error = spec_error(tuning={"mode": "Pinned", "pinnedMaxNumSeqs": 4})
    assert error.field == "spec.tuning" and "minMaxNumSeqs 8" in error.message
    assert (
        parse(
            tuning={"mode": "Pinned", "pinnedMaxNumSeqs": 4, "minMaxNumSeqs": 4}
        ).spec.tuning.pinned_max_num_seqs
        == 4
    )


def test_a_name_the_kubelet_would_make_variables_of_other_pods_is_refused() -> None:
    """The engine Service takes the name, and the kubelet makes each Service of the namespace
    variables of every pod started there: `kubernetes` would replace the API server's address in the
    namespace's other pods, nvidia-require… would give GPU containers NVIDIA_REQUIRE_… variables, and
    `vllm` set VLLM_PORT=tcp://… (which vLLM refuses) in other teams' engines there."""
    for name in (
        "kubernetes",
        "nvidia-require-cuda",
        "nvidia-requirements",
        "vllm",
        "vllm-dp-master",
        "master",
    ):
        error = spec_error_name(name)
        assert error.field == "metadata.name" and "choose another name" in error.message, name
    for name in ("kubernetes-chat", "my-kubernetes", "nvidia-nemotron", "vllm-chat", "masters"):
        assert parse_llmserving(manifest(name=name)).metadata.name == name


def spec_error_name(name: str) -> SpecError:
    with pytest.raises(SpecError) as caught:
        parse_llmserving(manifest(name=name))
    return caught.value


def test_the_crd_carries_the_same_bounds_in_cel_and_schema() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    [name_rule, reserved_rule] = schema["x-kubernetes-validations"]
    assert "'kubernetes'" in reserved_rule["rule"] and "'vllm'" in reserved_rule["rule"]
    assert reserved_rule["message"] == RESERVED_NAME_MESSAGE
    # at creation only: the apiserver checks every rule at each status write too, and an object
    # made before a name was reserved could then never be told why it is refused (checked against
    # a real apiserver when the rule came in)
    assert reserved_rule["optionalOldSelf"] is True and reserved_rule["rule"].startswith(
        "oldSelf.hasValue() || ("
    )
    assert f"self.metadata.name.size() <= {MAX_NAME_LENGTH}" in name_rule["rule"]
    assert str(MAX_NAME_LENGTH) in name_rule["message"]
    spec = schema["properties"]["spec"]["properties"]
    assert spec["args"]["maxItems"] == MAX_ARGS and spec["args"]["items"]["maxLength"] == 1024
    tuning_rules = [r["rule"] for r in spec["tuning"]["x-kubernetes-validations"]]
    assert any("self.pinnedMaxNumSeqs <= self.maxMaxNumSeqs" in r for r in tuning_rules)
    template = spec["template"]
    assert "x-kubernetes-preserve-unknown-fields" not in str(template)
    assert template["properties"]["env"]["items"]["properties"]["value"]["type"] == "string"
    privileged = template["properties"]["containerSecurityContext"]["x-kubernetes-validations"]
    assert privileged[0]["rule"] == "!has(self.privileged) || !self.privileged"


def test_a_kv_pool_given_in_bytes_is_the_pool_vllm_sizes() -> None:
    """`--kv-cache-memory-bytes` sets vLLM's pool per GPU and vLLM then ignores the memory share."""

    def pool(*args: str) -> float:
        obj = parse(args=list(args))
        return kv_pool_bytes(obj.spec, resolve_roofline(obj.spec))

    assert pool("--kv-cache-memory-bytes", "20G", "--gpu-memory-utilization", "0.5") == 20 * 2**30
    assert pool("--kv-cache-memory=8g") == 8e9  # an abbreviation, a decimal suffix
    assert pool("--gpu-memory-utilization", "0.5") < pool() < 20 * 2**30 * 4  # the share otherwise


def test_each_resolution_error_names_its_cause() -> None:
    def cause(**spec: Any) -> str:
        obj = parse(**spec)
        with pytest.raises(SpecError) as caught:
            kv_pool_bytes(obj.spec, resolve_roofline(obj.spec))
        return caught.value.field

    assert cause(args=["--gpu-memory-utilization", "0.05"]) == "spec.args"
    assert cause(model={"name": "llama-3-8b", "params": 10**15}) == "spec.model.params"
    assert cause(model={"name": "llama-3-70b"}, gpu={"type": "l4"}) == "spec.gpu.count"
    architecture = {"layers": 40, "attentionHeads": 40, "kvHeads": 8, "headDim": 128, "params": 10**15}
    assert cause(model={"name": "x", "architecture": architecture}) == "spec.model.architecture.params"
    # the engines split the heads over the GPUs: 28 attention heads do not split over 8
    assert cause(model={"name": "qwen2.5-7b"}, gpu={"type": "a100-80gb", "count": 8}) == "spec.gpu.count"
    assert cause(model={"name": "llama-3-8b"}, gpu={"type": "a100-80gb", "count": 3}) == "spec.gpu.count"
    for fits in ({"name": "qwen2.5-7b", "count": 4}, {"name": "llama-3-70b", "count": 8}):
        parsed = parse(model={"name": fits["name"]}, gpu={"type": "a100-80gb", "count": fits["count"]})
        assert resolve_roofline(parsed.spec).tensor_parallel == fits["count"]


def test_rendered_pods_meet_the_restricted_pod_security_standard() -> None:
    pod = deployment(parse(), Desired(64, 0), RenderDefaults())["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    # no Service of the namespace as variables (`vllm` would set VLLM_PORT=tcp://…, which stops vLLM)
    assert pod["enableServiceLinks"] is False
    # what the spec adds is merged in, ALL is still dropped
    obj = parse(
        template={
            "securityContext": {"runAsUser": 2000},
            "containerSecurityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]}},
        }
    )
    pod = deployment(obj, Desired(64, 0), RenderDefaults())["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 2000 and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["capabilities"] == {
        "add": ["NET_BIND_SERVICE"],
        "drop": ["ALL", "NET_RAW"],
    }


def test_tensorrt_llm_max_tokens_stays_within_int32() -> None:
    """The operator leaves max_tokens to the user (max_batch_size carries the knee); a user value past
    TensorRT-LLM's 32-bit range is refused naming the field, and no computed one is rendered."""
    obj = parse(engine="TensorRTLLM")
    text = config_map(obj, Desired(65536, 65536 * 10_000_000))["data"][ENGINE_CONFIG_FILE]
    assert "max_tokens" not in text
    too_big = parse(engine="TensorRTLLM", extraLlmApiOptions={"kv_cache_config": {"max_tokens": 2**31}})
    with pytest.raises(SpecError, match=r"kv_cache_config\.max_tokens"):
        kv_pool_bytes(too_big.spec, resolve_roofline(too_big.spec))


@pytest.mark.parametrize(
    "options",
    [
        {"x": [0] * 300_000},  # held the worker half a minute at every evaluation
        {f"k{i}": "v" for i in range(2_000)},
        {"s": "a" * (MAX_OPTIONS_CHARACTERS + 1)},
        {"k" * (MAX_OPTIONS_CHARACTERS + 1): 1},
        {"cuda_graph_config": {"batch_sizes": list(range(MAX_OPTIONS_VALUES - 2))}},  # one past
    ],
)
def test_an_options_file_past_its_bounds_is_refused_naming_the_field(options: dict[str, Any]) -> None:
    error = spec_error(engine="TensorRTLLM", extraLlmApiOptions=options)
    assert error.field == "spec.extraLlmApiOptions"
    assert f"more than {MAX_OPTIONS_VALUES} values or {MAX_OPTIONS_CHARACTERS} characters" in error.message


def test_an_options_file_within_its_bounds_renders_as_pyyaml_writes_it() -> None:
    """At the bound it parses (11 values beside the list's); the file is PyYAML's own dump of the
    options, the same at a second render (taken from the cache)."""
    batch_sizes = list(range(MAX_OPTIONS_VALUES - 11))
    options = {
        "cuda_graph_config": {"batch_sizes": batch_sizes},
        "backend": "pytorch",
        "enable_chunked_prefill": True,
        "stream_interval": 2,
        "guided_decoding_backend": None,
        "note": "é ☃",
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": False},
    }
    obj = parse(engine="TensorRTLLM", extraLlmApiOptions=options)
    text = config_map(obj, Desired(64, None))["data"][ENGINE_CONFIG_FILE]
    assert yaml.safe_load(text)["cuda_graph_config"]["batch_sizes"] == batch_sizes
    expected = {
        **options,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": False},
        "max_batch_size": 64,
    }
    loaded = yaml.safe_load(text)
    assert {k: loaded[k] for k in expected} == expected
    assert text == yaml.safe_dump(loaded, sort_keys=True)
    assert config_map(obj, Desired(64, None))["data"][ENGINE_CONFIG_FILE] == text
    assert obj.spec.extra_llm_api_options == options  # the spec's own options are not changed


def test_the_requester_policy_is_generated_and_checks_every_gated_field() -> None:
    """crds/ and the chart carry the generated ValidatingAdmissionPolicy (`make crds`); its CEL names
    each kind of gated field that batchknee.api.admission refuses, every way the pod reads a
    ConfigMap, and an adopted workload (the integration tier runs it)."""
    root = Path(__file__).resolve().parents[2]
    assert (root / REQUESTER_POLICY_FILE).read_text() == requester_policy_yaml(), "run `make crds`"
    assert (root / CHART_REQUESTER_POLICY_FILE).read_text() == chart_requester_policy_template(), (
        "run `make crds`"
    )
    policy, binding = requester_policy()
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    gated = policy["spec"]["variables"][0]["expression"]
    for _, field, setting in HOSTILE:
        last = re.sub(r"\[[^\]]*\]", "", field).split(".")[-1]  # volumes[0].hostPath: hostPath
        if ".envFrom[" in field and setting == "allowDeviceRuntimeEnv":
            last = "e.prefix"  # every envFrom source, by the prefix its keys take
        assert last in gated, field
    pods, config_maps, target = policy["spec"]["validations"]
    assert "resource('pods')" in pods["expression"] and "check('create')" in pods["expression"]
    # a ConfigMap the pod reads (env, envFrom, volumes), each checked by name for get
    read = policy["spec"]["variables"][1]["expression"]
    assert all(f in read for f in ("configMapKeyRef.name", "configMapRef.name", "configMap.name"))
    expression = config_maps["expression"]
    assert "resource('configmaps')" in expression and ".name(n).check('get')" in expression
    # an adopted workload: its writer may patch it
    assert "object.spec.targetRef.name).check('patch')" in target["expression"]


@pytest.mark.parametrize(
    ("engine", "args", "flag"),
    [
        ("VLLM", ["-pp", "2"], "--pipeline-parallel-size 2"),
        ("VLLM", ["--data-parallel-size=4"], "--data-parallel-size 4"),
        ("VLLM", ["--pipeline", "2"], "--pipeline-parallel-size 2"),  # argparse's abbreviation
        ("SGLang", ["--dp-size", "2"], "--dp-size 2"),
        ("SGLang", ["--pipeline-parallel-size", "2"], "--pp-size 2"),
    ],
)
def test_parallelism_past_the_pods_gpus_is_refused_naming_the_flag(
    engine: str, args: list[str], flag: str
) -> None:
    """Tensor parallelism takes the pod's spec.gpu.count GPUs: pipeline or data parallelism on top
    asked the engine for more GPUs than the pod holds, and it never started (a crash loop, not a
    spec error)."""
    obj = parse(engine=engine, args=args)
    with pytest.raises(SpecError, match=f"spec.args.*{flag}: the operator runs one engine per pod"):
        resolve_roofline(obj.spec)
    assert resolve_roofline(parse(engine=engine, args=[args[0].split("=")[0], "1"]).spec)  # one is fine
    if engine == "SGLang":  # data-parallel attention groups share the tensor-parallel GPUs
        assert resolve_roofline(parse(engine=engine, args=["--enable-dp-attention", "--dp-size", "2"]).spec)
