"""HTTP answers read against a total deadline.

A socket timeout bounds each read, not the answer: a server (or a tenant's pod) that sends a byte
a little faster than the timeout holds the call for hours, in its status line and headers as much
as in its body. Here every read of an answer is given only the time left before the deadline of
the call in progress on this thread (`reads_before`). The connections of `DeadlineAdapter`
(requests) read so; a plain `http.client` connection does with `response_class = ResponseBefore`.
"""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from requests.adapters import HTTPAdapter

_calls = threading.local()


@contextmanager
def reads_before(deadline: float) -> Iterator[None]:
    """Answers read on this thread meanwhile end by `deadline` (time.monotonic())."""
    outer = getattr(_calls, "deadline", None)
    _calls.deadline = deadline
    try:
        yield
    finally:
        _calls.deadline = outer


class _ReadsBefore(io.RawIOBase):
    """A socket's reads, each given only the time left. It holds the socket's own file until it
    closes: a connection closes its socket once an answer's head is read, and that file keeps the
    descriptor open for the body."""

    def __init__(self, sock: socket.socket, socket_file: Any, deadline: float) -> None:
        super().__init__()
        self.sock, self.socket_file, self.deadline = sock, socket_file, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the call's deadline passed")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)

    def close(self) -> None:
        self.socket_file.close()
        super().close()


class ResponseBefore(http.client.HTTPResponse):
    """An answer read under the deadline of `reads_before` (as it was when the answer began)."""

    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        deadline = getattr(_calls, "deadline", None)
        if deadline is not None:
            self.fp = io.BufferedReader(_ReadsBefore(sock, self.fp, deadline))


class _Connection(urllib3.connection.HTTPConnection):
    response_class = ResponseBefore


class _TLSConnection(urllib3.connection.HTTPSConnection):
    response_class = ResponseBefore


class _Pool(urllib3.HTTPConnectionPool):
    ConnectionCls = _Connection


class _TLSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _TLSConnection


class DeadlineAdapter(HTTPAdapter):
    """requests' adapter whose connections read answers under `reads_before`'s deadline."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}
