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
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
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
from batchknee.engines import sglang, vllm

GROUP = "batchknee.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMServing"
PLURAL = "llmservings"
SINGULAR = "llmserving"
SHORT_NAMES = ("llms",)
CONDITION_TYPES = (
    "Ready",
    "MetricsAvailable",
    "Progressing",
    "Degraded",
    "ArgsOverridden",
    "Wired",
    "Actuation",
)
# The env var an adopted workload's args reference: `--max-num-seqs=$(BATCHKNEE_MAX_NUM_SEQS)`.
TARGET_ENV_VAR = "BATCHKNEE_MAX_NUM_SEQS"
DEFAULT_WINDOW_SECONDS = 300  # spec.tuning.windowSeconds
# Label and annotation keys the operator reads and writes on its objects (a tenant's would steer it).
OPERATOR_KEY_PREFIX = f"{GROUP}/"
# ...and the keys Prometheus reads as theirs: its Kubernetes discovery writes every character of a
# label key outside [a-zA-Z0-9_] as `_`, so `batchknee-io/llmserving` and `batchknee.io/llmserving`
# race for the one meta label the PodMonitors take the `llmserving` label from.
OPERATOR_KEY_LOOKALIKE = "^batchknee[^a-zA-Z0-9]io[^a-zA-Z0-9]"
# The engine Service takes the LLMServing's name, and the kubelet makes every Service of a namespace
# variables of the pods started there (<NAME>_SERVICE_HOST, <NAME>_PORT, …, service links): one named
# `kubernetes` replaces the API server's KUBERNETES_SERVICE_HOST and _PORT in the namespace's other
# pods (their clients would dial the engine, bearer tokens and all), one named nvidia-require…
# gives every GPU container there NVIDIA_REQUIRE_… variables NVIDIA's runtime reads as requirements,
# and one named after a port variable an engine reads (`vllm`: VLLM_PORT=tcp://<ip>:8000) stops
# the engines of other teams there that keep service links on.
SERVICE_LINK_SUFFIXES = ("_SERVICE_HOST", "_SERVICE_PORT", "_PORT")


def service_setting(variable: str) -> str | None:
    """The Service name whose service links set `variable`, if any (`VLLM_PORT` → `vllm`)."""
    for suffix in SERVICE_LINK_SUFFIXES:
        if variable.endswith(suffix) and len(variable) > len(suffix):
            return variable.removesuffix(suffix).lower().replace("_", "-")
    return None


