"""The operator's /metrics server on 127.0.0.1: a client that sends half a request and waits holds
no thread past the scrape deadline, and never more than MAX_SCRAPES at once (prometheus_client's own
server held one per connection for ever: 200 half-sent requests, 200 threads)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from contextlib import ExitStack

import pytest

from batchknee import operator_metrics
from batchknee.operator_metrics import MAX_SCRAPES, OperatorMetrics

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serving_threads() -> int:
    """Threads serving a connection (socketserver names them after their target); the other tests
    of the process start and end threads of their own meanwhile."""
    return sum(1 for thread in threading.enumerate() if "process_request_thread" in thread.name)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def test_half_sent_scrapes_hold_a_bounded_number_of_threads_for_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(operator_metrics, "SCRAPE_TIMEOUT_S", 1.0)
    port = free_port()
    server = OperatorMetrics().serve("127.0.0.1", port)
    try:
        assert "batchknee_" in scrape(port)
        with ExitStack() as stack:
            for _ in range(40):
                held = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
                held.sendall(b"GET /metrics HTTP/1.1\r\nX-a: ")  # and never the rest
            time.sleep(0.3)
            assert 0 < serving_threads() <= MAX_SCRAPES
            time.sleep(1.5)  # past the deadline: each served connection was dropped
            assert serving_threads() == 0
            assert "batchknee_" in scrape(port)  # while the 40 are still open on their side
    finally:
        server.shutdown()
        server.server_close()
