"""vLLM: `vllm serve MODEL`, batch limit `--max-num-seqs`, `vllm:` metrics (REFERENCE.md §2).

The metric names are pinned to the release in `VERSION` (tests/contract reads that release's wheel).
"""

from __future__ import annotations

from batchknee.core.catalog import GpuSpec
from batchknee.engines.contract import CommandLine, EngineMetrics, HttpSurface

VERSION = "0.34.0"
APP_NAME = "vllm"
KNOB_FLAG = "--max-num-seqs"
PROGRAM = "vllm"
# `vllm serve` and the older module entry point (adoption recognises both).
COMMANDS = ("vllm", "vllm.entrypoints.openai.api_server")
HTTP = HttpSurface(port=8000, health_path="/health", metrics_path="/metrics")
# The port variables vLLM reads (vllm/envs.py; MASTER_PORT: torch's, through its DeepGEMM) that a
# Service of the pod's namespace sets through the kubelet's service links (a Service `vllm` sets
# VLLM_PORT=tcp://<ip>:8000, which vLLM refuses). Pinned to the release by the contract tier.
PORT_VARIABLES = (
    "VLLM_PORT",
    "VLLM_DP_MASTER_PORT",
    "VLLM_EC_SIDE_CHANNEL_PORT",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_P2P_SIDE_CHANNEL_PORT",
    "MASTER_PORT",
)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The OpenAI server's defaults on a GPU of 70 GiB or more that is not an A100 (vllm/engine/arg_utils.py)
LARGE_GPU_BYTES = 70 * 1024**3
LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


def default_limits(gpu: GpuSpec) -> tuple[int, int]:
    """vLLM's default --max-num-seqs and --max-num-batched-tokens on `gpu`: 1,024 and 8,192 on a GPU
    of 70 GiB or more that is not an A100, else 256 and 2,048."""
    if gpu.memory_bytes >= LARGE_GPU_BYTES and not gpu.name.startswith("a100"):
        return LARGE_GPU_MAX_NUM_SEQS, LARGE_GPU_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS


MANAGED = ("--max-num-seqs", "--tensor-parallel-size", "--port", "--served-model-name")
# Short aliases from vLLM's own argparse (vllm/engine/arg_utils.py: `-tp`, `-pp`, `-dp`, `-q`).
SHORT_ALIASES: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--quantization": ("-q",),
}
# Flags of the user's args the operator reads (the step token budget, the KV pool's share of GPU
# memory or its size, the KV dtype) and the one it removes: vLLM 0.34's `--max-num-active-seqs` caps the running
# batch under `--max-num-seqs` (and vLLM refuses to start when it is above it), a second batch limit.
KV_MEMORY_FLAG = "--kv-cache-memory-bytes"  # the KV pool per GPU, in place of the memory share
# vLLM ≥ 0.18 aborts every request in flight at SIGTERM unless this says how long to wait (default 0)
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
# Parallelism other than tensor parallelism over the pod's GPUs: refused (the pod holds
# spec.gpu.count GPUs, tensor parallelism takes them all, and the knee math assumes one engine)
# (flag → the switch under which it shares the tensor-parallel GPUs instead: none for vLLM)
PARALLEL_FLAGS: dict[str, str | None] = {"--pipeline-parallel-size": None, "--data-parallel-size": None}
READ_FLAGS = (
    *PARALLEL_FLAGS,
    "--max-num-batched-tokens",
    "--gpu-memory-utilization",
    KV_MEMORY_FLAG,
    "--kv-cache-dtype",
    SHUTDOWN_TIMEOUT_FLAG,
)
STRIPPED = ("--max-num-active-seqs",)
# Every `vllm serve` long option sharing its first two letters with a flag the operator manages,
# reads or removes: argparse expands a prefix that starts one option only, so an abbreviation is one
# of those flags only when it is unambiguous among these (tests/contract holds this to the release).
NEIGHBOURS = (
    "--data-parallel-address",
    "--data-parallel-backend",
    "--data-parallel-external-lb",
    "--data-parallel-hybrid-lb",
    "--data-parallel-multi-port-external-lb",
    "--data-parallel-rank",
    "--data-parallel-rpc-port",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--data-parallel-start-rank",
    "--data-parallel-supervisor-port",
    "--gpu-memory-utilization",
    "--kv-cache-dtype",
    "--kv-cache-dtype-skip-layers",
    "--kv-cache-memory-bytes",
    "--kv-cache-metrics",
    "--kv-cache-metrics-sample",
    "--kv-events-config",
    "--kv-offloading-backend",
    "--kv-offloading-size",
    "--kv-sharing-fast-prefill",
    "--kv-transfer-config",
    "--mamba-backend",
    "--mamba-block-size",
    "--mamba-cache-dtype",
    "--mamba-cache-mode",
    "--mamba-cache-philox-rounds",
    "--mamba-ssm-cache-dtype",
    "--mamba-ssu-algorithm",
    "--master-addr",
    "--master-port",
    "--max-cpu-loras",
    "--max-cudagraph-capture-size",
    "--max-log-len",
    "--max-logprobs",
    "--max-lora-cls-labels",
    "--max-lora-rank",
    "--max-loras",
    "--max-model-len",
    "--max-num-active-seqs",
    "--max-num-batched-tokens",
    "--max-num-inflight-kv-loads",
    "--max-num-queued-reqs",
    "--max-num-queued-tokens",
    "--max-num-scheduled-tokens",
    "--max-num-seqs",
    "--max-parallel-loading-workers",
    "--pipeline-parallel-size",
    "--pooler-config",
    "--port",
    "--seed",
    "--served-model-name",
    "--show-hidden-metrics-for-version",
    "--shuffle-safetensors-files",
    "--shutdown-timeout",
    "--tensor-parallel-size",
)
COMMAND_LINE = CommandLine(managed=MANAGED, aliases=SHORT_ALIASES, abbreviable=frozenset(NEIGHBOURS))

