"""Integration tier: a real local control plane (one per session) and a real Prometheus.

Fixtures `cluster`, `prometheus` and `namespace` come from batchknee.devcluster.testing; this tier
plugs tests/integration/fake_engine.py into the test kubelet as the runtime for command "fake-engine",
and tests/support/vllm_exporter.py (a vLLM-format exporter whose values a test sets) for "vllm", and
has the apiserver write an audit log of service accounts' requests (test_chart.py reads it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from batchknee.devcluster.testing import (
    cluster,
    namespace,
    prometheus,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
)

__all__ = [
    "cluster",
    "namespace",
    "prometheus",
    "pytest_sessionfinish",
    "pytest_terminal_summary",
    "pytest_testnodedown",
]

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")
VLLM_EXPORTER = Path(__file__).parents[1] / "support" / "vllm_exporter.py"


@pytest.fixture(scope="session")
def cluster_runtimes() -> dict[str, list[str]]:
    return {"fake-engine": [sys.executable, str(FAKE_ENGINE)], "vllm": [sys.executable, str(VLLM_EXPORTER)]}


@pytest.fixture(scope="session")
def cluster_options() -> dict[str, Any]:
    """The audit log of service-account requests: test_chart.py checks the chart's RBAC against the
    calls the operator really makes with the chart's ServiceAccount."""
    return {"audit": True}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