RESERVED_NAMES = (
    "kubernetes",
    *sorted({service_setting(v) or "" for v in (*vllm.PORT_VARIABLES, *sglang.PORT_VARIABLES)} - {""}),
)
RESERVED_NAME_PREFIX = "nvidia-require"
RESERVED_NAME_MESSAGE = (
    f"metadata.name must not be one of {', '.join(RESERVED_NAMES)} or start with {RESERVED_NAME_PREFIX!r}: "
    "the engine Service takes the name, and the kubelet makes each Service of the namespace variables of "
    "every pod started there ('kubernetes' would replace the API server's address in the namespace's other "
    "pods, 'vllm' would set VLLM_PORT=tcp://…, which stops vLLM there, the others port variables vLLM, "
    f"SGLang or PyTorch read, {RESERVED_NAME_PREFIX}… requirements NVIDIA's runtime reads); "
    "choose another name"
)
# Kubernetes' syntax of label keys (IsQualifiedName) and values (IsValidLabelValue), checked at
# admission rather than at the Deployment write. '[.]', not an escaped dot: CEL strings have no such
# escape. A key's prefix is bounded to 253 characters apart (LONG_LABEL_KEY_PREFIX).
LABEL_KEY = (
    "^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
MAX_LABEL_KEY_LENGTH = 317  # a DNS-subdomain prefix (253), '/', a name (63)
# A prefix over 253 characters (RE2 has no lookahead to bound it inside LABEL_KEY).
LONG_LABEL_KEY_PREFIX = "^[^/]{254,}/"
LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_KEY_SYNTAX = (
    "is an optional DNS-subdomain prefix (at most 253 characters) and '/', then a name of 1 to 63 "
    "letters, digits, '-', '_' or '.' that starts and ends with a letter or digit (e.g. example.com/team)"
)


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


def _label_keys_rule(field: str, *, any_case: bool = False) -> dict[str, str]:
    """The CEL for a map's keys (a CRD schema constrains map keys only in CEL); annotation keys
    are read case-folded, as Kubernetes reads them."""
    key = "k.lowerAscii()" if any_case else "k"
    return {
        "rule": (
            f"self.all(k, size(k) <= {MAX_LABEL_KEY_LENGTH} && {key}.matches('{LABEL_KEY}')"
            f" && !k.matches('{LONG_LABEL_KEY_PREFIX}'))"
        ),
        "message": f"each {field} key {LABEL_KEY_SYNTAX}",
    }


def _check_label_keys(field: str, keys: Iterable[str], *, any_case: bool = False) -> None:
    """The pydantic side of _label_keys_rule (an object stored before it is parsed too)."""
    for key in sorted(keys):
        if not _is_label_key(key.lower() if any_case else key):
            raise ValueError(f"{field} key {key[:256]!r} {LABEL_KEY_SYNTAX}")


def _is_label_key(key: str) -> bool:
    return (
        len(key) <= MAX_LABEL_KEY_LENGTH
        and re.fullmatch(LABEL_KEY, key) is not None
        and re.match(LONG_LABEL_KEY_PREFIX, key) is None
    )


def _label_key(key: str) -> str:
    """LabelKey's check beyond its pattern (for an object stored before the CRD's rule)."""
    if re.match(LONG_LABEL_KEY_PREFIX, key):
        raise ValueError(f"a label key {LABEL_KEY_SYNTAX}")
    return key


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
    SGLang = "SGLang"


class TuningMode(StrEnum):
    Auto = "Auto"
    Recommend = "Recommend"
    Pinned = "Pinned"


class Actuation(StrEnum):
    Restart = "Restart"
    Live = "Live"


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
                "(layers, attentionHeads, kvHeads, headDim, params) or name a catalog model by the Hugging Face "
                "id the engine loads, such as meta-llama/Llama-3.1-8B-Instruct",
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
                "rule": "!has(self.pinnedMaxNumSeqs) || (self.pinnedMaxNumSeqs >= self.minMaxNumSeqs && "
                "self.pinnedMaxNumSeqs <= self.maxMaxNumSeqs)",
                "message": "spec.tuning.pinnedMaxNumSeqs must lie within spec.tuning.minMaxNumSeqs and "
                "spec.tuning.maxMaxNumSeqs; move it inside or widen the bounds",
                "fieldPath": ".pinnedMaxNumSeqs",
                "reason": "FieldValueInvalid",
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
        "samples exist; before that, a cap estimated from the current window, no raise while p99 is "
        "within 10% of the target (or unknown), and steps down by 3/4 while p99 is over it.",
    )
    actuation: Actuation = Field(
        Actuation.Restart,
        description="Restart: a new batch limit rolls the engine pods. Live: pods start with a ceiling "
        "(maxMaxNumSeqs, bounded by the KV pool) and each ready pod's cap is set through the engine's runtime "
        "endpoint (vLLM's /v1/runtime_config, trimtab's /trimtab/set_knobs) without a restart; a value above "
        "the ceiling, or pods without such an endpoint, fall back to a restart (condition Actuation says why).",
    )
    goal: TuningGoal = Field(
        TuningGoal.Knee,
        description="Knee: the memory-bandwidth knee, capped by the TPOT target when one is set. SLO (needs "
        "tpotP99TargetMilliseconds): the largest batch limit whose calibrated TPOT p99 stays under the target "
        "less sloMarginPercent — past the knee when the target allows; before calibration it starts at the "
        "knee and climbs at most ×3/2 per settled window while one window's TPOT shows headroom; a TPOT p99 "
        "over 2.5× the target steps it down ×3/4 whatever the model says.",
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
        description="Changes of the unrounded target smaller than this percentage of the target that set the "
        "running limit are not worth a rollout.",
    )
    cooldown_seconds: int = Field(
        600,
        ge=0,
        le=86400,
        description="Minimum time between two rollouts of the batch limit that restart the engines "
        "(a Live cap set in place neither waits for it nor starts it).",
    )
    max_rollouts_per_hour: int = Field(
        4,
        ge=1,
        le=HISTORY_KEPT,
        description="Rollout budget: at most this many batch-limit rollouts that restart the engines in "
        "any hour (Live caps set in place do not count).",
    )
    evaluation_interval_seconds: int = Field(
        30, ge=5, le=3600, description="How often the operator re-evaluates this object."
    )
    window_seconds: int = Field(
        DEFAULT_WINDOW_SECONDS,
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
        pinned = self.pinned_max_num_seqs
        if pinned is not None and not self.min_max_num_seqs <= pinned <= self.max_max_num_seqs:
            raise ValueError(
                f"pinnedMaxNumSeqs {pinned} must lie within minMaxNumSeqs {self.min_max_num_seqs} and "
                f"maxMaxNumSeqs {self.max_max_num_seqs}; move it inside or widen the bounds"
            )
        if self.goal == TuningGoal.SLO and self.tpot_p99_target_milliseconds is None:
            raise ValueError("goal SLO needs tpotP99TargetMilliseconds")
        return self


# A Prometheus label name as PromQL takes it unquoted; `__`-names are Prometheus's own. The selector's
# keys go into the operator's queries as written, so anything else could rewrite the query.
PROMETHEUS_LABEL_NAME = "^[a-zA-Z][a-zA-Z0-9_]*$|^_$|^_[a-zA-Z0-9][a-zA-Z0-9_]*$"


class PrometheusSpec(_Model):
    """Where the engines' metrics are read."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": f"!has(self.selector) || self.selector.all(k, k.matches('{PROMETHEUS_LABEL_NAME}'))",
                "message": "every spec.prometheus.selector key must be a Prometheus label name (letters, "
                "digits and _, not starting with a digit or __), such as model_name",
                "fieldPath": ".selector",
                "reason": "FieldValueInvalid",
            }
        )
    )

    url: str | None = Field(
        None,
        pattern=r"^https?://",
        max_length=2048,
        description="Prometheus base URL; defaults to the operator's BATCHKNEE_PROMETHEUS_URL.",
    )
    selector: dict[str, Annotated[str, Field(max_length=1024)]] | None = Field(
        None,
        max_length=16,
        description="Exact label matches selecting this object's engine series, for unusual labelling. By "
        "default series are matched by their `namespace` and `llmserving` labels (the scrape copies "
        "`llmserving` from the pod label batchknee.io/llmserving, as the chart's PodMonitors do).",
    )

    @model_validator(mode="after")
    def _selector_keys_are_label_names(self) -> PrometheusSpec:
        for key in self.selector or {}:
            if not re.fullmatch(PROMETHEUS_LABEL_NAME, key):
                raise ValueError(
                    f"spec.prometheus.selector key {key[:64]!r} is not a Prometheus label name: use letters, "
                    "digits and _, not starting with a digit or __ (such as model_name)"
                )
        return self


def _int_or_percent_rule(field: str) -> dict[str, str]:
    return {
        "rule": f"type(self.{field}) == int ? self.{field} >= 0 : self.{field}.matches('^[0-9]+%$')",
        "message": f"spec.rollout.{field} is a count of pods (an integer ≥ 0) or a percentage such as '25%'",
        "fieldPath": f".{field}",
        "reason": "FieldValueInvalid",
    }


# spec.rollout.progressDeadlineSeconds' maximum (a day), and the cap of the deadline derived when unset
MAX_PROGRESS_DEADLINE_S = 86400


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
    progress_deadline_seconds: int | None = Field(
        None,
        ge=10,
        le=MAX_PROGRESS_DEADLINE_S,
        description="New engine pods not Ready within this time (the value does not fit, the engine crashes) "
        "roll back to the last good batch limit, and the failed one is quarantined; a stall after a pod "
        "template that was not a batch limit's (an image, an operator upgrade) is reported (Degraded, "
        "RolloutStalled), not rolled back. Unset, it grows with the model: 600 s plus 10 s per GiB of "
        "weights, counted at 16 bits at least (each new pod downloads the whole checkpoint, at about "
        "100 MiB/s), at most 86400 — "
        "about 750 s for an 8B model in bf16, 1,900 s for a 70B one. A value set always wins. "
        "It defaulted to 600 before: an object created then with spec.rollout holds that 600 (remove it "
        "to get the derived deadline).",
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


# --- the engine pod: an allow-list ------------------------------------------------------------------
#
# What an LLMServing may put into the engine pod is typed field by field (no preserve-unknown-fields:
# anything else is pruned, or refused by a strict client). Fields that would give a tenant more than
# their own RBAC (a ServiceAccount, Secrets, host paths, PVCs, a loosened securityContext) are typed
# so an admin can enable them, and refused by the operator at reconcile time unless its settings do
# (`batchknee.api.admission`). Never allowed: privileged containers, host namespaces and ports.

# A name of another object in the namespace (a DNS subdomain).
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN)]
DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
ShortText = Annotated[str, Field(max_length=1024)]
# The name of the volume the operator mounts TensorRT-LLM's options file from.
RESERVED_VOLUME = "batchknee-engine-config"
# Engine pod names are <name>-<pod-template-hash, ≤10>-<5 random>; Kubernetes cuts a generated name
# to 63 characters, and the metrics are attributed by that pattern, so 63 - 17 = 46. The Service
# (a DNS-1035 label) and the `<name>-engine` ConfigMap fit within it too.
MAX_NAME_LENGTH = 46
MAX_ARGS = 64
MAX_ARG_LENGTH = 1024
MAX_ENV_VALUE_LENGTH = 32768


# TensorRT-LLM's options file holds a dozen keys in practice (a CUDA graph's batch sizes the longest
# list). It is rendered to YAML, in pure Python, at every evaluation: a million values held the
# operator's worker for half a minute, and every other namespace's evaluations behind it.
MAX_OPTIONS_VALUES = 1024
MAX_OPTIONS_CHARACTERS = 64 * 1024


def _small_options(options: dict[str, Any]) -> dict[str, Any]:
    """Refuse an options file past MAX_OPTIONS_VALUES values (maps, lists and scalars) or
    MAX_OPTIONS_CHARACTERS characters of keys and strings. Walked without recursion, stopping at
    the first bound passed."""
    values = characters = 0
    stack: list[Any] = [options]
    while stack:
        node = stack.pop()
        values += 1
        if type(node) is dict:
            characters += sum(len(str(key)) for key in node)
            stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
        elif type(node) is str:
            characters += len(node)
        if values > MAX_OPTIONS_VALUES or characters > MAX_OPTIONS_CHARACTERS:
            raise ValueError(
                f"more than {MAX_OPTIONS_VALUES} values or {MAX_OPTIONS_CHARACTERS} characters; keep it to "
                "the LLM API options trtllm-serve reads (a model's options file is a few dozen lines)"
            )
    return options


def _exactly_one(*fields: str) -> str:
    return "[" + ", ".join(f"has(self.{f})" for f in fields) + "].filter(x, x).size() == 1"


class ConfigMapKeySelector(_Model):
    """One key of a ConfigMap in the LLMServing's namespace."""

    name: ObjectName = Field(description="The ConfigMap's name.")
    key: str = Field(min_length=1, max_length=253, description="The key.")
    optional: bool | None = Field(None, description="Start even if the ConfigMap or key is missing.")


class SecretKeySelector(_Model):
    """One key of a Secret (admin-gated: allowSecretReferences)."""

    name: ObjectName = Field(description="The Secret's name.")
    key: str = Field(min_length=1, max_length=253, description="The key.")
    optional: bool | None = Field(None, description="Start even if the Secret or key is missing.")


class ObjectFieldSelector(_Model):
    """A field of the pod (metadata.name, status.podIP, ...)."""

    field_path: str = Field(min_length=1, max_length=253, description="Path of the field, e.g. status.podIP.")
    api_version: str | None = Field(None, max_length=64, description="Schema version of the path (v1).")


class ResourceFieldSelector(_Model):
    """A resource limit or request of a container (limits.memory, requests.cpu, ...)."""

    resource: str = Field(min_length=1, max_length=253, description="The resource, e.g. limits.memory.")
    container_name: str | None = Field(None, max_length=63, description="The container (default: this one).")
    divisor: IntOrString | None = Field(None, description="Output unit, e.g. 1Mi.")


class EnvVarSource(_Model):
    """Where a variable's value comes from (exactly one source)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": _exactly_one("configMapKeyRef", "fieldRef", "resourceFieldRef", "secretKeyRef"),
                "message": "valueFrom takes exactly one of configMapKeyRef, fieldRef, resourceFieldRef, "
                "secretKeyRef",
            }
        )
    )

    config_map_key_ref: ConfigMapKeySelector | None = Field(None, description="A key of a ConfigMap.")
    field_ref: ObjectFieldSelector | None = Field(None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(None, description="A container resource.")
    secret_key_ref: SecretKeySelector | None = Field(
        None, description="A key of a Secret; refused unless the admin sets allowSecretReferences."
    )


class EnvVar(_Model):
    """An environment variable of the engine container (a Kubernetes EnvVar: the value is a string)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "!(has(self.value) && has(self.valueFrom))",
                "message": "set value or valueFrom, not both",
            }
        )
    )

    name: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="Variable name."
    )
    value: str | None = Field(
        None,
        max_length=MAX_ENV_VALUE_LENGTH,
        description='The value, a string: quote numbers and booleans ("1", "true").',
    )
    value_from: EnvVarSource | None = Field(None, description="Read the value from elsewhere.")


