"""Package tier: what ships — the wheel the Dockerfile builds (installed into a fresh venv offline,
the way the image's runtime stage installs it) and the Helm chart (helm lint / helm template).

Needs `make tools` (helm) and `make wheelhouse` (the dependencies' wheels, fetched at install time);
nothing is downloaded here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchknee.devcluster.tools import tools_bin

ROOT = Path(__file__).resolve().parents[2]
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CHART = ROOT / "charts" / "batchknee"
KUBE_VERSION = "v1.36.3"  # the local control plane's; Chart.yaml's kubeVersion must admit it
NAMESPACE = "batchknee-system"
RELEASE = "rel"

Helm = Callable[..., subprocess.CompletedProcess[str]]
Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Run bin/helm on the chart: helm(subcommand, values=None, *extra, check=True)."""
    binary = tools_bin() / "helm"
    assert os.access(binary, os.X_OK), f"{binary} missing: run `make tools`"
    folder = tmp_path_factory.mktemp("values")
    counter = itertools.count()

    def run(
        command: str, values: dict[str, Any] | None = None, *extra: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(binary), command]
        if command == "template":
            argv += [RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
        elif command == "lint":
            argv += [str(CHART), "--strict", "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION]
        if values:
            path = folder / f"values-{next(counter)}.yaml"
            path.write_text(yaml.safe_dump(values))
            argv += ["--values", str(path)]
        argv += list(extra)
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(folder / "cache"),
            "HELM_CONFIG_HOME": str(folder / "config"),
            "HELM_DATA_HOME": str(folder / "data"),
        }
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {command} failed:\n{done.stdout}\n{done.stderr}")
        return done

    return run


@pytest.fixture(scope="session")
def render(helm: Helm) -> Render:
    """`helm template` with these values → the rendered objects."""

    def run(values: dict[str, Any] | None = None, *extra: str) -> list[dict[str, Any]]:
        return [doc for doc in yaml.safe_load_all(helm("template", values, *extra).stdout) if doc]

    return run


def kinds(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = kinds(objects, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects: {[o['metadata']['name'] for o in found]}"
    return found[0]
