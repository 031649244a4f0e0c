"""The model/GPU options `plan` and `simulate` share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from batchknee.argtypes import (
    at_most,
    bandwidth,
    fraction,
    int_list,
    non_negative_float,
    positive_float,
    positive_int,
    unit_fraction,
)
from batchknee.commands import UsageError
from batchknee.core.catalog import CatalogError, ModelArchitecture, find_gpu, find_model
from batchknee.core.dtypes import KV_DTYPES, WEIGHT_DTYPES
from batchknee.core.hf_config import ConfigError, architecture_from_hf_config
from batchknee.core.roofline import DEFAULT_RESERVE_BYTES, DecodeRoofline
from batchknee.emulator.workload import MAX_TOKENS
from batchknee.engines import sglang, trtllm, vllm

ENGINE_CHOICES = ("vllm", "trtllm", "sglang")
MAX_TP = 64  # GPUs per replica, as the LLMServing API bounds spec.gpu.count
MAX_BATCH_LIMIT = 65536  # the LLMServing API's bound on a batch limit (maxMaxNumSeqs)
MAX_STEP_TOKENS = MAX_TOKENS  # the longest request the simulation takes: a larger step budget changes nothing
MAX_SIMULATED_S = 86400.0  # a day of simulated time
MAX_PARAMS = 1e14  # a hundred times the largest model in the catalog
VLLM_STEP_TOKENS = (
    vllm.DEFAULT_MAX_NUM_BATCHED_TOKENS
)  # vLLM's --max-num-batched-tokens (an A100's; 8192 on larger GPUs)
VLLM_MEMORY_UTILIZATION = vllm.DEFAULT_GPU_MEMORY_UTILIZATION


param_count = at_most(positive_float, MAX_PARAMS, f"{MAX_PARAMS:.0e} parameters")
simulated_seconds = at_most(positive_float, MAX_SIMULATED_S, f"{MAX_SIMULATED_S:.0f} s (a day)")
step_tokens = at_most(positive_int, MAX_STEP_TOKENS, f"{MAX_STEP_TOKENS:,}")  # --max-num-batched-tokens
MAX_SLO_MARGIN_PERCENT = 90  # spec.tuning.sloMarginPercent's bound
slo_margin_percent = at_most(
    non_negative_float, MAX_SLO_MARGIN_PERCENT, f"{MAX_SLO_MARGIN_PERCENT}, as spec.tuning.sloMarginPercent"
)


def batch_limits(text: str) -> list[int]:
    """`8,64,256`: batch limits, each at most the API's bound."""
    values = int_list(text)
    if max(values) > MAX_BATCH_LIMIT:
        raise argparse.ArgumentTypeError(f"each value must be at most {MAX_BATCH_LIMIT}")
    return values


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="vllm",
        help="whose defaults to assume: sglang takes --mem-fraction-static "
        f"{sglang.DEFAULT_MEM_FRACTION_STATIC} of the GPU for weights + KV, pages of "
        f"{sglang.DEFAULT_PAGE_SIZE} token (a radix-shared prefix held once), a "
        f"{sglang.DEFAULT_CHUNKED_PREFILL_SIZE}-token prefill chunk; trtllm a KV pool of "
        f"free_gpu_memory_fraction {trtllm.DEFAULT_FREE_GPU_MEMORY_FRACTION} of what the weights leave, "
        f"blocks of {trtllm.DEFAULT_TOKENS_PER_BLOCK} tokens, max_num_tokens {trtllm.DEFAULT_MAX_NUM_TOKENS} "
        "per step, and each request's whole sequence reserved at admission (GUARANTEED_NO_EVICT)",
    )


def knob_flag(args: argparse.Namespace) -> str:
    """The batch-limit flag of the engine the command plans for."""
    engine = getattr(args, "engine", "vllm")
    return {"sglang": sglang.KNOB_FLAG, "trtllm": trtllm.KNOB_FLAG}.get(engine, "--max-num-seqs")


def engine_step_tokens(engine: str, roofline: DecodeRoofline) -> int:
    """The engine's default token budget per step (vLLM's depends on the GPU)."""
    return {"sglang": sglang.DEFAULT_CHUNKED_PREFILL_SIZE, "trtllm": trtllm.DEFAULT_MAX_NUM_TOKENS}.get(
        engine, vllm.default_limits(roofline.gpu)[1]
    )


def engine_block_size(engine: str) -> int:
    """The engine's default KV block (page) in tokens."""
    return {"sglang": sglang.DEFAULT_PAGE_SIZE, "trtllm": trtllm.DEFAULT_TOKENS_PER_BLOCK}.get(
        engine, vllm.DEFAULT_BLOCK_SIZE
    )


