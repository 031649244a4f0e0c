"""The engines' metric contract (REFERENCE.md §2), read from a running simulation at scrape time.

vLLM (`/metrics`): labels `model_name` and `engine`, counters with `_total`, gauges, and histograms
with vLLM's exact buckets. `metric_version` picks the names of a release line:
- `current` (0.12+): kv_cache_usage_perc, prefix_cache_*, inter_token_latency_seconds and the
  per-request request_time_per_output_token_seconds;
- `legacy` (≤ 0.9, V0): gpu_cache_usage_perc, gpu_prefix_cache_*, time_per_output_token_seconds
  (which is the inter-token latency), no per-request TPOT, and only the `model_name` label;
- `both` (0.10–0.11): every name of the two, with the `engine` label.
TensorRT-LLM (`/prometheus/metrics`): the `trtllm_` names with labels `model_name`, `engine_type`.
Plus the emulator's own `batchknee_emulator_*` series (requests received, finished, rejected,
dropped), which prove nothing was lost in a rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from batchknee.emulator.engine import Engine
from batchknee.emulator.stats import FINISH_REASONS, LEGACY_FINISH_REASONS, Histogram
from batchknee.engines import sglang, trtllm, vllm

VLLM_CURRENT_NAMES = vllm.CURRENT_NAMES
VLLM_LEGACY_NAMES = vllm.LEGACY_NAMES
_CURRENT_ONLY = vllm.CURRENT_ONLY
# CacheConfig fields (cache_config_info labels) that releases before 0.12 had and the pinned
# release no longer has (tests/contract checks the rest against the release's CacheConfig).
_PRE_012_CACHE_FIELDS = ("calculate_kv_scales", "cpu_offload_gb", "swap_space")
TRTLLM_NAMES = trtllm.NAMES
EMULATOR_NAMES = {
    "batchknee_emulator_requests_received": "counter",
    "batchknee_emulator_requests_finished": "counter",
    "batchknee_emulator_requests_rejected": "counter",
    "batchknee_emulator_dropped_requests": "counter",
    "batchknee_emulator_in_flight_requests": "gauge",
    "batchknee_emulator_draining": "gauge",
    "batchknee_emulator_max_num_seqs": "gauge",
    "batchknee_emulator_simulated_seconds": "gauge",
    "batchknee_emulator_lag_seconds": "gauge",
    "batchknee_emulator_info": "gauge",
}


def vllm_metric_names(version: str) -> dict[str, str]:
    """Family name → type that `/metrics` carries for a metric version."""
    if version == "current":
        return dict(VLLM_CURRENT_NAMES)
    names = {**VLLM_CURRENT_NAMES, **VLLM_LEGACY_NAMES}
    if version == "legacy":
        for name in _CURRENT_ONLY:
            names.pop(name)
    return names


_le = cast(Callable[[float], str], floatToGoString)  # how prometheus_client writes `le`


def _histogram(
    name: str, doc: str, labels: list[str], values: list[str], hist: Histogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    buckets = [(_le(bound), float(n)) for bound, n in hist.cumulative()]
    family.add_metric(values, buckets, sum_value=hist.sum)
    return family


def _gauge(name: str, doc: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


def _counter(name: str, doc: str, labels: list[str], values: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    family.add_metric(values, value)
    return family


class EmulatorState:
    """What the exporter reads besides the engine (set by the server)."""

    def __init__(self) -> None:
        self.draining = False
        self.simulated_s = 0.0
        self.lag_s = 0.0


def read_bytes_per_wall_second_basis(read_bytes: float, speedup: float) -> float:
    """The read-bytes counter scaled so that its rate per wall second (what Prometheus computes) is
    the simulated GPU's bytes per second: under --speedup the wall clock runs 1/speedup of simulated
    time, and a bandwidth figure only means something against the GPU's peak in the GPU's seconds."""
    return read_bytes / speedup


class VllmCollector(Collector):
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        version: str,
        cache_info: dict[str, str],
        mfu_metrics: bool = False,
        speedup: float = 1.0,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.version = version
        self.cache_info = cache_info
        self.mfu_metrics = mfu_metrics
        self.speedup = speedup

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.stats
        legacy = self.version == "legacy"
        current = self.version != "legacy"
        old = self.version != "current"
        labels = ["model_name"] if legacy else ["model_name", "engine"]
        values = [self.model_name] if legacy else [self.model_name, "0"]

        yield _gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            values,
            engine.num_running,
        )
        yield _gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            values,
            engine.num_waiting,
        )
        if old:
            yield _gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                labels,
                values,
                engine.kv_cache_usage,
            )
        if current:
            yield _gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                labels,
                values,
                engine.kv_cache_usage,
            )
        info = dict(self.cache_info)
        if not legacy:
            info["engine"] = "0"
        if not old:
            for field in _PRE_012_CACHE_FIELDS:
                info.pop(field, None)
        yield _gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            sorted(info),
            [info[k] for k in sorted(info)],
            1.0,
        )

        if old:
            yield _counter(
                "vllm:gpu_prefix_cache_queries",
                "GPU prefix cache queries, in terms of number of queried tokens.",
                labels,
                values,
                stats.prefix_cache_queries,
            )
            yield _counter(
                "vllm:gpu_prefix_cache_hits",
                "GPU prefix cache hits, in terms of number of cached tokens.",
                labels,
                values,
                stats.prefix_cache_hits,
            )
        if current:
            yield _counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                labels,
                values,
                stats.prefix_cache_queries,
            )
            yield _counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                labels,
                values,
                stats.prefix_cache_hits,
            )
        yield _counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            values,
            stats.preemptions,
        )
        yield _counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, values, stats.prompt_tokens
        )
        yield _counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            values,
            stats.generation_tokens,
        )
        if current:
            # vLLM registers it either way; it counts only with --enable-mfu-metrics.
            yield _counter(
                "vllm:estimated_read_bytes_per_gpu",
                "Estimated number of bytes read from memory per GPU.",
                labels,
                values,
                read_bytes_per_wall_second_basis(stats.read_bytes, self.speedup) if self.mfu_metrics else 0.0,
            )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason in LEGACY_FINISH_REASONS if legacy else FINISH_REASONS:
            success.add_metric([*values, reason], stats.success_by_reason.get(reason, 0))
        yield success

        yield _histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            values,
            stats.request_prompt_tokens,
        )
        yield _histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            values,
            stats.request_generation_tokens,
        )
        yield _histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            values,
            stats.iteration_tokens,
        )
        yield _histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            values,
            stats.ttft,
        )
        if old:
            yield _histogram(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                labels,
                values,
                stats.itl,
            )
        if current:
            yield _histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels,
                values,
                stats.itl,
            )
            yield _histogram(
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                labels,
                values,
                stats.request_tpot,
            )
        yield _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            values,
            stats.e2e,
        )
        yield _histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            values,
            stats.queue_time,
        )


class TrtllmCollector(Collector):
    def __init__(
        self, engine: Engine, model_name: str, cache_info: dict[str, str], max_num_tokens: int
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cache_info = cache_info
        self.max_num_tokens = max_num_tokens

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.stats
        labels = ["model_name", "engine_type"]
        values = [self.model_name, "trtllm"]
        bs = engine.block_size
        success = CounterMetricFamily(
            "trtllm_request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], stats.success_by_reason.get(reason, 0))
        yield success
        yield _histogram(
            "trtllm_e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            labels,
            values,
            stats.e2e,
        )
        yield _histogram(
            "trtllm_time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            values,
            stats.ttft,
        )
        yield _histogram(
            "trtllm_time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            labels,
            values,
            stats.request_tpot,
        )
        yield _histogram(
            "trtllm_request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            values,
            stats.queue_time,
        )
        yield _counter(
            "trtllm_prompt_tokens",
            "Cumulative number of prompt (input) tokens processed.",
            labels,
            values,
            stats.prompt_tokens,
        )
        yield _counter(
            "trtllm_generation_tokens",
            "Cumulative number of generation (output) tokens produced.",
            labels,
            values,
            stats.generation_tokens,
        )
        yield _counter(
            "trtllm_num_requests_completed",
            "Total number of completed requests across iterations",
            labels,
            values,
            stats.finished,
        )
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate", labels, values, hit_rate)
        yield _counter(
            "trtllm_kv_cache_reused_blocks",
            "Cumulative number of KV cache blocks reused (cache hits)",
            labels,
            values,
            stats.prefix_cache_hits // bs,
        )
        yield _counter(
            "trtllm_kv_cache_missed_blocks",
            "Cumulative number of KV cache blocks missed (cache misses)",
            labels,
            values,
            (stats.prefix_cache_queries - stats.prefix_cache_hits) // bs,
        )
        yield _gauge(
            "trtllm_kv_cache_utilization", "KV cache utilization", labels, values, engine.kv_cache_usage
        )
        yield _gauge(
            "trtllm_num_requests_running", "Number of active requests", labels, values, engine.num_running
        )
        yield _gauge(
            "trtllm_num_requests_waiting", "Number of queued requests", labels, values, engine.num_waiting
        )
        yield _gauge(
            "trtllm_iteration_latency_seconds",
            "Iteration latency in seconds",
            labels,
            values,
            engine.last_step_s,
        )
        yield _gauge(
            "trtllm_max_batch_size_static",
            "Static maximum batch size",
            labels,
            values,
            engine.config.max_num_seqs,
        )
        yield _gauge(
            "trtllm_max_num_tokens_runtime",
            "Runtime maximum number of tokens",
            labels,
            values,
            self.max_num_tokens,
        )
        yield _gauge(
            "trtllm_kv_cache_max_blocks",
            "Maximum number of KV cache blocks",
            labels,
            values,
            engine.total_blocks,
        )
        yield _gauge(
            "trtllm_kv_cache_free_blocks",
            "Number of free KV cache blocks",
            labels,
            values,
            engine.free_blocks,
        )
        yield _gauge(
            "trtllm_kv_cache_used_blocks",
            "Number of used KV cache blocks",
            labels,
            values,
            engine.used_blocks,
        )
        yield _gauge(
            "trtllm_kv_cache_tokens_per_block", "Number of tokens per KV cache block", labels, values, bs
        )
        info = {**dict(zip(labels, values, strict=True)), **self.cache_info}
        yield _gauge(
            "trtllm_kv_cache_config_info",
            "KV cache configuration info",
            sorted(info),
            [info[k] for k in sorted(info)],
            1.0,
        )


class SglangCollector(Collector):
    """SGLang's `/metrics` with `--enable-metrics`: the scheduler's gauges (labelled with the parallel
    ranks) and the tokenizer's counters and histograms (model and engine type, plus `is_streaming`
    or `cache_source` where the release has them). Names and labels: batchknee.engines.sglang.

    tensor_parallel, all_schedulers: every TP rank's scheduler writes the pool's constants
    (`max_total_num_tokens`, `page_size`, `num_pages`); the other series rank 0 only, or every rank
    (each the same batch) with --enable-metrics-for-all-schedulers.
    priority_scheduling: --enable-priority-scheduling's `priority` label on the scheduler's series,
    the queue gauges' total under "" and their breakdown under "None" (every request without a
    priority, as the release writes them without --default-priority-value). The tokenizer's
    `priority` label (per request) is left out."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        page_size: int,
        mfu_metrics: bool = False,
        speedup: float = 1.0,
        tensor_parallel: int = 1,
        all_schedulers: bool = False,
        priority_scheduling: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.page_size = page_size
        self.mfu_metrics = mfu_metrics
        self.speedup = speedup
        self.tensor_parallel = tensor_parallel
        self.all_schedulers = all_schedulers
        self.priority_scheduling = priority_scheduling

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.engine, self.engine.stats
        scheduler = list(sglang.SCHEDULER_LABELS) + (["priority"] if self.priority_scheduling else [])
        total = [""] if self.priority_scheduling else []
        # model_name, engine_type, tp_rank, pp_rank, moe_ep_rank (a dense model: one expert rank)
        every = [
            [self.model_name, "unified", str(rank), "0", "0", *total] for rank in range(self.tensor_parallel)
        ]
        ranks = every if self.all_schedulers else every[:1]
        constants = ("max_total_num_tokens", "page_size", "num_pages")  # emit_constants: every rank
        tokenizer = list(sglang.TOKENIZER_LABELS)
        base = [self.model_name, "unified"]
        pool = engine.total_blocks * self.page_size
        used = engine.used_blocks * self.page_size
        context = sum(r.prompt + r.generated for r in engine.running.values())
        gauges = {
            "num_running_reqs": engine.num_running,
            "num_queue_reqs": engine.num_waiting,
            "token_usage": engine.kv_cache_usage,
            "full_token_usage": engine.kv_cache_usage,
            "kv_used_tokens": used,
            "kv_available_tokens": pool - used,
            "max_total_num_tokens": pool,
            "page_size": self.page_size,
            "num_pages": engine.total_blocks,
            "decode_sum_seq_lens": context,
        }
        queues = ("num_running_reqs", "num_queue_reqs")

        def family(
            kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float
        ) -> Metric:
            metric = kind(f"sglang:{name}", doc, labels=scheduler)
            for labels in every if name in constants else ranks:
                metric.add_metric(labels, value)
                if self.priority_scheduling and name in queues:
                    metric.add_metric([*labels[:-1], "None"], value)  # the breakdown: no request has one
            return metric

        for name, value in gauges.items():
            yield family(GaugeMetricFamily, name, f"SGLang {name.replace('_', ' ')}.", value)
        yield family(
            CounterMetricFamily,
            "num_retracted_requests",
            "Number of retracted requests.",
            stats.preemptions,
        )
        # Registered either way; SGLang increments it (and so gives it a series) only with
        # --enable-mfu-metrics.
        read_bytes = CounterMetricFamily(
            "sglang:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU.",
            labels=scheduler,
        )
        if self.mfu_metrics:
            for labels in ranks:  # each rank its own GPU's
                read_bytes.add_metric(
                    labels, read_bytes_per_wall_second_basis(stats.read_bytes, self.speedup)
                )
        yield read_bytes
        streaming = [*tokenizer, "is_streaming"]
        yield _counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", streaming, [*base, "false"],
            stats.prompt_tokens,
        )  # fmt: skip
        yield _counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", streaming,
            [*base, "false"], stats.generation_tokens,
        )  # fmt: skip
        yield _counter(
            "sglang:cached_tokens", "Number of cached prompt tokens.", [*tokenizer, "cache_source"],
            [*base, "device"], stats.prefix_cache_hits,
        )  # fmt: skip
        histograms = (
            ("time_to_first_token_seconds", streaming, [*base, "false"], stats.ttft),
            ("inter_token_latency_seconds", tokenizer, base, stats.itl),
            ("request_time_per_output_token_seconds", streaming, [*base, "false"], stats.request_tpot),
            ("prompt_tokens_histogram", tokenizer, base, stats.request_prompt_tokens),
            ("generation_tokens_histogram", tokenizer, base, stats.request_generation_tokens),
        )
        for name, labels, values, hist in histograms:
            yield _histogram(f"sglang:{name}", f"SGLang {name.replace('_', ' ')}.", labels, values, hist)


