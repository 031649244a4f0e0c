"""The allocator adapter gives freed memory back (glibc only; elsewhere it does nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchknee.adapters import allocator

OPERATOR_SOURCE = Path(__file__).resolve().parents[2] / "operator"

pytestmark = pytest.mark.skipif(allocator._LIBC is None, reason="not glibc")

FREED_IN_A_THREAD = textwrap.dedent(
    """
    import sys, threading
    from batchknee.adapters import allocator

    def rss_mib():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    kept = []
    def parse_a_burst():  # like a refresh: 150 MB of bodies, a hundredth kept
        bodies = [bytes(1500) + str(i).encode() for i in range(100_000)]
        kept.extend(bodies[::100])

    thread = threading.Thread(target=parse_a_burst)
    thread.start()
    thread.join()
    before = rss_mib()
    allocator.trim()
    print(before, rss_mib())
    """
)


def test_a_trim_hands_back_what_a_thread_freed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FREED_IN_A_THREAD],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(OPERATOR_SOURCE)},
    )
    before, after = map(float, done.stdout.split())
    assert before > 100  # the freed burst still counted
    assert after < before / 3


def test_a_users_malloc_arena_max_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert allocator.limit_arenas(2) is False


TLS_STREAMS = textwrap.dedent(
    """
    import asyncio, ssl, sys, tempfile
    from pathlib import Path
    from batchknee.adapters import allocator
    from batchknee.devcluster.pki import ClusterPKI

    STREAMS, SENT = 24, 2 * 1024 * 1024  # like kopf's watches: long-lived, much read through each

    def rss_kib():
        with open("/proc/self/status") as status:
            return int(next(l for l in status if l.startswith("VmRSS")).split()[1])

    async def main():
        if sys.argv[1] == "limited":
            assert allocator.limit_tls_read_buffer(64 * 1024)
        pki = ClusterPKI(Path(tempfile.mkdtemp()))
        pair = pki.serving("server", ("localhost",), ("127.0.0.1",))
        served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        served.load_cert_chain(pair.cert, pair.key)
        client = ssl.create_default_context(cafile=str(pki.ca.cert))

        held = []

        async def send(reader, writer):
            writer.write(bytes(SENT))
            await writer.drain()
            held.append(writer)  # open until the end

        server = await asyncio.start_server(send, "127.0.0.1", 0, ssl=served)
        port = server.sockets[0].getsockname()[1]
        before = rss_kib()
        streams = []
        for _ in range(STREAMS):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            await reader.readexactly(SENT)
            streams.append(writer)
        print(rss_kib() - before)
        for writer in streams + held:
            writer.close()
        server.close()

    asyncio.run(main())
    """
)


def test_tls_streams_hold_a_smaller_read_buffer_each() -> None:
    def grown_kib(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", TLS_STREAMS, mode],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(OPERATOR_SOURCE), "MALLOC_ARENA_MAX": "2"},
            timeout=120,
        )
        return int(done.stdout.split()[-1])

    plain, limited = grown_kib("plain"), grown_kib("limited")
    # each of the 24 client streams (and its server end) stops holding 192 KiB of 256 KiB
    assert plain - limited > 24 * 192 * 0.75, (plain, limited)
