"""The Prometheus adapter's HTTP behaviour against real loopback servers that misbehave:
POST bodies of a fixed size, a total deadline against a trickling server (or proxy), bounded error
text, broken chunking refused, credentials that work but never show."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import sys
import threading
import time
import tracemalloc
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from fake_prometheus import FakePrometheus, LoopbackServer, Mode

from batchknee.adapters.prometheus import (
    ANSWER_BYTES_IN_FLIGHT,
    ANSWER_BYTES_RESERVED,
    EXCERPT_CHARS,
    MAX_ANSWER_VALUES,
    MAX_BODY_BYTES,
    WORDS_NOT_SHOWN,
    AnswerBudget,
    PrometheusObserver,
    queries,
    scope_for,
)
from batchknee.core.observation import Observation, ObservationTarget

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def target(name: str, namespace: str = "prod") -> ObservationTarget:
    return ObservationTarget(namespace, name, "VLLM", 300)


def own_scope(name: str) -> ObservationTarget:
    """A target read in a scope of its own (a selector): an error answer's words are shown to it."""
    return ObservationTarget("prod", name, "VLLM", 300, selector={"app": name})


def any_url_router(**settings: Any) -> Any:
    """The operator's own Prometheus wiring with any URL allowed to specs (its own URL a closed
    loopback port unless `settings` names one)."""
    from batchknee.handlers import prometheus_observer
    from batchknee.settings import OperatorSettings

    return prometheus_observer(
        OperatorSettings(
            **{"prometheus_url": "http://127.0.0.1:9", "prometheus_allowed_urls": ["*"], **settings}
        )
    )


def test_queries_are_posted_and_their_size_does_not_grow_with_the_fleet() -> None:
    with FakePrometheus("empty") as prom:
        one = PrometheusObserver(prom.url)
        one.observe([target("llama")], NOW)
        sent_for_one = list(prom.requests)
        prom.requests.clear()
        many = PrometheusObserver(prom.url)
        fleet = [target(f"{'x' * 59}{i:04d}", f"team-{i % 40}") for i in range(1000)]
        seen = many.observe(fleet, NOW)
        one.close()
        many.close()
    assert len(seen) == 1000
    assert seen[fleet[-1].key].avg_context_tokens.reason == "no VLLM engine metrics in the last 300s"
    assert len(prom.requests) == len(sent_for_one) == len(queries(scope_for(target("llama"))))
    assert sorted(r.body for r in prom.requests) == sorted(r.body for r in sent_for_one)
    for request in prom.requests:
        assert request.method == "POST" and request.path == "/api/v1/query"
        assert request.headers["Content-Type"] == "application/x-www-form-urlencoded"
        form = urllib.parse.parse_qs(request.body.decode())
        assert set(form) == {"query", "time", "partial_response"} and "x" * 59 not in form["query"][0]
        assert form["partial_response"] == ["false"]  # a Thanos querier's partial answer: an error
        assert len(request.body) < 8 * 1024
    assert many.largest_query_bytes == max(len(r.body) for r in prom.requests)


def test_a_tensorrt_llm_without_its_running_series_is_told_which_releases_export_them() -> None:
    """A stable TensorRT-LLM (through 1.2.1) exports request latencies only: the status says that
    much, not merely that the series are missing (which reads as a scrape problem)."""
    with FakePrometheus("empty") as prom:
        observer = PrometheusObserver(prom.url)
        seen = observer.observe([ObservationTarget("prod", "trt", "TensorRTLLM", 300)], NOW)[("prod", "trt")]
        observer.close()
    assert seen.avg_context_tokens.reason == (
        "no TensorRTLLM engine metrics in the last 300s; trtllm-serve exports trtllm_num_requests_running "
        "from the 1.3.0 release candidates on (the default image, 1.3.0rc14, has it); releases through "
        "1.2.1 export request latencies only"
    )


@pytest.mark.parametrize("mode", ["trickle", "trickle-head"])
def test_a_trickling_server_costs_one_deadline_not_one_read_timeout_per_byte(mode: Mode) -> None:
    """Each byte comes well within any read timeout, in the body or already in the status line and
    headers; only a total deadline ends the query (and frees its thread: the connection closes)."""
    with FakePrometheus(mode) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=1.0)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
        assert prom.disconnected.wait(10), "the client kept reading the trickle"
    assert seen.avg_context_tokens.reason == f"Prometheus at {prom.url} did not answer within 1s"
    assert prom.bytes_sent < 100  # of a 10 KB answer: the client gave up long before its end


@pytest.mark.parametrize("spelling", ["port with a leading zero", "escaped path"])
def test_another_spelling_of_the_url_is_read_under_the_deadline_too(spelling: str) -> None:
    """requests picks its adapter by the prepared URL: spelt `:09090` or with `%7E` in its path, the
    URL's prepared form did not start with it, so the default adapter read the answer's head without
    a deadline (eight query threads held per spelling, even after the observer was closed)."""
    with FakePrometheus("trickle-head") as prom:
        url = prom.url.replace(f":{prom.port}", f":0{prom.port}")
        if spelling == "escaped path":
            url = f"{prom.url}/%7Eprom"
        seen = observed_within_its_deadline(url)
        assert prom.disconnected.wait(10), "the client kept reading the trickle"
    assert seen.avg_context_tokens.reason == f"Prometheus at {url} did not answer within 1s"
    assert prom.bytes_sent < 100


def test_cookies_an_answer_sets_are_never_sent_back() -> None:
    """A jar kept every cookie any answer set and sent them all with every later query: 4 KB more
    per answer, without bound, until the heads alone took longer than the deadline."""
    with FakePrometheus("cookie") as prom:
        observer = PrometheusObserver(prom.url)
        for _ in range(2):
            seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert (
        len(prom.requests) > 10
        and seen.avg_context_tokens.reason == "no VLLM engine metrics in the last 300s"
    )
    assert [r.headers.get("Cookie") for r in prom.requests] == [None] * len(prom.requests)


