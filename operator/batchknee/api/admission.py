"""What an LLMServing may ask of its engine pod beyond the allow-list, and whether this cluster lets it.

The CRD schema (the same for every cluster) types the admin-gated pod fields so that an admin can
enable them; this pure check refuses each one at reconcile time unless the operator's settings do,
naming the field and the setting. Nothing is rendered or applied for a refused spec.

Admin-gated: a chosen ServiceAccount, Secret references (volumes, env, envFrom, image pull secrets),
hostPath and PersistentVolumeClaim volumes, a securityContext that loosens the restricted Pod
Security Standard, a pod (anti-)affinity term that reaches other namespaces, an environment variable
a GPU container runtime reads (it hands the container the devices it names), and, outside the
admin's allowed patterns, an image, a toleration's key, a priority class, a runtime class or an
extended resource (cluster-wide, and no RBAC guards naming them: a toleration lands the pods on
another team's tainted nodes, a priority class preempts their pods, a RuntimeClass can carry
tolerations of its own, a device plugin hands out its device), and a pod label or annotation key (a
label can match a Service's or a NetworkPolicy's pod selector written for other pods of the
namespace; an annotation can ask a network plugin or a mesh for another network or no sidecar).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

from batchknee.api.models import Affinity, ContainerSecurityContext, LLMServingSpec, PodSecurityContext
from batchknee.api.resolve import SpecError

# The repositories of the default engine images, any tag or digest.
DEFAULT_ALLOWED_IMAGES = (
    "vllm/vllm-openai:*",
    "vllm/vllm-openai@sha256:*",
    "docker.io/vllm/vllm-openai:*",
    "docker.io/vllm/vllm-openai@sha256:*",
    "nvcr.io/nvidia/tensorrt-llm/release:*",
    "nvcr.io/nvidia/tensorrt-llm/release@sha256:*",
    "lmsysorg/sglang:*",
    "lmsysorg/sglang@sha256:*",
    "docker.io/lmsysorg/sglang:*",
    "docker.io/lmsysorg/sglang@sha256:*",
)
# Taints engine pods may tolerate by default: the GPU nodes' (NVIDIA's device plugin, GKE, EKS).
DEFAULT_ALLOWED_TOLERATIONS = ("nvidia.com/gpu",)
# RuntimeClasses engine pods may name by default: NVIDIA's container runtime.
DEFAULT_ALLOWED_RUNTIME_CLASSES = ("nvidia",)
# Extended resources are devices the node's plugins hand out (a GPU, a MIG slice, but also
# /dev/kvm or /dev/fuse): beyond the container's own cpu, memory and storage each is the admin's.
DEFAULT_ALLOWED_RESOURCES = ("nvidia.com/*",)
CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage", "hugepages-*")
# Capabilities the restricted Pod Security Standard lets a container add.
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# Variables the GPU container runtimes read from a container's environment to choose its devices:
# NVIDIA's container toolkit, as configured by default, mounts every GPU NVIDIA_VISIBLE_DEVICES names
# ("all": the node's, those the device plugin gave other teams' pods included), whatever the pod
# requested; its other NVIDIA_* variables choose driver capabilities, MIG and IMEX access. AMD's and
# Habana's runtimes read their own. Shell patterns, case-sensitive as the environment is.
DEVICE_RUNTIME_ENV = ("NVIDIA_*", "AMD_VISIBLE_DEVICES", "HABANA_VISIBLE_*")


@dataclass(frozen=True)
class Setting:
    """An operator setting that enables a gated field: its Helm value and environment variable."""

    value: str  # allowServiceAccount (Helm: operator.admission.<value>)
    env: str  # BATCHKNEE_ALLOW_SERVICE_ACCOUNT

    def __str__(self) -> str:
        return f"operator.admission.{self.value} in the Helm values ({self.env})"


SERVICE_ACCOUNT = Setting("allowServiceAccount", "BATCHKNEE_ALLOW_SERVICE_ACCOUNT")
SECRETS = Setting("allowSecretReferences", "BATCHKNEE_ALLOW_SECRET_REFERENCES")
HOST_PATHS = Setting("allowHostPaths", "BATCHKNEE_ALLOW_HOST_PATHS")
CLAIMS = Setting("allowPersistentVolumeClaims", "BATCHKNEE_ALLOW_PERSISTENT_VOLUME_CLAIMS")
CROSS_NAMESPACE_AFFINITY = Setting(
    "allowCrossNamespacePodAffinity", "BATCHKNEE_ALLOW_CROSS_NAMESPACE_POD_AFFINITY"
)
SECURITY_CONTEXT = Setting(
    "allowUnrestrictedSecurityContext", "BATCHKNEE_ALLOW_UNRESTRICTED_SECURITY_CONTEXT"
)
DEVICE_ENV = Setting("allowDeviceRuntimeEnv", "BATCHKNEE_ALLOW_DEVICE_RUNTIME_ENV")
IMAGES = Setting("allowedImages", "BATCHKNEE_ALLOWED_IMAGES")
TOLERATIONS = Setting("allowedTolerations", "BATCHKNEE_ALLOWED_TOLERATIONS")
PRIORITY_CLASSES = Setting("allowedPriorityClasses", "BATCHKNEE_ALLOWED_PRIORITY_CLASSES")
RUNTIME_CLASSES = Setting("allowedRuntimeClasses", "BATCHKNEE_ALLOWED_RUNTIME_CLASSES")
RESOURCES = Setting("allowedResources", "BATCHKNEE_ALLOWED_RESOURCES")
POD_LABELS = Setting("allowedPodLabels", "BATCHKNEE_ALLOWED_POD_LABELS")
POD_ANNOTATIONS = Setting("allowedPodAnnotations", "BATCHKNEE_ALLOWED_POD_ANNOTATIONS")


@dataclass(frozen=True)
class AdmissionRules:
    """What the cluster admin allows LLMServings beyond the allow-list (operator settings)."""

    allowed_images: tuple[str, ...] = DEFAULT_ALLOWED_IMAGES
    allowed_tolerations: tuple[str, ...] = DEFAULT_ALLOWED_TOLERATIONS  # taint keys
    allowed_priority_classes: tuple[str, ...] = ()
    allowed_runtime_classes: tuple[str, ...] = DEFAULT_ALLOWED_RUNTIME_CLASSES
    allowed_resources: tuple[str, ...] = DEFAULT_ALLOWED_RESOURCES  # extended resource names
    allowed_pod_labels: tuple[str, ...] = ()  # label keys
    allowed_pod_annotations: tuple[str, ...] = ()  # annotation keys (confinement ones have their gate)
    allow_service_account: bool = False
    allow_secret_references: bool = False
    allow_host_paths: bool = False
    allow_persistent_volume_claims: bool = False
    allow_cross_namespace_pod_affinity: bool = False
    allow_unrestricted_security_context: bool = False
    allow_device_runtime_env: bool = False

    def patterns(self, setting: Setting) -> tuple[str, ...]:
        """The admin's patterns behind a list setting (images, taint keys, classes)."""
        return {
            IMAGES: self.allowed_images,
            TOLERATIONS: self.allowed_tolerations,
            PRIORITY_CLASSES: self.allowed_priority_classes,
            RUNTIME_CLASSES: self.allowed_runtime_classes,
            RESOURCES: self.allowed_resources,
            POD_LABELS: self.allowed_pod_labels,
            POD_ANNOTATIONS: self.allowed_pod_annotations,
        }[setting]

    def allows(self, setting: Setting) -> bool:
        return {
            SERVICE_ACCOUNT: self.allow_service_account,
            SECRETS: self.allow_secret_references,
            HOST_PATHS: self.allow_host_paths,
            CLAIMS: self.allow_persistent_volume_claims,
            CROSS_NAMESPACE_AFFINITY: self.allow_cross_namespace_pod_affinity,
            SECURITY_CONTEXT: self.allow_unrestricted_security_context,
            DEVICE_ENV: self.allow_device_runtime_env,
        }.get(setting, False)