# What the adapter queries: `vllm[:_]x` matches both spellings (`vllm:x`, and `vllm_x` through
# OpenMetrics negotiation). Older names follow the newest as fallbacks.
METRICS = EngineMetrics(
    running=("vllm[:_]num_requests_running",),
    waiting=("vllm[:_]num_requests_waiting",),
    kv_usage=("vllm[:_]kv_cache_usage_perc", "vllm[:_]gpu_cache_usage_perc"),
    tpot=(
        "vllm[:_]request_time_per_output_token_seconds",
        "vllm[:_]inter_token_latency_seconds",
        "vllm[:_]time_per_output_token_seconds",
    ),
    ttft=("vllm[:_]time_to_first_token_seconds",),
    generation_tokens=("vllm[:_]generation_tokens_total",),
    preemptions=("vllm[:_]num_preemptions_total",),
    prefix_hits=("vllm[:_]prefix_cache_hits_total", "vllm[:_]gpu_prefix_cache_hits_total"),
    prefix_queries=("vllm[:_]prefix_cache_queries_total", "vllm[:_]gpu_prefix_cache_queries_total"),
    prompt_length=("vllm[:_]request_prompt_tokens",),
    generation_length=("vllm[:_]request_generation_tokens",),
    read_bytes=("vllm[:_]estimated_read_bytes_per_gpu_total",),
    # (time_per_output_token_seconds is inter-token latency too, under its ≤ 0.11 name)
    step_time=("vllm[:_]inter_token_latency_seconds", "vllm[:_]time_per_output_token_seconds"),
)
# vLLM counts the bytes it reads only with this switch (vllm/v1/metrics/perf.py, 0.34.0); without it
# the counter is still registered, at zero, per engine (labels model_name, engine).
MFU_METRICS_SWITCH = "--enable-mfu-metrics"
# The KV pool size: cache_config_info carries the numbers as labels (the value is always 1).
CACHE_INFO = "vllm[:_]cache_config_info"
CACHE_INFO_LABELS = ("num_gpu_blocks", "block_size")

# What a release line exports (family name → type), for the emulator's `--metric-version`:
# `current` (0.12+), `legacy` (≤ 0.9: these names instead of `CURRENT_ONLY`), `both` (0.10–0.11).
CURRENT_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:estimated_read_bytes_per_gpu": "counter",
}
LEGACY_NAMES = {
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:gpu_prefix_cache_queries": "counter",
    "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:time_per_output_token_seconds": "histogram",
}
CURRENT_ONLY = frozenset(
    {
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:estimated_read_bytes_per_gpu",
    }
)