class EmulatorCollector(Collector):
    def __init__(self, engine: Engine, model_name: str, state: EmulatorState, info: dict[str, str]) -> None:
        self.engine = engine
        self.model_name = model_name
        self.state = state
        self.info = info

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        labels = ["model_name"]
        values = [self.model_name]
        yield _counter(
            "batchknee_emulator_requests_received",
            "Requests the emulator was given (built-in load and HTTP).",
            labels,
            values,
            stats.received,
        )
        yield _counter(
            "batchknee_emulator_requests_finished",
            "Requests the emulator finished.",
            labels,
            values,
            stats.finished,
        )
        yield _counter(
            "batchknee_emulator_requests_rejected",
            "Requests turned away (queue full or longer than max-model-len).",
            labels,
            values,
            stats.rejected,
        )
        yield _counter(
            "batchknee_emulator_dropped_requests",
            "Requests still queued or running when the drain grace time ran out.",
            labels,
            values,
            stats.dropped,
        )
        yield _gauge(
            "batchknee_emulator_in_flight_requests",
            "Requests queued or running.",
            labels,
            values,
            self.engine.in_flight,
        )
        yield _gauge(
            "batchknee_emulator_draining",
            "1 after SIGTERM, while draining.",
            labels,
            values,
            1.0 if self.state.draining else 0.0,
        )
        yield _gauge(
            "batchknee_emulator_max_num_seqs",
            "The batch limit this engine runs with.",
            labels,
            values,
            self.engine.config.max_num_seqs,
        )
        yield _gauge(
            "batchknee_emulator_simulated_seconds",
            "Simulated time since the engine became ready.",
            labels,
            values,
            self.state.simulated_s,
        )
        yield _gauge(
            "batchknee_emulator_lag_seconds",
            "How far the simulation is behind the scaled wall clock.",
            labels,
            values,
            self.state.lag_s,
        )
        info = {"model_name": self.model_name, **self.info}
        yield _gauge(
            "batchknee_emulator_info",
            "The emulated engine.",
            sorted(info),
            [info[k] for k in sorted(info)],
            1.0,
        )


