"""Misbehaving Prometheus servers on loopback, as real HTTP servers, for the adapter's tests:

    with FakePrometheus("trickle") as slow:      # 200, then one body byte every 0.2 s (bounded)
    FakePrometheus("trickle-head")                # its status line and headers a byte every 0.2 s too
        slow.url, slow.requests, slow.bytes_sent, slow.disconnected
    FakePrometheus("html-error")                  # 502 with a 5 KB HTML page
    FakePrometheus("empty")                       # a valid empty query result
    FakePrometheus("cookie")                      # the same, setting a new 4 KB cookie each time
    FakePrometheus("redirect", location=URL)      # 307 to URL
    FakePrometheus("busy")                        # 503 with Retry-After: 3600
    FakePrometheus("answer", payload=BYTES)       # 200 with BYTES as the body
    FakePrometheus("answer", answer=FUNCTION)     # 200 with FUNCTION(the query's PromQL) as the body
    FakePrometheus("echo")                        # 400 whose body repeats the request's headers
    FakePrometheus(..., tls=(CERT, KEY))          # over HTTPS with that certificate (url: https://)

Every request is recorded (method, path, headers, body) so a test can see what the client sent.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

Mode = Literal[
    "trickle", "trickle-head", "html-error", "empty", "cookie", "redirect", "busy", "answer", "echo"
]
TRICKLE_LIMIT_S = 30.0  # a trickle ends on its own after this long (bounded in time)
HTML_PAGE = (
    "<!DOCTYPE html>\n<html><head><title>502 Bad Gateway</title>"
    "<style>body { font-family: sans-serif }</style></head>\n<body>\n<h1>Bad Gateway</h1>\n"
    + "<p>upstream internal-prometheus-0.monitoring.svc:9090 failed; trace id 5f2c…</p>\n" * 64
    + "</body></html>\n"
)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class LoopbackServer(ThreadingHTTPServer):
    """A threaded test server with a real server's listen backlog: the standard library's 5 drops
    connections when a refresh's queries arrive together while a loaded machine is slow to run the
    accept loop, and the client's connect then waits out its deadline for the retransmit."""

    request_queue_size = 128
    daemon_threads = True


@dataclass
class FakePrometheus:
    mode: Mode
    host: str = "127.0.0.1"
    location: str = ""
    payload: bytes = b""
    answer: Callable[[str], bytes] | None = None
    tls: tuple[Path, Path] | None = None  # certificate and key files
    requests: list[Request] = field(default_factory=list)
    bytes_sent: int = 0
    disconnected: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fake.requests.append(Request(self.command, self.path, dict(self.headers), body))
                if fake.mode == "html-error":
                    self.reply(502, "text/html", HTML_PAGE.encode())
                elif fake.mode == "redirect":
                    self.send_response(307)
                    self.send_header("Location", fake.location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif fake.mode == "busy":
                    self.send_response(503)
                    self.send_header("Retry-After", "3600")
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"busy")
                elif fake.mode == "echo":  # as a debugging proxy does: what it was sent, credentials first
                    sent = [self.headers.get("Authorization"), *self.headers.values()]
                    self.reply(400, "text/plain", f"bad request: {sent}".encode())
                elif fake.mode == "answer" and fake.answer is not None:
                    query = urllib.parse.parse_qs(body.decode()).get("query", [""])[0]
                    self.reply(200, "application/json", fake.answer(query))
                elif fake.mode == "answer":
                    self.reply(200, "application/json", fake.payload)
                elif fake.mode in ("empty", "cookie"):
                    answer = {"status": "success", "data": {"resultType": "vector", "result": []}}
                    cookie = f"c{len(fake.requests)}={'x' * 4000}; Max-Age=999999; Path=/"
                    extra = {"Set-Cookie": cookie} if fake.mode == "cookie" else {}
                    self.reply(200, "application/json", json.dumps(answer).encode(), extra)
                else:
                    self.trickle()

            do_GET = do_POST = handle_one

            def reply(
                self, status: int, content_type: str, data: bytes, headers: dict[str, str] | None = None
            ) -> None:
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def trickle(self) -> None:
                data = b'{"status":"success","data":{"resultType":"vector","result":[]}}' + b" " * 10_000
                head = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                )
                if fake.mode == "trickle-head":
                    data = head + data
                else:
                    self.wfile.write(head)
                    self.wfile.flush()
                started = time.monotonic()
                for byte in data:
                    if time.monotonic() - started > TRICKLE_LIMIT_S:
                        break
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        fake.disconnected.set()
                        return
                    fake.bytes_sent += 1
                    time.sleep(0.2)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = LoopbackServer((self.host, 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        if self.tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self.tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.url = f"https://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
