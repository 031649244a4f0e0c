"""SGLang through a real Prometheus: the adapter reads the emulator's SGLang `/metrics` as it would a
real SGLang pod's, and a prompt prefix the requests share counts once in the context it reports.

The emulator runs as `python -m sglang.launch_server …` would, with a closed loop of 64 requests
whose 2,000-token prompts share their first 60 % (a system prompt). SGLang's radix tree holds that
prefix once in the KV pool, so the context per running sequence the knee needs is the unique part
plus the prefix spread over the batch — not the 2,000+ tokens each request attends to. Each test runs
against SGLang's defaults and again with the switches that write the same figures more than once.
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
from batchknee.devcluster import LocalPrometheus
from batchknee.devcluster.cluster import free_port

pytestmark = pytest.mark.integration

WINDOW_S = 20
TARGET = ObservationTarget("prod", "sgl", "SGLang", WINDOW_S)
CONCURRENCY, PROMPT, OUTPUT, SHARED, SPEEDUP = 64, 2000, 128, 0.6, 20


# SGLang's defaults, and the switches that add series beside the ones the queries sum: every TP
# rank's scheduler writing the same batch, and the queue gauges' breakdown by priority beside their
# total (read naively: 2 ranks × (total + breakdown) = four times the running requests).
SWITCHES = {
    "defaults": [],
    "all-ranks-by-priority": [
        "--tp-size", "2", "--enable-metrics-for-all-schedulers", "--enable-priority-scheduling",
    ],
}  # fmt: skip


@pytest.fixture(scope="module", params=list(SWITCHES))
def prometheus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPrometheus]:
    workdir = tmp_path_factory.mktemp("sglang")
    host = "127.1.4.1"
    port = free_port(host)
    engine = subprocess.Popen(
        [sys.executable, "-m", "batchknee.emulator", "sglang", "--speedup", str(SPEEDUP), "--seed", "1",
         "--concurrency", str(CONCURRENCY), "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT),
         "--prefix-sharing", str(SHARED), "--startup-delay-s", "0", "--host", host, "--port", str(port),
         "-m", "sglang.launch_server", "--model-path", "meta-llama/Meta-Llama-3-8B",
         "--max-running-requests", "128", "--enable-metrics", *SWITCHES[request.param]]
    )  # fmt: skip
    file_sd = workdir / "targets.json"
    labels = {"namespace": "prod", "pod": "sgl-7c9f8b6d5-abcde", "llmserving": "sgl"}
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


def test_the_shared_radix_prefix_counts_once_in_the_context(prometheus: LocalPrometheus) -> None:
    seen = observe(prometheus)
    running = seen.running.value
    assert seen.pods == 1 and running is not None and CONCURRENCY / 2 < running <= CONCURRENCY, seen
    context = seen.avg_context_tokens.value
    assert context is not None, seen
    shared = SHARED * PROMPT
    unique = PROMPT - shared + OUTPUT / 2 + shared / running
    print(f"avg context {context:.0f} tokens (unique {unique:.0f}, attended {PROMPT + OUTPUT / 2:.0f})")
    assert context == pytest.approx(unique, rel=0.15)


def test_every_sglang_reading_is_there(prometheus: LocalPrometheus) -> None:
    seen = observe(prometheus)
    # cached_tokens / prompt_tokens: the shared 60 % of each prompt is a radix hit
    assert seen.prefix_hit_ratio.value == pytest.approx(SHARED, abs=0.05), seen.prefix_hit_ratio
    assert seen.preemptions_per_s.value == 0  # retractions: none, the pool has room for the batch
    assert seen.waiting.value is not None and seen.kv_cache_usage.value is not None
    tpot_mean, tpot_p99, ttft = seen.tpot_mean_s.value, seen.tpot_p99_s.value, seen.ttft_p99_s.value
    assert tpot_mean is not None and tpot_p99 is not None and ttft is not None, seen
    assert 0 < tpot_mean <= tpot_p99
    rate = seen.generation_tokens_per_s.value
    # the counters run on the wall clock, the latencies on the simulated one (--speedup 20)
    assert rate is not None and rate == pytest.approx(SPEEDUP * CONCURRENCY / tpot_mean, rel=0.3)
