"""The operator's configuration, from the environment (BATCHKNEE_*) and `batchknee operator` flags."""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import urllib.parse
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from batchknee.adapters.observing import (
    CREDENTIAL_HEADERS,
    URL_FORM,
    check_ca_file,
    check_headers,
    has_host,
    read_bearer_token,
    redact_url,
)
from batchknee.api.admission import (
    DEFAULT_ALLOWED_IMAGES,
    DEFAULT_ALLOWED_RESOURCES,
    DEFAULT_ALLOWED_RUNTIME_CLASSES,
    DEFAULT_ALLOWED_TOLERATIONS,
    AdmissionRules,
)
from batchknee.api.models import DNS_LABEL_PATTERN, OBJECT_NAME_PATTERN, TARGET_ENV_VAR
from batchknee.render import RenderDefaults

DOTTED_NUMBERS = re.compile(r"^[0-9.]+$")
HOST_NAME = re.compile(
    r"^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$"
)
# The project's BATCHKNEE_* variables that are not operator settings (the operator does not warn of them):
OTHER_VARIABLES = frozenset(
    {
        TARGET_ENV_VAR,  # BATCHKNEE_MAX_NUM_SEQS: the operator writes it into adopted engine containers
        "BATCHKNEE_EMULATOR_GPU",  # emulator/engine_args.py: the emulated GPU
        "BATCHKNEE_EMULATOR_LIVE_ENDPOINTS",  # emulator/engine_args.py: the emulator's live endpoints
        "BATCHKNEE_TOOLS_BIN",  # devcluster/tools.py: the folder of kube-apiserver, etcd, kubectl, helm
        "BATCHKNEE_PROMETHEUS",  # devcluster/tools.py: the prometheus binary
        "BATCHKNEE_KEEP_DEVCLUSTER",  # devcluster/cluster.py: leave the dev cluster running
        "BATCHKNEE_POD_NETNS",  # devcluster/netns.py: the pods' network namespace
        "BATCHKNEE_KEEP_LOGS",  # tests/integration/test_operator.py: keep the operator's logs
        "BATCHKNEE_WHEELHOUSE",  # tests/package/test_image.py: the wheels the image installs
    }
)
# The variables the kubelet sets for each Service of the namespace (enableServiceLinks), named
# after it: the chart's `batchknee-metrics` gives BATCHKNEE_METRICS_SERVICE_HOST, …_PORT_8081_TCP, …
SERVICE_LINK = re.compile(
    r"^[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT_\d+_(TCP|UDP|SCTP)(_[A-Z]+)?)$"
)
# Past these a setting is a typo: a query deadline or a shared reading of minutes is already stale.
MAX_PROMETHEUS_SECONDS = 300.0
MIN_PROMETHEUS_TIMEOUT_SECONDS = 0.1  # under it no query to any Prometheus can answer
# No window (at most an hour) scraped at most once a second holds more: every reading too thin.
MAX_WINDOW_SAMPLES = 3600


def _prometheus_url(url: str) -> str:
    # the URL is not echoed: it may carry credentials
    if not (url.lower().startswith(("http://", "https://")) and has_host(url)):
        raise ValueError(f"not an http(s) URL with a host; write it as {URL_FORM}")
    if any(ch.isspace() for ch in url):
        raise ValueError(f"holds whitespace; write it as {URL_FORM}")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"its port is not a number within 1–65535; write it as {URL_FORM}")
    if "?" in url or "#" in url:  # the query path is appended to the URL's own
        raise ValueError(
            f"has a query or a fragment, which the queries' own path would follow; write it as {URL_FORM}"
        )
    return url