@dataclass(frozen=True)
class GatedUse:
    """One admin-gated field an LLMServing uses."""

    field: str  # spec.template.volumes[0].hostPath
    what: str  # a hostPath volume
    setting: Setting


class Forbidden(SpecError):
    """A spec that asks for what this cluster's operator does not allow: Degraded, reason Forbidden."""

    def __init__(self, field: str, message: str, setting: Setting) -> None:
        super().__init__(field, message)
        self.setting = setting


def _security_context(
    context: PodSecurityContext | ContainerSecurityContext | None, path: str
) -> Iterator[GatedUse]:
    if context is None:
        return
    if context.run_as_user == 0:
        yield GatedUse(f"{path}.runAsUser", "running as root (user 0)", SECURITY_CONTEXT)
    if context.run_as_non_root is False:
        yield GatedUse(f"{path}.runAsNonRoot", "runAsNonRoot false", SECURITY_CONTEXT)
    if context.seccomp_profile is not None and context.seccomp_profile.type == "Unconfined":
        yield GatedUse(f"{path}.seccompProfile.type", "an Unconfined seccomp profile", SECURITY_CONTEXT)
    if isinstance(context, ContainerSecurityContext):
        if context.allow_privilege_escalation:
            yield GatedUse(f"{path}.allowPrivilegeEscalation", "privilege escalation", SECURITY_CONTEXT)
        added = (
            set((context.capabilities.add or []) if context.capabilities else []) - RESTRICTED_CAPABILITIES
        )
        if added:
            yield GatedUse(
                f"{path}.capabilities.add", f"capabilities {', '.join(sorted(added))}", SECURITY_CONTEXT
            )


