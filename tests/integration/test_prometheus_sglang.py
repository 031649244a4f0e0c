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
from pathlib import Path

import pytest

from batchknee.adapters.prometheus import PrometheusObserver, queries, scope_for
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


def test_each_batch_and_pool_counts_once_in_prometheus_own_evaluation(tmp_path: Path) -> None:
    """The queries as Prometheus evaluates them (promtool, the release's engine) over the series
    four SGLang pods write: the defaults at TP 1; the defaults at TP 2 (rank 1 writes only the
    pool, one of the constants every rank writes); TP 2 with --enable-metrics-for-all-schedulers
    and the queue gauges' breakdown by priority beside their totals; two data-parallel attention
    groups of two TP ranks with --enable-metrics-for-all-schedulers, each group its own requests and
    pool. Each pod's requests and pool count once, its usage is the pool's, and the TP ranks behind
    one scrape target are one target."""
    base = {
        "namespace": "prod",
        "llmserving": "sgl",
        "job": "engines",
        "model_name": "m",
        "engine_type": "unified",
    }
    figures = {  # pod → each scheduler's series: (labels, running, waiting, usage, pool); None: not written
        "p1": [({"tp_rank": "0"}, 10, 2, 0.5, 1000)],
        "p4": [({"tp_rank": "0"}, 6, 5, 0.125, 800), ({"tp_rank": "1"}, None, None, None, 800)],
        "p2": [({"tp_rank": rank, "priority": ""}, 8, 1, 0.375, 500) for rank in ("0", "1")],
        "p3": [
            ({"tp_rank": rank, "dp_rank": group}, running, 0, usage, 600)
            for group, running, usage in (("0", 3, 0.25), ("1", 4, 0.75))
            for rank in ((str(2 * int(group)), str(2 * int(group) + 1)))
        ],
    }
    series = []
    for pod, schedulers in figures.items():
        for ranks, running, waiting, usage, pool in schedulers:
            labels = {
                **base,
                "pod": pod,
                "instance": f"{pod}:8000",
                "pp_rank": "0",
                "moe_ep_rank": "0",
                **ranks,
            }
            for name, value in (
                ("num_running_reqs", running),
                ("num_queue_reqs", waiting),
                ("full_token_usage", usage),
                ("max_total_num_tokens", pool),
            ):
                if value is None:
                    continue
                series.append((f"sglang:{name}", labels, value))
                if "priority" in ranks and name in ("num_running_reqs", "num_queue_reqs"):
                    series.append((f"sglang:{name}", {**labels, "priority": "None"}, value))  # the breakdown
    expected = {
        "running": {"p1": 10, "p2": 8, "p3": 7, "p4": 6},
        "waiting": {"p1": 2, "p2": 1, "p3": 0, "p4": 5},
        "usage": {"p1": 0.5, "p2": 0.375, "p3": 0.5, "p4": 0.125},
        "capacity": {"p1": 1000, "p2": 500, "p3": 1200, "p4": 800},
        "scrapes": {"p1": 1, "p2": 1, "p3": 1, "p4": 1},
    }
    found = queries(scope_for(ObservationTarget("prod", "sgl", "SGLang", 60)))

    def selector(name: str, labels: dict[str, str]) -> str:
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    tests = {
        "rule_files": [],
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {"series": selector(n, labels), "values": f"{value}x20"} for n, labels, value in series
                ],
                "promql_expr_test": [
                    {
                        "expr": found[name],
                        "eval_time": "5m",
                        "exp_samples": [
                            {
                                "labels": selector(
                                    "", {"namespace": "prod", "llmserving": "sgl", "pod": pod}
                                ),
                                "value": value,
                            }
                            for pod, value in by_pod.items()
                        ],
                    }
                    for name, by_pod in expected.items()
                ],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(json.dumps(tests))
    checked = subprocess.run(
        ["promtool", "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
