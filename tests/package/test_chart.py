"""The Helm chart: helm lint, and helm template with default and non-default values, checked object
by object — hardened pods, RBAC exactly as wide as the operator's calls, peering, monitors, the
dashboard, the CRD copy, and values that are all documented and all in the schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_values_doc import keys as value_keys
from conftest import CHART, NAMESPACE, PROJECT, RELEASE, ROOT, Helm, Render, kinds, one
from operator_rbac import granted, required, wildcards
from prometheus_client import generate_latest

from batchknee.adapters.prometheus import SGLANG_METRICS, TRTLLM_METRICS, VLLM_METRICS
from batchknee.api.crd import crd_manifest, peering_crds
from batchknee.api.models import LLMServingStatus, ObservedMetrics
from batchknee.api.resolve import parse_llmserving
from batchknee.core.policy import Decision
from batchknee.operator_metrics import OperatorMetrics
from batchknee.reconcile import Outcome
from batchknee.render import METRICS_PATH, Desired, RenderDefaults, render
from batchknee.settings import OperatorSettings

FULLNAME = f"{RELEASE}-batchknee"
PEERING = {"replicaCount": 2}
NAMESPACED = {"operator": {"watchNamespaces": ["ml", "chat"]}}
MONITORS = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
SA_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
AUTH_URL = "https://thanos-querier.openshift-monitoring.svc:9091"
SECRET_AUTH = {
    "operator": {
        "prometheusUrl": AUTH_URL,
        "prometheusAuth": {"bearerTokenSecret": "prom-token", "caConfigMap": "prom-ca"},
    }
}
SA_AUTH = {"operator": {"prometheusUrl": AUTH_URL, "prometheusAuth": {"serviceAccountToken": True}}}
EVERYTHING = {
    "replicaCount": 3,
    "image": {"repository": "registry.example/ml/batchknee", "digest": "sha256:" + "a" * 64},
    "operator": {"prometheusUrl": "http://prometheus.obs:9090", "verbose": True},
    "metrics": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podMonitor": {"enabled": True, "namespace": "monitoring", "interval": "5s"},
    },
    "grafanaDashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "podAnnotations": {"example.com/team": "ml"},
    "imagePullSecrets": [{"name": "regcred"}],
}


def deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    [c] = deployment(objects)["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def env(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(objects)["env"]}


def roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return kinds(objects, "Role") + kinds(objects, "ClusterRole")


def pod_volumes(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in deployment(objects)["spec"]["template"]["spec"]["volumes"]}


def mounts(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container(objects)["volumeMounts"]}


# --- lint ------------------------------------------------------------------------------------------


def settings_under(variables: dict[str, str]) -> OperatorSettings:
    """The operator's settings as its container's environment gives them (the rest as it is now)."""
    import os

    saved = dict(os.environ)
    try:
        os.environ.update(variables)
        return OperatorSettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize(
    "values",
    [
        None,
        PEERING,
        NAMESPACED,
        MONITORS,
        EVERYTHING,
        {**NAMESPACED, **PEERING, **MONITORS},
        SECRET_AUTH,
        SA_AUTH,
    ],
    ids=[
        "default",
        "peering",
        "namespaced",
        "monitors",
        "everything",
        "namespaced-peering-monitors",
        "prometheus-secret-auth",
        "prometheus-sa-auth",
    ],
)
def test_helm_lint(helm: Helm, values: dict[str, Any] | None) -> None:
    done = helm("lint", values)
    assert "1 chart(s) linted, 0 chart(s) failed" in done.stdout, done.stdout


def test_chart_versions_follow_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    import batchknee

    assert chart["appVersion"] == PROJECT["version"] == batchknee.__version__
    assert chart["apiVersion"] == "v2" and chart["type"] == "application"


# --- the operator Deployment -----------------------------------------------------------------------


def test_default_objects(render: Render) -> None:
    objects = render()
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(
        [
            ("ServiceAccount", FULLNAME),
            ("ClusterRole", FULLNAME),
            ("ClusterRoleBinding", FULLNAME),
            ("Deployment", FULLNAME),
            ("Service", f"{FULLNAME}-metrics"),
            ("NetworkPolicy", FULLNAME),
            ("ConfigMap", f"{FULLNAME}-dashboard"),
            ("CustomResourceDefinition", "llmservings.batchknee.io"),
            ("ValidatingAdmissionPolicy", "llmservings.batchknee.io-requester"),
            ("ValidatingAdmissionPolicyBinding", "llmservings.batchknee.io-requester"),
        ]
    )
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "batchknee", obj["kind"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "batchknee-0.1.0"
        if obj["kind"] not in (
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]


def test_the_operator_pod_is_hardened(render: Render) -> None:
    objects = render()
    pod = deployment(objects)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532  # the Dockerfile's USER
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(objects)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # the only writable path: an emptyDir on /tmp (HOME and TMPDIR in the image)
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert pod["serviceAccountName"] == FULLNAME and pod["automountServiceAccountToken"] is True
    sa = one(objects, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False  # mounted by the operator pod only


def test_the_operator_container(render: Render) -> None:
    objects = render()
    c = container(objects)
    assert c["image"] == "ghcr.io/batchknee/batchknee:0.1.0"  # tag defaults to the appVersion
    assert c["args"] == ["operator"]  # the image's ENTRYPOINT is `batchknee`
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8081, "health": 8080}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    variables = env(objects)
    assert variables["BATCHKNEE_METRICS_ADDRESS"] == variables["BATCHKNEE_HEALTH_ADDRESS"] == "0.0.0.0"
    assert variables["BATCHKNEE_METRICS_PORT"] == "8081" and variables["BATCHKNEE_HEALTH_PORT"] == "8080"
    assert variables["BATCHKNEE_PEERING"] == "standalone" and variables["BATCHKNEE_NAMESPACES"] == ""
    assert settings_under(variables).disruption_budgets is True
    ipv6 = settings_under(env(render({"operator": {"listenAddress": "::"}})))  # IPv6-only clusters
    assert ipv6.metrics_address == ipv6.health_address == "::"
    assert ipv6.liveness_endpoint() == "http://[::]:8080/healthz"
    no_budgets = env(render({"operator": {"disruptionBudgets": False}}))
    assert settings_under(no_budgets).disruption_budgets is False
    assert variables["BATCHKNEE_TEMPLATE_ROLLOUTS_AT_ONCE"] == "4"
    unpaced = env(render({"operator": {"templateRolloutsAtOnce": 0}}))
    assert settings_under(unpaced).template_rollouts_at_once == 0
    assert deployment(objects)["spec"]["strategy"] == {"type": "Recreate"}  # never two standalone ones
    service = one(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"] == deployment(objects)["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize(
    "values", [None, EVERYTHING, NAMESPACED], ids=["default", "everything", "namespaced"]
)
def test_every_environment_variable_is_an_operator_setting(render: Render, values: dict[str, Any]) -> None:
    """The chart's BATCHKNEE_* variables are fields of OperatorSettings and parse there."""
    variables = env(render(values))
    fields = set(OperatorSettings.model_fields)
    for name in variables:
        assert name.startswith("BATCHKNEE_") and name.removeprefix("BATCHKNEE_").lower() in fields, name
    settings = settings_under(variables)
    assert settings.metrics_address == "0.0.0.0" and settings.health_port == 8080
    assert settings.namespaces == ((values or {}).get("operator", {}).get("watchNamespaces") or [])


