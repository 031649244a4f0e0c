"""`python -m batchknee.devcluster.in_netns CMD`: CMD in a private network namespace of its own, with
10.0.0.0/8 local on `lo` there, or CMD as it is with a note why where none can be made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchknee.devcluster import netns

REPORT = "import os; print(os.readlink('/proc/self/ns/net'), os.environ.get('BATCHKNEE_POD_NETNS'))"


def in_netns(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchknee.devcluster.in_netns", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_the_command_runs_in_a_namespace_of_its_own_with_10_x_local_there() -> None:
    why = "this test run is already inside one" if netns.private() else netns.unavailable()
    if why is not None:
        pytest.skip(f"no private network namespace here: {why}")
    probe = (
        "import socket; s = socket.socket(); s.bind(('10.7.0.1', 0)); s.listen(); "
        "c = socket.create_connection(s.getsockname(), timeout=5); print('reached', c.getpeername()[0]); "
        + REPORT
    )
    run = in_netns(sys.executable, "-c", probe)
    assert run.returncode == 0, run.stderr
    reached, inside, marker = run.stdout.split()[-3:]
    assert reached == "10.7.0.1"
    assert inside == marker != netns.namespace_id()  # a new namespace, and marked as the run's own
    assert "pod network: a private network namespace" in run.stderr


def test_without_a_namespace_the_command_runs_as_it_is_and_says_why() -> None:
    run = in_netns(sys.executable, "-c", REPORT, env={netns.ENV: "off"})
    assert run.returncode == 0, run.stderr
    inside, marker = run.stdout.split()
    assert inside == netns.namespace_id() and marker == "off"
    assert (
        "pod network: loopback addresses, no private network namespace ($BATCHKNEE_POD_NETNS=off)"
        in run.stderr
    )


def test_the_exit_status_is_the_commands() -> None:
    assert in_netns(sys.executable, "-c", "raise SystemExit(7)").returncode == 7
    assert in_netns(sys.executable, "-c", "raise SystemExit(7)", env={netns.ENV: "off"}).returncode == 7