class ConfigMapEnvSource(_Model):
    """Every key of a ConfigMap as a variable."""

    name: ObjectName = Field(description="The ConfigMap's name.")
    optional: bool | None = Field(None, description="Start even if the ConfigMap is missing.")


class SecretEnvSource(_Model):
    """Every key of a Secret as a variable (admin-gated: allowSecretReferences)."""

    name: ObjectName = Field(description="The Secret's name.")
    optional: bool | None = Field(None, description="Start even if the Secret is missing.")


class EnvFromSource(_Model):
    """A source of many environment variables (exactly one of configMapRef, secretRef)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": _exactly_one("configMapRef", "secretRef"),
                "message": "envFrom takes exactly one of configMapRef, secretRef",
            }
        )
    )

    prefix: str | None = Field(
        None,
        max_length=253,
        description="Prefix added to every variable name. Without one that rules out the names a GPU "
        "container runtime reads (NVIDIA_*, AMD_VISIBLE_DEVICES, HABANA_VISIBLE_*; APP_ does), the "
        "source needs the admin's allowDeviceRuntimeEnv.",
    )
    config_map_ref: ConfigMapEnvSource | None = Field(None, description="A ConfigMap.")
    secret_ref: SecretEnvSource | None = Field(
        None, description="A Secret; refused unless the admin sets allowSecretReferences."
    )


class KeyToPath(_Model):
    """One key projected to a file."""

    key: str = Field(min_length=1, max_length=253, description="The key.")
    path: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[^/]",
        description="Relative file path (no leading /, no ..).",
    )
    mode: int | None = Field(None, ge=0, le=0o777, description="File mode bits (0-0777, decimal in JSON).")


class ConfigMapVolumeSource(_Model):
    """A ConfigMap of the namespace as files."""

    name: ObjectName = Field(description="The ConfigMap's name.")
    items: list[KeyToPath] | None = Field(None, max_length=64, description="Keys to project (default: all).")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Mode bits of the files.")
    optional: bool | None = Field(None, description="Start even if the ConfigMap is missing.")


class SecretVolumeSource(_Model):
    """A Secret as files (admin-gated: allowSecretReferences)."""

    secret_name: ObjectName = Field(description="The Secret's name.")
    items: list[KeyToPath] | None = Field(None, max_length=64, description="Keys to project (default: all).")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Mode bits of the files.")
    optional: bool | None = Field(None, description="Start even if the Secret is missing.")


class EmptyDirVolumeSource(_Model):
    """Scratch space that lives as long as the pod (e.g. medium Memory for /dev/shm)."""

    medium: Literal["", "Memory"] | None = Field(None, description='"" (node disk) or Memory (tmpfs).')
    size_limit: IntOrString | None = Field(None, description="Size limit, e.g. 16Gi.")


class HostPathVolumeSource(_Model):
    """A directory of the node (admin-gated: allowHostPaths)."""

    path: str = Field(min_length=1, max_length=4096, description="Path on the node.")
    type: (
        Literal[
            "",
            "DirectoryOrCreate",
            "Directory",
            "FileOrCreate",
            "File",
            "Socket",
            "CharDevice",
            "BlockDevice",
        ]
        | None
    ) = Field(None, description="What must be at the path.")


class PersistentVolumeClaimVolumeSource(_Model):
    """A PersistentVolumeClaim of the namespace (admin-gated: allowPersistentVolumeClaims)."""

    claim_name: ObjectName = Field(description="The claim's name.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class Volume(_Model):
    """A pod volume: exactly one of configMap, emptyDir (allowed); secret, hostPath,
    persistentVolumeClaim (admin-gated)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": _exactly_one("configMap", "emptyDir", "secret", "hostPath", "persistentVolumeClaim"),
                "message": "a volume takes exactly one of configMap, emptyDir, secret, hostPath, "
                "persistentVolumeClaim (other volume types are not supported)",
            },
            {
                "rule": f"self.name != '{RESERVED_VOLUME}'",
                "message": f"volume name {RESERVED_VOLUME} is the operator's own; choose another",
                "fieldPath": ".name",
            },
        )
    )

    name: DnsLabel = Field(description="Volume name (volumeMounts refer to it).")
    config_map: ConfigMapVolumeSource | None = Field(None, description="A ConfigMap as files.")
    empty_dir: EmptyDirVolumeSource | None = Field(None, description="Pod-lifetime scratch space.")
    secret: SecretVolumeSource | None = Field(
        None, description="A Secret as files; refused unless the admin sets allowSecretReferences."
    )
    host_path: HostPathVolumeSource | None = Field(
        None, description="A node directory; refused unless the admin sets allowHostPaths."
    )
    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = Field(
        None,
        description="A claim of the namespace; refused unless the admin sets allowPersistentVolumeClaims.",
    )

    @model_validator(mode="after")
    def _rules(self) -> Volume:
        sources = (self.config_map, self.empty_dir, self.secret, self.host_path, self.persistent_volume_claim)
        if sum(source is not None for source in sources) != 1:
            raise ValueError(
                "a volume takes exactly one of configMap, emptyDir, secret, hostPath, persistentVolumeClaim"
            )
        if self.name == RESERVED_VOLUME:
            raise ValueError(f"volume name {RESERVED_VOLUME} is the operator's own; choose another")
        return self


