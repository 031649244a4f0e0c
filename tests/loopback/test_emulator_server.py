"""`batchknee emulate` served in-process on 127.0.0.1: the metric contract, /health, /load, the
OpenAI endpoint, and the batch limit as a scraper sees it. High speedups, short runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from batchknee.emulator.engine_args import parse_emulator_args
from batchknee.emulator.metrics import EMULATOR_NAMES, TRTLLM_NAMES, vllm_metric_names
from batchknee.emulator.server import EmulatorServer
from batchknee.emulator.stats import TPOT_BUCKETS, TTFT_BUCKETS

pytestmark = pytest.mark.timeout(60)

BASE = [
    "--engine",
    "vllm",
    "--gpu",
    "a100-80gb",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--startup-delay-s",
    "0.05",
]


@contextlib.asynccontextmanager
async def emulator(
    argv: Sequence[str], *, wait_ready: bool = True
) -> AsyncIterator[tuple[EmulatorServer, aiohttp.ClientSession]]:
    settings = parse_emulator_args([*BASE, *argv], environ={})
    server = EmulatorServer(settings, log=io.StringIO(), out=io.StringIO())
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while server.port is None or (wait_ready and not server.ready):
        assert time.monotonic() < deadline, "the emulator did not start"
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            yield server, session
    finally:
        server.settings = dataclasses.replace(settings, drain_grace_s=0.0)
        server.begin_drain()
        await asyncio.wait_for(task, 20)


async def scrape(session: aiohttp.ClientSession, path: str = "/metrics") -> dict[str, Any]:
    async with session.get(path) as response:
        assert response.status == 200
        text = await response.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_vllm_metrics_carry_every_name_type_label_and_bucket() -> None:
    async def check() -> None:
        argv = ["serve", "meta-llama/Meta-Llama-3-8B", "--served-model-name", "llama", "--max-num-seqs", "32",
                "--speedup", "50", "--request-rate", "20", "--prompt-tokens", "300", "--output-tokens", "40",
                "--prefix-sharing", "0.5"]  # fmt: skip
        async with emulator(argv) as (server, session):
            await asyncio.sleep(0.6)
            families = await scrape(session)
        expected = {**vllm_metric_names("current"), **EMULATOR_NAMES}
        for name, kind in expected.items():
            assert name in families, name
            assert families[name].type == kind, name
        for name in vllm_metric_names("current"):
            for sample in families[name].samples:
                if name == "vllm:cache_config_info":
                    assert sample.labels["engine"] == "0"
                    assert sample.labels["num_gpu_blocks"] == str(server.engine.total_blocks)
                    assert sample.labels["block_size"] == "16"
                    assert sample.labels["enable_prefix_caching"] == "True"
                    assert sample.value == 1.0
                    continue
                assert sample.labels["model_name"] == "llama", name
                assert sample.labels["engine"] == "0", name
        assert {s.name for s in families["vllm:prompt_tokens"].samples} == {"vllm:prompt_tokens_total"}

        def bounds(name: str) -> list[float]:
            les = [s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")]
            return [float(le) for le in les if le != "+Inf"]

        assert bounds("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
        for name in ("vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds"):
            assert bounds(name) == list(TPOT_BUCKETS)
        assert bounds("vllm:request_prompt_tokens")[:4] == [1, 2, 5, 10]
        assert bounds("vllm:request_prompt_tokens")[-1] == 5000  # 1-2-5 up to max_model_len 8192

        def value(name: str, suffix: str = "", **labels: str) -> float:
            return sum(
                s.value for s in families[name].samples
                if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
            )  # fmt: skip

        finished = value("vllm:request_success", "_total", finished_reason="stop")
        assert finished > 20
        assert value("vllm:generation_tokens", "_total") >= 40 * finished
        assert value("vllm:prefix_cache_hits", "_total") > 0.4 * value("vllm:prefix_cache_queries", "_total")
        assert value("vllm:request_time_per_output_token_seconds", "_count") == finished
        assert 0 < value("vllm:kv_cache_usage_perc") < 1
        assert value("batchknee_emulator_requests_finished", "_total") == finished

    asyncio.run(check())


@pytest.mark.parametrize("version", ["legacy", "both"])
def test_older_metric_names_for_the_operators_fallbacks(version: str) -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--metric-version", version, "--speedup", "50", "--request-rate", "10"]
        async with emulator(argv) as (_, session):
            await asyncio.sleep(0.3)
            families = await scrape(session)
        names = vllm_metric_names(version)
        vllm_families = {n: f for n, f in families.items() if n.startswith("vllm:")}
        assert set(vllm_families) == set(names)
        for name, kind in names.items():
            assert vllm_families[name].type == kind
        assert "vllm:time_per_output_token_seconds" in vllm_families
        sample = families["vllm:num_requests_running"].samples[0]
        if version == "legacy":
            assert "vllm:kv_cache_usage_perc" not in families
            assert "vllm:inter_token_latency_seconds" not in families
            assert set(sample.labels) == {"model_name"}
        else:
            assert set(sample.labels) == {"model_name", "engine"}

    asyncio.run(check())


def test_openmetrics_negotiation_keeps_type_lines_and_underscores_the_samples() -> None:
    # What Prometheus itself negotiates; prometheus_client then writes `vllm_…` sample names
    # (REFERENCE.md §2): the emulator shows the same drift a real vLLM does.
    async def check() -> None:
        async with emulator(["llama-3-8b"]) as (_, session):
            headers = {"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"}
            async with session.get("/metrics", headers=headers) as response:
                assert response.headers["Content-Type"].startswith("application/openmetrics-text")
                text = await response.text()
        assert "# TYPE vllm:num_requests_running gauge" in text
        assert "\nvllm_num_requests_running{" in text
        names = {family.name for family in parse_openmetrics(text)}
        assert "vllm_num_requests_running" in names or "vllm:num_requests_running" in names

    asyncio.run(check())


def test_trtllm_metrics_and_iteration_stats(tmp_path: Path) -> None:
    options = tmp_path / "extra.yaml"
    options.write_text(
        "max_batch_size: 16\nkv_cache_config:\n  max_tokens: 40960\n  enable_block_reuse: true\n"
    )

    async def check() -> None:
        argv = ["--engine", "trtllm", "serve", "meta-llama/Meta-Llama-3-8B", "--max_batch_size", "64",
                "--extra_llm_api_options", str(options), "--speedup", "50", "--request-rate", "30"]  # fmt: skip
        async with emulator(argv) as (_, session):
            await asyncio.sleep(0.4)
            families = await scrape(session, "/prometheus/metrics")
            async with session.get("/metrics") as response:
                iteration = await response.json()
        for name, kind in TRTLLM_NAMES.items():
            assert families[name].type == kind, name
        for sample in families["trtllm_num_requests_running"].samples:
            assert sample.labels == {"model_name": "meta-llama/Meta-Llama-3-8B", "engine_type": "trtllm"}
        assert families["trtllm_kv_cache_max_blocks"].samples[0].value == 40960 / 32
        assert families["trtllm_kv_cache_tokens_per_block"].samples[0].value == 32
        assert families["trtllm_max_batch_size_static"].samples[0].value == 16
        assert 0 < families["trtllm_num_requests_running"].samples[0].value <= 16
        (stats,) = iteration
        assert stats["kvCacheStats"]["maxNumBlocks"] == 1280 and stats["maxNumActiveRequests"] == 16

    asyncio.run(check())


def test_health_waits_for_the_startup_delay() -> None:
    async def check() -> None:
        async with emulator(["llama-3-8b", "--startup-delay-s", "0.4"], wait_ready=False) as (
            server,
            session,
        ):
            async with session.get("/health") as response:
                assert response.status == 503
            async with session.get("/metrics") as response:
                assert response.status == 503
            for _ in range(100):
                if server.ready:
                    break
                await asyncio.sleep(0.02)
            async with session.get("/health") as response:
                assert response.status == 200

    asyncio.run(check())


def test_load_changes_by_post_and_by_load_file(tmp_path: Path) -> None:
    load_file = tmp_path / "load.json"

    async def check() -> None:
        argv = ["llama-3-8b", "--speedup", "20", "--request-rate", "1", "--load-file", str(load_file)]
        async with emulator(argv) as (server, session):
            async with session.get("/load") as response:
                assert (await response.json())["requestRate"] == 1.0
            async with session.post("/load", json={"request_rate": 7, "outputTokens": 33}) as response:
                body = await response.json()
                assert response.status == 200
                assert (body["requestRate"], body["outputTokens"], body["promptTokens"]) == (7.0, 33, 512)
            async with session.post("/load", json={"requestRate": -2}) as response:
                assert response.status == 400 and "requestRate" in (await response.json())["error"]
            async with session.post("/load", data="not json") as response:
                assert response.status == 400
            load_file.write_text(json.dumps({"requestRate": 3, "promptTokens": 2000}))
            for _ in range(60):
                async with session.get("/load") as response:
                    body = await response.json()
                if body["requestRate"] == 3.0:
                    break
                await asyncio.sleep(0.05)
            # The file is applied over the command line's load, not over the POSTed one.
            assert (body["requestRate"], body["promptTokens"], body["outputTokens"]) == (3.0, 2000, 128)
            assert body["source"].startswith("load file")
            assert server.engine.load is not None and server.engine.load.spec.prompt_tokens == 2000

    asyncio.run(check())


def test_completions_answer_when_the_request_finishes() -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "20"]
        async with emulator(argv) as (server, session):
            started = time.monotonic()
            payload = {"model": "llama", "prompt": "word " * 400, "max_tokens": 100}
            async with session.post("/v1/completions", json=payload) as response:
                body = await response.json()
            wall = time.monotonic() - started
            assert response.status == 200
            assert body["usage"] == {"prompt_tokens": 500, "completion_tokens": 100, "total_tokens": 600}
            assert body["choices"][0]["finish_reason"] == "length"
            e2e = body["batchknee"]["e2eSeconds"]
            assert e2e > 99 * 0.004  # a hundred decode steps of an 8B model
            assert wall >= e2e / 20 * 0.8  # it waited for simulated time to pass
            async with session.post("/v1/completions", json={"model": "other", "prompt": "x"}) as response:
                assert response.status == 404
            async with session.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            ) as response:
                chat = await response.json()
                assert chat["usage"]["completion_tokens"] == 3 and chat["object"] == "chat.completion"
            assert server.engine.stats.finished == 2 and server.engine.stats.received == 2

    asyncio.run(check())


async def _peak_running(session: aiohttp.ClientSession, scrapes: int) -> float:
    peak = 0.0
    for _ in range(scrapes):
        families = await scrape(session)
        peak = max(peak, families["vllm:num_requests_running"].samples[0].value)
        await asyncio.sleep(0.03)
    return peak


def test_running_batch_obeys_max_num_seqs_and_a_restart_changes_it() -> None:
    async def check() -> None:
        overload = [
            "--speedup",
            "20",
            "--request-rate",
            "40",
            "--prompt-tokens",
            "200",
            "--output-tokens",
            "300",
        ]
        async with emulator(["llama-3-8b", "--max-num-seqs", "8", *overload]) as (server, session):
            assert await _peak_running(session, 15) == 8
            assert (await scrape(session))["vllm:num_requests_waiting"].samples[0].value > 0
        # The same pod restarted by a rollout with a new value.
        async with emulator(["llama-3-8b", "--max-num-seqs", "24", *overload]) as (server, session):
            assert await _peak_running(session, 15) == 24
            assert server.engine.config.max_num_seqs == 24

    asyncio.run(check())