def engine_memory_utilization(engine: str, roofline: DecodeRoofline) -> float:
    """The share of GPU memory the engine gives weights and KV cache by default, as vLLM's
    --gpu-memory-utilization counts it (TensorRT-LLM's fraction is of what the weights leave)."""
    if engine == "sglang":
        return sglang.DEFAULT_MEM_FRACTION_STATIC
    if engine == "trtllm":
        fraction = trtllm.DEFAULT_FREE_GPU_MEMORY_FRACTION
        taken = min(1.0, (roofline.weight_bytes_per_gpu + DEFAULT_RESERVE_BYTES) / roofline.gpu.memory_bytes)
        return fraction + (1.0 - fraction) * taken
    return VLLM_MEMORY_UTILIZATION


def add_roofline_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="catalog name or alias, e.g. llama-3-8b or meta-llama/Meta-Llama-3-8B"
    )
    parser.add_argument("--model-config", type=Path, metavar="PATH", help="a local Hugging Face config.json")
    parser.add_argument("--gpu", required=True, help="catalog name, e.g. a100-80gb, h100-sxm, h200, l40s")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor parallel size (GPUs per replica)")
    parser.add_argument("--params", type=param_count, help="override the parameter count, e.g. 8.0e9")
    parser.add_argument(
        "--bandwidth", type=bandwidth, help="override HBM bandwidth, e.g. 2.0TB/s or 2039GB/s"
    )
    parser.add_argument("--weight-dtype", default="bf16", choices=WEIGHT_DTYPES)
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    parser.add_argument(
        "--overhead-ms", type=non_negative_float, default=0.0, help="fixed time per step (ms)"
    )
    parser.add_argument(
        "--bandwidth-efficiency",
        type=unit_fraction,
        default=1.0,
        help="achieved fraction of peak bandwidth (0, 1]",
    )
    parser.add_argument(
        "--prefix-sharing",
        type=fraction,
        default=0.0,
        metavar="FRACTION_OF_PROMPT",
        help="fraction of each prompt shared by all sequences (a system prompt; what the prefix-cache hit "
        "rate shows, status.observed.prefixHitPercent / 100); the math converts it to a share of the "
        "context with the mean output length",
    )
    parser.add_argument(
        "--prefix-reread",
        action="store_true",
        help="the engine's attention re-reads shared prefix blocks per sequence (saves memory, not bandwidth)",
    )


def resolve_model(args: argparse.Namespace) -> ModelArchitecture:
    if args.model_config is not None:
        try:
            config = json.loads(args.model_config.read_text())
        except OSError as error:
            raise UsageError(f"--model-config: cannot read {args.model_config}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(
                f"--model-config: {args.model_config} is not UTF-8 text (a config.json)"
            ) from None
        except json.JSONDecodeError as error:
            raise UsageError(f"--model-config: {args.model_config} is not JSON ({error.msg})") from None
        if not isinstance(config, dict):
            raise UsageError(f"--model-config: {args.model_config} is not a config.json object")
        try:
            return architecture_from_hf_config(
                config, args.model or args.model_config.parent.name or "custom"
            )
        except (ConfigError, ValueError) as error:
            raise UsageError(f"--model-config: {error}") from None
    if not args.model:
        raise UsageError("--model: give a catalog model name, or --model-config PATH")
    try:
        return find_model(args.model)
    except CatalogError as error:
        raise UsageError(f"--model: {error.args[0]}") from None


def resolve_roofline(args: argparse.Namespace) -> DecodeRoofline:
    model = resolve_model(args)
    try:
        gpu = find_gpu(args.gpu)
    except CatalogError as error:
        raise UsageError(f"--gpu: {error.args[0]}") from None
    if args.tp > MAX_TP:
        raise UsageError(f"--tp: {args.tp} GPUs per replica is more than {MAX_TP} (spec.gpu.count's bound)")
    if model.attention_heads % args.tp:  # the engines split the heads evenly (vLLM refuses other sizes)
        sizes = [tp for tp in range(1, MAX_TP + 1) if model.attention_heads % tp == 0]
        raise UsageError(
            f"--tp: {args.tp} does not divide {model.name}'s {model.attention_heads} attention heads; "
            f"use one of {', '.join(map(str, sizes))}"
        )
    return DecodeRoofline(
        model=model,
        gpu=gpu,
        tensor_parallel=args.tp,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        params=args.params,
        bandwidth_bytes_per_s=args.bandwidth,
        bandwidth_efficiency=args.bandwidth_efficiency,
        overhead_s=args.overhead_ms / 1e3,
        # --prefix-sharing is a share of the prompt; each command converts it to the roofline's unit
        # (a share of the context) where it knows the prompt and output lengths
        shared_prefix_read_once=not args.prefix_reread,
    )


def describe(roofline: DecodeRoofline) -> str:
    return (
        f"{roofline.model.name} on {roofline.gpu.name} ×{roofline.tensor_parallel} (TP), "
        f"{roofline.weight_dtype} weights, kv {roofline.kv_dtype}, "
        f"{roofline.bandwidth / 1e12:.2f} TB/s per GPU"
    )
