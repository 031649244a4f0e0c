"""`batchknee.io/v1alpha1` `LLMServing`: spec and status as pydantic models.

The CRD's OpenAPI schema is generated from these (`batchknee.api.crd`); every field carries the
description `kubectl explain` prints. Kubernetes API conventions: camelCase fields, integers with
their unit in the name, no floats in spec, CamelCase enum values, conditions with
`observedGeneration`. Cross-field rules are CEL (`x-kubernetes-validations`) in the CRD and the
same rules again in pydantic, so a spec that reached the cluster without them still gets a
clear message naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from batchknee.core.catalog import GPUS, MODELS
from batchknee.core.policy import CALIBRATION_SAMPLES_KEPT, HISTORY_KEPT, RECENT_TARGETS_KEPT

GROUP = "batchknee.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMServing"
PLURAL = "llmservings"
SINGULAR = "llmserving"
SHORT_NAMES = ("llms",)
CONDITION_TYPES = ("Ready", "MetricsAvailable", "Progressing", "Degraded", "ArgsOverridden", "Wired")
# The env var an adopted workload's args reference: `--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)`.
TARGET_ENV_VAR = "BATCHKNEE_MAX_NUM_SEQS"


def normalise_catalog_name(name: str) -> str:
    """How the catalogs match names (and how the CRD's CEL rules do): lower case, `_` as `-`."""
    return name.strip().lower().replace("_", "-")


def catalog_model_names() -> list[str]:
    return sorted({normalise_catalog_name(key) for m in MODELS for key in (m.name, *m.aliases)})


def catalog_gpu_names() -> list[str]:
    return sorted({normalise_catalog_name(key) for g in GPUS for key in (g.name, *g.aliases)})


def _cel_in(expression: str, names: list[str]) -> str:
    quoted = ", ".join(f"'{name}'" for name in names)
    return f"{expression}.lowerAscii().replace('_', '-') in [{quoted}]"


def format_timestamp(moment: datetime) -> str:
    """RFC 3339 in UTC with a Z, seconds precision: how Kubernetes writes times."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_timestamp(value: Any) -> Any:
    if isinstance(value, str) and value.endswith("Z"):
        return value[:-1] + "+00:00"
    return value


Timestamp = Annotated[
    datetime,
    BeforeValidator(_parse_timestamp),
    PlainSerializer(format_timestamp, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
IntOrString = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]
# A piece of a Kubernetes pod spec kept as given (resources, tolerations, volumes, ...).
Opaque = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]


def _validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        use_attribute_docstrings=False,
    )

    def dump(self) -> dict[str, Any]:
        """The object as Kubernetes JSON: camelCase, no unset optionals."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --- spec ------------------------------------------------------------------------------------------


class Engine(StrEnum):
    VLLM = "VLLM"
    TensorRTLLM = "TensorRTLLM"


class TuningMode(StrEnum):
    Auto = "Auto"
    Recommend = "Recommend"
    Pinned = "Pinned"


# The dtypes `batchknee.core.dtypes` knows (a unit test keeps these in step).
WeightDtype = Literal["bf16", "fp16", "fp8", "int8", "int4"]
KvCacheDtype = Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"]


class Architecture(_Model):
    """The model's shape, for models outside the built-in catalog (the fields of a Hugging Face
    config.json the knee depends on)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "has(self.experts) == has(self.expertsPerToken)",
                "message": "set both experts and expertsPerToken (a mixture-of-experts model), or neither",
            },
            {
                "rule": "!has(self.experts) || self.expertsPerToken <= self.experts",
                "message": "expertsPerToken must not exceed experts",
                "fieldPath": ".expertsPerToken",
            },
            {
                "rule": "!has(self.experts) || has(self.activeParams)",
                "message": "a mixture-of-experts model needs activeParams",
                "fieldPath": ".activeParams",
            },
            {
                "rule": "!has(self.activeParams) || self.activeParams <= self.params",
                "message": "activeParams must not exceed params",
                "fieldPath": ".activeParams",
            },
            {
                "rule": "has(self.kvLoraRank) == has(self.qkRopeHeadDim)",
                "message": "multi-head latent attention needs both kvLoraRank and qkRopeHeadDim, or neither",
            },
            {
                "rule": "!has(self.slidingWindowLayers) || self.slidingWindowLayers <= self.layers",
                "message": "slidingWindowLayers must not exceed layers",
                "fieldPath": ".slidingWindowLayers",
            },
        )
    )

    layers: int = Field(ge=1, le=1000, description="Transformer layers (config.json num_hidden_layers).")
    attention_heads: int = Field(ge=1, le=1024, description="Query heads (num_attention_heads).")
    kv_heads: int = Field(ge=1, le=1024, description="Key/value heads (num_key_value_heads; GQA groups).")
    head_dim: int = Field(ge=1, le=4096, description="Dimension of one attention head.")
    params: Int64 = Field(ge=1, description="Total parameter count, e.g. 8030000000.")
    active_params: Int64 | None = Field(
        None, ge=1, description="Parameters each token reads (mixture of experts); defaults to params."
    )
    experts: int | None = Field(None, ge=1, le=4096, description="Routed experts per MoE layer.")
    experts_per_token: int | None = Field(None, ge=1, le=4096, description="Routed experts each token picks.")
    kv_lora_rank: int | None = Field(
        None, ge=1, le=65536, description="Multi-head latent attention (DeepSeek): latent rank per token."
    )
    qk_rope_head_dim: int | None = Field(
        None, ge=1, le=65536, description="Multi-head latent attention: rotary part of each head."
    )
    sliding_window: int | None = Field(
        None, ge=1, description="Tokens a windowed layer attends to (keeps in its KV cache)."
    )
    sliding_window_layers: int | None = Field(
        None, ge=0, description="How many layers use the sliding window (default: all when a window is set)."
    )

    @model_validator(mode="after")
    def _rules(self) -> Architecture:
        if (self.experts is None) != (self.experts_per_token is None):
            raise ValueError("set both experts and expertsPerToken, or neither")
        if self.experts is not None and self.experts_per_token is not None:
            if self.experts_per_token > self.experts:
                raise ValueError("expertsPerToken must not exceed experts")
            if self.active_params is None:
                raise ValueError("a mixture-of-experts model needs activeParams")
        if self.active_params is not None and self.active_params > self.params:
            raise ValueError("activeParams must not exceed params")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError("set both kvLoraRank and qkRopeHeadDim, or neither")
        if self.sliding_window_layers is not None and self.sliding_window_layers > self.layers:
            raise ValueError("slidingWindowLayers must not exceed layers")
        return self


class ModelSpec(_Model):
    """Which model the engine serves, and what the knee math needs to know about it."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "has(self.architecture) || " + _cel_in("self.name", catalog_model_names()),
                "message": "spec.model.name is not in the built-in catalog: set spec.model.architecture "
                "(layers, attentionHeads, kvHeads, headDim, params) or use a catalog name such as llama-3-8b",
                "fieldPath": ".name",
                "reason": "FieldValueInvalid",
            }
        )
    )

    name: str = Field(
        min_length=1,
        max_length=253,
        description="What the engine loads: a Hugging Face repository id (e.g. meta-llama/Llama-3.1-8B-Instruct) "
        "or a path in the image or a volume. Also the catalog lookup key (names and aliases, case-insensitive) "
        "unless architecture is given.",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="The model name clients send in OpenAI requests (--served-model-name); defaults to name.",
    )
    architecture: Architecture | None = Field(
        None, description="The model's shape; required when name is not in the built-in catalog."
    )
    weight_dtype: WeightDtype = Field(
        "bf16", description="Data type of the weights as served (bf16, fp16, fp8, int8, int4)."
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="KV-cache data type; auto follows the activations (16-bit). fp8 halves KV bytes and is passed "
        "to vLLM as --kv-cache-dtype.",
    )
    params: Int64 | None = Field(
        None, ge=1, description="Override the parameter count (e.g. 8000000000 to reproduce rounded figures)."
    )


