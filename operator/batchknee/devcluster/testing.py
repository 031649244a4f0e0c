"""pytest fixtures for the local cluster. A test tier's conftest.py imports them:

    from batchknee.devcluster.testing import (  # noqa: F401
        cluster, cluster_runtimes, namespace, prometheus, pytest_terminal_summary,
        pytest_sessionfinish, pytest_testnodedown,  # the timings of each pytest-xdist worker's cluster
    )

and overrides `cluster_runtimes` to plug its engines into the test kubelet (and `cluster_options` for
other DevCluster arguments, e.g. {"audit": True}), e.g.

    @pytest.fixture(scope="session")
    def cluster_runtimes() -> dict[str, list[str]]:
        return {"vllm": [sys.executable, "-m", "batchknee.emulator", "vllm"]}

One cluster per test session (per conftest that imports these; per pytest-xdist worker).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from batchknee.devcluster import DevCluster, LocalPrometheus
from batchknee.devcluster.procs import wait_until

# Printed at the end of the session (import `pytest_terminal_summary` into the conftest too).
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def cluster_runtimes() -> dict[str, list[str]]:
    """command[0] → local argv prefix for the test kubelet. Override in a conftest."""
    return {}


@pytest.fixture(scope="session")
def cluster_options() -> dict[str, Any]:
    """Extra DevCluster keyword arguments (e.g. {"audit": True}). Override in a conftest."""
    return {}


@pytest.fixture(scope="session")
def cluster(cluster_runtimes: dict[str, list[str]], cluster_options: dict[str, Any]) -> Iterator[DevCluster]:
    """A real local control plane (etcd, kube-apiserver, controller-manager, scheduler, test kubelet)."""
    with DevCluster(runtimes=cluster_runtimes, **cluster_options) as dev:
        TIMINGS["local cluster start (s)"] = dev.start_seconds or 0.0
        yield dev


@pytest.fixture(scope="session")
def prometheus(cluster: DevCluster) -> Iterator[LocalPrometheus]:
    """Prometheus scraping the test kubelet's file_sd targets every second."""
    started = time.monotonic()
    with LocalPrometheus(cluster.file_sd_path, scrape_interval_s=1) as prom:
        TIMINGS["prometheus start (s)"] = time.monotonic() - started
        yield prom


@pytest.fixture
def namespace(cluster: DevCluster) -> Iterator[str]:
    """A fresh namespace per test (ready for pods: its `default` service account exists), deleted
    afterwards without waiting."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default service account in {name}",
        interval_s=0.1,
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# Under pytest-xdist each worker starts its own cluster: a worker hands its timings to the
# controller (`workeroutput`), which reports every cluster's.
WORKER_TIMINGS: list[dict[str, float]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)
    if output is not None and TIMINGS:
        output["devcluster_timings"] = dict(TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(pytest-xdist, on the controller) a worker ended: keep the timings it handed over."""
    timings = getattr(node, "workeroutput", {}).get("devcluster_timings")
    if timings:
        WORKER_TIMINGS.append(timings)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Report (not assert) how long each local cluster took to start."""
    clusters = [timings for timings in (TIMINGS, *WORKER_TIMINGS) if timings]
    for number, timings in enumerate(clusters, 1):
        title = "devcluster timings" + (f" (cluster {number})" if len(clusters) > 1 else "")
        terminalreporter.section(title)
        for what, seconds in timings.items():
            terminalreporter.write_line(f"{what}: {seconds:.1f}")
