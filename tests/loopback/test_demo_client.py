"""The demo's external client against a real emulator process on 127.0.0.1: it streams through
whatever endpoints it is given, records TTFT/TPOT in simulated seconds, and reports errors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_emulator_streaming import emulator_process

from batchknee.demo.client import STALL_BACKLOG_S, ExternalClient

pytestmark = pytest.mark.timeout(90)


def test_the_client_streams_through_its_endpoints_and_reports(tmp_path: Path) -> None:
    argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "10", "--startup-delay-s", "0.1"]
    with emulator_process(argv) as url:
        endpoints = [("pod-a", url), ("pod-gone", "http://127.0.0.1:9")]  # port 9: nothing listens
        client = ExternalClient(lambda: endpoints, model="llama", speedup=10.0, concurrency=2, max_tokens=32)
        client.set_phase("short", 200)
        client.start()
        deadline = time.monotonic() + 30
        while sum(1 for r in client.records if r.pod == "pod-a") < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        client.stop()
    served = [r for r in client.records if r.pod == "pod-a"]
    refused = [r for r in client.records if r.pod == "pod-gone"]
    assert len(served) >= 4 and refused
    assert all(r.error is None and r.tokens == 32 for r in served)
    assert all(r.ttft_s is not None and r.tpot_s is not None and r.tpot_s > 0 for r in served)
    assert all(r.error and "Connection" in r.error for r in refused)
    client.write_report(tmp_path / "client.json")
    report = json.loads((tmp_path / "client.json").read_text())
    assert report["requests"] == len(client.records)
    assert report["errors"] == len(refused) == report["byPhase"]["short"]["errors"]


def test_the_client_follows_endpoint_changes_and_lets_a_leaving_pods_requests_finish(tmp_path: Path) -> None:
    """Round robin over the endpoints it reads; when one leaves, no new request goes there, and
    the requests it held finish there (flagged as drained) without error."""
    argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "2", "--startup-delay-s", "0.1"]
    with emulator_process(argv) as url:
        endpoints = [("pod-a", url), ("pod-b", url)]  # two names, one engine: only routing differs
        client = ExternalClient(
            lambda: list(endpoints), model="llama", speedup=2.0, concurrency=4, max_tokens=64
        )
        client.set_phase("short", 200)
        client.start()
        deadline = time.monotonic() + 30
        while not any(r.pod == "pod-a" for r in client.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        endpoints = [("pod-b", url)]
        while len(client.endpoint_sets) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        while sum(1 for r in client.records if r.pod == "pod-b") < 12 and time.monotonic() < deadline:
            time.sleep(0.1)
        client.stop()
    assert [pods for _at, pods in client.endpoint_sets] == [["pod-a", "pod-b"], ["pod-b"]]
    left_at = client.endpoint_sets[1][0]
    assert client.records and all(r.error is None for r in client.records)
    assert not [r for r in client.records if r.pod == "pod-a" and r.started_at > left_at]
    drained = [r for r in client.records if r.drained]
    assert drained and all(r.pod == "pod-a" and r.tokens == 64 for r in drained)
    client.write_report(tmp_path / "client.json")
    report = json.loads((tmp_path / "client.json").read_text())
    assert report["finishedOnDrainingPods"] == len(drained)
    assert [s["pods"] for s in report["endpointSets"]] == [["pod-a", "pod-b"], ["pod-b"]]
    assert report["itlP50Ms"] is not None and report["ttftP50Ms"] is not None


def loop_holder(seconds: float) -> tuple[Callable[[], None], dict[str, float]]:
    """A callback that holds the loop it runs on for `seconds`, and when it did (wall clock)."""
    held: dict[str, float] = {}

    def hold_the_loop() -> None:
        held["from"] = time.time()
        time.sleep(seconds)
        held["until"] = time.time()

    return hold_the_loop, held


def test_the_client_follows_endpoints_while_its_streams_hold_its_event_loop() -> None:
    """In a busy run the streams' event loop wakes seconds late; routing must not wait for it
    (a pod's preStop sleep covers only so long). Here the loop is held for 3 s: the endpoints
    changed meanwhile are seen while it is still held."""
    argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "10", "--startup-delay-s", "0.1"]
    hold_the_loop, held = loop_holder(3.0)

    with emulator_process(argv) as url:
        endpoints = [("pod-a", url), ("pod-b", url)]
        client = ExternalClient(
            lambda: list(endpoints), model="llama", speedup=10.0, concurrency=2, max_tokens=16
        )
        client.set_phase("short", 200)
        client.start()
        deadline = time.monotonic() + 30
        while (client.loop is None or not client.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.loop is not None
        client.loop.call_soon_threadsafe(hold_the_loop)
        while "from" not in held and time.monotonic() < deadline:
            time.sleep(0.01)
        endpoints = [("pod-b", url)]
        while "until" not in held and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop()
    assert [pods for _at, pods in client.endpoint_sets] == [["pod-a", "pod-b"], ["pod-b"]]
    assert held["from"] < client.endpoint_sets[1][0] < held["until"]


def test_the_client_marks_the_requests_it_read_across_a_stall_of_its_own_loop(tmp_path: Path) -> None:
    """Tokens that arrive while the client's loop is held are read in one burst when it resumes: a
    request whose first or last token was among them has a TPOT that measures the client. The client
    sees its own loop wake late and marks those requests; the report's ITL leaves them out."""
    argv = ["llama-3-8b", "--served-model-name", "llama", "--speedup", "10", "--startup-delay-s", "0.1"]
    hold_the_loop, held = loop_holder(0.3)

    with emulator_process(argv) as url:
        client = ExternalClient(
            lambda: [("pod-a", url)], model="llama", speedup=10.0, concurrency=2, max_tokens=64
        )
        client.set_phase("short", 200)
        client.start()
        deadline = time.monotonic() + 30
        while (client.loop is None or len(client.records) < 4) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.loop is not None
        client.loop.call_soon_threadsafe(hold_the_loop)
        while "until" not in held and time.monotonic() < deadline:
            time.sleep(0.05)
        started = len(client.records)
        while len(client.records) < started + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop()
    client.write_report(tmp_path / "client.json")
    assert any(since <= held["from"] + 0.01 and until >= held["until"] for since, until in client.stalls)

    def read_in_the_hold(at: float | None) -> bool:
        return at is not None and held["from"] <= at <= held["until"] + STALL_BACKLOG_S

    delayed = [
        r for r in client.records if read_in_the_hold(r.first_token_at) or read_in_the_hold(r.last_token_at)
    ]
    assert delayed and all(r.stalled and r.stall_s >= 0.25 for r in delayed)
    before = [r for r in client.records if r.last_token_at and r.last_token_at < held["from"]]
    assert any(not r.stalled for r in before)
    report = json.loads((tmp_path / "client.json").read_text())
    assert report["stalledRequests"] == sum(1 for r in client.records if r.stalled) >= len(delayed)
    assert report["longestStallSeconds"] >= 0.25
