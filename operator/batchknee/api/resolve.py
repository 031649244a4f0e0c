"""From an LLMServing to the planner's plain values, with errors that name the field and the fix."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from batchknee.api.models import MAX_PROGRESS_DEADLINE_S, Engine, LLMServing, LLMServingSpec
from batchknee.core.catalog import GIB, CatalogError, GpuSpec, ModelArchitecture, find_gpu, find_model
from batchknee.core.dtypes import dtype_bytes
from batchknee.core.engine_args import (
    flag_value,
    float_flag,
    int_flag,
    sglang_mem_fraction_static,
    token_count_flag,
    vllm_gpu_memory_utilization,
)
from batchknee.core.observation import ObservationTarget
from batchknee.core.policy import TuningRules
from batchknee.core.roofline import DEFAULT_RESERVE_BYTES, DecodeRoofline
from batchknee.engines import sglang, trtllm, vllm

TRTLLM_FREE_GPU_MEMORY_FRACTION = 0.9  # TensorRT-LLM's default share of the memory left after weights
TRTLLM_MAX_TOKENS_LIMIT = 2**31 - 1  # kv_cache_config.max_tokens is a 32-bit integer in the engine
_KV_OPTIONS = "spec.extraLlmApiOptions.kv_cache_config"
UNKNOWN_PEAK_FLOPS = 1e18  # outside the catalog without peakTeraflops: the compute roof never binds
MAX_GPUS = 64  # spec.gpu.count's maximum
# The free-form extraLlmApiOptions (and an object stored before affinity was typed) takes any
# JSON, which the apiserver stores nested up to 10,000 levels; nothing a pod or an engine reads goes
# deeper than a dozen, and much of Python (json, pydantic, the operator's own walks) recurses once
# per level.
MAX_SPEC_DEPTH = 32
# spec.rollout.progressDeadlineSeconds when unset: a new engine pod gets Ready only once it has its
# weights, and one pod downloads the whole checkpoint at each start (tensor parallelism splits it
# across the GPUs only once read), so the deadline grows with the weight bytes. 10 s per GiB is a
# download at about 100 MiB/s (102.4), what a pod commonly gets from the Hugging Face Hub or an
# object store; the base is Kubernetes' own default, the deadline every LLMServing had before, which
# holds an image pull, the engine's start and CUDA graph capture. Llama-3.1-8B in bf16 (15.0 GiB)
# gets 750 s, Llama-3.1-70B (131.5 GiB) 1916 s, Llama-3.1-405B (756 GiB) 8161 s.
PROGRESS_DEADLINE_BASE_S = 600
PROGRESS_DEADLINE_S_PER_GIB = 10
CHECKPOINT_BYTES = 2.0  # per parameter, the least a checkpoint is counted at (bf16)


class SpecError(ValueError):
    """A spec the operator cannot act on: `field` is its path (spec.tuning.minMaxNumSeqs)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _location(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def deepest(value: Any) -> tuple[int, str]:
    """How many maps and lists `value` (parsed JSON: dicts and lists) nests, and the top-level key
    (or index) it is deepest under. Without recursion (the value may be nested past Python's
    recursion limit), and holding nothing per node but the node: a spec of 1.5 MB may hold a
    million of them, walked on every evaluation, so the checks are exact types (an ABC check per
    node took five times as long)."""
    depth, top = 0, ""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")] if type(value) in (dict, list) else []
    while stack:
        node, level, under = stack.pop()
        if level > depth:
            depth, top = level, under
        for key, child in node.items() if type(node) is dict else enumerate(node):
            if type(child) is dict or type(child) is list:
                stack.append((child, level + 1, under or str(key)))
    return depth, top


def parse_llmserving(obj: Mapping[str, Any]) -> LLMServing:
    """Validate a raw LLMServing's metadata and spec (the status is the operator's own, read apart);
    the first problem becomes a SpecError naming its field."""
    depth, top = deepest(obj.get("spec"))
    if depth > MAX_SPEC_DEPTH:
        field = f"spec.{top}" if top else "spec"
        raise SpecError(
            field,
            f"nested {depth} levels deep (at most {MAX_SPEC_DEPTH} in spec); flatten it — nothing an engine or a "
            "pod reads goes that deep",
        )
    try:
        return LLMServing.model_validate({k: v for k, v in obj.items() if k != "status"})
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["type"] == "missing":
            message = "required; set it"
        return_field = _location(tuple(first["loc"])) or "spec"
        raise SpecError(return_field, message) from None


def resolve_model(spec: LLMServingSpec) -> ModelArchitecture:
    model = spec.model
    if model.architecture is not None:
        a = model.architecture
        windowed = 0
        if a.sliding_window is not None:
            windowed = a.layers if a.sliding_window_layers is None else a.sliding_window_layers
        try:
            return ModelArchitecture(
                name=model.name,
                layers=a.layers,
                attention_heads=a.attention_heads,
                kv_heads=a.kv_heads,
                head_dim=a.head_dim,
                params=float(a.params),
                active_params=float(a.active_params) if a.active_params is not None else None,
                experts=a.experts,
                experts_per_token=a.experts_per_token,
                kv_lora_rank=a.kv_lora_rank,
                qk_rope_head_dim=a.qk_rope_head_dim,
                sliding_window=a.sliding_window if windowed else None,
                sliding_window_layers=windowed,
            )
        except ValueError as error:
            raise SpecError("spec.model.architecture", str(error)) from None
    try:
        return find_model(model.name)
    except CatalogError as error:
        raise SpecError(
            "spec.model.name",
            f"{error.args[0]}; set spec.model.architecture (layers, attentionHeads, kvHeads, headDim, params) "
            "for a model outside the catalog",
        ) from None


def resolve_gpu(spec: LLMServingSpec) -> GpuSpec:
    gpu = spec.gpu
    try:
        base = find_gpu(gpu.type)
    except CatalogError as error:
        if gpu.memory_mebibytes is None or gpu.bandwidth_gigabytes_per_second is None:
            raise SpecError(
                "spec.gpu.type",
                f"{error.args[0]}; set spec.gpu.memoryMebibytes and spec.gpu.bandwidthGigabytesPerSecond "
                "for a GPU outside the catalog",
            ) from None
        base = GpuSpec(gpu.type, 1, 1.0, UNKNOWN_PEAK_FLOPS)
    return replace(
        base,
        memory_bytes=gpu.memory_mebibytes * 1024**2 if gpu.memory_mebibytes else base.memory_bytes,
        bandwidth_bytes_per_s=gpu.bandwidth_gigabytes_per_second * 1e9
        if gpu.bandwidth_gigabytes_per_second
        else base.bandwidth_bytes_per_s,
        peak_bf16_flops=gpu.peak_teraflops * 1e12 if gpu.peak_teraflops else base.peak_bf16_flops,
    )


def _check_tensor_parallel(model: ModelArchitecture, tensor_parallel: int) -> None:
    """The engines split the attention heads over the GPUs, and the KV heads or their copies:
    vLLM, SGLang and TensorRT-LLM refuse to start otherwise (a pod crash-looping, not a spec
    error)."""
    heads, kv_heads = model.attention_heads, model.kv_heads
    if heads % tensor_parallel or (kv_heads % tensor_parallel and tensor_parallel % kv_heads):
        raise SpecError(
            "spec.gpu.count",
            f"{tensor_parallel} GPUs (tensor parallel) do not divide {model.name}'s {heads} attention heads "
            f"and {kv_heads} KV heads (each GPU takes an equal share, or a copy of one KV head); the engine "
            "would refuse to start: choose a count that divides both (or that the KV heads divide)",
        )


def _check_tensor_parallel_only(spec: LLMServingSpec) -> None:
    """The pod holds spec.gpu.count GPUs and tensor parallelism takes them all: pipeline or data
    parallelism on top asks the engine for more GPUs than the pod has (it would not start), and
    the knee is one engine's. More engines are more replicas."""
    module = vllm if spec.engine == Engine.VLLM else sglang if spec.engine == Engine.SGLang else None
    if module is None:
        return
    for flag, sharing in module.PARALLEL_FLAGS.items():
        if sharing is not None and sharing in spec.args:
            continue  # (SGLang's data-parallel attention runs within the tensor-parallel GPUs)
        size = int_flag(spec.args, flag, module.COMMAND_LINE)
        if size is not None and size > 1:
            raise SpecError(
                "spec.args",
                f"{flag} {size}: the operator runs one engine per pod by tensor parallelism over "
                "spec.gpu.count GPUs (the pod holds no more); remove it — spec.gpu.count sets the "
                "tensor parallelism, spec.replicas the number of engines",
            )


def resolve_roofline(spec: LLMServingSpec) -> DecodeRoofline:
    roofline = _roofline(spec)
    _check_tensor_parallel(roofline.model, spec.gpu.count)
    _check_tensor_parallel_only(spec)
    return roofline


def _roofline(spec: LLMServingSpec) -> DecodeRoofline:
    """The spec's roofline, its GPU count unchecked (a hypothetical one, to say what would fit)."""
    try:
        return DecodeRoofline(
            model=resolve_model(spec),
            gpu=resolve_gpu(spec),
            tensor_parallel=spec.gpu.count,
            weight_dtype=spec.model.weight_dtype,
            kv_dtype=spec.model.kv_cache_dtype,
            params=float(spec.model.params) if spec.model.params else None,
        )
    except ValueError as error:
        if isinstance(error, SpecError):
            raise
        raise SpecError("spec.model", str(error)) from None


def progress_deadline_seconds(spec: LLMServingSpec) -> int:
    """The engine Deployment's progress deadline: spec.rollout.progressDeadlineSeconds when set,
    else PROGRESS_DEADLINE_BASE_S plus PROGRESS_DEADLINE_S_PER_GIB per GiB of the model's weights
    (all of them, at 16 bits at least: a model quantized as it loads downloads its 16-bit
    checkpoint), at most MAX_PROGRESS_DEADLINE_S. A spec whose model does not resolve (never
    rendered by the reconcile, which refuses it first) gets the base."""
    explicit = spec.rolling_update.progress_deadline_seconds
    if explicit is not None:
        return explicit
    try:
        roofline = _roofline(spec)
        weights = roofline.model_bytes * max(1.0, CHECKPOINT_BYTES / dtype_bytes(roofline.weight_dtype))
    except SpecError:
        return PROGRESS_DEADLINE_BASE_S
    derived = PROGRESS_DEADLINE_BASE_S + math.ceil(PROGRESS_DEADLINE_S_PER_GIB * weights / GIB)
    return min(MAX_PROGRESS_DEADLINE_S, derived)


@dataclass(frozen=True)
class TrtllmKvCache:
    """TensorRT-LLM's KV-cache configuration: one source for the math (the pool) and the render
    (the options file's `kv_cache_config`)."""

    free_gpu_memory_fraction: float
    max_tokens: int | None  # the user's cap, if any: the operator sets none (max_batch_size carries the knee)
    dtype: str | None  # `dtype` to render: the spec's kvCacheDtype when not auto


def trtllm_kv_cache(spec: LLMServingSpec) -> TrtllmKvCache:
    """`kv_cache_config` from spec.extraLlmApiOptions (which overrides trtllm-serve's flags, as the
    engine does), then `--kv_cache_free_gpu_memory_fraction` in spec.args, then the default."""
    options = spec.extra_llm_api_options or {}
    kv = options.get("kv_cache_config") if isinstance(options, dict) else None
    kv = kv if isinstance(kv, dict) else {}

    fraction: Any = kv.get("free_gpu_memory_fraction")
    where = f"{_KV_OPTIONS}.free_gpu_memory_fraction"
    if fraction is None:
        fraction = float_flag(spec.args, "--kv_cache_free_gpu_memory_fraction")
        where = "spec.args --kv_cache_free_gpu_memory_fraction"
        given = flag_value(spec.args, "--kv_cache_free_gpu_memory_fraction")
        if fraction is None and given is not None:  # trtllm-serve would refuse it: not its default
            raise SpecError(where, f"must be a number in (0, 1], got {given[:40]!r}")
    if fraction is None:
        fraction = TRTLLM_FREE_GPU_MEMORY_FRACTION
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 < fraction <= 1.0:
        raise SpecError(where, f"must be a number in (0, 1], got {fraction!r}")

    max_tokens: Any = kv.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= TRTLLM_MAX_TOKENS_LIMIT
    ):
        raise SpecError(
            f"{_KV_OPTIONS}.max_tokens",
            f"must be a whole number within 1–{TRTLLM_MAX_TOKENS_LIMIT} (a 32-bit integer in TensorRT-LLM), "
            f"got {max_tokens!r}; remove it to let free_gpu_memory_fraction size the KV pool",
        )
    dtype = spec.model.kv_cache_dtype if spec.model.kv_cache_dtype != "auto" else None
    return TrtllmKvCache(float(fraction), max_tokens, dtype)