class VolumeMount(_Model):
    """A volume of spec.template.volumes mounted into the engine container."""

    name: DnsLabel = Field(description="The volume's name in spec.template.volumes.")
    mount_path: str = Field(
        min_length=1, max_length=4096, pattern=r"^/", description="Absolute path in the container."
    )
    sub_path: str | None = Field(None, max_length=4096, description="Path within the volume.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class Toleration(_Model):
    """A taint the engine pods tolerate."""

    key: str | None = Field(None, max_length=317, description="Taint key (empty with Exists: all taints).")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default).")
    value: str | None = Field(None, max_length=63, description="Taint value (operator Equal).")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match (empty: all)."
    )
    toleration_seconds: Int64 | None = Field(
        None, description="How long a NoExecute taint is tolerated (default: forever)."
    )


# Affinity, typed like Kubernetes' own (its field names, enums, required fields and the values each
# operator takes), so a malformed or deeply nested term is refused at admission and the
# cross-namespace gate reads fields, not JSON. The bounds are far above any scheduler's use.
LabelKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_LABEL_KEY_LENGTH,
        pattern=LABEL_KEY,
        json_schema_extra=_validations(
            {
                "rule": f"!self.matches('{LONG_LABEL_KEY_PREFIX}')",
                "message": f"a label key {LABEL_KEY_SYNTAX}",
            }
        ),
    ),
    AfterValidator(_label_key),
]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
MAX_AFFINITY_TERMS = 32
MAX_MATCH_EXPRESSIONS = 32
MAX_MATCH_LABELS = 64
MAX_MATCH_VALUES = 1024  # e.g. kubernetes.io/hostname In [every node of a pool]
INTEGER_VALUE = "[-+]?[0-9]{1,18}"  # as the scheduler's strconv.ParseInt reads one, within 64 bits
_REQUIREMENT_VALUES: dict[tuple[str, ...], tuple[str, str, Callable[[list[str]], bool]]] = {
    # operators → (what their values must be, the CEL that says so, the same in Python)
    ("In", "NotIn"): (
        "need at least one value",
        "has(self.values) && size(self.values) > 0",
        lambda values: len(values) > 0,
    ),
    ("Exists", "DoesNotExist"): (
        "take no values; remove them",
        "!has(self.values) || size(self.values) == 0",
        lambda values: not values,
    ),
    ("Gt", "Lt"): (
        "need exactly one value, an integer (the scheduler reads 64 bits)",
        f"has(self.values) && size(self.values) == 1 && self.values[0].matches('^{INTEGER_VALUE}$')",
        lambda values: len(values) == 1 and re.fullmatch(INTEGER_VALUE, values[0]) is not None,
    ),
}


