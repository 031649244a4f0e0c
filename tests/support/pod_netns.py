"""Tests that need the run's own network namespace (batchknee.devcluster.netns) to mean anything:
skipped only when the run says so (BATCHKNEE_POD_NETNS=off), failed otherwise, so a machine that
cannot make one never passes them by skipping."""

from __future__ import annotations

import os

import pytest

from batchknee.devcluster import netns


def require_private_namespace(why: str) -> None:
    """Skip (the run turned the namespace off) or fail (it could not be made) for `why`."""
    if os.environ.get(netns.ENV) == "off":
        pytest.skip(f"{why} (${netns.ENV}=off)")
    pytest.fail(
        f"{why}: run it through `make test` on a machine where `unshare --net` works (as root, or with "
        f"user namespaces), or set {netns.ENV}=off to skip it"
    )
