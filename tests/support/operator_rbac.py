"""Every Kubernetes API call the operator makes, and the RBAC permissions that follow from them.

The table is the source the chart's RBAC is checked against: tests/package renders the chart and
requires its rules to grant exactly these permissions (no more, no wildcards); tests/integration
installs the chart, asks the apiserver (`kubectl auth can-i --as=<the chart's ServiceAccount>`), runs
the operator with that ServiceAccount's token and compares the apiserver's audit log with the table.

Where each call comes from:
- batchknee.adapters.kubernetes.KubernetesAdapter: list an LLMServing by name (when the watch cache
  has not brought its latest); patch llmservings/status
  (server-side apply); get Deployment/Service/ConfigMap (never apply over an object another owner
  controls); list the engine pods (crash loops); patch Deployment/Service/ConfigMap (server-side apply: a PATCH
  request, but when the object does not exist yet the apiserver creates it and checks `create` too —
  seen as a 403 "cannot create resource" with `patch` alone); list and delete old TensorRT-LLM options
  ConfigMaps; create Event; create the peering object.
- kopf (handlers.py registers: on.event and an index on LLMServings, on.event on Deployments,
  Services and PodDisruptionBudgets; all feed the watch cache reconcile reads): list+watch of each; patch of LLMServings (only to remove the
  finalizer an older build's per-object daemons added); with peering: list+watch of the peering
  objects (the scheduler lists them too, to pause with kopf) and a patch of its own keep-alive into
  the one named by the peering name; cluster-wide only: list+watch
  of CustomResourceDefinitions (kopf's resource observer). Discovery (/api, /apis, /version) is open to
  every authenticated user (system:discovery). Posting of kopf's own Events is off (handlers.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Permission:
    group: str
    resource: str  # "llmservings/status" for a subresource
    verb: str
    name: str = ""  # resourceNames restriction, "" for none
    cluster_scoped: bool = False  # the resource itself is cluster-scoped (CRDs, ClusterKopfPeerings)


@dataclass(frozen=True)
class Call:
    permission: Permission
    who: str


def _calls(cluster_wide: bool, peering: bool, peering_name: str, disruption_budgets: bool) -> list[Call]:
    def p(group: str, resource: str, verb: str, name: str = "", cluster: bool = False) -> Permission:
        return Permission(group, resource, verb, name, cluster)

    calls = [
        Call(
            p("batchknee.io", "llmservings", "list"),
            "kopf: the LLMServing watch-stream; KubernetesAdapter.get_llmserving (a list by name)",
        ),
        Call(p("batchknee.io", "llmservings", "watch"), "kopf: the LLMServing watch-stream"),
        Call(p("batchknee.io", "llmservings", "patch"), "kopf: removes an older build's finalizer"),
        Call(p("batchknee.io", "llmservings/status", "patch"), "KubernetesAdapter.patch_status"),
        Call(
            p("batchknee.io", "llmservings/finalizers", "update"),
            "the apiserver's OwnerReferencesPermissionEnforcement, for each applied object's owner "
            "reference with blockOwnerDeletion (no request of its own)",
        ),
        Call(p("apps", "deployments", "get"), "KubernetesAdapter.get_deployment"),
        Call(p("apps", "deployments", "list"), "kopf: on.event of Deployments (the watch cache)"),
        Call(p("apps", "deployments", "watch"), "kopf: on.event of Deployments (the watch cache)"),
        Call(p("apps", "deployments", "patch"), "KubernetesAdapter.apply (server-side apply)"),
        Call(p("apps", "deployments", "create"), "KubernetesAdapter.apply (server-side apply creating it)"),
        Call(p("apps", "statefulsets", "get"), "KubernetesAdapter.get_object (an adopted StatefulSet)"),
        Call(p("apps", "statefulsets", "patch"), "KubernetesAdapter.apply (its one env entry)"),
        Call(p("", "services", "get"), "KubernetesAdapter.get_object (is it this LLMServing's?)"),
        Call(p("", "services", "list"), "kopf: on.event of Services (the watch cache)"),
        Call(p("", "services", "watch"), "kopf: on.event of Services (the watch cache)"),
        Call(p("", "configmaps", "get"), "KubernetesAdapter.get_object (is it this LLMServing's?)"),
        Call(p("", "pods", "list"), "KubernetesAdapter.list_pods (engine crash loops)"),
        Call(p("policy", "poddisruptionbudgets", "get"), "KubernetesAdapter.get_object (is it ours?)"),
        Call(p("policy", "poddisruptionbudgets", "list"), "kopf: on.event of budgets (the watch cache)"),
        Call(p("policy", "poddisruptionbudgets", "watch"), "kopf: on.event of budgets (the watch cache)"),
        Call(p("policy", "poddisruptionbudgets", "create"), "KubernetesAdapter.apply (creating it)"),
        Call(p("policy", "poddisruptionbudgets", "patch"), "KubernetesAdapter.apply (server-side apply)"),
        Call(p("", "services", "patch"), "KubernetesAdapter.apply (server-side apply)"),
        Call(p("", "services", "create"), "KubernetesAdapter.apply (server-side apply creating it)"),
        Call(p("", "configmaps", "patch"), "KubernetesAdapter.apply (TensorRT-LLM options file)"),
        Call(p("", "configmaps", "create"), "KubernetesAdapter.apply (server-side apply creating it)"),
        Call(p("", "configmaps", "list"), "KubernetesAdapter.list_config_maps (old TensorRT-LLM options)"),
        Call(p("", "configmaps", "delete"), "KubernetesAdapter.delete (past the newest three)"),
        Call(p("", "events", "create"), "KubernetesAdapter.emit_event"),
    ]
    if cluster_wide:
        crds = "customresourcedefinitions"
        calls += [
            Call(p("apiextensions.k8s.io", crds, "list", cluster=True), "kopf: resource observer"),
            Call(p("apiextensions.k8s.io", crds, "watch", cluster=True), "kopf: resource observer"),
        ]
    if not disruption_budgets:
        calls.append(
            Call(
                p("policy", "poddisruptionbudgets", "delete"),
                "KubernetesAdapter.delete (the operator's own, while operator.disruptionBudgets is off)",
            )
        )
    if peering:
        plural = "clusterkopfpeerings" if cluster_wide else "kopfpeerings"
        calls += [
            Call(p("kopf.dev", plural, "create", cluster=cluster_wide), "KubernetesAdapter.ensure_peering"),
            Call(
                p("kopf.dev", plural, "list", cluster=cluster_wide),
                "kopf: peering watch-stream; KubernetesAdapter.peering_statuses (the scheduler's pause)",
            ),
            Call(p("kopf.dev", plural, "watch", cluster=cluster_wide), "kopf: peering watch-stream"),
            Call(
                p("kopf.dev", plural, "patch", name=peering_name, cluster=cluster_wide),
                "kopf: its keep-alive in the peering object",
            ),
        ]
    return calls


def operator_calls(
    *, cluster_wide: bool, peering: bool, peering_name: str = "batchknee", disruption_budgets: bool = True
) -> list[Call]:
    return _calls(cluster_wide, peering, peering_name, disruption_budgets)


def required(
    *, cluster_wide: bool, peering: bool, peering_name: str = "batchknee", disruption_budgets: bool = True
) -> set[Permission]:
    return {c.permission for c in _calls(cluster_wide, peering, peering_name, disruption_budgets)}


# Checked by the apiserver on the operator's own writes, never a request of its own (so absent from
# the audit log): an owner reference that blocks the owner's deletion needs update on its finalizers.
ADMISSION_CHECKED = {Permission("batchknee.io", "llmservings/finalizers", "update")}

CLUSTER_SCOPED = {"customresourcedefinitions", "clusterkopfpeerings", "namespaces", "nodes"}


def granted(rules: Iterable[Mapping[str, Any]]) -> set[Permission]:
    """The permissions a Role's or ClusterRole's rules grant, one per (group, resource, verb, name)."""
    out: set[Permission] = set()
    for rule in rules:
        names = rule.get("resourceNames") or [""]
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    for name in names:
                        cluster = resource.split("/")[0] in CLUSTER_SCOPED
                        out.add(Permission(group, resource, verb, name, cluster))
    return out


def wildcards(rules: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every '*' in apiGroups, resources, verbs or resourceNames, and every nonResourceURLs rule."""
    found = []
    for i, rule in enumerate(rules):
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            if any("*" in item for item in rule.get(key) or []):
                found.append(f"rule {i}: {key} {rule[key]}")
        if rule.get("nonResourceURLs"):
            found.append(f"rule {i}: nonResourceURLs {rule['nonResourceURLs']}")
    return found