def _requirement_rules(operators: tuple[str, ...]) -> dict[str, Any]:
    return _validations(
        *(
            {
                "rule": f"!(self.operator in {list(ops)}) || ({rule})",
                "message": f"operators {' and '.join(ops)} {need}",
                "fieldPath": ".values",
            }
            for ops, (need, rule, _) in _REQUIREMENT_VALUES.items()
            if ops[0] in operators
        )
    )


def _check_requirement(operator: str, values: list[str] | None) -> None:
    """The pydantic side of _requirement_rules (an object stored before them is parsed too)."""
    for ops, (need, _, holds) in _REQUIREMENT_VALUES.items():
        if operator in ops and not holds(values or []):
            raise ValueError(f"operators {' and '.join(ops)} {need}")


FIELD_REQUIREMENT = "a matchFields requirement is key metadata.name, operator In or NotIn and one node name"


class NodeSelectorRequirement(_Model):
    """A node label (or field) compared with values."""

    model_config = ConfigDict(json_schema_extra=_requirement_rules(("In", "Exists", "Gt")))

    key: LabelKey = Field(description="The node label key (matchFields: metadata.name).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="In, NotIn, Exists, DoesNotExist, Gt or Lt."
    )
    values: list[Annotated[str, Field(max_length=253)]] | None = Field(
        None, max_length=MAX_MATCH_VALUES, description="Values (In, NotIn: some; Gt, Lt: one integer)."
    )

    @model_validator(mode="after")
    def _rules(self) -> NodeSelectorRequirement:
        _check_requirement(self.operator, self.values)
        return self


class NodeSelectorTerm(_Model):
    """Node requirements, all of which must hold."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "!has(self.matchFields) || self.matchFields.all(r, r.key == 'metadata.name' && "
                "r.operator in ['In', 'NotIn'] && has(r.values) && size(r.values) == 1)",
                "message": FIELD_REQUIREMENT,
                "fieldPath": ".matchFields",
            }
        )
    )

    match_expressions: list[NodeSelectorRequirement] | None = Field(
        None, max_length=MAX_MATCH_EXPRESSIONS, description="Requirements on node labels."
    )
    match_fields: list[NodeSelectorRequirement] | None = Field(
        None, max_length=MAX_MATCH_EXPRESSIONS, description="Requirements on node fields."
    )

    @model_validator(mode="after")
    def _rules(self) -> NodeSelectorTerm:
        for field in self.match_fields or []:
            if (
                field.key != "metadata.name"
                or field.operator not in ("In", "NotIn")
                or len(field.values or []) != 1
            ):
                raise ValueError(FIELD_REQUIREMENT)
        return self


class NodeSelector(_Model):
    """Node selector terms, any one of which must match."""

    node_selector_terms: list[NodeSelectorTerm] = Field(
        min_length=1, max_length=MAX_AFFINITY_TERMS, description="The terms (ORed)."
    )


class PreferredSchedulingTerm(_Model):
    """A node preference and its weight."""

    weight: int = Field(ge=1, le=100, description="Weight, 1 to 100.")
    preference: NodeSelectorTerm = Field(description="The nodes preferred.")


class NodeAffinity(_Model):
    """Which nodes the engine pods go to."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        None, description="Nodes the pods must run on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = Field(
        None, max_length=MAX_AFFINITY_TERMS, description="Nodes the pods prefer."
    )