# Pod annotations that set a container's confinement, as securityContext does: AppArmor (honoured
# by the kubelet beside securityContext.appArmorProfile) and the older seccomp annotations.
CONFINEMENT_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)
CONFINEMENT_ANNOTATIONS = ("seccomp.security.alpha.kubernetes.io/pod",)
CONFINED = "runtime/default"


def sets_confinement(key: str) -> bool:
    """An annotation that sets a container's AppArmor or seccomp profile."""
    return key.startswith(CONFINEMENT_ANNOTATION_PREFIXES) or key in CONFINEMENT_ANNOTATIONS


def loosens_confinement(key: str, value: str) -> bool:
    """An annotation that sets a profile other than the runtime's default (unconfined, a node's own)."""
    return sets_confinement(key) and value != CONFINED


# Pod (anti-)affinity terms: without namespaces or a namespaceSelector a term looks only at pods of
# the pod's own namespace; with them, at other teams' pods too, and a required anti-affinity term
# keeps every pod it selects off the engine's topology domain (the scheduler honours it both ways).
# The names as the CRD spells them, for the requester policy's CEL.
POD_AFFINITY_KINDS = ("podAffinity", "podAntiAffinity")
REQUIRED_TERMS = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED_TERMS = "preferredDuringSchedulingIgnoredDuringExecution"
NAMESPACE_FIELDS = ("namespaces", "namespaceSelector")


def cross_namespace_affinity(affinity: Affinity | None) -> Iterator[str]:
    """The path (under affinity) of each pod affinity term field that reaches other namespaces
    (present at all: an empty list or selector is where a tenant starts)."""
    if affinity is None:
        return
    for kind, rules in zip(
        POD_AFFINITY_KINDS, (affinity.pod_affinity, affinity.pod_anti_affinity), strict=True
    ):
        if rules is None:
            continue
        required = rules.required_during_scheduling_ignored_during_execution or []
        preferred = rules.preferred_during_scheduling_ignored_during_execution or []
        terms = [(f"{kind}.{REQUIRED_TERMS}[{i}]", term) for i, term in enumerate(required)] + [
            (f"{kind}.{PREFERRED_TERMS}[{i}].podAffinityTerm", weighted.pod_affinity_term)
            for i, weighted in enumerate(preferred)
        ]
        for path, term in terms:
            if term.namespaces is not None:
                yield f"{path}.namespaces"
            if term.namespace_selector is not None:
                yield f"{path}.namespaceSelector"


