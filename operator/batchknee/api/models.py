"""`batchknee.io/v1alpha1` `LLMServing`: spec and status as pydantic models.

The CRD's OpenAPI schema is generated from these (`batchknee.api.crd`); every field carries the
description `kubectl explain` prints. Kubernetes API conventions: camelCase fields, integers with
their unit in the name, no floats in spec, CamelCase enum values, conditions with
`observedGeneration`. Cross-field rules are CEL (`x-kubernetes-validations`) in the CRD and the
same rules again in pydantic, so a spec that reached the cluster without them still gets a
clear message naming the field.
"""

from __future__ import annotations

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
from batchknee.core.policy import CALIBRATION_SAMPLES_KEPT, HISTORY_KEPT

GROUP = "batchknee.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMServing"
PLURAL = "llmservings"
SINGULAR = "llmserving"
SHORT_NAMES = ("llms",)
CONDITION_TYPES = ("Ready", "MetricsAvailable", "Progressing", "Degraded")


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


class TuningGoal(StrEnum):
    Knee = "Knee"
    SLO = "SLO"


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
            {
                "rule": "self.goal != 'SLO' || has(self.tpotP99TargetMilliseconds)",
                "message": "spec.tuning.goal SLO needs spec.tuning.tpotP99TargetMilliseconds",
                "fieldPath": ".tpotP99TargetMilliseconds",
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
    goal: TuningGoal = Field(
        TuningGoal.Knee,
        description="Knee: the memory-bandwidth knee, capped by the TPOT target when one is set. SLO (needs "
        "tpotP99TargetMilliseconds): the largest batch limit whose calibrated TPOT p99 stays under the target "
        "less sloMarginPercent — past the knee when the target allows; before calibration it starts at the "
        "knee and climbs ×1.25 per settled window while the observed p99 has headroom.",
    )
    slo_margin_percent: int = Field(
        10, ge=0, le=90, description="Goal SLO: headroom kept under the TPOT p99 target (percent)."
    )
    ttft_p99_target_milliseconds: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Time-to-first-token p99 target. Goal SLO does not climb while TTFT p99 is over it.",
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
        if self.goal == TuningGoal.SLO and self.tpot_p99_target_milliseconds is None:
            raise ValueError("goal SLO needs tpotP99TargetMilliseconds")
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


class RolloutSpec(_Model):
    """The Deployment's rolling update. The default replaces one pod at a time without a surge
    pod, because a surge pod needs GPUs the node usually does not have."""

    max_surge: IntOrString = Field(
        0, description="Pods above replicas during a rollout (count or percentage)."
    )
    max_unavailable: IntOrString = Field(
        1, description="Pods that may be unavailable during a rollout (count or percentage)."
    )

    @model_validator(mode="after")
    def _rules(self) -> RolloutSpec:
        if str(self.max_surge).rstrip("%") == "0" and str(self.max_unavailable).rstrip("%") == "0":
            raise ValueError("maxSurge and maxUnavailable must not both be zero")
        return self


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


class LLMServingSpec(_Model):
    """An LLM engine the operator runs as a Deployment and keeps at the memory-bandwidth knee."""

    engine: Engine = Field(description="The engine: VLLM or TensorRTLLM.")
    model: ModelSpec = Field(description="The model the engine serves.")
    gpu: GpuSpec = Field(description="The GPUs of one replica.")
    replicas: int = Field(1, ge=0, le=1000, description="Engine replicas (pods).")
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
        "max_batch_size and kv_cache_config.max_tokens.",
    )
    template: TemplateSpec = Field(default_factory=TemplateSpec, description="Pod template overrides.")
    tuning: TuningSpec = Field(default_factory=TuningSpec, description="How the batch limit is tuned.")
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec, description="Where metrics are read.")
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="Rolling update of the engine pods."
    )


# --- status ----------------------------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Model):
    """One aspect of the object's state, Kubernetes style."""

    type: Literal["Ready", "MetricsAvailable", "Progressing", "Degraded"] = Field(
        description="Ready, MetricsAvailable, Progressing or Degraded."
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
    message: str = Field("", max_length=32768, description="Human-readable details.")


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


class HistoryEntry(_Model):
    """One change of the batch limit."""

    time: Timestamp = Field(description="When the change was applied.")
    from_: int | None = Field(
        None, alias="from", description="The previous max-num-seqs (absent at creation)."
    )
    to: int = Field(description="The new max-num-seqs.")
    reason: str = Field(max_length=2048, description="Why, in one line from the math.")


class CalibrationSample(_Model):
    """One settled observation used to fit TPOT to the roofline."""

    time: Timestamp = Field(description="When it was observed.")
    batch: float = Field(ge=0, description="Running sequences per pod.")
    context_length: int = Field(ge=0, description="Average context per running sequence (tokens).")
    tpot_p99_milliseconds: float = Field(ge=0, description="Time per output token, p99 (ms).")
    tpot_mean_milliseconds: float | None = Field(
        None, ge=0, description="Time per output token, mean over the window's requests (ms)."
    )
    prompt_tokens: float | None = Field(
        None, ge=0, description="Mean prompt length of the requests (tokens)."
    )
    output_tokens: float | None = Field(
        None, ge=0, description="Mean output length of the requests (tokens)."
    )
    prefix_hit_percent: float | None = Field(
        None, ge=0, le=100, description="Prefix-cache hit ratio (percent): prompt tokens not prefilled."
    )


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
    limited_by: str | None = Field(
        None,
        max_length=64,
        description="What set the recommendation: knee, tpot-target, slo-target (goal SLO's bound), "
        "kv-capacity, minimum, maximum.",
    )
    slo_bound_max_num_seqs: int | None = Field(
        None,
        ge=0,
        description="The largest batch limit whose calibrated TPOT p99 meets the target (goal SLO: less the "
        "margin); absent without a target or before calibration.",
    )
    action: str | None = Field(None, max_length=64, description="The last decision: roll, hold or recommend.")
    hold_reason: str | None = Field(
        None, max_length=64, description="Why the last decision held, as a keyword."
    )
    reason: str | None = Field(
        None, max_length=2048, description="The last decision in one line from the math."
    )
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