def _split(value: Any) -> Any:
    """A comma-separated list (the environment's form; a flag given once per item may carry commas too)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return value
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def _https_only(info: ValidationInfo, why: str) -> str | None:
    """The Prometheus URL validated so far (None if it was refused); ValueError `why` unless https."""
    url: str | None = info.data.get("prometheus_url")
    if url is not None and not url.lower().startswith("https://"):
        raise ValueError(f"{why}, and the Prometheus URL {redact_url(url)} is not https")
    return url


def _no_userinfo(url: str | None) -> None:
    """ValueError when the Prometheus URL carries Basic credentials, which requests would send in
    place of another Authorization."""
    if url is not None and urllib.parse.urlsplit(url).username is not None:
        raise ValueError("the Prometheus URL carries a user and password too: give one of the two")


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHKNEE_", extra="ignore")

    prometheus_url: str = Field(
        "http://127.0.0.1:9090",
        description="Prometheus base URL (an LLMServing's spec.prometheus.url overrides)",
    )
    prometheus_timeout_seconds: float = Field(
        5.0,
        ge=MIN_PROMETHEUS_TIMEOUT_SECONDS,
        le=MAX_PROMETHEUS_SECONDS,
        description="Total deadline of one Prometheus query (not per read)",
    )
    prometheus_min_samples: int = Field(
        3,
        ge=1,
        le=MAX_WINDOW_SAMPLES,
        description="Fewer samples in the window read as too thin",
    )
    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Namespaces to watch, comma-separated; empty: the whole cluster"
    )
    metrics_address: str = Field(
        "127.0.0.1", description="Address of the operator's own /metrics (the image sets 0.0.0.0)"
    )
    metrics_port: int = Field(8081, ge=0, le=65535, description="Port of /metrics (0: off)")
    health_address: str = Field("127.0.0.1", description="Address of /healthz (the image sets 0.0.0.0)")
    health_port: int = Field(8080, ge=0, le=65535, description="Port of /healthz (0: off)")
    peering: Literal["auto", "mandatory", "standalone"] = Field(
        "auto", description="kopf peering: replicas see each other and only the highest priority acts"
    )
    peering_name: str = Field("batchknee", description="Name of the kopf peering object")
    peering_priority: int | None = Field(
        None,
        ge=-(2**31),
        le=2**31 - 1,
        description="This replica's peering priority (default: random, so two replicas never tie)",
    )
    # the engine releases the contracts are pinned to (batchknee.engines)
    vllm_image: str = Field(RenderDefaults.vllm_image, description="Default vLLM image")
    trtllm_image: str = Field(RenderDefaults.trtllm_image, description="Default TensorRT-LLM image")
    sglang_image: str = Field(RenderDefaults.sglang_image, description="Default SGLang image")
    verbose: bool = Field(False, description="Debug logging")
    # What LLMServings may ask of their engine pods beyond the allow-list (batchknee.api.admission).
    allowed_images: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_IMAGES),
        description="Images an LLMServing's spec.image may name: comma-separated shell patterns",
    )
    allowed_tolerations: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_TOLERATIONS),
        description="Taint keys an LLMServing's tolerations may name: comma-separated shell patterns "
        "(`*` also allows a toleration without a key, of every taint)",
    )
    allowed_priority_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="PriorityClasses spec.template.priorityClassName may name: comma-separated shell patterns",
    )
    allowed_runtime_classes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_RUNTIME_CLASSES),
        description="RuntimeClasses spec.template.runtimeClassName may name: comma-separated shell patterns",
    )
    allowed_resources: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_RESOURCES),
        description="Extended resources spec.template.resources may name (besides cpu, memory, "
        "ephemeral-storage, hugepages-*): comma-separated shell patterns",
    )
    allowed_pod_labels: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Label keys spec.template.labels may set: comma-separated shell patterns (none by default)",
    )
    allowed_pod_annotations: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Annotation keys spec.template.annotations may set: comma-separated shell patterns "
        "(none by default; AppArmor and seccomp ones follow allow_unrestricted_security_context)",
    )
    allow_service_account: bool = Field(False, description="Allow spec.template.serviceAccountName")
    allow_secret_references: bool = Field(
        False, description="Allow Secret volumes, secretKeyRef, envFrom secretRef and imagePullSecrets"
    )
    allow_host_paths: bool = Field(False, description="Allow hostPath volumes")
    allow_persistent_volume_claims: bool = Field(False, description="Allow PersistentVolumeClaim volumes")
    allow_cross_namespace_pod_affinity: bool = Field(
        False, description="Allow pod (anti-)affinity terms with namespaces or a namespaceSelector"
    )
    allow_unrestricted_security_context: bool = Field(
        False,
        description="Allow securityContext fields that loosen the restricted Pod Security Standard "
        "(root, privilege escalation, added capabilities, seccomp Unconfined, AppArmor or seccomp "
        "annotations other than runtime/default)",
    )
    allow_device_runtime_env: bool = Field(
        False,
        description="Allow env variables a GPU container runtime reads to choose the devices "
        "(NVIDIA_*, AMD_VISIBLE_DEVICES, HABANA_VISIBLE_*), and envFrom sources whose prefix does not "
        "rule them out: NVIDIA_VISIBLE_DEVICES=all mounts every GPU of the node, whatever the pod requested",
    )

    disruption_budgets: bool = Field(
        True,
        description="Give each engine Deployment a PodDisruptionBudget (maxUnavailable 1); off: none, "
        "and the operator deletes its own. Turn it off where LLMServing writers are untrusted: a "
        "template that confines its replicas to one node (a hostname nodeSelector, required affinity "
        "to its own pods) makes the budget block that node's drain",
    )

    template_rollouts_at_once: int = Field(
        4,
        ge=0,
        le=100_000,
        description="Engines restarted at once, cluster-wide, for a pod template the operator renders anew "
        "of its own (an operator upgrade that changes it, a changed default image), each counted until "
        "its rollout completes with as many pods available as before (one whose pods do not start keeps "
        "its place, so a template that does not start stops there; one namespace holds at most all places "
        "but one, so its engines cannot stop the rest); an engine that waits holds its "
        "batch limit meanwhile, but for a safety decrease (its TPOT target broken, its KV-cache pool "
        "exceeded, restarting the engines): it rolls with the new template without waiting, in a free place or "
        "one of as many again over this limit, within its namespace's share. LLMServing "
        "spec changes and hand edits of a Deployment put back do not wait. 0: no limit",
    )

    # --- Prometheus: what tenants may point the operator at, and how results are shared ---
    prometheus_allowed_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Prometheus URLs an LLMServing may name in spec.prometheus.url, comma-separated "
        "(the default URL always may); empty: none, `*`: any",
    )
    prometheus_bearer_token_file: str = Field(
        "",
        description="A file holding a bearer token sent to prometheus_url, and only there (never to a "
        "URL an LLMServing names); read at each query, so a rotated token is used",
    )
    prometheus_ca_file: str = Field(
        "", description="A PEM CA bundle that verifies prometheus_url's HTTPS certificate"
    )
    prometheus_headers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="HTTP headers sent with every query to prometheus_url, and only there, as a JSON "
        'object: `{"X-Scope-OrgID": "team-a"}` for Mimir or Cortex; values are masked where an answer echoes them',
    )
    prometheus_cache_seconds: float = Field(
        5.0,
        gt=0,
        le=MAX_PROMETHEUS_SECONDS,
        description="How long one refresh of the engine metrics serves every LLMServing",
    )
    reconcile_workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Reconciles at once (each sends its independent apiserver requests together); "
        "Live LLMServings' reconciles, which wait on their engines, run on workers of their own",
    )

    @field_validator("prometheus_allowed_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("prometheus_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return _prometheus_url(value.strip())

    @field_validator("prometheus_allowed_urls")
    @classmethod
    def _check_allowed_urls(cls, value: list[str]) -> list[str]:
        for number, url in enumerate(value, 1):
            if url != "*":
                try:
                    _prometheus_url(url)
                except ValueError as error:
                    raise ValueError(f"entry {number}: {error}") from None
        return value

    @field_validator("prometheus_bearer_token_file")
    @classmethod
    def _check_token_file(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return value
        read_bearer_token(value)  # one that cannot work is refused at start, not at every query
        # (over http: a ServiceAccount's token in clear text, to every proxy and hop on the way)
        _no_userinfo(_https_only(info, "a bearer token goes over HTTPS only"))
        return value

    @field_validator("prometheus_ca_file")
    @classmethod
    def _check_ca_file(cls, value: str, info: ValidationInfo) -> str:
        if value:
            check_ca_file(value)
            _https_only(info, "a CA verifies HTTPS only")
        return value

    @field_validator("prometheus_headers", mode="wrap")
    @classmethod
    def _check_headers(cls, value: Any, handler: Any, info: ValidationInfo) -> dict[str, str]:
        # checked before pydantic's type check, whose messages would carry a value (it may be a
        # secret): these messages name none (a ValidationError's str() carries the input, so the
        # operator command prints the messages alone)
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except (ValueError, RecursionError):
                value = None
        if not isinstance(value, Mapping):
            raise ValueError(
                'not a JSON object of header names to values; write it as {"X-Scope-OrgID": "team-a"}'
            )
        headers = check_headers(value)
        names = {name.lower() for name in headers}
        if names & CREDENTIAL_HEADERS:
            url = _https_only(info, "a header with credentials goes over HTTPS only")
            if "authorization" in names and info.data.get("prometheus_bearer_token_file"):
                raise ValueError("Authorization is the bearer token file's header too: give one of the two")
            if "authorization" in names:
                _no_userinfo(url)
        return handler(headers)  # type: ignore[no-any-return]

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: Any) -> Any:
        names = _split(value)
        # garbage must not widen the watch to the whole cluster (which an empty list means)
        if names == [] and value not in ("", []):
            raise ValueError(
                f"{value!r} names no namespace; list names, or leave it unset to watch every namespace"
            )
        return names

    @field_validator("namespaces")
    @classmethod
    def _check_namespaces(cls, value: list[str]) -> list[str]:
        for name in value:
            if len(name) > 63 or not re.match(DNS_LABEL_PATTERN, name):
                raise ValueError(
                    f"{name!r} is not a namespace name (lowercase letters, digits and '-', at most 63)"
                )
        return value

    @field_validator("vllm_image", "trtllm_image", "sglang_image")
    @classmethod
    def _check_image(cls, value: str) -> str:
        # a Deployment takes an empty image (a pod template's is optional) and its pods never start
        if not 0 < len(value) <= 1024 or any(not ch.isprintable() or ch.isspace() for ch in value):
            raise ValueError(
                "is not an image reference (1–1024 characters, no whitespace), e.g. vllm/vllm-openai:v0.34.0"
            )
        return value

    @field_validator("peering_name")
    @classmethod
    def _check_peering_name(cls, value: str) -> str:
        if not (0 < len(value) <= 253 and re.match(OBJECT_NAME_PATTERN, value)):
            raise ValueError(f"{value!r} is not an object name (lowercase letters, digits, '-' and '.')")
        return value

    @field_validator("metrics_address", "health_address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            if DOTTED_NUMBERS.match(value) or not HOST_NAME.match(value):
                raise ValueError(f"{value!r} is neither an IP address nor a host name") from None
        return value

    @field_validator("health_port")
    @classmethod
    def _distinct_ports(cls, value: int, info: ValidationInfo) -> int:
        addresses = {info.data.get("metrics_address"), info.data.get("health_address")}
        overlap = len(addresses) == 1 or bool(
            addresses & {"0.0.0.0", "::"}
        )  # a wildcard takes the port on every address
        if value and value == info.data.get("metrics_port") and overlap:
            raise ValueError(
                f"{value} is the metrics port too: give them different ports, or 0 to turn one off"
            )
        return value

    def liveness_endpoint(self) -> str | None:
        """kopf's /healthz URL (None: off); an IPv6 address in brackets, as kopf reads the host."""
        if not self.health_port:
            return None
        host = f"[{self.health_address}]" if ":" in self.health_address else self.health_address
        return f"http://{host}:{self.health_port}/healthz"

    def admission_rules(self) -> AdmissionRules:
        return AdmissionRules(
            allowed_images=tuple(self.allowed_images),
            allowed_tolerations=tuple(self.allowed_tolerations),
            allowed_priority_classes=tuple(self.allowed_priority_classes),
            allowed_runtime_classes=tuple(self.allowed_runtime_classes),
            allowed_resources=tuple(self.allowed_resources),
            allowed_pod_labels=tuple(self.allowed_pod_labels),
            allowed_pod_annotations=tuple(self.allowed_pod_annotations),
            allow_service_account=self.allow_service_account,
            allow_secret_references=self.allow_secret_references,
            allow_host_paths=self.allow_host_paths,
            allow_persistent_volume_claims=self.allow_persistent_volume_claims,
            allow_cross_namespace_pod_affinity=self.allow_cross_namespace_pod_affinity,
            allow_unrestricted_security_context=self.allow_unrestricted_security_context,
            allow_device_runtime_env=self.allow_device_runtime_env,
        )

    @field_validator(
        "allowed_images",
        "allowed_tolerations",
        "allowed_priority_classes",
        "allowed_runtime_classes",
        "allowed_resources",
        "allowed_pod_labels",
        "allowed_pod_annotations",
        mode="before",
    )
    @classmethod
    def _split_patterns(cls, value: Any) -> Any:
        return _split(value)


