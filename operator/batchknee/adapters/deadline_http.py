"""HTTP answers read against a total deadline.

A socket timeout bounds each read, not the answer: a server (or a tenant's pod) that sends a byte
a little faster than the timeout holds the call for hours, in its status line and headers as much
as in its body. Here every read of an answer is given only the time left before the deadline of
the call in progress on this thread (`reads_before`). The connections of `DeadlineAdapter`
(requests), through a proxy of the environment's too, read so; a plain `http.client` connection
does with `response_class = ResponseBefore`. Either way a chunk size of `-1` is refused, and an
answer's head (status line and headers) may take at most MAX_HEAD_BYTES: http.client alone keeps
100 header lines of 64 KiB each, and copies them as it parses (about 40 MiB of memory an answer).
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
from requests.exceptions import InvalidSchema

_calls = threading.local()

MAX_HEAD_BYTES = 64 * 1024  # an answer's status line and headers, read ahead included


class HeadTooLarge(http.client.HTTPException):
    """The answer's status line and headers passed MAX_HEAD_BYTES."""

    def __init__(self) -> None:
        super().__init__(f"the answer's status line and headers passed {MAX_HEAD_BYTES // 1024} KiB")


def head_too_large(error: BaseException) -> bool:
    """Whether `error` is, or wraps (as urllib3 and requests do), a HeadTooLarge."""
    seen: set[int] = set()
    pending: list[object] = [error]
    while pending:
        current = pending.pop()
        if isinstance(current, HeadTooLarge):
            return True
        if isinstance(current, BaseException) and id(current) not in seen:
            seen.add(id(current))
            pending += [*current.args, current.__cause__, current.__context__]
    return False


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
    """A socket's reads, each given only the time left (none: the socket's own timeout), and at
    most `allowance` bytes while it is set. It holds the socket's own file until it closes: a
    connection closes its socket once an answer's head is read, and that file keeps the
    descriptor open for the body."""

    def __init__(self, sock: socket.socket, socket_file: Any, deadline: float | None) -> None:
        super().__init__()
        self.sock, self.socket_file, self.deadline = sock, socket_file, deadline
        self.allowance: int | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the call's deadline passed")
            self.sock.settimeout(remaining)
        if self.allowance is None:
            return self.sock.recv_into(buffer)
        if self.allowance <= 0:
            raise HeadTooLarge()
        read = self.sock.recv_into(memoryview(buffer)[: self.allowance])
        self.allowance -= read
        return read

    def close(self) -> None:
        self.socket_file.close()
        super().close()


class ResponseBefore(http.client.HTTPResponse):
    """An answer read under the deadline of `reads_before` (as it was when the answer began), its
    head within MAX_HEAD_BYTES."""

    def __init__(self, sock: socket.socket, *args: Any, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        self._reads = _ReadsBefore(sock, self.fp, getattr(_calls, "deadline", None))
        self.fp = io.BufferedReader(self._reads)

    def begin(self) -> None:
        self._reads.allowance = MAX_HEAD_BYTES
        try:
            super().begin()
        finally:
            self._reads.allowance = None

    # A chunk size of `-1` parses (int("-1", 16)), and a read of -1 bytes reads to the end of the
    # stream: past every bound on the answer, as fast as the server sends. Both parsers refuse it,
    # http.client's own (read, read1: IncompleteRead) and urllib3's (read_chunked, which reads each
    # chunk with `_safe_read`: ProtocolError).

    def _read_next_chunk_size(self) -> int:
        size: int = super()._read_next_chunk_size()  # type: ignore[misc]
        if size < 0:
            self._close_conn()  # type: ignore[attr-defined]
            raise ValueError(f"a negative chunk size ({size})")
        return size

    def _safe_read(self, amt: int) -> bytes:
        if amt < 0:
            self._close_conn()  # type: ignore[attr-defined]
            raise http.client.IncompleteRead(b"")
        data: bytes = super()._safe_read(amt)  # type: ignore[misc]
        return data


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

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        """The manager of a proxy the environment names (HTTP_PROXY, HTTPS_PROXY; NO_PROXY is
        requests' to apply), with the same connections: urllib3's own would read answers
        without the deadline, through a proxy that trickles them."""
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        if not isinstance(manager, urllib3.ProxyManager):  # SOCKS: PySocks' connections, not ours
            raise InvalidSchema(f"a {proxy.split(':', 1)[0]} proxy cannot read answers under a deadline")
        manager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}
        return manager
