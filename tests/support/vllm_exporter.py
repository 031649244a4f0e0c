"""A tiny engine stand-in whose vLLM-format metrics a test sets through a JSON state file.

    python vllm_exporter.py --state STATE.json [engine args ...] --host 127.1.0.3 --port 8000

Serves /metrics (vLLM names, types, labels and buckets; `"legacyNames": true` switches to the
pre-0.12 names) and /health. Every 0.1 s it re-reads the state file and advances counters and
histograms at the rates the state gives, so Prometheus sees what a real engine would show.
Unknown engine arguments (`serve MODEL --max-num-seqs 64 ...`) are accepted and recorded in
`batchknee_test_exporter_args_info` so a test can see what the pod was started with.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder

TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
    640,
    2560,
)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

DEFAULT_STATE: dict[str, Any] = {
    "running": 0.0,
    "waiting": 0.0,
    "kvUsage": 0.0,
    "numGpuBlocks": 30000,
    "blockSize": 16,
    "tpotSeconds": 0.02,
    # the mean inter-token latency (one sample per output step; current names only); null: tpotSeconds
    "itlSeconds": None,
    "ttftSeconds": 0.2,
    "requestsPerSecond": 0.0,
    "promptTokens": 1000,
    "generationTokens": 200,
    "prefixHitRatio": 0.0,
    "preemptionsPerSecond": 0.0,
    # bytes read per GPU per second (vLLM's --enable-mfu-metrics counter; 0: registered, not counting)
    "readBytesPerSecond": 0.0,
    # dcgm-exporter's DRAM-active fraction of this pod's GPU (null: no such series), served here
    # with its gpu/UUID/Hostname labels; the scrape's namespace/pod labels stand for its pod mapping
    "dramActive": None,
    "legacyNames": False,
    "forceTextFormat": False,
    # hostile pods: every family served under both spellings (`vllm:x` and `vllm_x`, same labels),
    # and the running gauge for this many more `engine` label values
    "bothSpellings": False,
    "extraEngines": 0,
    # seconds before it listens (a real engine loads its model first): its pod is not Ready meanwhile
    "startupSeconds": 0.0,
    # the largest --max-num-seqs that "fits": above it the engine exits at start-up, as a real one
    # does when the batch does not fit its memory (null: everything fits)
    "fitsMaxNumSeqs": None,
    # serve vLLM PR #54816's /v1/runtime_config (GET, PATCH) for live caps; off: the route is absent
    "runtimeConfig": False,
    # pods whose name starts with this take RUNTIME_CONFIG_SILENT_S to answer /v1/runtime_config
    # (a wedged engine: past the operator's 2-s deadline); null: every pod answers at once
    "runtimeConfigSilentPods": None,
}
RUNTIME_CONFIG_SILENT_S = 5.0


def build(
    registry: CollectorRegistry, legacy: bool, model: str, cache: dict[str, Any], engine_args: str
) -> dict[str, Any]:
    labels = ["model_name", "engine"]
    usage_name = "vllm:gpu_cache_usage_perc" if legacy else "vllm:kv_cache_usage_perc"
    tpot_name = (
        "vllm:time_per_output_token_seconds" if legacy else "vllm:request_time_per_output_token_seconds"
    )
    prefix = "vllm:gpu_prefix_cache" if legacy else "vllm:prefix_cache"
    m: dict[str, Any] = {
        "running": Gauge("vllm:num_requests_running", "running", labels, registry=registry),
        "waiting": Gauge("vllm:num_requests_waiting", "waiting", labels, registry=registry),
        "usage": Gauge(usage_name, "kv usage", labels, registry=registry),
        "tpot": Histogram(tpot_name, "tpot", labels, buckets=TPOT_BUCKETS, registry=registry),
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds", "ttft", labels, buckets=TTFT_BUCKETS, registry=registry
        ),
        "prompt_len": Histogram(
            "vllm:request_prompt_tokens", "p", labels, buckets=LENGTH_BUCKETS, registry=registry
        ),
        "gen_len": Histogram(
            "vllm:request_generation_tokens", "g", labels, buckets=LENGTH_BUCKETS, registry=registry
        ),
        "gen_tokens": Counter("vllm:generation_tokens", "gen", labels, registry=registry),
        "prompt_tokens": Counter("vllm:prompt_tokens", "prompt", labels, registry=registry),
        "preemptions": Counter("vllm:num_preemptions", "preempt", labels, registry=registry),
        "read_bytes": Counter(
            "vllm:estimated_read_bytes_per_gpu", "bytes read per GPU", labels, registry=registry
        ),
        "hits": Counter(f"{prefix}_hits", "hits", labels, registry=registry),
        "queries": Counter(f"{prefix}_queries", "queries", labels, registry=registry),
    }
    if not legacy:
        m["itl"] = Histogram(
            "vllm:inter_token_latency_seconds", "itl", labels, buckets=TPOT_BUCKETS, registry=registry
        )
    m["dram_active"] = Gauge(
        "DCGM_FI_PROF_DRAM_ACTIVE", "DRAM active ratio", ["gpu", "UUID", "Hostname"], registry=registry
    )
    info = Gauge("vllm:cache_config_info", "cache config", [*labels, *cache], registry=registry)
    info.labels(model_name=model, engine="0", **cache).set(1)
    Info("batchknee_test_exporter_args", "engine args", registry=registry).info({"args": engine_args})
    return m


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="test-model")
    args, engine_args = parser.parse_known_args()

    state = {**DEFAULT_STATE, **json.loads(args.state.read_text())}
    fits = state["fitsMaxNumSeqs"]
    wanted = (
        engine_args[engine_args.index("--max-num-seqs") + 1] if "--max-num-seqs" in engine_args[:-1] else None
    )
    if fits is not None and wanted is not None and int(wanted) > int(fits):
        sys.exit(f"ValueError: max_num_seqs {wanted} does not fit in GPU memory (at most {fits})")
    time.sleep(min(float(state["startupSeconds"]), 60.0))
    cache = {
        "block_size": str(state["blockSize"]),
        "num_gpu_blocks": str(state["numGpuBlocks"]),
        "cache_dtype": "auto",
    }
    registry = CollectorRegistry()
    metrics = build(
        registry, bool(state["legacyNames"]), args.served_model_name, cache, " ".join(engine_args)
    )
    label = {"model_name": args.served_model_name, "engine": "0"}
    gpu = {"gpu": "0", "UUID": "GPU-00000000-0000-0000-0000-000000000000", "Hostname": "node-0"}
    for name, metric in metrics.items():  # like vLLM, every series exists from the start (zero counts)
        if name != "dram_active":
            metric.labels(**label)
    for engine in range(1, 1 + int(state["extraEngines"])):
        metrics["running"].labels(model_name=args.served_model_name, engine=str(engine)).set(1)
    stop = threading.Event()
    # a scrape sees each tick's observations whole: a histogram's sum and count from the same
    # requests (a scrape between them shifts a 10-s window's mean by a percent)
    ticking = threading.Lock()

    def tick(current: dict[str, Any], elapsed: float) -> None:
        """The gauges as `current` says, and `elapsed` seconds of its rates."""
        nonlocal owed
        metrics["running"].labels(**label).set(current["running"])
        metrics["waiting"].labels(**label).set(current["waiting"])
        metrics["usage"].labels(**label).set(current["kvUsage"])
        owed += current["requestsPerSecond"] * elapsed
        finished, owed = int(owed), owed - int(owed)
        for _ in range(finished):
            metrics["tpot"].labels(**label).observe(current["tpotSeconds"])
            if "itl" in metrics:
                itl = current["itlSeconds"]
                metrics["itl"].labels(**label).observe(current["tpotSeconds"] if itl is None else itl)
            metrics["ttft"].labels(**label).observe(current["ttftSeconds"])
            metrics["prompt_len"].labels(**label).observe(current["promptTokens"])
            metrics["gen_len"].labels(**label).observe(current["generationTokens"])
            metrics["prompt_tokens"].labels(**label).inc(current["promptTokens"])
            metrics["gen_tokens"].labels(**label).inc(current["generationTokens"])
            metrics["queries"].labels(**label).inc(current["promptTokens"])
            metrics["hits"].labels(**label).inc(current["promptTokens"] * current["prefixHitRatio"])
        metrics["preemptions"].labels(**label).inc(current["preemptionsPerSecond"] * elapsed)
        metrics["read_bytes"].labels(**label).inc(current["readBytesPerSecond"] * elapsed)
        if current["dramActive"] is None:
            metrics["dram_active"].clear()
        else:
            metrics["dram_active"].labels(**gpu).set(current["dramActive"])

    owed = 0.0
    tick(state, 0.0)  # the first scrape already sees the state: no 0 before the first tick

    def advance() -> None:
        last = time.monotonic()
        while not stop.wait(0.1):
            try:
                current = {**DEFAULT_STATE, **json.loads(args.state.read_text())}
            except (OSError, ValueError):
                continue  # mid-write: keep the last good state
            with ticking:
                now = time.monotonic()
                elapsed, last = now - last, now
                tick(current, elapsed)

    ceiling = int(wanted) if wanted is not None else 256
    live = {"cap": ceiling}

    def runtime_config() -> bool:
        """Whether the route is served; a pod the state names as silent answers only after a wait."""
        current = json.loads(args.state.read_text())
        silent = current.get("runtimeConfigSilentPods")
        if silent and os.environ.get("POD_NAME", "").startswith(silent):
            time.sleep(RUNTIME_CONFIG_SILENT_S)
        return bool(current.get("runtimeConfig"))

    class Handler(BaseHTTPRequestHandler):
        def answer(self, status: int, document: dict[str, Any]) -> None:
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PATCH(self) -> None:
            if self.path != "/v1/runtime_config" or not runtime_config():
                self.send_error(404)
                return
            length = int(self.headers.get("Content-Length") or 0)
            value = json.loads(self.rfile.read(length) or b"{}").get("max_num_running_seqs")
            if not isinstance(value, int) or not 1 <= value <= ceiling:
                self.answer(400, {"error": f"max_num_running_seqs must be within 1..{ceiling}"})
                return
            live["cap"] = value
            self.answer(200, {"max_num_running_seqs": value, "max_num_seqs_capacity": ceiling})

        def do_POST(self) -> None:
            self.send_error(404)

        def do_GET(self) -> None:
            if self.path == "/v1/runtime_config" and runtime_config():
                self.answer(200, {"max_num_running_seqs": live["cap"], "max_num_seqs_capacity": ceiling})
                return
            if self.path.startswith("/metrics"):
                # Negotiate like vLLM does (prometheus_client): an OpenMetrics scrape stores
                # `vllm_x`, the plain text format keeps `vllm:x`. The state can force plain text.
                served = json.loads(args.state.read_text())
                with ticking:
                    if served.get("bothSpellings"):
                        body, content_type = generate_latest(registry), CONTENT_TYPE_LATEST
                        body += body.replace(b"vllm:", b"vllm_")
                    elif served.get("forceTextFormat"):
                        body, content_type = generate_latest(registry), CONTENT_TYPE_LATEST
                    else:
                        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                        body = encoder(registry)
            elif self.path == "/health":
                body, content_type = b"ok", "text/plain"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    threading.Thread(target=advance, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stop.set()
        server.server_close()


if __name__ == "__main__":
    main()