def gated_uses(spec: LLMServingSpec) -> list[GatedUse]:
    """Every admin-gated field the spec uses, in field order."""
    t, base = spec.pod_template, "spec.template"
    uses: list[GatedUse] = []
    if t.service_account_name is not None:
        uses.append(GatedUse(f"{base}.serviceAccountName", "a chosen ServiceAccount", SERVICE_ACCOUNT))
    for i, env in enumerate(t.env or []):
        if matches_any(env.name, DEVICE_RUNTIME_ENV):
            uses.append(
                GatedUse(
                    f"{base}.env[{i}].name",
                    f"the variable {_short(env.name)!r}, which the GPU container runtime reads to choose "
                    "the container's devices (all of the node's, other teams' included, whatever the pod "
                    "requested)",
                    DEVICE_ENV,
                )
            )
        if env.value_from is not None and env.value_from.secret_key_ref is not None:
            uses.append(
                GatedUse(f"{base}.env[{i}].valueFrom.secretKeyRef", "a Secret in the environment", SECRETS)
            )
    for i, source in enumerate(t.env_from or []):
        kind, what = (
            ("secretRef", "Secret") if source.secret_ref is not None else ("configMapRef", "ConfigMap")
        )
        if source.secret_ref is not None:
            uses.append(GatedUse(f"{base}.envFrom[{i}].secretRef", "a Secret in the environment", SECRETS))
        if could_form(source.prefix or "", DEVICE_RUNTIME_ENV):
            uses.append(
                GatedUse(
                    f"{base}.envFrom[{i}].{kind}",
                    f"a {what}'s keys as variables without a prefix that rules out "
                    f"{', '.join(DEVICE_RUNTIME_ENV)} (the GPU container runtime reads those to choose the "
                    "container's devices, and the kubelet reads the keys out of the operator's sight; set "
                    "a prefix such as APP_, or name each variable in env with its valueFrom)",
                    DEVICE_ENV,
                )
            )
    for i, volume in enumerate(t.volumes or []):
        if volume.secret is not None:
            uses.append(GatedUse(f"{base}.volumes[{i}].secret", "a Secret volume", SECRETS))
        if volume.host_path is not None:
            uses.append(GatedUse(f"{base}.volumes[{i}].hostPath", "a hostPath volume", HOST_PATHS))
        if volume.persistent_volume_claim is not None:
            uses.append(
                GatedUse(
                    f"{base}.volumes[{i}].persistentVolumeClaim", "a PersistentVolumeClaim volume", CLAIMS
                )
            )
    if t.image_pull_secrets:
        uses.append(GatedUse(f"{base}.imagePullSecrets", "image pull Secrets", SECRETS))
    uses.extend(_security_context(t.security_context, f"{base}.securityContext"))
    uses.extend(_security_context(t.container_security_context, f"{base}.containerSecurityContext"))
    for path in cross_namespace_affinity(t.affinity):
        uses.append(
            GatedUse(
                f"{base}.affinity.{path}",
                "a pod affinity term reaching other namespaces (a required anti-affinity term keeps the "
                "pods it selects off every node of the engine's topology domain)",
                CROSS_NAMESPACE_AFFINITY,
            )
        )
    for key, value in sorted((t.annotations or {}).items()):
        if loosens_confinement(key, value):
            uses.append(
                GatedUse(f"{base}.annotations[{key}]", f"the confinement profile {value!r}", SECURITY_CONTEXT)
            )
    return uses