def test_non_default_values(render: Render) -> None:
    objects = render(EVERYTHING)
    c = container(objects)
    assert c["image"] == "registry.example/ml/batchknee@sha256:" + "a" * 64
    pod = deployment(objects)["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    variables = env(objects)
    assert variables["BATCHKNEE_PROMETHEUS_URL"] == "http://prometheus.obs:9090"
    assert variables["BATCHKNEE_VERBOSE"] == "true"
    assert one(objects, "ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {m["metadata"]["namespace"] for m in kinds(objects, "PodMonitor")} == {"monitoring"}
    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "LLM"}


# --- peering ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 3])
def test_several_replicas_peer(render: Render, replicas: int) -> None:
    objects = render({"replicaCount": replicas})
    assert deployment(objects)["spec"]["replicas"] == replicas
    assert env(objects)["BATCHKNEE_PEERING"] == "mandatory"
    assert env(objects)["BATCHKNEE_PEERING_NAME"] == "batchknee"
    assert deployment(objects)["spec"]["strategy"]["type"] == "RollingUpdate"
    crds = {o["metadata"]["name"] for o in kinds(objects, "CustomResourceDefinition")}
    assert crds == {"llmservings.batchknee.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    rules = one(objects, "ClusterRole")["rules"]
    assert granted(rules) == required(cluster_wide=True, peering=True)


def test_peering_crds_can_be_left_to_another_kopf_operator(render: Render) -> None:
    objects = render({"replicaCount": 2, "crds": {"peering": False}})
    assert [o["metadata"]["name"] for o in kinds(objects, "CustomResourceDefinition")] == [
        "llmservings.batchknee.io"
    ]


def test_one_replica_can_peer_on_request(render: Render) -> None:
    objects = render({"operator": {"peering": {"mode": "mandatory", "name": "ml-ops"}}})
    assert env(objects)["BATCHKNEE_PEERING"] == "mandatory"
    assert granted(one(objects, "ClusterRole")["rules"]) == required(
        cluster_wide=True, peering=True, peering_name="ml-ops"
    )


def test_several_standalone_replicas_are_refused(helm: Helm) -> None:
    done = helm("template", {"replicaCount": 2, "operator": {"peering": {"mode": "standalone"}}}, check=False)
    assert done.returncode != 0 and "needs kopf peering" in done.stderr


@pytest.mark.parametrize(
    ("operator", "words"),
    [
        # the operator refuses each at start (settings.py): the chart refuses it at install instead
        ({"metricsPort": 8080, "healthPort": 8080}, "are both 8080"),
        ({"prometheusUrl": "http://:9090"}, "prometheusUrl"),
        ({"prometheusAllowedUrls": ["http://?x"]}, "prometheusAllowedUrls"),
        ({"prometheusAuth": {"caConfigMap": "prom-ca"}}, "prometheusUrl is not an https:// URL"),
        ({"prometheusHeaders": {"X Scope": "a"}}, "does not match pattern"),
        ({"prometheusHeaders": {"X-Scope-OrgID": "s3cret\r\nX-Injected: 1"}}, "the value of X-Scope-OrgID"),
        ({"prometheusHeaders": {"X-Scope-OrgID": "s3cret "}}, "ends with a space"),
        ({"prometheusHeaders": {"X-Scope-OrgID": "s3crét"}}, "non-ASCII"),
        ({"prometheusHeaders": {"X-Api-Key": "s3cret", "x-api-key": "s3cret2"}}, "given twice"),
        (
            {"prometheusUrl": "https://u:pw@mimir", "prometheusHeaders": {"Authorization": "Basic s3cret"}},
            "a user and password too",
        ),
        ({"prometheusHeaders": {"HOST": "mimir"}}, "HOST frames the request"),
        ({"prometheusHeaders": {"Authorization": "Basic YTpi"}}, "goes over HTTPS only"),
        (
            {
                "prometheusUrl": "https://mimir:8080",
                "prometheusHeaders": {"authorization": "Basic YTpi"},
                "prometheusAuth": {"serviceAccountToken": True},
            },
            "give one of the two",
        ),
    ],
)
def test_settings_the_operator_would_refuse_are_refused_at_install(
    helm: Helm, operator: dict[str, Any], words: str
) -> None:
    done = helm("template", {"operator": operator}, check=False)
    assert done.returncode != 0 and words in done.stderr, done.stderr
    assert "s3cr" not in done.stderr and "Injected" not in done.stderr  # a header's value: maybe a secret


# --- Prometheus behind a bearer token and a private CA -----------------------------------------------


def test_by_default_prometheus_gets_no_token_and_no_private_ca(render: Render) -> None:
    objects = render()
    variables = env(objects)
    assert "BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE" not in variables
    assert "BATCHKNEE_PROMETHEUS_CA_FILE" not in variables
    assert set(pod_volumes(objects)) == set(mounts(objects)) == {"tmp"}


def test_the_service_account_token_is_sent_without_another_volume(render: Render) -> None:
    objects = render(SA_AUTH)
    variables = env(objects)
    assert variables["BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE"] == SA_TOKEN_PATH
    assert "BATCHKNEE_PROMETHEUS_CA_FILE" not in variables
    # the kubelet's automounted, rotated token: nothing else mounted
    assert deployment(objects)["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert set(pod_volumes(objects)) == set(mounts(objects)) == {"tmp"}


def test_a_token_secret_is_mounted_read_only_for_the_operator_alone(render: Render) -> None:
    objects = render(
        {"operator": {"prometheusUrl": AUTH_URL, "prometheusAuth": {"bearerTokenSecret": "prom-token"}}}
    )
    volume = pod_volumes(objects)["prometheus-token"]
    assert volume["secret"] == {
        "secretName": "prom-token",
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    # 0440 with the pod's fsGroup: the non-root container user reads it through its group, others not
    pod = deployment(objects)["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 65532 and pod["securityContext"]["runAsNonRoot"] is True
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    mount = mounts(objects)["prometheus-token"]
    # the folder, not a subPath: the kubelet updates a rotated Secret in it
    assert mount == {
        "name": "prometheus-token",
        "mountPath": "/etc/batchknee/prometheus-token",
        "readOnly": True,
    }
    variables = env(objects)
    assert variables["BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE"] == "/etc/batchknee/prometheus-token/token"
    assert "BATCHKNEE_PROMETHEUS_CA_FILE" not in variables
    assert set(pod_volumes(objects)) == set(mounts(objects)) == {"tmp", "prometheus-token"}


@pytest.mark.parametrize(
    ("auth", "key"),
    [
        ({"caConfigMap": "prom-ca"}, "ca.crt"),
        ({"caConfigMap": "openshift-service-ca.crt", "caConfigMapKey": "service-ca.crt"}, "service-ca.crt"),
    ],
    ids=["ca.crt", "openshift-service-ca"],
)
def test_a_ca_config_map_is_mounted_and_verifies_prometheus(
    render: Render, auth: dict[str, str], key: str
) -> None:
    objects = render({"operator": {"prometheusUrl": AUTH_URL, "prometheusAuth": auth}})
    volume = pod_volumes(objects)["prometheus-ca"]
    assert volume["configMap"] == {
        "name": auth["caConfigMap"],
        "defaultMode": 0o444,
        "items": [{"key": key, "path": "ca.crt"}],
    }
    mount = mounts(objects)["prometheus-ca"]
    assert mount == {"name": "prometheus-ca", "mountPath": "/etc/batchknee/prometheus-ca", "readOnly": True}
    variables = env(objects)
    assert variables["BATCHKNEE_PROMETHEUS_CA_FILE"] == "/etc/batchknee/prometheus-ca/ca.crt"
    assert "BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE" not in variables


@pytest.mark.parametrize("auth", [{"serviceAccountToken": True}, {"bearerTokenSecret": "prom-token"}])
def test_a_bearer_token_over_plain_http_is_refused(helm: Helm, auth: dict[str, Any]) -> None:
    """The operator's ServiceAccount token may patch Deployments cluster-wide: never in clear text
    (the chart's default URL is kube-prometheus-stack's plain-http Service)."""
    done = helm("template", {"operator": {"prometheusAuth": auth}}, check=False)
    assert done.returncode != 0
    assert "a bearer token goes over HTTPS only" in done.stderr, done.stderr


def test_the_operator_gets_no_service_links(render: Render) -> None:
    """The kubelet's BATCHKNEE_METRICS_SERVICE_HOST & co. (named after the release's Service) would
    share the settings' prefix."""
    assert deployment(render())["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_both_bearer_tokens_at_once_are_refused(helm: Helm) -> None:
    both = {
        "operator": {
            "prometheusUrl": AUTH_URL,
            "prometheusAuth": {"serviceAccountToken": True, "bearerTokenSecret": "prom-token"},
        }
    }
    done = helm("template", both, check=False)
    assert done.returncode != 0
    assert "set serviceAccountToken or bearerTokenSecret, not both" in done.stderr, done.stderr


def test_prometheus_headers_reach_the_operator_as_its_setting(render: Render) -> None:
    headers = {"X-Scope-OrgID": "team-a|team-b", "X-Api-Key": "k3y"}
    variables = env(render({"operator": {"prometheusHeaders": headers}}))
    assert settings_under(variables).prometheus_headers == headers
    assert "BATCHKNEE_PROMETHEUS_HEADERS" not in env(render())


def test_the_prometheus_auth_variables_are_operator_settings(render: Render, tmp_path: Path) -> None:
    """The token and CA variables the chart sets are OperatorSettings fields, and parse there once the
    files they name exist (the settings read them: here a token file and a real CA bundle)."""

    import certifi

    variables = env(render(SECRET_AUTH))
    fields = set(OperatorSettings.model_fields)
    for name in ("BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE", "BATCHKNEE_PROMETHEUS_CA_FILE"):
        assert name.removeprefix("BATCHKNEE_").lower() in fields, name
    token = tmp_path / "token"
    token.write_text("abc.def.ghi\n")
    variables["BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE"] = str(token)
    variables["BATCHKNEE_PROMETHEUS_CA_FILE"] = certifi.where()
    settings = settings_under(variables)
    assert settings.prometheus_url == AUTH_URL
    assert settings.prometheus_bearer_token_file == str(token)
    assert settings.prometheus_ca_file == certifi.where()


def test_prometheus_auth_widens_no_role(render: Render) -> None:
    """The kubelet mounts the Secret and the ConfigMap: the operator's roles stay exactly as they are."""
    for values in (SECRET_AUTH, SA_AUTH):
        assert roles(render(values)) == roles(render())
    namespaced = {"operator": {**SECRET_AUTH["operator"], **NAMESPACED["operator"]}}
    assert roles(render(namespaced)) == roles(render(NAMESPACED))


# --- RBAC ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        None,
        PEERING,
        NAMESPACED,
        {**NAMESPACED, **PEERING},
        EVERYTHING,
        SECRET_AUTH,
        SA_AUTH,
        {"operator": {**SECRET_AUTH["operator"], **NAMESPACED["operator"]}},
        {"operator": {"disruptionBudgets": False}},
        {"operator": {**NAMESPACED["operator"], "disruptionBudgets": False}},
    ],
    ids=[
        "default",
        "peering",
        "namespaced",
        "namespaced-peering",
        "everything",
        "prometheus-secret-auth",
        "prometheus-sa-auth",
        "namespaced-prometheus-secret-auth",
        "no-disruption-budgets",
        "namespaced-no-disruption-budgets",
    ],
)
def test_rbac_grants_exactly_the_operators_calls(render: Render, values: dict[str, Any] | None) -> None:
    objects = render(values)
    values = values or {}
    namespaces = values.get("operator", {}).get("watchNamespaces") or []
    peering = values.get("replicaCount", 1) > 1
    budgets = values.get("operator", {}).get("disruptionBudgets", True)
    found = roles(objects)
    assert found
    for role in found:
        assert wildcards(role["rules"]) == [], role["metadata"]
        expected = required(cluster_wide=not namespaces, peering=peering, disruption_budgets=budgets)
        assert granted(role["rules"]) == expected, role["metadata"]
    if namespaces:
        assert not kinds(objects, "ClusterRole") and not kinds(objects, "ClusterRoleBinding")
        assert sorted(r["metadata"]["namespace"] for r in kinds(objects, "Role")) == sorted(namespaces)
        bindings = kinds(objects, "RoleBinding")
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces)
        for binding in bindings:
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": FULLNAME,
            }
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}
            ]
        assert env(objects)["BATCHKNEE_NAMESPACES"] == ",".join(namespaces)
    else:
        binding = one(objects, "ClusterRoleBinding")
        assert binding["roleRef"]["kind"] == "ClusterRole" and binding["roleRef"]["name"] == FULLNAME
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]


