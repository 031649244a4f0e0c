"""One light exporter standing in for a whole fleet of vLLM engine pods (the scale benchmark).

    python tests/bench/fleet_exporter.py --fleet FLEET.json --host 127.0.0.1 --port 9400

FLEET.json lists the pods: [{"namespace": ..., "pod": ..., "llmserving": ...}, ...]. /metrics serves
every pod's series with those labels (Prometheus must scrape it with `honor_labels: true`) in vLLM's
names and types (tests/support/vllm_exporter.py), at a steady load computed from the time since
start: counters and histograms grow at fixed rates. Light on purpose: few histogram buckets (those
around the values served), label sets rendered once, and the text rebuilt at most once a second, so
a thousand pods' series (about 30 each) come back in well under a scrape timeout on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Every pod: 32 running sequences of 2,048 tokens in a pool of 30,000 blocks of 16 tokens.
RUNNING, CONTEXT, BLOCKS, BLOCK_SIZE = 32, 2048, 30000, 16
REQUESTS_PER_S, TPOT_S, TTFT_S, PROMPT, GENERATION, PREFIX_HITS = 5.0, 0.02, 0.2, 1900, 300, 0.2
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.1)  # a subset of vLLM's (tests/support/vllm_exporter.py)
TTFT_BUCKETS = (0.1, 0.25, 0.5, 1.0)


def label_sets(pods: list[dict[str, str]]) -> list[str]:
    return [
        f'namespace="{p["namespace"]}",pod="{p["pod"]}",llmserving="{p["llmserving"]}",model_name="bench",engine="0"'
        for p in pods
    ]


def render(labels: list[str], elapsed: float) -> bytes:
    requests = REQUESTS_PER_S * elapsed
    lines: list[str] = []

    def family(name: str, kind: str, value_lines: list[str]) -> None:
        lines.append(f"# HELP {name} {name}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(value_lines)

    def per_pod(name: str, value: float) -> list[str]:
        return [f"{name}{{{ls}}} {value}" for ls in labels]

    def histogram(name: str, buckets: tuple[float, ...], value: float) -> None:
        rows = []
        for ls in labels:
            for le in buckets:
                rows.append(f'{name}_bucket{{{ls},le="{le}"}} {requests if value <= le else 0.0}')
            rows.append(f'{name}_bucket{{{ls},le="+Inf"}} {requests}')
            rows.append(f"{name}_sum{{{ls}}} {value * requests}")
            rows.append(f"{name}_count{{{ls}}} {requests}")
        family(name, "histogram", rows)

    family("vllm:num_requests_running", "gauge", per_pod("vllm:num_requests_running", RUNNING))
    family("vllm:num_requests_waiting", "gauge", per_pod("vllm:num_requests_waiting", 0))
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        per_pod("vllm:kv_cache_usage_perc", CONTEXT * RUNNING / (BLOCKS * BLOCK_SIZE)),
    )
    family(
        "vllm:cache_config_info",
        "gauge",
        [
            f'vllm:cache_config_info{{{ls},block_size="{BLOCK_SIZE}",num_gpu_blocks="{BLOCKS}"}} 1'
            for ls in labels
        ],
    )
    histogram("vllm:request_time_per_output_token_seconds", TPOT_BUCKETS, TPOT_S)
    histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS, TTFT_S)
    histogram("vllm:request_prompt_tokens", (), PROMPT)
    histogram("vllm:request_generation_tokens", (), GENERATION)
    for name, total in (
        ("vllm:generation_tokens", requests * GENERATION),
        ("vllm:num_preemptions", 0.0),
        ("vllm:prefix_cache_queries", requests * PROMPT),
        ("vllm:prefix_cache_hits", requests * PROMPT * PREFIX_HITS),
    ):
        family(f"{name}_total", "counter", per_pod(f"{name}_total", total))
    return ("\n".join(lines) + "\n").encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fleet", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    labels = label_sets(json.loads(args.fleet.read_text()))
    started = time.monotonic()
    lock = threading.Lock()
    cached: dict[str, Any] = {"at": -1.0, "body": b""}

    def body() -> bytes:
        with lock:  # one render at a time; scrapes within a second share it
            now = time.monotonic()
            if now - cached["at"] >= 1.0:
                cached["body"], cached["at"] = render(labels, now - started), now
            result: bytes = cached["body"]
            return result

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if not self.path.startswith("/metrics"):
                self.send_error(404)
                return
            data = body()
            try:
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the scraper gave up: nothing to tell it
                pass

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
