"""The Live runtime client against a real loopback pod that stops answering: a pod that did not
answer in time is not called again for a backoff (30 s, doubling while it stays silent), so a
tenant's wedged engines cost the shared Live workers one deadline per backoff, not one per
evaluation; a quick refusal is not held against a pod, and a quick answer does not undo the count
a slow call earned (only 5 minutes without a slow call do). A pod runs
its tenant's code, so it also answers with redirects, trickled bytes, huge bodies and broken
chunking here: a call follows no redirect, ends at its deadline and reads a bounded answer."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchknee.adapters.engine_runtime import (
    MAX_SILENT_BACKOFF_S,
    SILENT_BACKOFF_S,
    HttpEngineRuntime,
)
from batchknee.ports import LiveCap, LiveCapError

TIMEOUT_S = 0.3


class Pod(ThreadingHTTPServer):
    """A pod's /v1/runtime_config that answers, or hangs until released (wedged)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.wedged = False
        self.delay_s = 0.0  # before an answer
        self.patch_delay_s = 0.0  # before an answer to a PATCH
        self.answer: Callable[[Handler], None] | None = None  # a hostile pod's own answer
        self.calls = 0
        self.patched: list[bytes] = []
        self.released = threading.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Pod

    def do_PATCH(self) -> None:
        self.server.calls += 1
        self.server.patched.append(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.patch_delay_s)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self.server.calls += 1
        if self.server.answer is not None:
            self.server.answer(self)
            return
        if self.server.wedged:
            self.server.released.wait(10 * TIMEOUT_S)
            return
        time.sleep(self.server.delay_s)
        body = json.dumps({"max_num_running_seqs": 48, "max_num_seqs_capacity": 256}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serving() -> Iterator[Pod]:
    server = Pod()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


pod = pytest.fixture(serving)
other_pod = pytest.fixture(serving)


class Clock:
    """Monotonic time that a test can move ahead (the backoff), real in between (the deadline)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def timed_failure(runtime: HttpEngineRuntime, address: str) -> tuple[float, str]:
    started = time.monotonic()
    with pytest.raises(LiveCapError) as error:
        runtime.read_cap(address)
    return time.monotonic() - started, str(error.value)


def failure_with_peak(runtime: HttpEngineRuntime, address: str) -> tuple[float, str, int]:
    """timed_failure, and the most memory Python held meanwhile (tracemalloc's peak)."""
    tracemalloc.start()
    try:
        took, message = timed_failure(runtime, address)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return took, message, peak


def test_a_silent_pod_is_not_called_again_until_its_backoff_ends(pod: Pod) -> None:
    clock = Clock()
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S, clock=clock)
    pod.wedged = True
    took, _ = timed_failure(runtime, pod.address)
    assert took >= TIMEOUT_S and pod.calls == 1

    took, message = timed_failure(runtime, pod.address)  # within the backoff: no call at all
    assert took < TIMEOUT_S / 3 and pod.calls == 1
    assert message == f"did not answer within {TIMEOUT_S:g} s: not called again for 30 s"
    with pytest.raises(LiveCapError, match="not called again"):
        runtime.set_cap(pod.address, "runtime-config", 32)
    assert pod.calls == 1

    clock.ahead += SILENT_BACKOFF_S  # the backoff ends: one probe, silent again, twice as long
    took, _ = timed_failure(runtime, pod.address)
    assert took >= TIMEOUT_S and pod.calls == 2
    clock.ahead += SILENT_BACKOFF_S
    assert "2 times running): not called again for 60 s" in timed_failure(runtime, pod.address)[1]
    assert pod.calls == 2

    pod.wedged = False  # it answers again once the longer backoff ends: the backoff is over
    clock.ahead += SILENT_BACKOFF_S
    assert runtime.read_cap(pod.address) == LiveCap("runtime-config", 48, 256)
    assert runtime.read_cap(pod.address) == LiveCap("runtime-config", 48, 256)
    assert pod.calls == 4


def test_a_pod_answering_in_time_but_slowly_is_backed_off_too(pod: Pod) -> None:
    """An answer at 0.6 of the deadline, every time, cost a Live worker that long at every call of
    every evaluation: it is held against the pod like a silence (its answer still counts), and a
    quick answer after the backoff ends it."""
    clock = Clock()
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S, clock=clock)
    pod.delay_s = 0.6 * TIMEOUT_S
    assert runtime.read_cap(pod.address) == LiveCap("runtime-config", 48, 256)
    took, message = timed_failure(runtime, pod.address)
    assert took < TIMEOUT_S / 3 and pod.calls == 1
    assert message == f"took half its {TIMEOUT_S:g}-s deadline or more to answer: not called again for 30 s"
    pod.delay_s = 0.0
    clock.ahead += SILENT_BACKOFF_S
    assert runtime.read_cap(pod.address) == LiveCap("runtime-config", 48, 256)
    assert runtime.read_cap(pod.address) == LiveCap("runtime-config", 48, 256)
    assert pod.calls == 3