def test_no_rbac_and_an_existing_service_account(render: Render, helm: Helm) -> None:
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}})
    assert not roles(objects) and not kinds(objects, "ServiceAccount")
    assert deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    done = helm("template", {"serviceAccount": {"create": False}}, check=False)
    assert done.returncode != 0 and "serviceAccount.name is required" in done.stderr


# --- monitors and dashboard ------------------------------------------------------------------------


def test_only_the_monitoring_namespaces_reach_the_operators_metrics(render: Render) -> None:
    """/metrics names every LLMServing of every namespace with its figures: by default only
    kube-prometheus-stack's namespace may scrape it; /healthz stays open for the kubelet; no other
    port of the operator pods takes traffic."""
    objects = render()
    policy, deployment = one(objects, "NetworkPolicy"), one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], pod_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    metrics_rule, health_rule = policy["spec"]["ingress"]
    assert metrics_rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    [source] = metrics_rule["from"]
    assert source == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
            ]
        }
    }
    assert health_rule == {"ports": [{"port": "health", "protocol": "TCP"}]}
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"metrics", "health"}
    closed = render({"metrics": {"networkPolicy": {"metricsFromNamespaces": []}}})
    assert one(closed, "NetworkPolicy")["spec"]["ingress"] == [health_rule]
    assert not kinds(render({"metrics": {"networkPolicy": {"enabled": False}}}), "NetworkPolicy")