class GpuSpec(_Model):
    """The accelerators of one engine replica."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "(has(self.memoryMebibytes) && has(self.bandwidthGigabytesPerSecond)) || "
                + _cel_in("self.type", catalog_gpu_names()),
                "message": "spec.gpu.type is not in the built-in catalog: set spec.gpu.memoryMebibytes and "
                "spec.gpu.bandwidthGigabytesPerSecond, or use a catalog name such as a100-80gb or h100-sxm",
                "fieldPath": ".type",
                "reason": "FieldValueInvalid",
            }
        )
    )

    type: str = Field(
        min_length=1,
        max_length=63,
        description="GPU type: a catalog name or alias (a100-80gb, h100-sxm, h200, l40s, l4, mi300x, ...).",
    )
    count: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs per replica: the tensor-parallel size, and the nvidia.com/gpu limit of each pod.",
    )
    memory_mebibytes: int | None = Field(
        None, ge=1, description="Memory of one GPU in MiB; overrides the catalog (required outside it)."
    )
    bandwidth_gigabytes_per_second: int | None = Field(
        None,
        ge=1,
        description="Peak memory bandwidth of one GPU in GB/s; overrides the catalog (required outside it).",
    )
    peak_teraflops: int | None = Field(
        None,
        ge=1,
        description="Dense BF16 peak of one GPU in TFLOP/s, for the compute roof; overrides the catalog "
        "(outside it the compute roof is ignored).",
    )


class TuningSpec(_Model):
    """How the operator keeps the batch limit at the knee."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "self.minMaxNumSeqs <= self.maxMaxNumSeqs",
                "message": "spec.tuning.minMaxNumSeqs must not exceed spec.tuning.maxMaxNumSeqs",
                "fieldPath": ".minMaxNumSeqs",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": "self.mode != 'Pinned' || has(self.pinnedMaxNumSeqs)",
                "message": "spec.tuning.mode Pinned needs spec.tuning.pinnedMaxNumSeqs",
                "fieldPath": ".pinnedMaxNumSeqs",
                "reason": "FieldValueRequired",
            },
        )
    )

    mode: TuningMode = Field(
        TuningMode.Auto,
        description="Auto: roll the engine to the knee as traffic shifts. Recommend: compute and report in "
        "status, never roll. Pinned: run pinnedMaxNumSeqs.",
    )
    knee_factor_percent: int = Field(
        100,
        ge=100,
        le=200,
        description="max-num-seqs = this percentage of the knee batch B_knee, rounded up to a multiple of 8 "
        "(the source recommends 100–150).",
    )
    tpot_p99_target_milliseconds: int | None = Field(
        None,
        ge=1,
        le=100000,
        description="Time-per-output-token p99 target. Enables the SLO guard: a calibrated cap once enough "
        "samples exist, otherwise a step down while p99 is over the target.",
    )
    min_max_num_seqs: int = Field(8, ge=1, le=65536, description="Lower bound of the batch limit.")
    max_max_num_seqs: int = Field(512, ge=1, le=65536, description="Upper bound of the batch limit.")
    dead_band_percent: int = Field(
        10,
        ge=0,
        le=100,
        description="Changes smaller than this percentage of the applied value are not worth a rollout.",
    )
    cooldown_seconds: int = Field(
        600, ge=0, le=86400, description="Minimum time between two rollouts of the batch limit."
    )
    max_rollouts_per_hour: int = Field(
        4,
        ge=1,
        le=HISTORY_KEPT,
        description="Rollout budget: at most this many batch-limit rollouts in any hour.",
    )
    evaluation_interval_seconds: int = Field(
        30, ge=5, le=3600, description="How often the operator re-evaluates this object."
    )
    window_seconds: int = Field(
        300,
        ge=30,
        le=3600,
        description="Metrics window (rates and quantiles), and how long to wait after a rollout before "
        "trusting the metrics again.",
    )
    initial_context_length: int = Field(
        2048,
        ge=1,
        le=10_000_000,
        description="Context length (tokens) assumed before any traffic has been seen.",
    )
    pinned_max_num_seqs: int | None = Field(
        None, ge=1, le=65536, description="The batch limit to run in Pinned mode."
    )

    @model_validator(mode="after")
    def _rules(self) -> TuningSpec:
        if self.min_max_num_seqs > self.max_max_num_seqs:
            raise ValueError("minMaxNumSeqs must not exceed maxMaxNumSeqs")
        if self.mode == TuningMode.Pinned and self.pinned_max_num_seqs is None:
            raise ValueError("mode Pinned needs pinnedMaxNumSeqs")
        return self


