"""Pods on their own addresses in a network namespace the run creates: the real EndpointSlice
controller publishes them, and takes a pod out when its readiness drops on deletion."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pod_netns import require_private_namespace

from batchknee.devcluster import netns

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("netns_endpoints.py")


def test_in_a_private_namespace_the_services_endpointslices_follow_readiness(tmp_path: Path) -> None:
    why = netns.unavailable()
    if why is not None:
        require_private_namespace(f"no private network namespace here: {why}")
    out = tmp_path / "seen.json"
    run = subprocess.run(
        [sys.executable, "-m", "batchknee.devcluster.in_netns", sys.executable, str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["private"] and seen["podNetwork"] == "netns"
    ip = ipaddress.ip_address(seen["podIP"])
    assert ip in ipaddress.ip_network("10.0.0.0/8") and ip not in ipaddress.ip_network("10.96.0.0/16")
    assert seen["readyEndpoint"]["addresses"] == [seen["podIP"]]
    assert seen["readyEndpoint"]["targetRef"]["name"] == "engine"
    # readiness (and so the endpoint) dropped while the preStop hook was still running
    assert not seen["hookEndedBeforeNotReady"]
    [endpoint] = seen["afterDelete"]
    assert endpoint["conditions"]["ready"] is False and endpoint["conditions"]["terminating"] is True
    assert seen["gone"]


def test_the_namespaces_pod_network_is_refused_outside_it() -> None:
    """10.x pod addresses only inside the run's own namespace: never on the machine's network."""
    from batchknee.devcluster.kubelet import PodNetwork

    if netns.private():
        pytest.skip("this test run is itself inside a private namespace")
    with pytest.raises(RuntimeError, match="netns needs the run's own network namespace"):
        PodNetwork("netns")