def test_the_backoff_doubles_up_to_five_minutes(pod: Pod) -> None:
    clock = Clock()
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S, clock=clock)
    pod.wedged = True
    backoffs = []
    for _ in range(6):
        timed_failure(runtime, pod.address)
        message = timed_failure(runtime, pod.address)[1]
        backoffs.append(int(message.rsplit("for ", 1)[1].removesuffix(" s")))
        clock.ahead += MAX_SILENT_BACKOFF_S
    assert backoffs == [30, 60, 120, 240, 300, 300]
    assert pod.calls == 6  # one probe per backoff


def test_a_quick_refusal_is_not_held_against_the_pod() -> None:
    closed = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    address = f"127.0.0.1:{closed.server_address[1]}"
    closed.server_close()  # nothing listens: refused at once
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S)
    for _ in range(2):
        took, message = timed_failure(runtime, address)
        assert message == "GET /v1/runtime_config: ConnectionRefusedError"  # called, and refused, each time
        assert took < TIMEOUT_S


def redirect_to(target: str, method_keeping: int) -> Callable[[Handler], None]:
    def answer(handler: Handler) -> None:
        body = b"moved; see the internal page"
        handler.send_response(method_keeping)
        handler.send_header("Location", f"http://{target}/v1/runtime_config")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def test_a_quick_answer_does_not_undo_the_backoff_a_slow_call_earned(pod: Pod) -> None:
    """A pod quick to read its cap and slow to set it (a cap it claims differs from the decided one,
    so a set is due at every evaluation): before, the quick read wiped the count the slow set had
    earned, so the backoff never doubled and the pod cost a whole deadline every evaluation."""
    clock = Clock()
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S, clock=clock)
    pod.patch_delay_s = 3 * TIMEOUT_S
    waits = []
    for _ in range(4):  # four evaluations, 31 s apart
        try:
            runtime.read_cap(pod.address)
            runtime.set_cap(pod.address, "runtime-config", 32)
        except LiveCapError as error:
            waits.append(str(error).rsplit("for ", 1)[1] if "not called again" in str(error) else "slow")
        clock.ahead += SILENT_BACKOFF_S + 1
    assert waits == ["slow", "slow", "60 s", "slow"]  # 30 s, then 60 s: the read within it is refused
    assert len(pod.patched) == 3
    clock.ahead += MAX_SILENT_BACKOFF_S + 4 * SILENT_BACKOFF_S  # not slow for the longest backoff
    pod.patch_delay_s = 0.0
    runtime.set_cap(pod.address, "runtime-config", 32)
    pod.patch_delay_s = 3 * TIMEOUT_S
    with pytest.raises(LiveCapError):
        runtime.set_cap(pod.address, "runtime-config", 32)
    assert "not called again for 30 s" in timed_failure(runtime, pod.address)[1]  # counted anew


def test_a_slow_redirect_is_backed_off_like_any_slow_answer(pod: Pod, other_pod: Pod) -> None:
    """A redirect sent just before the deadline was refused before its time was counted: every call
    cost most of a deadline, never backed off."""
    clock = Clock()
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S, clock=clock)
    redirect = redirect_to(other_pod.address, 302)

    def slow_redirect(handler: Handler) -> None:
        time.sleep(0.6 * TIMEOUT_S)
        redirect(handler)

    pod.answer = slow_redirect
    with pytest.raises(LiveCapError, match="a redirect, not followed"):
        runtime.read_cap(pod.address)
    took, message = timed_failure(runtime, pod.address)
    assert took < TIMEOUT_S / 3 and pod.calls == 1 and other_pod.calls == 0
    assert message == f"took half its {TIMEOUT_S:g}-s deadline or more to answer: not called again for 30 s"


@pytest.mark.parametrize("code", [302, 307, 308])
def test_a_redirect_is_an_error_and_never_followed(pod: Pod, other_pod: Pod, code: int) -> None:
    pod.answer = redirect_to(other_pod.address, code)
    runtime = HttpEngineRuntime(timeout_s=TIMEOUT_S)
    with pytest.raises(LiveCapError) as error:
        runtime.read_cap(pod.address)
    assert str(error.value) == f"GET /v1/runtime_config answered {code}: a redirect, not followed"
    assert pod.calls == 1 and other_pod.calls == 0  # the other pod was never called


def trickle(head: bytes, body: bytes) -> Callable[[Handler], None]:
    """Every byte of the answer a twentieth of the deadline after the one before."""

    def answer(handler: Handler) -> None:
        try:
            for byte in head + body:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(TIMEOUT_S / 20)
        except OSError:  # the client gave up: what the test wants
            pass

    return answer


BODY = json.dumps({"max_num_running_seqs": 48, "max_num_seqs_capacity": 256}).encode()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)