def matches_any(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `name` (an image, a taint key, a class) matches one of the patterns (shell wildcards,
    case-sensitive)."""
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def could_form(prefix: str, patterns: tuple[str, ...]) -> bool:
    """Whether a variable `prefix` + some key could match one of the patterns (literals, or a stem
    and one trailing `*`): envFrom names each key of its source that way."""
    for pattern in patterns:
        stem = pattern.removesuffix("*")
        if stem.startswith(prefix) or (stem != pattern and prefix.startswith(stem)):
            return True
    return False


def _short(text: str, limit: int = 256) -> str:
    """Bounded for status and Events (an image may be 1024 characters, the patterns many)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _listed(patterns: tuple[str, ...]) -> str:
    return _short(", ".join(patterns)) or "none"


def _outside_allowed(spec: LLMServingSpec, rules: AdmissionRules) -> Iterator[Forbidden]:
    """Each cluster-wide name the spec uses that matches none of the admin's patterns."""
    t, base = spec.pod_template, "spec.template"
    for i, toleration in enumerate(t.tolerations or []):
        key = toleration.key or ""  # no key (with Exists): every taint, allowed only by a pattern matching ""
        if not matches_any(key, rules.allowed_tolerations):
            what = f"taint key {_short(key)!r}" if key else "every taint (no key)"
            yield Forbidden(
                f"{base}.tolerations[{i}].key",
                f"a toleration of {what} matches none of the operator's allowed tolerations "
                f"({_listed(rules.allowed_tolerations)}): it would place the engine pods on nodes tainted "
                f"for others; remove it, or ask the cluster admin to add the key to {TOLERATIONS}",
                TOLERATIONS,
            )
    for kind, amounts in (
        ("limits", t.resources.limits if t.resources else None),
        ("requests", t.resources.requests if t.resources else None),
    ):
        for resource in sorted(amounts or {}):
            if not matches_any(resource, CONTAINER_RESOURCES + rules.allowed_resources):
                yield Forbidden(
                    f"{base}.resources.{kind}[{_short(resource)}]",
                    f"resource {_short(resource)!r} matches none of the operator's allowed resources "
                    f"({_listed(rules.allowed_resources)}, besides cpu, memory and storage): a device "
                    f"plugin would hand the engine pod that device; remove it, or ask the cluster admin to "
                    f"add it to {RESOURCES}",
                    RESOURCES,
                )
    reaches = (
        (
            "labels",
            t.labels,
            "label",
            POD_LABELS,
            "a pod label can match a Service's or a NetworkPolicy's pod selector written for other pods of "
            "the namespace",
        ),
        (
            "annotations",
            # a confinement profile is securityContext's: runtime/default always, others by its gate
            {key: value for key, value in (t.annotations or {}).items() if not sets_confinement(key)},
            "annotation",
            POD_ANNOTATIONS,
            "a pod annotation can ask a network plugin or a mesh for another network, an address or no sidecar",
        ),
    )
    for name, keys, what, setting, why in reaches:
        patterns = rules.patterns(setting)
        for key in sorted(keys or {}):
            if not matches_any(key, patterns):
                yield Forbidden(
                    f"{base}.{name}[{_short(key)}]",
                    f"{what} key {_short(key)!r} matches none of the operator's allowed pod {name} "
                    f"({_listed(patterns)}): {why}; remove it, or ask the cluster admin to add the key to "
                    f"{setting}",
                    setting,
                )
    preempts = ": it would let the engine pods preempt others"
    classes = (
        ("priorityClassName", t.priority_class_name, "priority class", preempts, PRIORITY_CLASSES),
        ("runtimeClassName", t.runtime_class_name, "runtime class", "", RUNTIME_CLASSES),
    )
    for name, value, what, why, setting in classes:
        patterns = rules.patterns(setting)
        if value is not None and not matches_any(value, patterns):
            yield Forbidden(
                f"{base}.{name}",
                f"{what} {_short(value)!r} matches none of the operator's allowed {what}es "
                f"({_listed(patterns)}){why}; remove it, or ask the cluster admin to add it to {setting}",
                setting,
            )


def check_admission(spec: LLMServingSpec, rules: AdmissionRules) -> None:
    """Raise Forbidden for the first thing the spec asks that the rules do not allow."""
    if spec.image is not None and not matches_any(spec.image, rules.allowed_images):
        raise Forbidden(
            "spec.image",
            f"image {_short(spec.image)!r} matches none of the operator's allowed images "
            f"({_listed(rules.allowed_images)}); leave spec.image unset for the default image, "
            f"use an allowed one, or ask the cluster admin to add a pattern to {IMAGES}",
            IMAGES,
        )
    for refusal in _outside_allowed(spec, rules):
        raise refusal
    for use in gated_uses(spec):
        if not rules.allows(use.setting):
            raise Forbidden(
                use.field,
                f"{use.what} is not allowed for LLMServings in this cluster; remove it, or ask the cluster "
                f"admin to set {use.setting}",
                use.setting,
            )