def test_a_redirect_is_not_followed() -> None:
    """An allowed Prometheus URL must not choose where else the operator reads."""
    with (
        FakePrometheus("empty") as inside,
        FakePrometheus("redirect", location=f"{inside.url}/api/v1/query") as allowed,
    ):
        observer = PrometheusObserver(allowed.url)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert seen.avg_context_tokens.reason == (
        f"Prometheus at {allowed.url} answered HTTP 307, a redirect, not followed: give the URL it redirects to"
    )
    assert allowed.requests and not inside.requests


def test_a_retry_after_is_not_slept_on() -> None:
    """A busy gateway's `Retry-After: 3600` must not put the query threads to sleep for an hour:
    the answer is reported, and the next refresh asks again at once."""
    with FakePrometheus("busy") as prom:
        observer = PrometheusObserver(prom.url, timeout_s=1.0)
        for _ in range(2):
            seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
            assert (
                seen.avg_context_tokens.reason
                == f"Prometheus at {prom.url} answered HTTP 503; {WORDS_NOT_SHOWN}"
            )
        observer.close()
    asked = Counter(request.body for request in prom.requests)
    assert asked and max(asked.values()) <= 2  # each query at most once per refresh: none retried


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 100_000,
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":[],"value":[0,"1"]}]}}',
        b'{"status":"success","data":{"resultType":"vector","result":["a"]}}',
    ],
    ids=["deeply-nested", "metric-not-a-map", "series-not-a-map"],
)
def test_an_answer_of_the_wrong_shape_is_no_reading(payload: bytes) -> None:
    with FakePrometheus("answer", payload=payload) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=2.0)
        seen = observer.observe([own_scope("llama")], NOW)[("prod", "llama")]
        shared = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    reason = seen.avg_context_tokens.reason or ""
    assert seen.avg_context_tokens.value is None
    assert reason.startswith(f"Prometheus at {prom.url} answered something that is not a query result: ")
    assert shared.avg_context_tokens.reason == (
        f"Prometheus at {prom.url} answered something that is not a query result; {WORDS_NOT_SHOWN}"
    )


def vector_of(sample: list[Any]) -> bytes:
    """Every query answered with one series of the target's pod, carrying `sample`."""
    labels = {"namespace": "prod", "llmserving": "llama", "pod": "llama-0", "engine": "0"}
    return json.dumps(
        {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": labels, "value": sample}]},
        }
    ).encode()


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        ([NOW.timestamp(), True], 'answered a sample that is not [time, "value"]'),
        ([NOW.timestamp(), 0.02], 'answered a sample that is not [time, "value"]'),
        ([str(NOW.timestamp()), "0.02"], 'answered a sample that is not [time, "value"]'),
        ([NOW.timestamp() - 3600, "0.02"], "answered for -3600s from the time asked: a cache"),
        ([10**400, "0.02"], "answered series of an unexpected shape"),
        ([NOW.timestamp(), "0.02", "x"], "answered series of an unexpected shape"),
    ],
    ids=["json-true", "a-number", "time-as-text", "an-hour-old", "time-past-float", "three-items"],
)
def test_a_sample_not_as_prometheus_writes_it_is_no_reading(sample: list[Any], reason: str) -> None:
    """float() reads JSON's true as 1.0 and 0.02 as 0.02: a proxy's or a fake's answer of that shape
    would become a TPOT of a second or a context of one token. And an answer for another time than
    asked (a cache in between) is the past, not the window the operator asked about."""
    with FakePrometheus("answer", payload=vector_of(sample)) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=2.0)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    for reading in (seen.avg_context_tokens, seen.tpot_p99_s, seen.running):
        assert reading.value is None and (reading.reason or "").startswith(
            f"Prometheus at {prom.url} {reason}"
        )


def test_a_label_value_of_any_length_or_character_is_quoted_as_a_short_excerpt() -> None:
    """A Prometheus answering a 200 KB pod name of escapes had it quoted whole in every reason."""
    pod = "x\n\x1b[31m" + "A" * 200_000
    labels = {"namespace": "prod", "llmserving": "llama", "pod": pod, "engine": "0"}
    result = [{"metric": labels, "value": [NOW.timestamp(), "2"]}]
    payload = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
    with FakePrometheus("answer", payload=payload) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=2.0)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    reason = seen.running.reason or ""
    assert (
        reason.startswith("pod x [31mAAAA") and "…'s engine metrics came through 2 scrape targets" in reason
    )
    assert len(reason) < 400 and reason.isprintable()


# What each query answers in the tests below, by its name in queries(): every figure distinct, so a
# reading taken from another query's answer shows. (capacity: vLLM's cache config, 1,000 blocks of 16.)
FIGURES = {
    "running": 48, "recent_running": 40, "waiting": 3, "usage": 0.5, "recent_usage": 0.625, "samples": 10,
    "scrapes": 1, "capacity": 1, "tpot_p99": 0.03, "tpot_mean": 0.02, "ttft_p99": 0.4, "generation": 2400,
    "preemptions": 0.125, "prefix": 0.25, "prompt_length_mean": 200, "output_length_mean": 300,
    "length_fallback": 350, "read_bytes": 1.5e12,
}  # fmt: skip


def answers_by_query(at: float, of: ObservationTarget) -> Callable[[str], bytes]:
    """Each query of `of`'s refresh answered with its FIGURES value (none: an empty vector)."""
    names = {promql: name for name, promql in queries(scope_for(of)).items()}

    def answer(promql: str) -> bytes:
        name = names[promql]  # (a query not in queries() is a KeyError: the reading would fail)
        labels = {"namespace": of.namespace, "llmserving": of.name, "pod": f"{of.name}-0", "engine": "0"}
        if name == "capacity":
            labels |= {"num_gpu_blocks": "1000", "block_size": "16"}
        result = [{"metric": labels, "value": [at, str(FIGURES[name])]}] if name in FIGURES else []
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()

    return answer