def kv_pool_bytes(spec: LLMServingSpec, roofline: DecodeRoofline) -> float:
    """One GPU's KV pool as the engine sizes it; a SpecError when the weights do not fit at all."""
    if spec.engine == Engine.TensorRTLLM:
        kv = trtllm_kv_cache(spec)
        pool = roofline.kv_pool_bytes_free_fraction(kv.free_gpu_memory_fraction)
        if kv.max_tokens is not None:  # with both, the smaller budget wins (as in the engine)
            pool = min(pool, kv.max_tokens * roofline.kv_bytes_per_token)
        budget = (
            f"{roofline.gpu.memory_bytes / GIB:.0f} GiB (free fraction {kv.free_gpu_memory_fraction:.2f})"
        )
    elif spec.engine == Engine.SGLang:
        # --mem-fraction-static: the share of the whole GPU memory for weights + KV pool, the same
        # budget vLLM's --gpu-memory-utilization sets (activations live outside it in both).
        fraction = sglang_mem_fraction_static(spec.args)
        pool = roofline.kv_pool_bytes(fraction)
        budget = f"{roofline.gpu.memory_bytes / GIB:.0f} GiB × {fraction:.2f} (--mem-fraction-static)"
    elif (explicit := token_count_flag(spec.args, vllm.KV_MEMORY_FLAG)) is not None:
        return float(explicit)  # per GPU; vLLM then ignores --gpu-memory-utilization
    else:
        utilization = vllm_gpu_memory_utilization(spec.args)
        pool = roofline.kv_pool_bytes(utilization)
        budget = f"{roofline.gpu.memory_bytes / GIB:.0f} GiB × {utilization:.2f}"
    if pool <= 0:
        field, fix = _no_room_cause(spec, roofline)
        raise SpecError(
            field,
            f"{roofline.model.name} weights ({roofline.weight_bytes_per_gpu / GIB:.1f} GiB per GPU at tensor "
            f"parallel {roofline.tensor_parallel}) leave no KV cache in {budget} of {roofline.gpu.name} "
            f"(reserve {DEFAULT_RESERVE_BYTES / GIB:.0f} GiB); {fix}",
        )
    return pool


