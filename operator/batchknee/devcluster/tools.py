"""Where the control-plane binaries (built by `make tools`) and Prometheus live."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TOOLS_ENV = "BATCHKNEE_TOOLS_BIN"
PROMETHEUS_ENV = "BATCHKNEE_PROMETHEUS"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


class ToolsNotFoundError(RuntimeError):
    """A binary the local cluster needs is missing; the message says how to get it."""


def repo_root() -> Path:
    """The checkout this package runs from (operator/batchknee/devcluster/tools.py → repo)."""
    return Path(__file__).resolve().parents[3]


def tools_bin() -> Path:
    """The folder holding kube-apiserver, etcd, kubectl, helm …: $BATCHKNEE_TOOLS_BIN or <repo>/bin."""
    configured = os.environ.get(TOOLS_ENV)
    candidates = [Path(configured)] if configured else [repo_root() / "bin", Path.cwd() / "bin"]
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in COMPONENTS):
            return folder.resolve()
    where = " or ".join(str(c) for c in candidates)
    missing = [n for n in COMPONENTS if not os.access(candidates[0] / n, os.X_OK)]
    raise ToolsNotFoundError(
        f"the local control plane binaries are missing from {where} (missing: {', '.join(missing)}).\n"
        f"Run `make tools` in the batchknee checkout (it builds them once and caches them), "
        f"or set {TOOLS_ENV} to a folder holding {', '.join(COMPONENTS)}."
    )


def tool(name: str) -> Path:
    return tools_bin() / name


def prometheus_binary() -> Path:
    """Debian's prometheus (`make system-deps` installs it) or $BATCHKNEE_PROMETHEUS."""
    configured = os.environ.get(PROMETHEUS_ENV)
    found = configured or shutil.which("prometheus")
    if not found or not os.access(found, os.X_OK):
        raise ToolsNotFoundError(
            "prometheus is not installed. Run `make system-deps` (installs Debian's prometheus "
            f"package with apt-get) or set {PROMETHEUS_ENV} to a prometheus binary."
        )
    return Path(found)