def test_a_sample_as_prometheus_writes_it_is_read() -> None:
    """Answers with the time asked and values as text: each reading is its own query's figure (the
    contrast above); at whole seconds Prometheus writes the time as an integer, and VictoriaMetrics
    answers a query near now for up to its latency offset (30 s by default) earlier."""
    for at in (NOW.timestamp(), int(NOW.timestamp()), NOW.timestamp() - 30):
        with FakePrometheus("answer", answer=answers_by_query(at, target("llama"))) as prom:
            observer = PrometheusObserver(prom.url, timeout_s=2.0, min_samples=1)
            seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
            observer.close()
        assert (seen.running.value, seen.waiting.value, seen.kv_cache_usage.value) == (48, 3, 0.5), at
        assert (seen.tpot_p99_s.value, seen.tpot_mean_s.value, seen.ttft_p99_s.value) == (0.03, 0.02, 0.4)
        assert (seen.generation_tokens_per_s.value, seen.preemptions_per_s.value) == (2400, 0.125)
        assert (seen.prefix_hit_ratio.value, seen.prompt_tokens_mean.value) == (0.25, 200)
        assert seen.avg_context_tokens.value == pytest.approx(0.5 * 1000 * 16 / 48)  # usage × pool / running
        assert seen.recent_avg_context_tokens.value == pytest.approx(0.625 * 1000 * 16 / 40)
        assert (seen.output_tokens_mean.value, seen.read_bytes_per_s_per_gpu.value) == (300, 1.5e12)
        assert seen.pods_served.value == 1
        assert seen.dram_active.value is None and "no DRAM-active fraction" in (seen.dram_active.reason or "")


