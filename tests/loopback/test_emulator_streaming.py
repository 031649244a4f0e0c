"""Streaming (`stream: true`) from `batchknee emulate`: the OpenAI chunk shapes, and the real `openai`
client's own timings against the histograms the emulator exports. Everything on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_emulator_server import emulator

pytestmark = pytest.mark.timeout(120)


def _events(body: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    events = [block for block in body.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in events), body[:500]
    return [block[len("data: ") :] for block in events]


def test_completions_stream_one_chunk_per_token_then_usage_and_done() -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "20"]
        async with emulator(argv) as (server, session):
            payload = {
                "model": "llama",
                "prompt": [1] * 50,  # token ids: exactly 50 prompt tokens
                "max_tokens": 12,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with session.post("/v1/completions", json=payload) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                events = _events(await response.text())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            *tokens, usage = chunks
            assert len(tokens) == 12
            assert {c["object"] for c in chunks} == {"text_completion"}
            assert len({c["id"] for c in chunks}) == 1
            assert "".join(c["choices"][0]["text"] for c in tokens) == " ".join(["lorem"] * 12)
            assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
            assert usage["choices"] == []
            assert usage["usage"] == {"prompt_tokens": 50, "completion_tokens": 12, "total_tokens": 62}
            assert server.engine.stats.finished == 1
            assert not server._streams

    asyncio.run(check())


def test_chat_stream_carries_the_role_first_and_no_usage_unless_asked() -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "20"]
        async with emulator(argv) as (_, session):
            payload = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5, "stream": True}
            async with session.post("/v1/chat/completions", json=payload) as response:
                assert response.status == 200
                events = _events(await response.text())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert len(chunks) == 5
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
            assert all("usage" not in c for c in chunks)
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert deltas[0] == {"role": "assistant", "content": "lorem"}
            assert all("role" not in d for d in deltas[1:])
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            bad = {"prompt": "x", "stream_options": {"include_usage": True}}
            async with session.post("/v1/completions", json=bad) as response:
                assert response.status == 400
                assert "stream_options" in (await response.json())["error"]["message"]
            async with session.post("/v1/completions", json={"prompt": "x", "stream": "yes"}) as response:
                assert response.status == 400

    asyncio.run(check())


def test_a_drain_that_runs_out_ends_the_stream_with_an_error_event() -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--speedup", "1", "--drain-grace-s", "0.3"]
        async with emulator(argv) as (server, session):
            payload = {"prompt": "hello", "max_tokens": 2000, "stream": True}
            async with session.post("/v1/completions", json=payload) as response:
                assert response.status == 200
                first = await response.content.readuntil(b"\n\n")
                assert json.loads(first[len(b"data: ") :])["choices"][0]["text"] == "lorem"
                server.begin_drain()
                events = _events(first.decode() + (await response.read()).decode())
            assert events[-1] == "[DONE]"
            assert "error" in json.loads(events[-2])
            assert 1 <= len(events) - 2 < 2000
            assert server.engine.stats.dropped == 1

    asyncio.run(check())


# --- the real openai client against a separate emulator process -----------------------------------

SPEEDUP = 2.0
STREAMS = 4
ROUNDS = 4
OUTPUT_TOKENS = 96


@contextlib.contextmanager
def emulator_process(argv: list[str]) -> Iterator[str]:
    """`batchknee emulate` as its own process on a free loopback port; yields its base URL."""
    cmd = [sys.executable, "-m", "batchknee", "emulate", "--host", "127.0.0.1", "--port", "0", *argv]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # bounded: the log names the port, then says ready
            line = proc.stderr.readline()
            assert line, f"the emulator exited with {proc.wait()}"
            if "listening on " in line:
                url = line.rsplit("listening on ", 1)[1].strip()
            if line.rstrip().endswith("ready") and url:
                break
        assert url is not None
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _stream_once(client: openai.AsyncOpenAI, prompt: str) -> tuple[float, list[float]]:
    """One streamed completion: the client's TTFT and inter-token gaps, wall seconds."""
    start = time.perf_counter()
    arrivals = []
    stream = await client.completions.create(
        model="llama", prompt=prompt, max_tokens=OUTPUT_TOKENS, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
    assert len(arrivals) == OUTPUT_TOKENS
    return arrivals[0] - start, [b - a for a, b in itertools.pairwise(arrivals)]


def _histogram(
    before: dict[str, Any], after: dict[str, Any], name: str
) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, cumulative buckets) of a histogram's growth between two scrapes."""

    def read(families: dict[str, Any]) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for s in families[name].samples}

    old, new = read(before), read(after)
    grown = {key: value - old.get(key, 0.0) for key, value in new.items()}
    buckets = sorted(
        (float(le), value) for (sample, le), value in grown.items() if sample.endswith("_bucket")
    )
    return grown[(name + "_sum", "")], grown[(name + "_count", "")], buckets


