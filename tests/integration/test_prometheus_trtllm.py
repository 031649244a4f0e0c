"""TensorRT-LLM through a real Prometheus: the context the adapter reads is the decode-time average.

The engine emulator runs as a trtllm-serve pod would (GUARANTEED_NO_EVICT: each request reserves
its prompt and whole output), serving `/prometheus/metrics`; a real Prometheus scrapes it with the
labels a PodMonitor gives (namespace, pod, llmserving). The KV pool shows the reservation, about 1.54× the
context; the adapter reads the context from the token counters and the reservation together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from batchknee.adapters.prometheus import PrometheusObserver
from batchknee.core.observation import Observation, ObservationTarget
from batchknee.demo.scenario import FULL
from batchknee.devcluster import LocalPrometheus
from batchknee.devcluster.cluster import free_port

pytestmark = pytest.mark.integration

PHASE = FULL.phases[1]  # the demo's 2,048-token phase: 939-token prompts, outputs 1,024–3,072
WINDOW_S = 20
TARGET = ObservationTarget("prod", "trt", "TensorRTLLM", WINDOW_S)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPrometheus]:
    workdir = tmp_path_factory.mktemp("trtllm")
    host = "127.1.3.1"
    port = free_port(host)
    load = workdir / "load.json"
    load.write_text(json.dumps(PHASE.load()))
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchknee.emulator",
            "trtllm",
            "--speedup",
            "20",
            "--seed",
            "1",
            "--load-file",
            str(load),
            "--host",
            host,
            "--port",
            str(port),
            "serve",
            "meta-llama/Meta-Llama-3-8B",
            "--max_batch_size",
            "64",
            "--max_seq_len",
            "8192",
        ]
    )
    file_sd = workdir / "targets.json"
    labels = {
        "namespace": "prod",
        "pod": "trt-7c9f8b6d5-abcde",
        "llmserving": "trt",
        "__metrics_path__": "/prometheus/metrics",
    }
    file_sd.write_text(json.dumps([{"targets": [f"{host}:{port}"], "labels": labels}]))
    try:
        with LocalPrometheus(file_sd, scrape_interval_s=1) as prom:
            observer = PrometheusObserver(prom.url)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if observer.observe([TARGET], datetime.now(UTC))[TARGET.key].avg_context_tokens.available:
                    break
                time.sleep(1)
            time.sleep(WINDOW_S)  # a whole window of steady traffic
            yield prom
    finally:
        engine.terminate()
        engine.wait(30)


def observe(prometheus: LocalPrometheus) -> Observation:
    return PrometheusObserver(prometheus.url).observe([TARGET], datetime.now(UTC))[TARGET.key]


def test_the_context_is_the_decode_time_average_not_the_reservation(prometheus: LocalPrometheus) -> None:
    seen = observe(prometheus)
    assert seen.pods == 1 and seen.running.value is not None and seen.running.value > 32
    context = seen.avg_context_tokens.value
    usage = seen.kv_cache_usage.value
    assert context is not None and usage is not None, seen
    print(f"avg context {context:.0f} tokens (target {PHASE.target_context}), KV usage {usage:.2f}")
    assert context == pytest.approx(PHASE.target_context, rel=0.05)
    recent = seen.recent_avg_context_tokens.value
    assert recent is not None and recent == pytest.approx(PHASE.target_context, rel=0.1)