def test_an_answer_of_many_small_values_is_refused_before_it_is_parsed() -> None:
    """json.loads of `[{},{},...]` takes 25 bytes of memory per byte: 8 MiB of it parsed to 200 MiB
    (under the old 64-MiB limit, one answer took 1.6 GiB: the operator's whole memory, and with it
    every tenant's loop). The values are counted in the raw bytes first: refused unparsed."""

    head = b'{"status":"success","data":{"resultType":"vector","result":['
    body = head + b"{}," * ((MAX_BODY_BYTES - len(head) - 16) // 3) + b"{}]}}"
    assert len(body) <= MAX_BODY_BYTES
    with FakePrometheus("answer", payload=body) as prom:
        seen, peak = observed_with_peak(
            PrometheusObserver(prom.url, timeout_s=10.0, max_concurrent_queries=1)
        )
    reason = seen.avg_context_tokens.reason or ""
    assert reason == (
        f"Prometheus at {prom.url} answered {body.count(b',') + body.count(b'{') + body.count(b'['):,} "
        f"JSON values (at most {MAX_ANSWER_VALUES:,}, about {MAX_ANSWER_VALUES // 11:,} series, are parsed)"
    )
    assert peak < 5 * MAX_BODY_BYTES, peak  # the answer, its read pieces and the server's copy


def test_an_answer_past_the_limit_is_refused_for_its_size_holding_nothing() -> None:
    """Its size is told before its last piece would be taken from the budget: the reason is the
    size (not a full budget), and nothing stays held."""
    budget = AnswerBudget(MAX_BODY_BYTES)
    with FakePrometheus("answer", payload=b" " * (MAX_BODY_BYTES + 100_000)) as prom:
        observer = PrometheusObserver(prom.url, timeout_s=5.0, max_concurrent_queries=1, budget=budget)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert seen.running.reason == f"Prometheus at {prom.url} answered more than 8 MiB"
    assert budget.held == 0


def test_the_urls_specs_chose_share_one_budget_and_the_operators_has_its_own() -> None:
    """Each URL a spec chose holds one answer's worth under one budget they share, and parses in
    its own turn and then their shared one; the operator's own Prometheus has its own budget (its
    query threads' worth) and turn. So a tenant's Prometheus whose answers take the shared turn
    (parsing 400,000 values takes most of a second) has one answer there at a time, its others
    waiting on its own turn (which one is parsed next is the OS's choice: fair in expectation, not
    a strict rotation), and never delays the operator's own reads. A budget past
    its limit refuses the next piece at once (the next evaluation asks again) and keeps nothing."""

    answer = vector_of([NOW.timestamp(), "1"])  # every query: 1 (one scrape target, one sample)
    with (
        FakePrometheus("answer", payload=answer) as own_prom,
        FakePrometheus("answer", payload=answer) as chosen,
    ):
        router = any_url_router(
            prometheus_url=own_prom.url,
            prometheus_timeout_seconds=1,
            prometheus_min_samples=1,
        )
        cache = router.inner._cache  # type: ignore[attr-defined]
        own, first, second = (cache(url).observer for url in (own_prom.url, chosen.url, "http://127.0.0.3:9"))
        assert own.budget.parent is None and own.budget.limit == 8 * MAX_BODY_BYTES  # its 8 threads
        shared = first.budget.parent
        assert (
            shared is not None and shared is second.budget.parent and shared.limit == ANSWER_BYTES_IN_FLIGHT
        )
        assert first.budget.limit == MAX_BODY_BYTES and first.budget is not second.budget
        with shared.turn:  # a tenant's answer being parsed, for longer than a deadline
            mine = own.observe([target("llama")], NOW)[("prod", "llama")]
            theirs = first.observe([target("llama")], NOW)[("prod", "llama")]
        with second.budget.turn:  # another tenant's answers queued on its own turn: not ahead of these
            again = first.observe([target("llama")], NOW)[("prod", "llama")]
        for observer in (own, first, second):
            observer.close()
    assert mine.running.value == 1
    assert (
        theirs.running.value is None
        and theirs.running.reason == f"Prometheus at {chosen.url} did not answer within 1s"
    )
    assert again.running.value == 1

    budget = AnswerBudget(limit=2**20)
    with FakePrometheus("answer", payload=b"[" + b"0," * 2**20 + b"0]") as prom:
        observer = PrometheusObserver(prom.url, timeout_s=5.0, budget=budget)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert seen.avg_context_tokens.reason == (
        f"Prometheus at {prom.url}: the answers being read at once passed 1 MiB; asking again at the "
        "next evaluation"
    )
    # the queries still reading when the first was refused end within their deadline, giving back all
    deadline = time.monotonic() + 6.0
    while budget.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert budget.held == 0


def test_a_small_answer_passes_when_other_tenants_fill_the_shared_budget() -> None:
    """Four tenants' Prometheus servers holding an 8-MiB answer each fill the budget the URLs specs
    chose share; another tenant's honest answer (about 1 KiB) is read from its URL's own first
    bytes and goes through. A large answer of theirs still waits for the shared budget, and
    everything taken is given back."""

    small = vector_of([NOW.timestamp(), "1"])
    large = small + b" " * ANSWER_BYTES_RESERVED  # valid JSON, past the reserve
    with (
        FakePrometheus("answer", payload=small) as honest,
        FakePrometheus("answer", payload=large) as bulky,
    ):
        router = any_url_router(prometheus_timeout_seconds=5, prometheus_min_samples=1)
        cache = router.inner._cache  # type: ignore[attr-defined]
        first, second = (cache(url).observer for url in (honest.url, bulky.url))
        shared = first.budget.parent
        assert shared is not None and first.budget.reserved == ANSWER_BYTES_RESERVED
        assert shared.take(shared.limit) is None  # the hoarders' answers
        try:
            seen = first.observe([target("llama")], NOW)[("prod", "llama")]
            refused = second.observe([target("llama")], NOW)[("prod", "llama")]
        finally:
            shared.give(shared.limit)
            for observer in (first, second):
                observer.close()
    assert seen.running.value == 1
    assert refused.running.reason == (
        f"Prometheus at {bulky.url}: the answers being read at once passed 32 MiB; asking again at the "
        "next evaluation"
    )
    assert (shared.held, first.budget.held, second.budget.held) == (0, 0, 0)


def test_a_refresh_whose_first_query_fails_waits_for_the_others_it_started() -> None:
    """A tenant's server refuses the first query at once and trickles the others: the refresh
    returns once the queries it started have ended (by the deadline), so what the threads refreshing
    bound — the answers being read at once, and their first bytes held outside the shared budget —
    stays bounded by them, however many URL spellings a tenant uses."""

    first_query = queries(scope_for(target("llama")))["running"]
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if urllib.parse.parse_qs(body.decode())["query"][0] == first_query:
                self.send_response(400)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"no")
                return
            self.send_response(200)
            self.send_header("Content-Length", str(MAX_BODY_BYTES - 1))
            self.end_headers()
            self.wfile.write(b" " * ANSWER_BYTES_RESERVED)  # the reserve's worth, then silence
            self.wfile.flush()
            stop.wait(5.0)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = LoopbackServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    router = any_url_router(prometheus_timeout_seconds=1)
    cache: Any = router.inner
    held_after: list[int] = []
    try:
        for spelling in range(3):
            url = f"{base}/tenant{spelling}"
            data = cache.refresh(url, target("llama"), NOW)
            held_after.append(cache._cache(url).observer.budget.held)
    finally:
        stop.set()
        for url in cache.urls():
            cache.drop_url(url)
        server.shutdown()
        server.server_close()
    assert data.error == f"Prometheus at {base}/tenant2 answered HTTP 400; {WORDS_NOT_SHOWN}"
    assert held_after == [0, 0, 0]  # nothing still reading once its refresh returned