class PrometheusSpec(_Model):
    """Where the engines' metrics are read."""

    url: str | None = Field(
        None,
        pattern=r"^https?://",
        max_length=2048,
        description="Prometheus base URL; defaults to the operator's BATCHKNEE_PROMETHEUS_URL.",
    )
    selector: dict[str, str] | None = Field(
        None,
        description="Exact label matches selecting this object's engine series, for unusual labelling. By "
        "default series are matched by namespace and pod name (<name>-<replicaset hash>-<pod hash>).",
    )


def _int_or_percent_rule(field: str) -> dict[str, str]:
    return {
        "rule": f"type(self.{field}) == int ? self.{field} >= 0 : self.{field}.matches('^[0-9]+%$')",
        "message": f"spec.rollout.{field} is a count of pods (an integer ≥ 0) or a percentage such as '25%'",
        "fieldPath": f".{field}",
        "reason": "FieldValueInvalid",
    }


class RolloutSpec(_Model):
    """The Deployment's rolling update. The default replaces one pod at a time without a surge
    pod, because a surge pod needs GPUs the node usually does not have."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _int_or_percent_rule("maxSurge"),
            _int_or_percent_rule("maxUnavailable"),
            {
                "rule": "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])",
                "message": "spec.rollout.maxSurge and spec.rollout.maxUnavailable must not both be zero: "
                "the rollout could never replace a pod",
                "fieldPath": ".maxUnavailable",
                "reason": "FieldValueInvalid",
            },
        )
    )

    max_surge: IntOrString = Field(
        0,
        description="Pods above replicas during a rollout (count or percentage). 1 with a spare GPU lets a "
        "single-replica LLMServing retune without a serving gap.",
    )
    max_unavailable: IntOrString = Field(
        1, description="Pods that may be unavailable during a rollout (count or percentage)."
    )
    allow_serving_gap: bool = Field(
        False,
        description="Let Auto mode retune a single replica without a surge pod, accepting that it serves "
        "nothing while its engine restarts (1–5 minutes on a real GPU).",
    )
    progress_deadline_seconds: int = Field(
        600,
        ge=10,
        le=86400,
        description="New engine pods not Ready within this time (the value does not fit, the engine crashes) "
        "roll back to the last good batch limit, which is then quarantined.",
    )

    @model_validator(mode="after")
    def _rules(self) -> RolloutSpec:
        for name, value in (("maxSurge", self.max_surge), ("maxUnavailable", self.max_unavailable)):
            if (isinstance(value, int) and value < 0) or (
                isinstance(value, str) and not re.fullmatch(r"\d+%", value)
            ):
                raise ValueError(
                    f"spec.rollout.{name} is a count of pods (≥ 0) or a percentage such as '25%'"
                )
        if str(self.max_surge).rstrip("%") == "0" and str(self.max_unavailable).rstrip("%") == "0":
            raise ValueError("maxSurge and maxUnavailable must not both be zero")
        return self

    @property
    def surges(self) -> bool:
        return str(self.max_surge).rstrip("%") not in ("0", "")


class TemplateSpec(_Model):
    """Overrides merged into the engine pods (Kubernetes pod and container fields, as in a pod spec)."""

    labels: dict[str, str] | None = Field(None, description="Extra pod labels.")
    annotations: dict[str, str] | None = Field(None, description="Extra pod annotations.")
    resources: Opaque | None = Field(
        None,
        description="Engine container resources (requests/limits); the nvidia.com/gpu limit is always gpu.count.",
    )
    env: list[Opaque] | None = Field(None, description="Extra environment variables of the engine container.")
    env_from: list[Opaque] | None = Field(None, description="Environment sources of the engine container.")
    volume_mounts: list[Opaque] | None = Field(
        None, description="Extra volume mounts of the engine container."
    )
    volumes: list[Opaque] | None = Field(None, description="Extra pod volumes (model caches, /dev/shm).")
    node_selector: dict[str, str] | None = Field(None, description="Pod node selector.")
    tolerations: list[Opaque] | None = Field(None, description="Pod tolerations.")
    affinity: Opaque | None = Field(None, description="Pod affinity.")
    service_account_name: str | None = Field(None, max_length=253, description="Pod service account.")
    image_pull_secrets: list[Opaque] | None = Field(None, description="Pod image pull secrets.")
    priority_class_name: str | None = Field(None, max_length=253, description="Pod priority class.")
    runtime_class_name: str | None = Field(None, max_length=253, description="Pod runtime class.")
    security_context: Opaque | None = Field(None, description="Pod security context.")
    termination_grace_period_seconds: int = Field(
        120, ge=0, le=3600, description="Grace period for a pod to finish in-flight requests."
    )
    drain_seconds: int = Field(
        15,
        ge=0,
        le=3600,
        description="preStop sleep: time for endpoints to stop sending traffic before the engine is told to exit.",
    )


class TargetRef(_Model):
    """An engine workload the user already runs (their Helm chart, GitOps): the operator writes one
    env var into it and nothing else."""

    api_version: Annotated[Literal["apps/v1"], WithJsonSchema({"type": "string", "enum": ["apps/v1"]})] = (
        Field("apps/v1", description="apps/v1.")
    )
    kind: Literal["Deployment", "StatefulSet"] = Field(description="Deployment or StatefulSet.")
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The workload's name, in the LLMServing's namespace.",
    )
    container: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        description="The engine container; default: the container whose command or args start the engine, "
        "else the only container.",
    )


_MANAGED_ONLY = ("image", "replicas", "template", "extraLlmApiOptions", "rollout")


def _adopted_rules() -> list[dict[str, str]]:
    """With targetRef the workload is the user's: the fields that shape a managed one are refused."""
    rules = [
        {
            "rule": f"!has(self.targetRef) || !has(self.{field})",
            "message": f"spec.{field} shapes a Deployment the operator runs itself; with spec.targetRef the "
            f"workload is yours: remove spec.{field} and set it in your workload",
            "fieldPath": f".{field}",
            "reason": "FieldValueForbidden",
        }
        for field in _MANAGED_ONLY
    ]
    rules.append(
        {
            "rule": "!has(self.targetRef) || self.args.size() == 0",
            "message": f"spec.args are rendered into a managed Deployment; with spec.targetRef put them in your "
            f"workload and reference the batch limit there as --max-num-seqs=$({TARGET_ENV_VAR})",
            "fieldPath": ".args",
            "reason": "FieldValueForbidden",
        }
    )
    return rules