def _no_room_cause(spec: LLMServingSpec, roofline: DecodeRoofline) -> tuple[str, str]:
    """The field to blame when the weights leave no KV cache: the one whose value makes the
    difference (a low --gpu-memory-utilization, a parameter-count override), else the GPU count."""
    if spec.engine == Engine.VLLM:
        utilization = vllm_gpu_memory_utilization(spec.args)
        default = vllm_gpu_memory_utilization([])
        if utilization < default and roofline.kv_pool_bytes(default) > 0:
            return "spec.args", (
                f"--gpu-memory-utilization {utilization:g} is too low for this model; raise it "
                f"(vLLM's default is {default:g}) or drop it"
            )
    if spec.engine == Engine.SGLang:
        fraction = sglang_mem_fraction_static(spec.args)
        default = sglang_mem_fraction_static([])
        if fraction < default and roofline.kv_pool_bytes(default) > 0:
            return "spec.args", (
                f"--mem-fraction-static {fraction:g} is too low for this model; raise it "
                f"(the planner assumes SGLang's {default:g}) or drop it"
            )
    if spec.model.params is not None:
        without = _roofline(spec.model_copy(update={"model": spec.model.model_copy(update={"params": None})}))
        if without.kv_pool_bytes(0.9) > 0:
            return "spec.model.params", f"check spec.model.params ({spec.model.params}) or drop the override"
    widest = _roofline(spec.model_copy(update={"gpu": spec.gpu.model_copy(update={"count": MAX_GPUS})}))
    if widest.kv_pool_bytes(0.9) <= 0:  # no GPU count helps: the parameter count is what is off
        field = "spec.model.params" if spec.model.params is not None else "spec.model.architecture.params"
        if spec.model.params is not None or spec.model.architecture is not None:
            return field, f"the weights do not fit even on {MAX_GPUS} GPUs; check {field}"
    return "spec.gpu.count", "raise spec.gpu.count or use a larger GPU"


