"""The unit tier's guard (conftest.py): no network socket, while asyncio's own unix socketpair works."""

from __future__ import annotations

import asyncio
import socket

import pytest
from pytest_socket import SocketBlockedError


@pytest.mark.filterwarnings("ignore:A test tried to use socket.socket")  # the guard's own note
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["ipv4", "ipv6"])
def test_a_network_socket_is_refused_here(family: socket.AddressFamily) -> None:
    with pytest.raises(SocketBlockedError):
        socket.socket(family, socket.SOCK_STREAM)


def test_an_event_loop_still_runs() -> None:
    assert asyncio.run(asyncio.sleep(0, result="ran")) == "ran"