def test_a_silent_url_a_spec_chose_is_asked_again_only_after_ten_times_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tenant's Prometheus that never answers costs each refresh the whole deadline, on threads
    every URL specs chose shares: the URL is asked nothing for ten times as long as its last
    refresh took (at most PACED_MAX_S, here 2.5 s), and its last refresh serves meanwhile. The
    operator's own Prometheus, on a thread of its own, is asked again once a reconcile no longer
    reuses its last refresh (three TTLs)."""
    from batchknee.adapters import prometheus

    monkeypatch.setattr(prometheus, "PACED_MAX_S", 2.5)
    ttl_s = 0.3
    with FakePrometheus("trickle-head") as own, FakePrometheus("trickle-head") as chosen:
        router = any_url_router(
            prometheus_url=own.url,
            prometheus_timeout_seconds=1,
            prometheus_cache_seconds=ttl_s,
        )
        cache: Any = router.inner

        def asked(prom: FakePrometheus) -> tuple[int, str | None]:
            reason = cache.observation(prom.url, target("llama"), NOW).running.reason
            return len(prom.requests), reason

        try:
            first = asked(chosen)
            time.sleep(3 * ttl_s + 0.1)
            reused = asked(chosen)
            time.sleep(2.5 - 3 * ttl_s)
            again = asked(chosen)
            own_first = asked(own)
            time.sleep(3 * ttl_s + 0.1)
            own_again = asked(own)
        finally:
            for url in cache.urls():
                cache.drop_url(url)
    assert first[0] > 0 and first[1] == f"Prometheus at {chosen.url} did not answer within 1s"
    assert reused == first  # nothing asked: the last refresh serves
    assert again == (2 * first[0], first[1])  # asked again once the pace allows
    assert own_first[0] > 0 and own_again[0] == 2 * own_first[0]


def test_a_paced_urls_next_refresh_reads_every_window_asked_for_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two LLMServings with different windows read one slow Prometheus a spec chose. While the
    URL is paced the second is told it is read with the next refresh — and it is, whichever object
    asks first then: no window waits behind another's turn."""
    from batchknee.adapters import prometheus

    monkeypatch.setattr(prometheus, "PACED_MAX_S", 1.5)

    def slowly(query: str) -> bytes:
        time.sleep(0.05)
        return vector_of([NOW.timestamp(), "1"])

    first_window, second_window = target("llama"), ObservationTarget("prod", "llama", "VLLM", 301)
    with FakePrometheus("answer", answer=slowly) as chosen:
        router = any_url_router(
            prometheus_timeout_seconds=5,
            prometheus_cache_seconds=0.3,
            prometheus_min_samples=1,
        )
        cache: Any = router.inner

        def second_windows_queries() -> int:
            return sum(b"301s" in request.body for request in chosen.requests)

        try:
            cache.observation(chosen.url, first_window, NOW)
            waiting = cache.observation(chosen.url, second_window, NOW).running
            asked_while_paced = second_windows_queries()
            time.sleep(1.6)
            cache.observation(chosen.url, first_window, NOW)  # the first object asks first again
            read = cache.observation(chosen.url, second_window, NOW).running
        finally:
            for url in cache.urls():
                cache.drop_url(url)
    assert waiting.value is None and waiting.reason == (
        f"Prometheus at {chosen.url} has not been read for this window and selector yet: a URL a spec "
        "chose is read at most a tenth of the time (its answers are slow), and this one is read with "
        "its next refresh"
    )
    assert asked_while_paced == 0 and read.value == 1


def test_a_selector_a_url_never_answers_keeps_no_other_selector_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two LLMServings (two teams) chose one Prometheus URL, each with its own selector; the URL
    never answers the first's queries. However often the first asks first, the second's scope is
    read at the URL's next refresh: the scope read longest ago goes first, and the silent one,
    just tried, goes to the back."""
    from batchknee.adapters import prometheus

    monkeypatch.setattr(prometheus, "PACED_MAX_S", 1.5)

    def silent_for_one_selector(query: str) -> bytes:
        if 'model_name="silent"' in query:
            time.sleep(1.5)  # past the 1-s deadline
        return vector_of([NOW.timestamp(), "1"])

    silent = ObservationTarget("team-a", "llama", "VLLM", 300, selector={"model_name": "silent"})
    answered = ObservationTarget("team-b", "llama", "VLLM", 300, selector={"model_name": "fine"})
    with FakePrometheus("answer", answer=silent_for_one_selector) as chosen:
        router = any_url_router(
            prometheus_timeout_seconds=1, prometheus_cache_seconds=0.3, prometheus_min_samples=1
        )
        cache: Any = router.inner
        try:
            first = cache.observation(chosen.url, silent, NOW).running
            waiting = cache.observation(chosen.url, answered, NOW).running
            time.sleep(1.6)
            again = cache.observation(chosen.url, silent, NOW).running  # the silent one asks first again
            read = cache.observation(chosen.url, answered, NOW).running
        finally:
            for url in cache.urls():
                cache.drop_url(url)
    assert first.value is None and first.reason == f"Prometheus at {chosen.url} did not answer within 1s"
    assert waiting.value is None and "has not been read" in str(waiting.reason)
    assert again.value is None and again.reason == first.reason
    assert read.value == 1


def test_recreating_the_objects_that_chose_a_slow_url_does_not_end_its_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last object choosing a silent URL is deleted (its cache and session go) and created
    again at once: the URL is still paced — asked nothing, the new object told it is read with the
    next refresh — and is asked again once the pace ends."""
    from batchknee.adapters import prometheus

    monkeypatch.setattr(prometheus, "PACED_MAX_S", 2.0)
    with FakePrometheus("trickle-head") as chosen:
        router = any_url_router(prometheus_timeout_seconds=1)
        cache: Any = router.inner

        def recreate_and_read() -> tuple[int, str | None]:
            router.forget("prod", "llama")
            router.route("prod", "llama", chosen.url)
            return len(chosen.requests), cache.observation(chosen.url, target("llama"), NOW).running.reason

        try:
            router.route("prod", "llama", chosen.url)
            cache.observation(chosen.url, target("llama"), NOW)
            asked_first = len(chosen.requests)
            recreated = recreate_and_read()
            time.sleep(2.1)
            after_pace = recreate_and_read()
        finally:
            router.forget("prod", "llama")
    assert asked_first > 0 and cache.urls() == []
    assert recreated[0] == asked_first and "has not been read" in str(recreated[1])
    assert after_pace == (asked_first, f"Prometheus at {chosen.url} did not answer within 1s")
    assert len(chosen.requests) == 2 * asked_first