def test_monitors_only_when_enabled(render: Render) -> None:
    assert not kinds(render(), "ServiceMonitor") and not kinds(render(), "PodMonitor")
    objects = render(MONITORS)
    monitor = one(objects, "ServiceMonitor")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # the series' own `namespace` (the LLMServing's) stays
    service = one(objects, "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def engine_pod_labels(engine: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The pod labels and container the operator really renders for an engine."""
    obj = parse_llmserving(
        {
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"},
            "spec": {
                "engine": engine,
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                "gpu": {"type": "h100"},
            },
        }
    )
    [dep] = [o for o in render(obj, Desired(64, 131072), RenderDefaults()) if o["kind"] == "Deployment"]
    template = dep["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]["containers"][0]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        if op == "Exists" and key not in labels:
            return False
        if op == "In" and labels.get(key) not in values:
            return False
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("values", [MONITORS, {**MONITORS, **NAMESPACED}], ids=["cluster", "namespaced"])
def test_pod_monitors_select_the_engine_pods_with_the_labels_the_operator_queries(
    render: Render, values: dict[str, Any]
) -> None:
    monitors = kinds(render(values), "PodMonitor")
    assert len(monitors) == 3
    for engine in ("VLLM", "TensorRTLLM", "SGLang"):
        labels, engine_container = engine_pod_labels(engine)
        [monitor] = [m for m in monitors if matches(m["spec"]["selector"], labels)]
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] in {p["name"] for p in engine_container["ports"]}
        assert endpoint["path"] == METRICS_PATH[engine]  # type: ignore[index]
        targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        # the Prometheus adapter selects by `llmserving` and groups by it, `namespace` and `pod`
        assert targets["namespace"] == ["__meta_kubernetes_namespace"]
        assert targets["pod"] == ["__meta_kubernetes_pod_name"]
        assert targets["llmserving"] == ["__meta_kubernetes_pod_label_batchknee_io_llmserving"]
        namespaces = values.get("operator", {}).get("watchNamespaces")
        expected = {"matchNames": namespaces} if namespaces else {"any": True}
        assert monitor["spec"]["namespaceSelector"] == expected
        # a pod runs the tenant's image: its scrape may not flood a Prometheus other teams share,
        # in samples, body (counted before the samples), labels or label lengths
        assert monitor["spec"]["sampleLimit"] == 20000
        assert "bodySizeLimit" not in monitor["spec"] and monitor["spec"]["labelLimit"] == 64
        assert monitor["spec"]["labelNameLengthLimit"] == 128
        assert monitor["spec"]["labelValueLengthLimit"] == 4096
        # nor serve the operator's own names (tests/integration proves the drop on a real Prometheus)
        assert endpoint["metricRelabelings"] == [
            {"action": "drop", "sourceLabels": ["__name__"], "regex": "batchknee_.*"}
        ]
    not_an_engine = {"app.kubernetes.io/name": "batchknee", "app.kubernetes.io/instance": "rel"}
    assert not any(matches(m["spec"]["selector"], not_an_engine) for m in monitors)
    unlimited = {"metrics": {"podMonitor": {"enabled": True, "sampleLimit": 0}}}
    assert not any("sampleLimit" in m["spec"] for m in kinds(render(unlimited), "PodMonitor"))
    # the body's bound needs a Prometheus Operator from 2024 on: set, it is passed on
    bounded = {"metrics": {"podMonitor": {"enabled": True, "bodySizeLimit": "16MiB"}}}
    assert all(m["spec"]["bodySizeLimit"] == "16MiB" for m in kinds(render(bounded), "PodMonitor"))


def test_the_prometheus_adapter_queries_the_labels_the_pod_monitors_set() -> None:
    """What the PodMonitor relabelings promise (namespace, pod, llmserving), read from the
    adapter's own queries."""
    from batchknee.adapters.prometheus import queries, scope_for
    from batchknee.core.observation import ObservationTarget

    for engine in ("VLLM", "TensorRTLLM"):
        target = ObservationTarget(namespace="ml", name="chat", engine=engine, window_s=300)  # type: ignore[call-arg, arg-type]
        scope = scope_for(target)
        assert scope.matcher == 'llmserving!=""'
        texts = queries(scope).values()
        assert all("namespace, llmserving" in promql for promql in texts)
        assert any("namespace, llmserving, pod" in promql for promql in texts)


def dashboard(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(objects, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(cm["data"]["batchknee.json"])  # type: ignore[no-any-return]


def operator_metric_names() -> set[str]:
    metrics = OperatorMetrics()
    observed = ObservedMetrics(avg_context_length=2048, tpot_p99_milliseconds=20.0)
    status = LLMServingStatus(
        max_num_seqs=64, recommended_max_num_seqs=64, b_knee=60.0, hold_reason="cooldown", observed=observed
    )
    decision = Decision(action="roll", value=64, max_tokens=0, reason="r")
    metrics.record(
        Outcome("ml", "chat", decision=decision, status=status, tpot_target_ms=30, rolled=True), 0.01
    )
    text = generate_latest(metrics.registry).decode()
    return {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def test_the_grafana_dashboard(render: Render) -> None:
    board = dashboard(render())
    assert board["uid"] == "batchknee-operator"
    titles = " | ".join(p["title"] for p in board["panels"])
    for topic in (
        "B_knee",
        "applied vs recommended",
        "TPOT p99 vs target",
        "context",
        "Rollouts",
        "Holds by reason",
    ):
        assert topic in titles, topic
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"namespace", "llmserving"} <= variables.keys()
    for name in ("namespace", "llmserving"):
        assert re.search(
            r'label_values\(batchknee_max_num_seqs\{llmserving="".*\}, ', variables[name]["query"]["query"]
        )
    ours = operator_metric_names()
    families = (VLLM_METRICS, TRTLLM_METRICS, SGLANG_METRICS)
    engine = {name for family in families for names in vars(family).values() for name in names}
    seen: set[str] = set()
    engine_seen: set[str] = set()
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            expr = target["expr"]
            for name, selector in re.findall(r"\b(batchknee_[a-z_0-9]+)(\{[^}]*\})?", expr):
                assert name in ours, f"{panel['title']}: {name} is not an operator metric"
                # the operator's series, not one an engine pod served under its name (no llmserving label)
                assert 'llmserving=""' in selector, f'{panel["title"]}: {name} without llmserving=""'
                seen.add(name)
            for regex in re.findall(r'__name__=~"([^"]+)"', expr):
                for alternative in regex.split("|"):
                    base = re.sub(r"_bucket$", "", alternative)
                    assert base in engine, (
                        f"{panel['title']}: {alternative} is not an engine metric the adapter reads"
                    )
                    engine_seen.add(base)
    # the running batch and the engines' TPOT histogram of every engine (SGLang's panels were empty)
    for family in families:
        assert family.running[0] in engine_seen and set(family.tpot) & engine_seen, family
    # a gauge read as the adapter reads it: SGLang's per-priority breakdown and its ranks' copies
    # of one batch are not summed into it
    gauges = [
        target["expr"]
        for panel in board["panels"]
        for target in panel["targets"]
        if SGLANG_METRICS.running[0] in target["expr"]
    ]
    assert gauges and all(
        SGLANG_METRICS.gauge_matchers in expr
        and f"max without ({', '.join(SGLANG_METRICS.rank_labels)})" in expr
        for expr in gauges
    ), gauges
    assert {
        "batchknee_b_knee",
        "batchknee_max_num_seqs",
        "batchknee_recommended_max_num_seqs",
        "batchknee_observed_tpot_p99_seconds",
        "batchknee_tpot_p99_target_seconds",
        "batchknee_observed_context_tokens",
        "batchknee_retunes_total",
        "batchknee_holds_total",
    } <= seen


def test_the_dashboard_can_be_left_out(render: Render) -> None:
    assert not kinds(render({"grafanaDashboard": {"enabled": False}}), "ConfigMap")


# --- CRDs ------------------------------------------------------------------------------------------


def test_the_charts_crds_are_the_generated_ones(render: Render) -> None:
    """Rendered by helm, the chart's CRDs equal crds/ (the same models), and are kept on uninstall."""
    committed = {
        d["metadata"]["name"]: d
        for path in (ROOT / "crds").glob("*.yaml")
        for d in yaml.safe_load_all(path.read_text())
        if d
    }
    assert committed["llmservings.batchknee.io"] == crd_manifest()
    for values in (None, PEERING):
        for crd in kinds(render(values), "CustomResourceDefinition"):
            name = crd["metadata"]["name"]
            assert crd["spec"] == committed[name]["spec"], name
            assert crd["apiVersion"] == committed[name]["apiVersion"]
            assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert {c["metadata"]["name"] for c in peering_crds()} <= committed.keys()


def test_crds_can_be_left_out_or_deleted_on_uninstall(render: Render) -> None:
    assert not kinds(render({"crds": {"enabled": False}, **PEERING}), "CustomResourceDefinition")
    crd = one(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


# --- values ----------------------------------------------------------------------------------------


def test_every_value_is_documented() -> None:
    undocumented = [k.path for k in value_keys() if not k.doc]
    assert undocumented == [], "add a `# -- ` comment above each of these keys in values.yaml"
    listed = {k.path for k in value_keys()}

    def walk(node: Any, prefix: str = "") -> list[str]:
        out = []
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{prefix}{key}"
                out.append(path)
                out += walk(value, f"{path}.")
        return out

    assert set(walk(yaml.safe_load((CHART / "values.yaml").read_text()))) == listed


def test_the_readme_values_reference_is_current() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "chart_values_doc.py"),
            "--check",
            str(ROOT / "README.md"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_schema_knows_every_value_and_rejects_unknown_ones(helm: Helm) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(node: dict[str, Any], part: dict[str, Any], path: str) -> None:
        if part.get("additionalProperties") is False:
            assert set(node) <= set(part["properties"]), f"{path}: {set(node) - set(part['properties'])}"
            assert set(part["properties"]) - set(node) <= {"global", "claims", "localhostProfile"}, path
        for key, value in node.items():
            sub = part.get("properties", {}).get(key)
            if isinstance(value, dict) and sub and "properties" in sub:
                check(value, sub, f"{path}.{key}")

    check(values, schema, "")
    for bad, message in (
        ({"replicas": 2}, "additional properties 'replicas' not allowed"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"operator": {"peering": {"mode": "auto"}}}, "mode"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces"),
        ({"metrics": {"podMonitor": {"interval": "ten seconds"}}}, "interval"),
        # values rendered into the YAML as they are: a newline would add fields (hostNetwork, …)
        ({"priorityClassName": "x\n      hostNetwork: true"}, "priorityClassName"),
        ({"tmpSizeLimit": "64Mi\n          medium: Memory"}, "tmpSizeLimit"),
        ({"serviceAccount": {"name": "op\n  finalizers: [x]"}}, "name"),
        ({"metrics": {"podMonitor": {"namespace": "monitoring\n  finalizers: [x]"}}}, "namespace"),
        ({"metrics": {"serviceMonitor": {"namespace": "Monitoring"}}}, "namespace"),
        ({"grafanaDashboard": {"namespace": "x\ny"}}, "namespace"),
        ({"image": {"digest": "latest"}}, "digest"),
        ({"operator": {"prometheusAuth": {"bearerTokenSecret": "Prom_Token"}}}, "bearerTokenSecret"),
        ({"operator": {"prometheusAuth": {"bearerTokenSecret": "a" * 254}}}, "bearerTokenSecret"),
        ({"operator": {"prometheusAuth": {"caConfigMap": "-ca"}}}, "caConfigMap"),
        ({"operator": {"prometheusAuth": {"caConfigMapKey": "ca/crt"}}}, "caConfigMapKey"),
        ({"operator": {"prometheusAuth": {"caConfigMapKey": ".."}}}, "caConfigMapKey"),
        ({"operator": {"prometheusAuth": {"serviceAccountToken": "yes"}}}, "serviceAccountToken"),
        ({"operator": {"prometheusAuth": {"bearerToken": "s3cret"}}}, "'bearerToken' not allowed"),
        ({"operator": {"listenAddress": "0.0.0.0\n            - name: X"}}, "listenAddress"),
        ({"operator": {"disruptionBudgets": "no"}}, "disruptionBudgets"),
        ({"operator": {"templateRolloutsAtOnce": -1}}, "templateRolloutsAtOnce"),
        ({"operator": {"templateRolloutsAtOnce": "4\n            - name: X"}}, "templateRolloutsAtOnce"),
        ({"nameOverride": "x\nteam: a"}, "nameOverride"),  # a label line in every labels block
        ({"fullnameOverride": "Op"}, "fullnameOverride"),
        ({"metrics": {"podMonitor": {"bodySizeLimit": "16 MiB\n  x: y"}}}, "bodySizeLimit"),
        # what the operator refuses at start: the chart says so at install, not a crash-looping pod
        ({"operator": {"prometheusUrl": "http://prom:9090/?x=1"}}, "prometheusUrl"),
        ({"operator": {"prometheusUrl": "http://prom 9090"}}, "prometheusUrl"),
        ({"operator": {"prometheusAllowedUrls": ["http://prom:abc"]}}, "prometheusAllowedUrls"),
        ({"operator": {"prometheusUrl": "http://prom:99999"}}, "prometheusUrl"),
        ({"operator": {"prometheusUrl": "http://prom:0"}}, "prometheusUrl"),
        ({"operator": {"prometheusMinSamples": 99999}}, "prometheusMinSamples"),
        ({"operator": {"engineImages": {"vllm": "not an image"}}}, "vllm"),
    ):
        done = helm("template", bad, check=False)
        assert done.returncode != 0 and message in done.stderr, (bad, done.stderr)


def test_nothing_in_the_chart_is_stale() -> None:
    """The generated CRD templates carry their generator's header (edits belong in the models)."""
    for path in (CHART / "templates" / "crds").glob("*.yaml"):
        assert path.read_text().startswith("{{- /* Generated by `batchknee crd --chart`"), path
    assert not list(Path(CHART).rglob("*.tgz"))


def test_the_admission_settings_reach_the_operator_and_the_requester_policy_is_the_generated_one(
    render: Render,
) -> None:
    """operator.admission.* become the operator's admission rules; the requester policy the chart
    installs is crds/'s (both from batchknee.api.crd), and it can be left out."""
    from batchknee.api.crd import requester_policy

    admission = {
        "allowedImages": ["registry.local/*"],
        "allowHostPaths": True,
        "allowedTolerations": ["nvidia.com/gpu", "dedicated"],
        "allowedPriorityClasses": [],
    }
    values = {"operator": {"admission": admission}}
    variables = env(render(values))
    import os

    saved = dict(os.environ)
    try:
        os.environ.update(variables)
        rules = OperatorSettings().admission_rules()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert rules.allowed_images == ("registry.local/*",)
    assert rules.allow_host_paths and not rules.allow_service_account and not rules.allow_secret_references
    assert rules.allowed_tolerations == ("nvidia.com/gpu", "dedicated")
    assert rules.allowed_priority_classes == () and rules.allowed_runtime_classes == ("nvidia",)
    objects = render()
    for generated in requester_policy():
        [rendered] = kinds(objects, generated["kind"])
        assert rendered["spec"] == generated["spec"]
    assert not kinds(render({"admissionPolicy": {"enabled": False}}), "ValidatingAdmissionPolicy")


@pytest.mark.parametrize(
    ("release", "service"),
    [
        ("team.ops", "team-ops-batchknee-metrics"),  # a release name Helm takes, a Service name not
        ("r" * 53, "r" * 53 + "-b-metrics"),  # the longest release name: 63 characters
    ],
)
def test_the_metrics_service_is_named_as_kubernetes_names_services(release: str, service: str) -> None:
    """A DNS-1035 label: no dots, at most 63 characters, starting with a letter (else a clear error)."""
    from batchknee.devcluster.tools import tools_bin

    argv = [str(tools_bin() / "helm"), "template", release, str(CHART), "--kube-version", "v1.36.3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Service"]
    assert names == [service] and re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", names[0])
    refused = subprocess.run([*argv[:2], "1team", *argv[3:]], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "set fullnameOverride" in refused.stderr