class LabelSelectorRequirement(_Model):
    """A label compared with values."""

    model_config = ConfigDict(json_schema_extra=_requirement_rules(("In", "Exists")))

    key: LabelKey = Field(description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[LabelValue] | None = Field(
        None, max_length=MAX_MATCH_VALUES, description="Values (In, NotIn)."
    )

    @model_validator(mode="after")
    def _rules(self) -> LabelSelectorRequirement:
        _check_requirement(self.operator, self.values)
        return self


class LabelSelector(_Model):
    """Labels to select by (empty: everything)."""

    # (keys as plain strings: a CRD schema bounds map keys only in CEL)
    match_labels: dict[str, LabelValue] | None = Field(
        None,
        max_length=MAX_MATCH_LABELS,
        description="Labels that must be equal.",
        json_schema_extra=_validations(_label_keys_rule("matchLabels")),
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        None, max_length=MAX_MATCH_EXPRESSIONS, description="Requirements on labels."
    )

    @model_validator(mode="after")
    def _rules(self) -> LabelSelector:
        _check_label_keys("matchLabels", self.match_labels or {})
        return self


class PodAffinityTerm(_Model):
    """Pods the engine pods should (or should not) share a topology domain with."""

    label_selector: LabelSelector | None = Field(None, description="The pods (none: no pods).")
    namespaces: list[DnsLabel] | None = Field(
        None,
        max_length=MAX_MATCH_VALUES,
        description="Namespaces to look in (admin-gated: allowCrossNamespacePodAffinity; default: the pod's own).",
    )
    namespace_selector: LabelSelector | None = Field(
        None,
        description="Namespaces to look in by label (admin-gated: allowCrossNamespacePodAffinity; {} is all).",
    )
    topology_key: LabelKey = Field(description="The node label whose value is the domain (e.g. a zone).")
    match_label_keys: list[LabelKey] | None = Field(
        None, max_length=MAX_MATCH_EXPRESSIONS, description="Pod label keys whose values the pods must share."
    )
    mismatch_label_keys: list[LabelKey] | None = Field(
        None,
        max_length=MAX_MATCH_EXPRESSIONS,
        description="Pod label keys whose values the pods must not share.",
    )


class WeightedPodAffinityTerm(_Model):
    """A pod affinity term and its weight."""

    weight: int = Field(ge=1, le=100, description="Weight, 1 to 100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(_Model):
    """Pod (anti-)affinity terms."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = Field(
        None, max_length=MAX_AFFINITY_TERMS, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = Field(
        None, max_length=MAX_AFFINITY_TERMS, description="Terms preferred, by weight."
    )


class Affinity(_Model):
    """Scheduling constraints of the engine pods."""

    node_affinity: NodeAffinity | None = Field(None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(None, description="Pods to be near.")
    pod_anti_affinity: PodAffinity | None = Field(None, description="Pods to be away from.")


class ResourceRequirements(_Model):
    """CPU, memory and extended resources of the engine container."""

    limits: dict[str, IntOrString] | None = Field(
        None, description="Limits, e.g. memory: 64Gi (nvidia.com/gpu is always spec.gpu.count)."
    )
    requests: dict[str, IntOrString] | None = Field(None, description="Requests, e.g. cpu: 8.")


class SeccompProfile(_Model):
    """A seccomp profile."""

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        description="RuntimeDefault, Localhost (with localhostProfile) or Unconfined (admin-gated)."
    )
    localhost_profile: str | None = Field(None, max_length=4096, description="Profile file on the node.")


class Capabilities(_Model):
    """Linux capabilities. The operator always drops ALL; adding any but NET_BIND_SERVICE is
    admin-gated (allowUnrestrictedSecurityContext)."""

    add: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None, max_length=64, description="Capabilities to add."
    )
    drop: list[Annotated[str, Field(max_length=64)]] | None = Field(
        None, max_length=64, description="Capabilities to drop (ALL is always dropped)."
    )


class PodSecurityContext(_Model):
    """Pod security settings. By default the operator runs the engine as user 1000, non-root, with the
    RuntimeDefault seccomp profile (the restricted Pod Security Standard); root (runAsUser 0,
    runAsNonRoot false) and seccomp Unconfined are admin-gated (allowUnrestrictedSecurityContext)."""

    run_as_user: Int64 | None = Field(None, ge=0, description="User id of the processes (default 1000).")
    run_as_group: Int64 | None = Field(None, ge=0, description="Primary group id (default 1000).")
    run_as_non_root: bool | None = Field(None, description="Refuse to start as root (default true).")
    fs_group: Int64 | None = Field(None, ge=0, description="Group owning mounted volumes (default 1000).")
    supplemental_groups: list[Int64] | None = Field(None, max_length=64, description="Extra group ids.")
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = Field(
        None, description="When volume ownership is changed."
    )
    seccomp_profile: SeccompProfile | None = Field(
        None, description="Seccomp profile (default RuntimeDefault)."
    )


class ContainerSecurityContext(_Model):
    """Engine container security settings; the defaults meet the restricted Pod Security Standard.
    Privileged containers are never run (GPUs come from the device plugin, not privileged mode)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "!has(self.privileged) || !self.privileged",
                "message": "batchknee never runs privileged containers (GPUs come from the device plugin); "
                "remove privileged",
                "fieldPath": ".privileged",
                "reason": "FieldValueForbidden",
            }
        )
    )

    run_as_user: Int64 | None = Field(None, ge=0, description="User id (overrides the pod's).")
    run_as_group: Int64 | None = Field(None, ge=0, description="Primary group id (overrides the pod's).")
    run_as_non_root: bool | None = Field(None, description="Refuse to start as root.")
    read_only_root_filesystem: bool | None = Field(None, description="Mount the root filesystem read-only.")
    allow_privilege_escalation: bool | None = Field(
        None, description="Default false; true is admin-gated (allowUnrestrictedSecurityContext)."
    )
    privileged: bool | None = Field(None, description="Always false: a privileged engine is refused.")
    capabilities: Capabilities | None = Field(None, description="Linux capabilities.")
    seccomp_profile: SeccompProfile | None = Field(None, description="Seccomp profile (overrides the pod's).")

    @model_validator(mode="after")
    def _rules(self) -> ContainerSecurityContext:
        if self.privileged:
            raise ValueError("batchknee never runs privileged containers; remove privileged")
        return self


class LocalObjectReference(_Model):
    """A reference to an object of the namespace by name."""

    name: ObjectName = Field(description="Its name.")


