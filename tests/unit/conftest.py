"""The unit tier is pure: a test here that opens a network socket fails.

Tests of servers, clients and namespaces on loopback belong in tests/loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import urllib3  # noqa: F401  (imported before the guard: it probes for IPv6 with a socket on import)
from pytest_socket import disable_socket, enable_socket


@pytest.fixture(autouse=True)
def no_network() -> Iterator[None]:
    disable_socket(allow_unix_socket=True)  # asyncio's event loop wakes itself through a unix socketpair
    yield
    enable_socket()