def test_an_error_page_becomes_a_status_code_and_a_short_excerpt(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with FakePrometheus("html-error") as prom:
        url = f"http://reader:s3cr3t-token@127.0.0.1:{prom.port}/"
        observer = PrometheusObserver(url)
        seen = observer.observe([own_scope("llama")], NOW)[("prod", "llama")]
        observer.close()
    reason = seen.avg_context_tokens.reason
    prefix = f"Prometheus at http://127.0.0.1:{prom.port} answered HTTP 502: "
    assert reason.startswith(prefix)
    assert reason[len(prefix) :].startswith("502 Bad Gateway Bad Gateway upstream")
    assert len(reason) <= len(prefix) + EXCERPT_CHARS
    assert "\n" not in reason and "<" not in reason
    # The credentials were used, and appear nowhere else.
    expected = "Basic " + base64.b64encode(b"reader:s3cr3t-token").decode()
    assert {r.headers.get("Authorization") for r in prom.requests} == {expected}
    assert "s3cr3t" not in reason and "reader" not in reason
    assert "s3cr3t" not in caplog.text


def test_one_refresh_serves_every_object_of_a_scope_and_a_new_one_triggers_none() -> None:
    from batchknee.adapters.prometheus import CachedObserver

    with FakePrometheus("empty") as prom:
        cache = CachedObserver(lambda url: PrometheusObserver(url), ttl_s=3600)
        per_refresh = len(queries(scope_for(target("a"))))
        cache.observation(prom.url, target("a"), NOW)
        assert len(prom.requests) == per_refresh
        for name in ("b", "c", "a-new-one"):
            cache.observation(prom.url, target(name), NOW)
        assert len(prom.requests) == per_refresh
        other_window = ObservationTarget("prod", "d", "VLLM", 60)
        cache.observation(prom.url, other_window, NOW)  # another scope: its own refresh only
        assert len(prom.requests) == 2 * per_refresh
        cache.drop_url(prom.url)
        assert cache.urls() == []


def test_a_slow_url_holds_no_thread_of_another_url() -> None:
    """Threads observing through a trickling Prometheus never make a thread observing through
    another URL wait; and while the slow refresh runs, a second thread of that URL does not wait
    either when an older refresh exists."""
    import threading

    from batchknee.adapters.prometheus import CachedObserver

    with FakePrometheus("trickle") as slow, FakePrometheus("empty") as fast:
        cache = CachedObserver(lambda url: PrometheusObserver(url, timeout_s=3), ttl_s=0.5)
        cache.observation(slow.url, target("a"), NOW)  # a first (timed-out) refresh exists
        done = threading.Event()
        stuck = threading.Thread(target=lambda: (cache.observation(slow.url, target("a"), NOW), done.set()))
        threading.Event().wait(1.6)  # the first refresh is too old to serve a reconcile now
        stuck.start()
        for _ in range(500):  # until the slow refresh is in flight (at most 5 s)
            if cache._cache(slow.url).refreshing.locked():
                break
            threading.Event().wait(0.01)
        assert cache._cache(slow.url).refreshing.locked()
        fast_seen = cache.observation(fast.url, target("b"), NOW)
        assert fast_seen.avg_context_tokens.reason == "no VLLM engine metrics in the last 300s"
        meanwhile = cache.observation(slow.url, target("c"), NOW)  # served by the older refresh
        assert not done.is_set()
        assert meanwhile.avg_context_tokens.reason == f"Prometheus at {slow.url} did not answer within 3s"
        stuck.join(10)
        assert done.is_set()
        for url in cache.urls():
            cache.drop_url(url)


def test_silent_urls_specs_chose_never_hold_the_operators_own_prometheus() -> None:
    """Tenants' URLs that never answer fill every refresh thread of chosen URLs; the objects of the
    operator's own Prometheus are observed meanwhile (sharing asyncio's default pool, of as many
    threads, they waited out the silent ones' deadlines)."""
    import asyncio
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from batchknee.adapters.observing import CHOSEN_REFRESH_THREADS, RoutedObserver
    from batchknee.adapters.prometheus import CachedObserver

    with contextlib.ExitStack() as stack:
        silent = [stack.enter_context(FakePrometheus("trickle")) for _ in range(CHOSEN_REFRESH_THREADS)]
        own = stack.enter_context(FakePrometheus("empty"))
        cache = CachedObserver(lambda url: PrometheusObserver(url, timeout_s=3), ttl_s=60)
        router = RoutedObserver(cache, own.url, [prom.url for prom in silent])
        for i, prom in enumerate(silent):
            router.route("tenant", f"t{i}", prom.url)

        async def meanwhile() -> None:
            # the default pool as large as the chosen URLs' (its size is the machine's otherwise)
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(CHOSEN_REFRESH_THREADS))
            now = datetime.now(UTC)
            waiting = [
                asyncio.create_task(router.prepare(target(f"t{i}", "tenant"), now))
                for i in range(len(silent))
            ]
            while not all(prom.requests for prom in silent):  # every silent refresh in flight
                await asyncio.sleep(0.05)
            await router.prepare(target("llama"), now)
            assert not any(task.done() for task in waiting)
            assert (
                router.observation(target("llama"), now).running.reason
                == "no VLLM engine metrics in the last 300s"
            )
            await asyncio.gather(*waiting)

        asyncio.run(meanwhile())
        for url in cache.urls():
            cache.drop_url(url)