class TemplateSpec(_Model):
    """What the LLMServing may set in its engine pods: an allow-list of Kubernetes pod and container
    fields. Fields marked admin-gated are refused (Degraded, reason Forbidden) unless the operator's
    settings enable them."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            {
                "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                "self.volumes.exists(v, v.name == m.name))",
                "message": "every spec.template.volumeMounts[].name must name a volume in spec.template.volumes",
                "fieldPath": ".volumeMounts",
                "reason": "FieldValueInvalid",
            },
            *(
                {
                    "rule": f"!has(self.{name}) || self.{name}.all(k, !k.matches('{OPERATOR_KEY_LOOKALIKE}'))",
                    "message": f"spec.template.{name} keys under {OPERATOR_KEY_PREFIX} (or spelled so that "
                    "Prometheus reads them so, such as batchknee-io/) are the operator's own; rename the key",
                    "fieldPath": f".{name}",
                    "reason": "FieldValueInvalid",
                }
                for name in ("labels", "annotations")
            ),
        )
    )

    labels: dict[str, LabelValue] | None = Field(
        None,
        max_length=64,
        description="Extra pod labels; each key must match the admin's allowedPodLabels (none by default).",
        json_schema_extra=_validations(_label_keys_rule("spec.template.labels")),
    )
    annotations: dict[str, Annotated[str, Field(max_length=65536)]] | None = Field(
        None,
        max_length=64,
        json_schema_extra=_validations(_label_keys_rule("spec.template.annotations", any_case=True)),
        description="Extra pod annotations; each key must match the admin's allowedPodAnnotations (none by "
        "default). A confinement profile other than runtime/default (AppArmor, seccomp annotations) is "
        "admin-gated (allowUnrestrictedSecurityContext) instead.",
    )
    resources: ResourceRequirements | None = Field(
        None,
        description="Engine container resources (requests/limits); the nvidia.com/gpu limit is always gpu.count.",
    )
    env: list[EnvVar] | None = Field(
        None, max_length=128, description="Extra environment variables of the engine container."
    )
    env_from: list[EnvFromSource] | None = Field(
        None,
        max_length=16,
        description="Environment sources of the engine container (ConfigMaps; Secrets are admin-gated).",
    )
    volume_mounts: list[VolumeMount] | None = Field(
        None,
        max_length=64,
        description="Extra volume mounts of the engine container.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]},
    )
    volumes: list[Volume] | None = Field(
        None,
        max_length=32,
        description="Extra pod volumes: configMap and emptyDir (e.g. /dev/shm); secret, hostPath and "
        "persistentVolumeClaim are admin-gated.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    node_selector: dict[str, LabelValue] | None = Field(
        None,
        max_length=64,
        description="Pod node selector.",
        json_schema_extra=_validations(_label_keys_rule("spec.template.nodeSelector")),
    )
    tolerations: list[Toleration] | None = Field(
        None,
        max_length=32,
        description="Pod tolerations; each key must match the admin's allowedTolerations (default nvidia.com/gpu).",
    )
    affinity: Affinity | None = Field(
        None,
        description="Pod affinity (Kubernetes' Affinity: node, pod and anti-affinity terms). A pod "
        "(anti-)affinity term with namespaces or a namespaceSelector is admin-gated "
        "(allowCrossNamespacePodAffinity); without them a term sees the pod's own namespace only.",
    )
    service_account_name: DnsLabel | None = Field(
        None,
        description="Pod service account (its token is mounted); refused unless the admin sets "
        "allowServiceAccount. By default the pods run as the namespace's default account without a token.",
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        None,
        max_length=16,
        description="Pod image pull secrets; refused unless the admin sets allowSecretReferences.",
    )
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        description="Pod priority class; refused unless it matches the admin's allowedPriorityClasses (none by default).",
    )
    runtime_class_name: str | None = Field(
        None,
        max_length=253,
        description="Pod runtime class; must match the admin's allowedRuntimeClasses (default nvidia).",
    )
    security_context: PodSecurityContext | None = Field(None, description="Pod security context.")
    container_security_context: ContainerSecurityContext | None = Field(
        None, description="Engine container security context."
    )
    termination_grace_period_seconds: int = Field(
        120, ge=0, le=3600, description="Grace period for a pod to finish in-flight requests."
    )
    drain_seconds: int = Field(
        15,
        ge=0,
        le=3600,
        description="preStop sleep: time for endpoints to stop sending traffic before the engine is told to exit.",
    )

    @model_validator(mode="after")
    def _rules(self) -> TemplateSpec:
        _check_label_keys("labels", self.labels or {})
        _check_label_keys("annotations", self.annotations or {}, any_case=True)
        _check_label_keys("nodeSelector", self.node_selector or {})
        for name, keys in (("labels", self.labels), ("annotations", self.annotations)):
            for key in sorted(keys or {}):
                if re.match(OPERATOR_KEY_LOOKALIKE, key):
                    raise ValueError(
                        f"{name} key {key[:256]!r}: keys under {OPERATOR_KEY_PREFIX} (or spelled so that "
                        "Prometheus reads them so, such as batchknee-io/) are the operator's own; rename the key"
                    )
        names = {volume.name for volume in self.volumes or []}
        for mount in self.volume_mounts or []:
            if mount.name not in names:
                raise ValueError(
                    f"volumeMounts {mount.name!r} names no volume in spec.template.volumes; add the volume"
                )
        return self


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
    rules.append(
        {
            # added, the operator's own Deployment would run on beside the adopted workload (the GPUs
            # taken twice); removed, a managed one would start beside the user's
            "rule": "has(self.targetRef) == has(oldSelf.targetRef)",
            "message": "spec.targetRef cannot be added to or removed from an existing LLMServing (a managed "
            "engine and an adopted workload would run side by side): delete the LLMServing and create it "
            "again with or without spec.targetRef",
            "fieldPath": ".targetRef",
            "reason": "FieldValueForbidden",
        }
    )
    return rules


class LLMServingSpec(_Model):
    """An LLM engine the operator runs as a Deployment and keeps at the memory-bandwidth knee."""

    model_config = ConfigDict(json_schema_extra=_validations(*_adopted_rules()))

    engine: Engine = Field(description="The engine: VLLM, TensorRTLLM or SGLang.")
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
        f"--max-num-seqs=$({TARGET_ENV_VAR}). Whoever writes it must be allowed to patch the workload.",
    )
    image: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Engine container image; defaults to the operator's image for the engine. It must match "
        "the operator's allowed images (setting allowedImages), or the operator refuses it (Degraded, Forbidden).",
    )
    args: list[Annotated[str, Field(max_length=MAX_ARG_LENGTH)]] = Field(
        default_factory=list,
        max_length=MAX_ARGS,
        description=f"Extra engine arguments (at most {MAX_ARGS}, each at most {MAX_ARG_LENGTH} characters), "
        "kept as given, but for pipeline or data parallelism over 1, which is refused (one engine per pod: "
        "spec.gpu.count sets the tensor parallelism, spec.replicas the engines). The operator owns --max-num-seqs, "
        "--tensor-parallel-size, --port and --served-model-name (vLLM), the options file (TensorRT-LLM), "
        "--model-path, --max-running-requests, --tp-size, --host and --port (SGLang, aliases included); "
        "those are replaced, never duplicated.",
    )
    extra_llm_api_options: Annotated[Opaque, AfterValidator(_small_options)] | None = Field(
        None,
        description=f"TensorRT-LLM only: extra keys of the LLM API options file (at most {MAX_OPTIONS_VALUES} "
        f"values and {MAX_OPTIONS_CHARACTERS} characters of keys and strings); the operator owns "
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
        text = value if value.isprintable() else "".join(ch if ch.isprintable() else " " for ch in value)
        return text if len(text) <= limit else text[: limit - 1] + "…"

    return bound


MessageText = Annotated[str, BeforeValidator(bounded(32768)), Field(max_length=32768)]
REASON_CHARS = 2048  # a reason in status (a rollout record's too)
ReasonText = Annotated[str, BeforeValidator(bounded(REASON_CHARS)), Field(max_length=REASON_CHARS)]
KeywordText = Annotated[str, BeforeValidator(bounded(64)), Field(max_length=64)]


# --- status ----------------------------------------------------------------------------------------

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Model):
    """One aspect of the object's state, Kubernetes style."""

    type: Literal[
        "Ready", "MetricsAvailable", "Progressing", "Degraded", "ArgsOverridden", "Wired", "Actuation"
    ] = Field(
        description="Ready, MetricsAvailable, Progressing, Degraded, ArgsOverridden, Wired (targetRef: the "
        "workload's args reference the batch limit), or Actuation (Live: the caps are set live, or why not)."
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
    bandwidth_utilization_percent: float | None = Field(
        None,
        ge=0,
        description="Achieved memory bandwidth per GPU as a percent of the GPU's peak: the engines' "
        "read-bytes counters (vLLM/SGLang --enable-mfu-metrics), else dcgm-exporter's "
        "DCGM_FI_PROF_DRAM_ACTIVE. Absent when neither is exported.",
    )
    bandwidth_source: Literal["Engine", "DCGM"] | None = Field(
        None, description="Where the bandwidth figure came from."
    )
    read_gigabytes_per_second: float | None = Field(
        None, ge=0, description="Bytes the engines read per GPU per second (GB/s), from their counters."
    )
    diagnosis: Literal["memory-bound", "prefill-bound", "queueing", "underused", "balanced"] | None = Field(
        None,
        description="What the bandwidth says: memory-bound (decode saturates the memory bus, at the "
        "knee), prefill-bound (TTFT over target or prefill dominates the steps), queueing (requests "
        "wait while the bus has headroom), underused (too little traffic), balanced.",
    )
    diagnosis_reason: ReasonText | None = Field(None, description="The figures behind the diagnosis.")


class WindowFigures(_Model):
    """What one metrics window showed, for the check after a change."""

    context_tokens: int = Field(ge=0, description="Average context per running sequence (tokens).")
    tokens_per_second_per_pod: float = Field(ge=0, description="Generation throughput per pod (tokens/s).")
    tpot_p99_milliseconds: float = Field(ge=0, description="Time per output token, p99 (ms).")
    preemptions_per_second: float = Field(ge=0, description="Preemptions per second, all pods.")
    tpot_mean_milliseconds: float | None = Field(None, ge=0, description="Time per output token, mean (ms).")
    prompt_tokens: int | None = Field(
        None, ge=0, description="Mean prompt of the requests finished in the window (tokens)."
    )


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
        None,
        description="Kept, Reverted (and quarantined) or Inconclusive (traffic moved meanwhile, or the "
        "engine, model, GPU, image or engine args changed).",
    )
    verdict_reason: ReasonText | None = Field(
        None, description="The before/after figures behind the verdict."
    )
    completed: Timestamp | None = Field(
        None,
        description="When its pods were first seen all updated and available (absent: not yet). A "
        "stall after it is a later template's, not this limit's.",
    )


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
    read_gigabytes_per_second: float | None = Field(
        None, ge=0, description="Bytes the engines read per GPU per second (GB/s), when they count them."
    )


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
    """A batch limit that failed at a context: not tried again there until `until`, nor after a change
    of the engine, model, GPU, image or engine args (another setup: the entry is dropped)."""

    max_num_seqs: int = Field(
        ge=1, description="The batch limit that failed (and any beyond it, in the direction of the change)."
    )
    direction: Literal["Above", "Below"] = Field(
        "Above",
        description="Above: the failed change raised the limit (larger values are held too); Below: it lowered it.",
    )
    context_tokens: int | None = Field(
        None,
        ge=0,
        description="The average context it failed at; held within the dead band of it and beyond it "
        "in the direction that makes the value no lighter (longer for Above, shorter for Below). "
        "Absent when no context was observed then, or for a raised limit whose pods never got Ready: "
        "held at every context.",
    )
    until: Timestamp = Field(description="When it may be tried again.")
    reason: ReasonText = Field(description="What went wrong.")