class LLMServingSpec(_Model):
    """An LLM engine the operator runs as a Deployment and keeps at the memory-bandwidth knee."""

    model_config = ConfigDict(json_schema_extra=_validations(*_adopted_rules()))

    engine: Engine = Field(description="The engine: VLLM or TensorRTLLM.")
    model: ModelSpec = Field(description="The model the engine serves.")
    gpu: GpuSpec = Field(description="The GPUs of one replica.")
    replicas: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Engine replicas (pods); also the LLMServing's scale subresource (kubectl scale, HPA, "
        "KEDA). Omitted: the operator leaves the Deployment's replicas to whoever scales it.",
    )
    target_ref: TargetRef | None = Field(
        None,
        description="Adopt a workload you already run instead of creating one: the operator only sets the "
        f"env var {TARGET_ENV_VAR} in its engine container, which your args reference, e.g. "
        f"--max-num-seqs=$({TARGET_ENV_VAR}).",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Engine container image; defaults to the operator's image for the engine.",
    )
    args: list[str] = Field(
        default_factory=list,
        description="Extra engine arguments, kept as given. The operator owns --max-num-seqs, "
        "--tensor-parallel-size, --port and --served-model-name (vLLM) and the options file (TensorRT-LLM); "
        "those are replaced, never duplicated.",
    )
    extra_llm_api_options: Opaque | None = Field(
        None,
        description="TensorRT-LLM only: extra keys of the LLM API options file; the operator owns "
        "max_batch_size, writes kv_cache_config.free_gpu_memory_fraction (this one or 0.9) and dtype "
        "(from model.kvCacheDtype); kv_cache_config.max_tokens (1–2147483647) is optional and caps the "
        "KV pool in the math too.",
    )
    template: TemplateSpec | None = Field(None, description="Pod template overrides.")
    tuning: TuningSpec = Field(default_factory=TuningSpec, description="How the batch limit is tuned.")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec, description="Where metrics are read.")
    rollout: RolloutSpec | None = Field(None, description="Rolling update of the engine pods.")

    @model_validator(mode="after")
    def _adopted(self) -> LLMServingSpec:
        if self.target_ref is not None:
            given = {
                "image": self.image,
                "replicas": self.replicas,
                "template": self.template,
                "extraLlmApiOptions": self.extra_llm_api_options,
                "rollout": self.rollout,
                "args": self.args or None,
            }
            for field, value in given.items():
                if value is not None:
                    raise ValueError(
                        f"spec.{field} is not allowed with spec.targetRef (the workload is yours)"
                    )
        return self

    @property
    def pod_template(self) -> TemplateSpec:
        return self.template or TemplateSpec()

    @property
    def rolling_update(self) -> RolloutSpec:
        return self.rollout or RolloutSpec()