@contextmanager
def serving(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A server on loopback (its URL) that reads each POST and lets `answer` write the reply."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with contextlib.suppress(OSError):  # the client gave up: what the tests want
                answer(self)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = LoopbackServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def answering_a_negative_chunk() -> AbstractContextManager[str]:
    """A server on loopback (its URL) answering chunked with a chunk size of `-1`, then sending as
    fast as it can: 64 MiB at most, for 5 s at most, until the client closes."""
    piece = b" " * 65536

    def negative_chunk(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n"
        )
        stop = time.monotonic() + 5.0
        for _ in range(1024):
            if time.monotonic() > stop:
                break
            handler.wfile.write(piece)

    return serving(negative_chunk)


def observed_with_peak(observer: PrometheusObserver) -> tuple[Observation, int]:
    """One observation of `llama` and the most memory traced while it was taken (the observer is
    closed after)."""
    tracemalloc.start()
    try:
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        observer.close()
    return seen, peak


def test_a_negative_chunk_size_is_refused_before_the_rest_is_read() -> None:
    """`-1` parses as a chunk size, and reading a chunk of -1 bytes reads to the end of the stream:
    the answer is refused as broken at once, not read as a body until its size is refused."""
    with answering_a_negative_chunk() as url:
        seen, peak = observed_with_peak(PrometheusObserver(url, timeout_s=5.0, max_concurrent_queries=1))
    assert seen.avg_context_tokens.reason == f"Prometheus at {url} unreachable: ProtocolError"
    assert peak < 2**20, peak  # of the 8 MiB a body may be: nothing past the chunk size was kept


def test_a_negative_chunk_size_is_refused_by_urllib3s_chunk_reader_too() -> None:
    """A body read whole (requests' `.content`, `iter_content`) goes through urllib3's own chunk
    parser, which reads each chunk with the answer's `_safe_read`: a read of -1 bytes is refused."""
    import requests

    from batchknee.adapters.deadline_http import DeadlineAdapter, reads_before

    with answering_a_negative_chunk() as url, requests.Session() as session:
        session.mount(url, DeadlineAdapter())
        tracemalloc.start()
        try:
            with (
                reads_before(time.monotonic() + 5.0),
                pytest.raises(requests.exceptions.ChunkedEncodingError),
            ):
                session.post(url, data=b"query=up", timeout=5.0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 2**20, peak


BEHIND_PROXY = "http://prometheus.invalid:9090"  # its name is resolved by the proxy, never here


def proxied_by(monkeypatch: pytest.MonkeyPatch, proxy_url: str, no_proxy: str = "") -> None:
    """The operator's environment (the chart's operator.extraEnv) names `proxy_url` as its HTTP
    proxy, and `no_proxy` as the hosts read without it."""
    for name in list(os.environ):
        if name.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    if no_proxy:
        monkeypatch.setenv("NO_PROXY", no_proxy)


def query_threads_reading_an_answer() -> list[str]:
    frames = sys._current_frames()
    reading = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.name.startswith("prometheus-query") else None
        while frame is not None and frame.f_code.co_name != "getresponse":
            frame = frame.f_back
        if frame is not None:
            reading.append(thread.name)
    return reading


def observed_within_its_deadline(url: str) -> Observation:
    """One observation through `url` with a deadline of 1 s, and every query thread done reading
    soon after it (a thread still reading the answer's head is one the deadline did not reach)."""
    observer = PrometheusObserver(url, timeout_s=1.0)
    started = time.monotonic()
    seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
    for _ in range(50):  # until no query thread reads an answer any more (5 s at most)
        reading = query_threads_reading_an_answer()
        if not reading:
            break
        time.sleep(0.1)
    stopped_s = time.monotonic() - started
    observer.close()
    assert not reading and stopped_s < 2.5, (reading, stopped_s)
    return seen


def test_a_proxy_from_the_environment_is_used_and_read_under_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An admin's HTTP_PROXY is honoured, and its answers are read under the query's deadline as a
    Prometheus's are: a proxy trickling its headers held every query thread past it (urllib3's own
    connections, 16 s later still reading them), until no query could start at all."""
    with FakePrometheus("trickle-head") as proxy:
        proxied_by(monkeypatch, proxy.url)
        seen = observed_within_its_deadline(BEHIND_PROXY)
        assert proxy.disconnected.wait(10), "the client kept reading the proxy's trickle"
    assert proxy.requests and {r.path for r in proxy.requests} == {f"{BEHIND_PROXY}/api/v1/query"}
    assert seen.avg_context_tokens.reason == f"Prometheus at {BEHIND_PROXY} did not answer within 1s"
    assert proxy.bytes_sent < 100


def test_a_host_the_environment_exempts_from_its_proxy_is_read_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakePrometheus("empty") as prom, FakePrometheus("empty") as proxy:
        proxied_by(monkeypatch, proxy.url, no_proxy="127.0.0.1")
        observer = PrometheusObserver(prom.url, timeout_s=2.0)
        seen = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert seen.avg_context_tokens.reason == "no VLLM engine metrics in the last 300s"
    assert prom.requests and not proxy.requests


# --- the operator's Prometheus behind a bearer token and a private CA ---------------------------------


def test_the_operators_bearer_token_goes_to_its_own_prometheus_only_and_a_rotated_one_is_used(
    tmp_path: Path,
) -> None:
    """OpenShift's Thanos querier, a kube-rbac-proxy: the operator's Prometheus wants a bearer
    token (its ServiceAccount's, which the kubelet rotates in place). A URL an LLMServing chose
    never gets it, even one the admin allowed."""
    from batchknee.devcluster.pki import ClusterPKI
    from batchknee.handlers import prometheus_observer
    from batchknee.settings import OperatorSettings

    pki = ClusterPKI(tmp_path / "pki")
    serving = pki.serving("prometheus", ("localhost",), ("127.0.0.1",))
    token_file = tmp_path / "token"
    token_file.write_text("first-token-0123\n")
    with (
        FakePrometheus("empty", tls=(serving.cert, serving.key)) as own_prom,
        FakePrometheus("empty") as chosen,  # a plain-http URL the admin allowed a tenant
    ):
        router = prometheus_observer(
            OperatorSettings(
                prometheus_url=own_prom.url,
                prometheus_allowed_urls=[chosen.url],
                prometheus_bearer_token_file=str(token_file),
                prometheus_ca_file=str(pki.ca.cert),
            )
        )
        cache = router.inner._cache  # type: ignore[attr-defined]
        own, theirs = cache(own_prom.url).observer, cache(chosen.url).observer
        own.observe([target("llama")], NOW)
        theirs.observe([target("llama")], NOW)
        token_file.write_text("second-token-4567\n")  # rotated in place
        own.observe([target("llama")], NOW)
        own.close()
        theirs.close()
    sent = [r.headers.get("Authorization") for r in own_prom.requests]
    per_refresh = len(queries(scope_for(target("llama"))))
    assert sent == ["Bearer first-token-0123"] * per_refresh + ["Bearer second-token-4567"] * per_refresh
    # neither the token nor the operator's CA goes with a URL an LLMServing chose
    assert chosen.requests and all("Authorization" not in r.headers for r in chosen.requests)
    assert theirs.verify is True and own.verify == str(pki.ca.cert)


def test_a_bearer_token_an_answer_echoes_is_masked_and_an_unreadable_one_sends_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-bearer-token")
    with FakePrometheus("echo") as prom:
        observer = PrometheusObserver(prom.url, bearer_token_file=str(token_file))
        echoed = observer.observe([own_scope("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert echoed.running.reason.startswith(f"Prometheus at {prom.url} answered HTTP 400: bad request:")
    assert prom.requests and "s3cr3t" not in echoed.running.reason and "s3cr3t" not in caplog.text

    token_file.unlink()
    with FakePrometheus("empty") as prom:
        observer = PrometheusObserver(prom.url, bearer_token_file=str(token_file))
        unreadable = observer.observe([target("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert unreadable.running.reason == (
        f"Prometheus at {prom.url}: its bearer token file cannot be read (FileNotFoundError)"
    )
    assert prom.requests == []  # not asked without its token
    assert str(tmp_path) not in unreadable.running.reason  # the operator's own path, not for status


def test_the_operators_headers_go_to_its_own_prometheus_only_and_an_echo_shows_none() -> None:
    """Mimir and Cortex answer only with a tenant (`X-Scope-OrgID`), a gateway only with its API key:
    the operator's headers go with every query to its own Prometheus, never to a URL a tenant chose;
    and an answer that echoes the request shows none of their values."""
    from batchknee.handlers import prometheus_observer
    from batchknee.settings import OperatorSettings

    headers = {"X-Scope-OrgID": "team-a|team-b", "X-Api-Key": "k3y-0123456789"}
    with FakePrometheus("empty") as own_prom, FakePrometheus("echo") as chosen:
        router = prometheus_observer(
            OperatorSettings(
                prometheus_url=own_prom.url,
                prometheus_allowed_urls=[chosen.url],
                prometheus_headers=json.dumps(headers),
            )
        )
        cache = router.inner._cache  # type: ignore[attr-defined]
        own, theirs = cache(own_prom.url).observer, cache(chosen.url).observer
        own.observe([target("llama")], NOW)
        theirs.observe([target("llama")], NOW)
        own.close()
        theirs.close()
    per_refresh = len(queries(scope_for(target("llama"))))
    assert len(own_prom.requests) == per_refresh
    assert all({k: r.headers.get(k) for k in headers} == headers for r in own_prom.requests)
    assert all(
        r.headers.get("Content-Type") == "application/x-www-form-urlencoded" for r in own_prom.requests
    )
    assert chosen.requests and all(k not in r.headers for r in chosen.requests for k in headers)

    with FakePrometheus("echo") as prom:
        observer = PrometheusObserver(prom.url, headers={"X-Api-Key": "k3y-0123456789", "X-Scope-OrgID": "a"})
        echoed = observer.observe([own_scope("llama")], NOW)[("prod", "llama")]
        observer.close()
    assert echoed.running.reason.startswith(f"Prometheus at {prom.url} answered HTTP 400: bad request:")
    assert "k3y-0123456789" not in echoed.running.reason and "***" in echoed.running.reason
    # a one-letter tenant is no secret: masking it would mask every "a" of the error
    assert "bad request" in echoed.running.reason


def test_an_https_prometheus_is_read_with_the_ca_given_and_refused_without_it(tmp_path: Path) -> None:
    from batchknee.devcluster.pki import ClusterPKI

    pki = ClusterPKI(tmp_path / "pki")
    serving = pki.serving("prometheus", ("localhost",), ("127.0.0.1",))
    answer = vector_of([NOW.timestamp(), "1"])
    with FakePrometheus("answer", payload=answer, tls=(serving.cert, serving.key)) as prom:
        trusting = PrometheusObserver(prom.url, ca_file=str(pki.ca.cert), min_samples=1)
        verified = trusting.observe([target("llama")], NOW)[("prod", "llama")]
        served = len(prom.requests)
        stranger = PrometheusObserver(prom.url, min_samples=1)  # the system's CAs only
        refused = stranger.observe([target("llama")], NOW)[("prod", "llama")]
        trusting.close()
        stranger.close()
    assert prom.url.startswith("https://") and verified.running.value == 1
    assert served == len(queries(scope_for(target("llama"))))
    assert refused.running.value is None
    assert refused.running.reason.startswith(f"Prometheus at {prom.url} unreachable: SSLError")
    assert len(prom.requests) == served  # nothing was sent over the connection that did not verify


# 98 header lines of 65,000 bytes: each within http.client's limits, about 40 MiB held to parse.
HUGE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-Padding-%d: %s\r\n" % (line, b"a" * 65_000) for line in range(98))
    + b"Content-Length: 2\r\n\r\n"
)


def test_a_huge_head_is_refused_after_its_bound() -> None:
    """A Prometheus a spec chose answers every query with 6 MiB of headers: each answer is refused
    at 64 KiB of status line and headers, the refresh says so, and no answer's head is held whole."""

    def huge_head(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(HUGE_HEAD)
        handler.wfile.write(b"{}")

    with serving(huge_head) as url:
        router = any_url_router(prometheus_timeout_seconds=2)
        cache: Any = router.inner
        tracemalloc.start()
        try:
            running = cache.observation(url, target("llama"), NOW).running
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            for each in cache.urls():
                cache.drop_url(each)
    assert running.value is None
    assert running.reason == f"Prometheus at {url}: its answer's status line and headers passed 64 KiB"
    assert peak < 4 * 2**20, peak  # eight queries at once, each refused at 64 KiB and a read ahead