class LLMServingStatus(_Model):
    """What the operator saw and did."""

    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation last reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, MetricsAvailable, Progressing, Degraded, ArgsOverridden, Wired (targetRef), "
        "Actuation (Live).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed: ObservedMetrics | None = Field(
        None,
        description="The last good observation of the engines. While the decision holds steady (at target, "
        "or within the dead band) its figures are refreshed once a window, anything else at once.",
    )
    b_knee: float | None = Field(None, ge=0, description="The knee batch at the observed context (B_knee).")
    max_num_seqs: int | None = Field(None, ge=0, description="The batch limit the engine Deployment runs.")
    recommended_max_num_seqs: int | None = Field(None, ge=0, description="What the knee math recommends now.")
    max_tokens: int | None = Field(
        None,
        ge=0,
        description="TensorRT-LLM: the KV token cap (kv_cache_config.max_tokens) of the spec's "
        "extraLlmApiOptions, when it sets one (the operator sets none).",
    )
    limited_by: KeywordText | None = Field(
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
    action: KeywordText | None = Field(None, description="The last decision: roll, hold or recommend.")
    hold_reason: KeywordText | None = Field(None, description="Why the last decision held, as a keyword.")
    reason: ReasonText | None = Field(None, description="The last decision in one line from the math.")
    last_rollout_time: Timestamp | None = Field(None, description="When the batch limit last changed.")
    rollout_complete_time: Timestamp | None = Field(
        None,
        description=(
            "When the last rollout was first seen complete, the pods it replaced gone (the metrics "
            "window settles from here)."
        ),
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
        description="Batch limits held off for a while: a rollout not Ready by its deadline, a change the "
        f"check after it reverted, a limit whose TPOT p99 broke the target; the newest {QUARANTINE_KEPT}.",
    )
    ceiling_max_num_seqs: int | None = Field(
        None,
        ge=0,
        description="Live actuation: the pods' startup --max-num-seqs, the most a live cap can be.",
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


def _not_a_reserved_service_name(name: str) -> str:
    if name in RESERVED_NAMES or name.startswith(RESERVED_NAME_PREFIX):
        raise ValueError(RESERVED_NAME_MESSAGE)
    return name


class ObjectMeta(_Model):
    """The metadata the operator reads."""

    name: Annotated[str, AfterValidator(_not_a_reserved_service_name)] = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description=f"Object name: a DNS label starting with a letter, at most {MAX_NAME_LENGTH} characters.",
    )
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