def setting_variables() -> frozenset[str]:
    """The environment variables OperatorSettings reads: its env prefix before each field's name."""
    prefix = str(OperatorSettings.model_config.get("env_prefix", ""))
    return frozenset((prefix + name).upper() for name in OperatorSettings.model_fields)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each variable of `environ` with the settings' prefix that is neither a setting nor one of
    OTHER_VARIABLES (a typo, read by nothing), with the setting its name is close to, if one is.
    Names only: a value may be a secret."""
    prefix = str(OperatorSettings.model_config.get("env_prefix", "")).upper()
    settings = setting_variables()
    # compared without the prefix, which every name shares (and would make any two look alike)
    suffixes = {name.removeprefix(prefix): name for name in settings}
    unknown = []
    upper_names = {name.upper() for name in environ}
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings matches names in any case
        if not upper.startswith(prefix) or upper in settings or upper in OTHER_VARIABLES:
            continue
        # the kubelet's, for a Service such as `batchknee-metrics` (its bare `…_PORT` beside its host)
        if SERVICE_LINK.match(upper) or (
            upper.endswith("_PORT") and f"{upper.removesuffix('_PORT')}_SERVICE_HOST" in upper_names
        ):
            continue
        close = difflib.get_close_matches(upper.removeprefix(prefix), sorted(suffixes), n=1)
        unknown.append((name, suffixes[close[0]] if close else None))
    return unknown