def bounded(limit: int) -> Callable[[Any], Any]:
    """A status text that always fits its schema limit: control characters become spaces and an
    over-long text is cut with an ellipsis, so a status write can never fail on what an upstream
    (an apiserver message, a Prometheus error) put into it."""

    def bound(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        text = "".join(ch if ch.isprintable() else " " for ch in value)
        return text if len(text) <= limit else text[: limit - 1] + "…"

    return bound


MessageText = Annotated[str, BeforeValidator(bounded(32768)), Field(max_length=32768)]
ReasonText = Annotated[str, BeforeValidator(bounded(2048)), Field(max_length=2048)]
KeywordText = Annotated[str, BeforeValidator(bounded(64)), Field(max_length=64)]


# --- status ----------------------------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Model):
    """One aspect of the object's state, Kubernetes style."""

    type: Literal["Ready", "MetricsAvailable", "Progressing", "Degraded", "ArgsOverridden", "Wired"] = Field(
        description="Ready, MetricsAvailable, Progressing, Degraded, ArgsOverridden, or Wired (targetRef: the "
        "workload's args reference the batch limit)."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation this condition was computed from."
    )
    last_transition_time: Timestamp = Field(description="When status last changed.")
    reason: str = Field(
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        max_length=1024,
        description="CamelCase reason for the condition's last transition.",
    )
    message: MessageText = Field("", description="Human-readable details.")


class ObservedMetrics(_Model):
    """What the engines reported over the metrics window, summed or averaged over the pods."""

    avg_context_length: int | None = Field(
        None, ge=0, description="Average context per running sequence (tokens), shared prefixes counted once."
    )
    tpot_p99_milliseconds: float | None = Field(None, ge=0, description="Time per output token, p99 (ms).")
    ttft_p99_milliseconds: float | None = Field(None, ge=0, description="Time to first token, p99 (ms).")
    running: float | None = Field(None, ge=0, description="Running sequences, all pods.")
    waiting: float | None = Field(None, ge=0, description="Waiting requests, all pods.")
    kv_cache_usage_percent: float | None = Field(None, ge=0, description="KV-cache pool in use (percent).")
    prefix_hit_percent: float | None = Field(None, ge=0, description="Prefix-cache hit ratio (percent).")
    pods: int | None = Field(None, ge=0, description="Engine pods that reported.")
    sampled_at: Timestamp | None = Field(None, description="When these values were read.")


class WindowFigures(_Model):
    """What one metrics window showed, for the check after a change."""

    context_tokens: int = Field(ge=0, description="Average context per running sequence (tokens).")
    tokens_per_second_per_pod: float = Field(ge=0, description="Generation throughput per pod (tokens/s).")
    tpot_p99_milliseconds: float = Field(ge=0, description="Time per output token, p99 (ms).")
    preemptions_per_second: float = Field(ge=0, description="Preemptions per second, all pods.")


class HistoryEntry(_Model):
    """One change of the batch limit, and the check of what it did."""

    time: Timestamp = Field(description="When the change was applied.")
    from_: int | None = Field(
        None, alias="from", description="The previous max-num-seqs (absent at creation)."
    )
    to: int = Field(description="The new max-num-seqs.")
    reason: ReasonText = Field(description="Why, in one line from the math.")
    before: WindowFigures | None = Field(None, description="The metrics window before the change.")
    after: WindowFigures | None = Field(None, description="The settled metrics window after the change.")
    verdict: Literal["Kept", "Reverted", "Inconclusive"] | None = Field(
        None, description="Kept, Reverted (and quarantined) or Inconclusive (traffic moved meanwhile)."
    )
    verdict_reason: ReasonText | None = Field(
        None, description="The before/after figures behind the verdict."
    )


class CalibrationSample(_Model):
    """One settled observation used to fit TPOT to the roofline."""

    time: Timestamp = Field(description="When it was observed.")
    batch: float = Field(ge=0, description="Running sequences per pod.")
    context_length: int = Field(ge=0, description="Average context per running sequence (tokens).")
    tpot_p99_milliseconds: float = Field(ge=0, description="Time per output token, p99 (ms).")


class RecentTarget(_Model):
    """One evaluation's batch target before rounding, for the dead band and the steadiness rules."""

    time: Timestamp = Field(description="When the observation behind it was sampled.")
    batch: float = Field(ge=0, description="The target batch before rounding to the granularity.")


class CalibrationStatus(_Model):
    """The TPOT guard's calibration: observed samples and the fitted terms."""

    fingerprint: str | None = Field(
        None,
        max_length=256,
        description="Engine, model and GPU the samples belong to; a change discards them.",
    )
    samples: list[CalibrationSample] = Field(
        default_factory=list,
        max_length=CALIBRATION_SAMPLES_KEPT,
        description=f"The newest {CALIBRATION_SAMPLES_KEPT} samples.",
    )
    overhead_milliseconds: float | None = Field(None, description="Fitted fixed time per step (ms).")
    bandwidth_efficiency_percent: float | None = Field(
        None, description="Fitted fraction of peak bandwidth achieved (percent)."
    )


QUARANTINE_KEPT = 8


class QuarantineEntry(_Model):
    """A batch limit that failed at a context: not tried again there until `until`."""

    max_num_seqs: int = Field(
        ge=1, description="The batch limit that failed (and any beyond it, in the direction of the change)."
    )
    direction: Literal["Above", "Below"] = Field(
        "Above",
        description="Above: the failed change raised the limit (larger values are held too); Below: it lowered it.",
    )
    context_tokens: int = Field(ge=0, description="The average context it failed at (within the dead band).")
    until: Timestamp = Field(description="When it may be tried again.")
    reason: ReasonText = Field(description="What went wrong.")


class LLMServingStatus(_Model):
    """What the operator saw and did."""

    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, MetricsAvailable, Progressing, Degraded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed: ObservedMetrics | None = Field(None, description="The last good observation of the engines.")
    b_knee: float | None = Field(None, ge=0, description="The knee batch at the observed context (B_knee).")
    max_num_seqs: int | None = Field(None, ge=0, description="The batch limit the engine Deployment runs.")
    recommended_max_num_seqs: int | None = Field(None, ge=0, description="What the knee math recommends now.")
    max_tokens: int | None = Field(
        None, ge=0, description="TensorRT-LLM: KV token cap (kv_cache_config.max_tokens) that goes with it."
    )
    limited_by: KeywordText | None = Field(
        None,
        description="What set the recommendation: knee, tpot-target, kv-capacity, minimum, maximum.",
    )
    action: KeywordText | None = Field(None, description="The last decision: roll, hold or recommend.")
    hold_reason: KeywordText | None = Field(None, description="Why the last decision held, as a keyword.")
    reason: ReasonText | None = Field(None, description="The last decision in one line from the math.")
    last_rollout_time: Timestamp | None = Field(None, description="When the batch limit last changed.")
    rollout_complete_time: Timestamp | None = Field(
        None,
        description="When the last rollout was first seen complete (the metrics window settles from here).",
    )
    history: list[HistoryEntry] = Field(
        default_factory=list,
        max_length=HISTORY_KEPT,
        description=f"The last {HISTORY_KEPT} batch-limit changes.",
    )
    calibration: CalibrationStatus | None = Field(None, description="TPOT guard calibration.")
    quarantine: list[QuarantineEntry] = Field(
        default_factory=list,
        max_length=QUARANTINE_KEPT,
        description=f"Batch limits that failed (rollout not Ready by its deadline), the newest {QUARANTINE_KEPT}.",
    )
    replicas: int | None = Field(None, ge=0, description="Engine pods (the scale subresource's status).")
    selector: str | None = Field(
        None, max_length=4096, description="Label selector of the engine pods (the scale subresource's)."
    )
    recent_targets: list[RecentTarget] | None = Field(
        None,
        max_length=RECENT_TARGETS_KEPT,
        description="Recent evaluations' unrounded targets: what 'still moving' and 'held long enough' "
        "compare with.",
    )

    def condition(self, kind: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)


class ObjectMeta(_Model):
    """The metadata the operator reads."""

    name: str = Field(description="Object name.")
    namespace: str = Field("default", description="Object namespace.")
    uid: str | None = Field(None, description="Object UID.")
    generation: int | None = Field(None, description="Spec generation.")
    creation_timestamp: str | None = Field(None, description="Creation time.")
    labels: dict[str, str] | None = Field(None, description="Labels.")


class LLMServing(_Model):
    """An LLMServing as the operator reads it from the cluster."""

    api_version: str = Field(API_VERSION, description="batchknee.io/v1alpha1")
    kind: str = Field(KIND, description="LLMServing")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: LLMServingSpec = Field(description="Desired state.")
    status: LLMServingStatus = Field(default_factory=LLMServingStatus, description="Observed state.")