@pytest.mark.parametrize(("head", "body"), [(HEAD, BODY), (HEAD + BODY[:1], BODY[1:])], ids=["head", "body"])
def test_a_trickling_pod_costs_one_deadline_not_one_read_timeout_per_byte(
    pod: Pod, head: bytes, body: bytes
) -> None:
    pod.answer = trickle(head, body)
    # every byte comes in time for a per-read timeout; the whole answer takes 5 deadlines and more
    assert len(head + body) * TIMEOUT_S / 20 > 5 * TIMEOUT_S
    took, message = timed_failure(HttpEngineRuntime(timeout_s=TIMEOUT_S), pod.address)
    assert took < 2 * TIMEOUT_S
    assert message == "GET /v1/runtime_config: no answer within the deadline (TimeoutError)"


def test_a_huge_answer_is_refused_after_its_bound(pod: Pod) -> None:
    def huge(handler: Handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(50 * 2**20))
        handler.end_headers()
        try:
            for _ in range(50 * 16):
                handler.wfile.write(b"x" * 65536)
        except OSError:
            pass

    pod.answer = huge
    took, message = timed_failure(HttpEngineRuntime(timeout_s=TIMEOUT_S), pod.address)
    assert message == "GET /v1/runtime_config: answered more than 64 KiB"
    assert took < TIMEOUT_S


@pytest.mark.parametrize(
    ("ceiling", "read"), [(256, 256), (True, None), (0, None), (-1, None), ("256", None)]
)
def test_a_startup_limit_is_read_only_as_a_count(pod: Pod, ceiling: object, read: int | None) -> None:
    """`true` is an int to Python: read as a ceiling of 1, every cap above it went unset."""

    def answering(handler: Handler) -> None:
        body = json.dumps({"max_num_running_seqs": 48, "max_num_seqs_capacity": ceiling}).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    pod.answer = answering
    assert HttpEngineRuntime(timeout_s=TIMEOUT_S).read_cap(pod.address) == LiveCap("runtime-config", 48, read)


def test_a_cap_is_patched_as_json(pod: Pod) -> None:
    HttpEngineRuntime(timeout_s=TIMEOUT_S).set_cap(pod.address, "runtime-config", 32)
    assert [json.loads(body) for body in pod.patched] == [{"max_num_running_seqs": 32}]


def test_an_answer_nested_past_the_interpreters_limit_is_not_json(pod: Pod) -> None:
    """60 KiB of `[` parse to nothing the recursion limit allows: the call fails with what the pod
    answered, like any answer that is not JSON, rather than a RecursionError out of the reconcile."""

    def nested(handler: Handler) -> None:
        body = b"[" * 60_000 + b"]" * 1_000
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    pod.answer = nested
    _, message = timed_failure(HttpEngineRuntime(timeout_s=TIMEOUT_S), pod.address)
    assert message.startswith("GET /v1/runtime_config answered 200: [[["), message
    assert len(message) < 1024, message


def test_a_negative_chunk_size_is_refused_before_the_rest_is_read(pod: Pod) -> None:
    """`-1` parses as a chunk size, and a read of -1 bytes reads to the end of the stream: the pod
    would have the operator hold all it sends (167 MiB in under 2 s) however small the bound."""
    piece = b"x" * 65536

    def negative_chunk(handler: Handler) -> None:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n")
        stop = time.monotonic() + 5.0
        try:
            for _ in range(1024):  # 64 MiB at most, 5 s at most
                if time.monotonic() > stop:
                    break
                handler.wfile.write(piece)
        except OSError:  # the client gave up: what the test wants
            pass

    pod.answer = negative_chunk
    _, message, peak = failure_with_peak(HttpEngineRuntime(timeout_s=TIMEOUT_S), pod.address)
    assert message == "GET /v1/runtime_config: IncompleteRead"
    assert peak < 2**20, peak  # what the pod sent after its head was never buffered


# 98 header lines of 65,000 bytes: each within http.client's line limit, together within its 100
# lines; read whole, it keeps them and copies them as it parses (about 40 MiB an answer).
HUGE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-Padding-%d: %s\r\n" % (line, b"a" * 65_000) for line in range(98))
    + b"Content-Length: %d\r\n\r\n" % len(BODY)
)


def test_a_huge_head_is_refused_after_its_bound(pod: Pod) -> None:
    """A pod's status line and headers may take 64 KiB: many pods answering 6 MiB heads at once
    would have the operator hold hundreds of MiB (its chart's limit is 512 MiB)."""

    def huge_head(handler: Handler) -> None:
        try:
            handler.wfile.write(HUGE_HEAD)
            handler.wfile.write(BODY)
        except OSError:  # the client gave up: what the test wants
            pass

    pod.answer = huge_head
    took, message, peak = failure_with_peak(HttpEngineRuntime(timeout_s=2.0), pod.address)
    assert message == "GET /v1/runtime_config: the answer's status line and headers passed 64 KiB"
    assert peak < 2**20, peak
    assert took < 2.0  # refused at the bound, not at the deadline
