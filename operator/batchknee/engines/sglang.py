"""SGLang: `python -m sglang.launch_server --model-path M` (or `sglang serve`), batch limit
`--max-running-requests`, `sglang:` metrics with `--enable-metrics` (REFERENCE.md §2).

The command line and metric names are read from the release in `VERSION` (tests/contract reads that
release's wheel: `sglang/srt/arg_groups/fields/*.py` for the flags, `srt/observability/
metrics_collector.py` for the metrics). SGLang's parser is argparse with abbreviations allowed; the
flags are dash-spelled (`--tp-size`, alias `--tensor-parallel-size`; `--model-path`, alias `--model`).
"""

from __future__ import annotations

from batchknee.engines.contract import CommandLine, EngineMetrics, HttpSurface

VERSION = "0.5.23"
APP_NAME = "sglang"
KNOB_FLAG = "--max-running-requests"
MODULE = "sglang.launch_server"
PROGRAM = "python"  # `python -m sglang.launch_server`
CLI_PROGRAM = "sglang"  # `sglang serve`
COMMANDS = (MODULE, CLI_PROGRAM)
# The operator runs every engine on the same container port (SGLang's own default is 30000).
HTTP = HttpSurface(port=8000, health_path="/health", metrics_path="/metrics")
# The port variables SGLang reads that a Service of the pod's namespace would set (see vllm's).
PORT_VARIABLES = ("MASTER_PORT", "DUMPER_SERVER_PORT", "MS_SCHED_PORT")
METRICS_SWITCH = "--enable-metrics"  # SGLang exports no Prometheus metrics without it

# Defaults the planner assumes. SGLang resolves `--mem-fraction-static` (the fraction of the whole GPU
# memory for weights + KV pool) and `--page-size` at start when unset; these are its values for a
# single 80 GB-class GPU (a page of one token: the radix tree shares prefixes token by token).
DEFAULT_MEM_FRACTION_STATIC = 0.88
DEFAULT_PAGE_SIZE = 1
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
# `--max-running-requests` unset: SGLang derives it from the pool, max_total_num_tokens / context
# length × 512, within [2048, 4096].
DEFAULT_MAX_RUNNING_REQUESTS_FLOOR = 2048
DEFAULT_MAX_RUNNING_REQUESTS_CEILING = 4096


def default_max_running_requests(pool_tokens: int, context_length: int) -> int:
    """The batch limit SGLang picks when `--max-running-requests` is not given."""
    derived = int(pool_tokens / max(1, context_length) * 512)
    return min(max(derived, DEFAULT_MAX_RUNNING_REQUESTS_FLOOR), DEFAULT_MAX_RUNNING_REQUESTS_CEILING)


MANAGED = ("--max-running-requests", "--tp-size", "--port", "--model-path", "--host")
ALIASES: dict[str, tuple[str, ...]] = {
    "--tp-size": ("--tensor-parallel-size",),
    "--model-path": ("--model",),
    "--pp-size": ("--pipeline-parallel-size",),
    "--dp-size": ("--data-parallel-size",),
}
# Parallelism other than tensor parallelism over the pod's GPUs: refused, as for vLLM — but for
# data-parallel attention, whose groups share the tensor-parallel GPUs (their pools add up).
DP_ATTENTION_SWITCH = "--enable-dp-attention"
PARALLEL_FLAGS: dict[str, str | None] = {"--pp-size": None, "--dp-size": DP_ATTENTION_SWITCH}
# Flags of the user's args the operator reads (the step token budget, the KV pool's share of memory).
READ_FLAGS = (*PARALLEL_FLAGS, "--chunked-prefill-size", "--mem-fraction-static")
# Every SGLang long option sharing its first two letters with a flag the operator manages (or an
# alias) or reads: an abbreviation is one of those flags only when it is unambiguous among these
# (tests/contract holds this to the release).
NEIGHBOURS = (
    "--chat-template",
    "--checkpoint-engine-wait-weights-before-ready",
    "--chunked-prefill-size",
    "--data-parallel-size",
    "--dp-size",
    "--host",
    "--mamba-backend",
    "--mamba-cache-philox-rounds",
    "--mamba-full-memory-ratio",
    "--mamba-max-states-per-path",
    "--mamba-radix-cache-strategy",
    "--mamba-ssm-dtype",
    "--mamba-track-interval",
    "--max-ep-size",
    "--max-loaded-loras",
    "--max-lora-chunk-size",
    "--max-lora-rank",
    "--max-loras-per-batch",
    "--max-mamba-cache-size",
    "--max-prefill-tokens",
    "--max-queued-requests",
    "--max-running-requests",
    "--max-total-tokens",
    "--media-url-max-file-size-mb",
    "--mem-fraction-static",
    "--model",
    "--model-checksum",
    "--model-config-parser",
    "--model-impl",
    "--model-loader-extra-config",
    "--model-path",
    "--modelexpress-config",
    "--modelopt-checkpoint-restore-path",
    "--modelopt-checkpoint-save-path",
    "--modelopt-export-path",
    "--modelopt-quant",
    "--moe-a2a-backend",
    "--moe-data-parallel-size",
    "--moe-dense-tp-size",
    "--moe-dp-size",
    "--moe-runner-backend",
    "--monokernel-backend",
    "--mooncake-ib-device",
    "--pipeline-parallel-size",
    "--port",
    "--pp-async-batch-depth",
    "--pp-max-micro-batch-size",
    "--pp-size",
    "--tensor-parallel-size",
    "--tp-size",
)
COMMAND_LINE = CommandLine(managed=MANAGED, aliases=ALIASES, abbreviable=frozenset(NEIGHBOURS))

