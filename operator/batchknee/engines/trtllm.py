"""TensorRT-LLM: `trtllm-serve MODEL`, batch limit `max_batch_size` in the LLM API options file,
`trtllm_` metrics at `/prometheus/metrics` (its `/metrics` is JSON iteration stats).

The metric names are pinned to the collector at `COLLECTOR_COMMIT` (the wheel is not on PyPI;
tests/contract holds that collector's registrations)."""

from __future__ import annotations

from batchknee.engines.contract import CommandLine, EngineMetrics, HttpSurface

# The default image's release. No stable release exports the running, waiting and KV-pool series
# the operator reads (1.2.1 exports five request histograms, unprefixed): they came with the 1.3.0
# release candidates (NVIDIA/TensorRT-LLM PR #12545, after 1.3.0rc7), so the default is a candidate
# that has them.
VERSION = "1.3.0rc14"
COLLECTOR_COMMIT = "050f80d"
APP_NAME = "tensorrt-llm"
KNOB_FLAG = "--max_batch_size"
KNOB_OPTION = "max_batch_size"  # in the options file, which overrides the flag
PROGRAM = "trtllm-serve"
COMMANDS = ("trtllm-serve",)
HTTP = HttpSurface(port=8000, health_path="/health", metrics_path="/prometheus/metrics")
JSON_METRICS_PATH = "/metrics"

DEFAULT_MAX_BATCH_SIZE = 2048
DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_TOKENS_PER_BLOCK = 32
DEFAULT_FREE_GPU_MEMORY_FRACTION = 0.9

OPTIONS_FILE_FLAGS = ("--extra_llm_api_options", "--config")  # the LLM API options file: overrides flags
# The tensor-parallel size in the options file, which overrides the flag: forced to the pod's GPUs
TP_OPTION = "tensor_parallel_size"
MANAGED = (
    "--max_batch_size",
    "--tp_size",
    "--tensor_parallel_size",  # the option's other name (trtllm-serve takes both)
    "--port",
    "--host",
    "--extra_llm_api_options",
    "--config",
)
DEFAULT_BACKEND = "pytorch"
# The backends whose LLM API takes `enable_iter_perf_stats` (the `tensorrt` one always collects
# iteration stats, and its options refuse unknown keys).
ITER_STATS_SWITCH_BACKENDS = ("pytorch", "_autodeploy")


def metrics_options(backend: str | None) -> dict[str, bool]:
    """The options that make trtllm-serve export its Prometheus metrics, set in every options file:
    it builds its MetricsCollector and mounts /prometheus/metrics only with `return_perf_metrics`,
    and its iteration gauges (running, waiting, KV cache) come from a stats loop that the PyTorch
    backend runs only with `enable_iter_perf_stats` (tensorrt_llm/serve/openai_server.py; both
    default to false)."""
    options = {"return_perf_metrics": True}
    if (backend or DEFAULT_BACKEND) in ITER_STATS_SWITCH_BACKENDS:
        options["enable_iter_perf_stats"] = True
    return options


# trtllm-serve's click parser takes no abbreviations and no short aliases of these.
COMMAND_LINE = CommandLine(managed=MANAGED)

METRICS = EngineMetrics(
    running=("trtllm_num_requests_running",),
    waiting=("trtllm_num_requests_waiting",),
    kv_usage=("trtllm_kv_cache_utilization",),
    tpot=("trtllm_time_per_output_token_seconds",),
    ttft=("trtllm_time_to_first_token_seconds",),
    generation_tokens=("trtllm_generation_tokens_total",),
    preemptions=(),
    prefix_hits=(),
    prefix_queries=(),
    prompt_length=(),
    generation_length=(),
    prompt_tokens=("trtllm_prompt_tokens_total",),
    finished_requests=("trtllm_e2e_request_latency_seconds_count",),
)
# Said when none of its running series is there (which reads as a scrape problem otherwise).
ABSENT_HINT = (
    "trtllm-serve exports trtllm_num_requests_running from the 1.3.0 release candidates on "
    f"(the default image, {VERSION}, has it); releases through 1.2.1 export request latencies only"
)
# The KV pool size: blocks × tokens per block.
KV_MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
KV_TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"

NAMES = {
    "trtllm_request_success": "counter",
    "trtllm_e2e_request_latency_seconds": "histogram",
    "trtllm_time_to_first_token_seconds": "histogram",
    "trtllm_time_per_output_token_seconds": "histogram",
    "trtllm_request_queue_time_seconds": "histogram",
    "trtllm_prompt_tokens": "counter",
    "trtllm_generation_tokens": "counter",
    "trtllm_num_requests_completed": "counter",
    "trtllm_kv_cache_hit_rate": "gauge",
    "trtllm_kv_cache_reused_blocks": "counter",
    "trtllm_kv_cache_missed_blocks": "counter",
    "trtllm_kv_cache_utilization": "gauge",
    "trtllm_num_requests_running": "gauge",
    "trtllm_num_requests_waiting": "gauge",
    "trtllm_iteration_latency_seconds": "gauge",
    "trtllm_max_batch_size_static": "gauge",
    "trtllm_max_num_tokens_runtime": "gauge",
    "trtllm_kv_cache_max_blocks": "gauge",
    "trtllm_kv_cache_free_blocks": "gauge",
    "trtllm_kv_cache_used_blocks": "gauge",
    "trtllm_kv_cache_tokens_per_block": "gauge",
    "trtllm_kv_cache_config_info": "gauge",
}