def _quantile_bucket(buckets: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """The (lower, upper] bucket bounds the histogram's q-quantile falls in."""
    count = buckets[-1][1]
    lower = 0.0
    for upper, cumulative in buckets:
        if cumulative >= q * count:
            return lower, upper
        lower = upper
    raise AssertionError("empty histogram")


def test_the_openai_client_sees_the_latencies_the_histograms_report() -> None:
    """A client's TTFT and inter-token gaps, times the speedup, agree with the emulator's own
    vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds. The tolerance allows for
    HTTP and event-loop overhead on the wall clock (scaled up by the speedup) and, for the median
    TPOT, the histogram's bucket resolution."""
    argv = ["llama-3-8b", "--served-model-name", "llama", "--gpu", "a100-80gb", "--speedup", str(SPEEDUP),
            "--max-num-seqs", "64", "--startup-delay-s", "0.1"]  # fmt: skip
    with emulator_process(argv) as url:
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def scrape() -> dict[str, Any]:
            with no_proxy.open(f"{url}/metrics", timeout=10) as response:
                text = response.read().decode()
            return {f.name: f for f in text_string_to_metric_families(text)}

        async def drive() -> tuple[dict[str, Any], list[tuple[float, list[float]]]]:
            http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=60)  # loopback, never a proxy
            async with openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0
            ) as client:
                prompt = "tok " * 2000
                # A warm-up round opens the connections (and the client's lazy imports): its TTFT
                # is the client's start-up, not the server's.
                await asyncio.gather(*(_stream_once(client, prompt) for _ in range(STREAMS)))
                before = await asyncio.to_thread(scrape)
                results = []
                for _ in range(ROUNDS):
                    results += await asyncio.gather(*(_stream_once(client, prompt) for _ in range(STREAMS)))
                return before, results

        before, results = asyncio.run(drive())
        after = scrape()

    ttft_sum, ttft_count, _ = _histogram(before, after, "vllm:time_to_first_token_seconds")
    itl_sum, itl_count, itl_buckets = _histogram(before, after, "vllm:inter_token_latency_seconds")
    assert ttft_count == STREAMS * ROUNDS
    assert itl_count == STREAMS * ROUNDS * (OUTPUT_TOKENS - 1)

    client_ttft = statistics.fmean(ttft for ttft, _ in results) * SPEEDUP
    gaps = [gap * SPEEDUP for _, request_gaps in results for gap in request_gaps]
    client_itl = statistics.fmean(gaps)
    server_ttft, server_itl = ttft_sum / ttft_count, itl_sum / itl_count
    # Up to 100 ms of wall-clock overhead per request (HTTP, the client parsing its other streams, a
    # busy machine), in simulated seconds.
    overhead = 0.100 * SPEEDUP
    print(
        f"TTFT mean: client {client_ttft * 1e3:.1f} ms, histogram {server_ttft * 1e3:.1f} ms; "
        f"ITL mean: client {client_itl * 1e3:.2f} ms, histogram {server_itl * 1e3:.2f} ms (simulated)"
    )
    assert server_ttft - 0.001 <= client_ttft <= server_ttft * 1.1 + overhead
    # Gaps sum to last-minus-first token times: their mean is immune to bursts, not to a late first
    # or last token.
    assert client_itl == pytest.approx(server_itl, rel=0.1, abs=2 * overhead / (OUTPUT_TOKENS - 1))
    # Single gaps carry the client's own scheduling jitter (one event loop reads every stream, on a
    # shared machine, so tokens arrive in bursts): their quantiles are printed, not asserted. A
    # request's TPOT (decode time / (tokens − 1)) is immune to bursts: its median must fall in the
    # median bucket of the emulator's per-request histogram.
    tpots = [statistics.fmean(request_gaps) * SPEEDUP for _, request_gaps in results]
    _, _, tpot_buckets = _histogram(before, after, "vllm:request_time_per_output_token_seconds")
    lower, upper = _quantile_bucket(tpot_buckets, 0.5)
    assert lower * 0.9 <= statistics.median(tpots) <= upper * 1.1
    lower, upper = _quantile_bucket(itl_buckets, 0.9)
    p50, p90 = statistics.median(gaps), statistics.quantiles(gaps, n=10)[-1]
    print(
        f"ITL p50 {p50 * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms (client); "
        f"histogram p90 in ({lower * 1e3:g}, {upper * 1e3:g}] ms"
    )


def test_finished_streams_count_as_finished_requests() -> None:
    async def check() -> None:
        argv = ["llama-3-8b", "--speedup", "50", "--max-num-seqs", "8"]
        async with emulator(argv) as (server, session):

            async def one() -> int:
                payload = {"prompt": "hello world", "max_tokens": 20, "stream": True}
                async with session.post("/v1/completions", json=payload) as response:
                    return len(_events(await response.text())) - 1

            counts = await asyncio.gather(*(one() for _ in range(30)))
            assert counts == [20] * 30
            assert server.engine.stats.finished == 30
            assert not server._streams

    asyncio.run(check())