def _step_token_budget(spec: LLMServingSpec) -> int:
    """The engine's prefill + decode tokens per step: its flag in spec.args, else its default
    (vLLM 2048, or 8192 on a GPU of 70 GiB or more that is not an A100; TensorRT-LLM 8192, SGLang's
    chunked prefill 8192)."""
    if spec.engine == Engine.VLLM:
        _, default = vllm.default_limits(resolve_gpu(spec))
        return token_count_flag(spec.args, "--max-num-batched-tokens") or default
    if spec.engine == Engine.SGLang:
        chunk = int_flag(spec.args, "--chunked-prefill-size", sglang.COMMAND_LINE)
        return chunk if chunk is not None and chunk > 0 else sglang.DEFAULT_CHUNKED_PREFILL_SIZE
    return int_flag(spec.args, "--max_num_tokens") or trtllm.DEFAULT_MAX_NUM_TOKENS


def tuning_rules(spec: LLMServingSpec) -> TuningRules:
    tuning = spec.tuning
    try:
        return TuningRules(
            mode=tuning.mode.value,
            knee_factor_percent=tuning.knee_factor_percent,
            tpot_p99_target_ms=tuning.tpot_p99_target_milliseconds,
            min_max_num_seqs=tuning.min_max_num_seqs,
            max_max_num_seqs=tuning.max_max_num_seqs,
            dead_band_percent=tuning.dead_band_percent,
            cooldown_s=tuning.cooldown_seconds,
            max_rollouts_per_hour=tuning.max_rollouts_per_hour,
            window_s=tuning.window_seconds,
            initial_context_length=tuning.initial_context_length,
            pinned_max_num_seqs=tuning.pinned_max_num_seqs,
            evaluation_interval_s=tuning.evaluation_interval_seconds,
            goal=tuning.goal.value,
            slo_margin_percent=tuning.slo_margin_percent,
            ttft_p99_target_ms=tuning.ttft_p99_target_milliseconds,
            max_num_batched_tokens=_step_token_budget(spec),
        )
    except ValueError as error:
        raise SpecError("spec.tuning", str(error)) from None


def observation_target(obj: LLMServing) -> ObservationTarget:
    spec = obj.spec
    return ObservationTarget(
        namespace=obj.metadata.namespace,
        name=obj.metadata.name,
        engine=spec.engine.value,
        window_s=spec.tuning.window_seconds,
        selector=dict(spec.prometheus.selector) if spec.prometheus.selector else None,
    )


def calibration_fingerprint(spec: LLMServingSpec, image: str | None = None) -> str:
    """What the TPOT calibration depends on; samples taken under another fingerprint are discarded.
    `image`: the engine image that runs (the spec's, the operator's default, or an adopted
    workload's own), when known."""
    key = {
        "engine": spec.engine.value,
        "model": spec.model.dump(),
        "gpu": spec.gpu.dump(),
        "image": image or spec.image,
        "args": sorted(spec.args),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
