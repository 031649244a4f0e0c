"""One light exporter standing in for a whole fleet of vLLM engine pods (the scale benchmark).

    python tests/bench/fleet_exporter.py --fleet FLEET.json --host 127.0.0.1 --port 9400

FLEET.json lists the pods: [{"namespace": ..., "pod": ..., "llmserving": ...}, ...]. /metrics serves
every pod's series with those labels (Prometheus must scrape it with `honor_labels: true`), in vLLM's
names, types and buckets (tests/support/vllm_exporter.py), at a steady load computed from the time
since start — counters and histograms grow at fixed rates, so a scrape costs no per-request work.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

sys.path.insert(0, str(Path(__file__).parents[1] / "support"))
from vllm_exporter import TPOT_BUCKETS, TTFT_BUCKETS

LABELS = ["namespace", "pod", "llmserving", "model_name", "engine"]
# Every pod: 32 running sequences of 2,048 tokens in a pool of 30,000 blocks of 16 tokens.
RUNNING, CONTEXT, BLOCKS, BLOCK_SIZE = 32, 2048, 30000, 16
LOAD = {
    "requests_per_s": 5.0,
    "tpot_s": 0.02,
    "ttft_s": 0.2,
    "prompt_tokens": 1900,
    "generation_tokens": 300,
    "prefix_hit_ratio": 0.2,
}


def histogram(
    name: str, doc: str, buckets: tuple[float, ...], pods: list[list[str]], value: float, count: float
) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    cumulative = [(str(le), count if value <= le else 0.0) for le in buckets] + [("+Inf", count)]
    for labels in pods:
        family.add_metric(labels, cumulative, sum_value=value * count)
    return family


class FleetCollector(Collector):
    def __init__(self, pods: list[dict[str, str]]) -> None:
        self.pods = [[p["namespace"], p["pod"], p["llmserving"], "bench-model", "0"] for p in pods]
        self.started = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        elapsed = time.monotonic() - self.started
        requests = LOAD["requests_per_s"] * elapsed

        def gauge(name: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, name, labels=LABELS)
            for labels in self.pods:
                family.add_metric(labels, value)
            return family

        def counter(name: str, value: float) -> Metric:
            family = CounterMetricFamily(name, name, labels=LABELS)
            for labels in self.pods:
                family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", RUNNING)
        yield gauge("vllm:num_requests_waiting", 0)
        yield gauge("vllm:kv_cache_usage_perc", CONTEXT * RUNNING / (BLOCKS * BLOCK_SIZE))
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "cache config", labels=[*LABELS, "block_size", "num_gpu_blocks"]
        )
        for labels in self.pods:
            info.add_metric([*labels, str(BLOCK_SIZE), str(BLOCKS)], 1)
        yield info
        yield histogram(
            "vllm:request_time_per_output_token_seconds",
            "tpot",
            TPOT_BUCKETS,
            self.pods,
            LOAD["tpot_s"],
            requests,
        )
        yield histogram(
            "vllm:time_to_first_token_seconds", "ttft", TTFT_BUCKETS, self.pods, LOAD["ttft_s"], requests
        )
        yield histogram("vllm:request_prompt_tokens", "p", (), self.pods, LOAD["prompt_tokens"], requests)
        yield histogram(
            "vllm:request_generation_tokens", "g", (), self.pods, LOAD["generation_tokens"], requests
        )
        yield counter("vllm:generation_tokens", requests * LOAD["generation_tokens"])
        yield counter("vllm:prompt_tokens", requests * LOAD["prompt_tokens"])
        yield counter("vllm:num_preemptions", 0)
        yield counter("vllm:prefix_cache_queries", requests * LOAD["prompt_tokens"])
        yield counter("vllm:prefix_cache_hits", requests * LOAD["prompt_tokens"] * LOAD["prefix_hit_ratio"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fleet", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    registry = CollectorRegistry()
    registry.register(FleetCollector(json.loads(args.fleet.read_text())))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not self.path.startswith("/metrics"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