# What the adapter queries; `sglang[:_]x` matches `sglang:x` and the `sglang_x` spelling. Gauges and
# histograms carry the collector's labels (model_name, engine_type, …); prompt/generation tokens,
# TTFT and TPOT add `is_streaming`, cached tokens `cache_source`: the queries sum over them.
METRICS = EngineMetrics(
    running=("sglang[:_]num_running_reqs",),
    waiting=("sglang[:_]num_queue_reqs",),
    kv_usage=("sglang[:_]full_token_usage", "sglang[:_]token_usage"),
    tpot=("sglang[:_]request_time_per_output_token_seconds", "sglang[:_]inter_token_latency_seconds"),
    ttft=("sglang[:_]time_to_first_token_seconds",),
    generation_tokens=("sglang[:_]generation_tokens_total",),
    preemptions=("sglang[:_]num_retracted_requests_total",),  # retractions free a request's KV
    prefix_hits=("sglang[:_]cached_tokens_total",),
    prefix_queries=("sglang[:_]prompt_tokens_total",),
    prompt_length=("sglang[:_]prompt_tokens_histogram",),
    generation_length=("sglang[:_]generation_tokens_histogram",),
    read_bytes=("sglang[:_]estimated_read_bytes_per_gpu_total",),
    step_time=("sglang[:_]inter_token_latency_seconds",),
    # the queue gauges' totals, not their breakdown by priority (--enable-priority-scheduling); the
    # other scheduler series carry priority="" too, and without the switch no series has the label
    gauge_matchers='priority=""',
    # --enable-metrics-for-all-schedulers: each TP rank writes the same batch (a data-parallel
    # attention group keeps its own dp_rank: the groups' requests and pools add up)
    rank_labels=("tp_rank", "moe_ep_rank"),
)
# By default only the scheduler of attention-TP rank 0 writes the scheduler's series; with this
# switch every rank does, each the same batch under its own `tp_rank` (and `moe_ep_rank`).
ALL_SCHEDULERS_SWITCH = "--enable-metrics-for-all-schedulers"
# With this switch the queue gauges (running, waiting) carry the total under `priority=""` and a
# breakdown by request priority beside it (`"None"` for requests without one); every other
# scheduler series has `priority=""`.
PRIORITY_SWITCH = "--enable-priority-scheduling"
# SGLang counts the bytes it reads only with this switch (and --enable-metrics): the scheduler's
# collector registers the counter either way, but without samples until it is incremented.
MFU_METRICS_SWITCH = "--enable-mfu-metrics"
# The KV pool size in tokens (radix-shared prefixes are held once in it).
MAX_TOTAL_TOKENS = "sglang[:_]max_total_num_tokens"
KV_USED_TOKENS = "sglang[:_]kv_used_tokens"
DECODE_SUM_SEQ_LENS = "sglang[:_]decode_sum_seq_lens"

# What the release exports (family name → type and label names), for the emulator. The scheduler's
# collector labels its series with the parallel ranks too; the tokenizer's (requests, tokens,
# latencies) with the model and engine type only.
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")
_SCHEDULER_GAUGES = (
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "full_token_usage",
    "kv_used_tokens",
    "kv_available_tokens",
    "kv_evictable_tokens",
    "max_total_num_tokens",
    "page_size",
    "num_pages",
    "decode_sum_seq_lens",
    "cache_hit_rate",
    "gen_throughput",
    "num_retracted_reqs",
)
NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    **{f"sglang:{name}": ("gauge", SCHEDULER_LABELS) for name in _SCHEDULER_GAUGES},
    "sglang:num_retracted_requests": ("counter", SCHEDULER_LABELS),
    "sglang:estimated_read_bytes_per_gpu": ("counter", SCHEDULER_LABELS),
    "sglang:prompt_tokens": ("counter", (*TOKENIZER_LABELS, "is_streaming")),
    "sglang:generation_tokens": ("counter", (*TOKENIZER_LABELS, "is_streaming")),
    "sglang:cached_tokens": ("counter", (*TOKENIZER_LABELS, "cache_source")),
    "sglang:time_to_first_token_seconds": ("histogram", (*TOKENIZER_LABELS, "is_streaming")),
    "sglang:inter_token_latency_seconds": ("histogram", TOKENIZER_LABELS),
    "sglang:request_time_per_output_token_seconds": ("histogram", (*TOKENIZER_LABELS, "is_streaming")),
    "sglang:prompt_tokens_histogram": ("histogram", TOKENIZER_LABELS),
    "sglang:generation_tokens_histogram": ("histogram", TOKENIZER_LABELS),
}