def build_registry(collectors: list[Collector]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def trtllm_iteration_stats(engine: Engine, timestamp: str) -> list[dict[str, Any]]:
    """trtllm-serve's JSON `/metrics`: the latest iteration's stats."""
    used = engine.used_blocks
    stats = engine.stats
    return [
        {
            "timestamp": timestamp,
            "iter": engine.step_index,
            "iterLatencyMS": engine.last_step_s * 1e3,
            "numActiveRequests": engine.num_running,
            "numQueuedRequests": engine.num_waiting,
            "numCompletedRequests": stats.finished,
            "maxNumActiveRequests": engine.config.max_num_seqs,
            "maxBatchSizeStatic": engine.config.max_num_seqs,
            "maxNumTokensRuntime": engine.config.max_num_batched_tokens,
            "kvCacheStats": {
                "maxNumBlocks": engine.total_blocks,
                "freeNumBlocks": engine.free_blocks,
                "usedNumBlocks": used,
                "tokensPerBlock": engine.block_size,
                "cacheHitRate": stats.prefix_cache_hits / stats.prefix_cache_queries
                if stats.prefix_cache_queries
                else 0.0,
            },
            "inflightBatchingStats": {
                "numScheduledRequests": engine.num_running,
                "numContextRequests": len(engine.prefilling),
                "numGenRequests": engine.num_decoding,
                "numPausedRequests": 0,
                "numCtxTokens": 0,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0,
            },
        }
    ]
