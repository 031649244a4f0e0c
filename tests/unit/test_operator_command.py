"""`batchknee operator` without a cluster: help, configuration from the environment and flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchknee.cli import build_parser, main
from batchknee.commands import UsageError
from batchknee.commands.operator import settings_from


def test_help_needs_no_cluster() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchknee", "operator", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "--prometheus-url" in done.stdout and "BATCHKNEE_" in done.stdout


def test_settings_come_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHKNEE_NAMESPACES", "ml, serving")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", "http://127.0.0.1:9091")
    monkeypatch.setenv("BATCHKNEE_METRICS_PORT", "9100")
    args = build_parser().parse_args(["operator", "--prometheus-url", "http://127.0.0.1:9999"])
    settings = settings_from(args)
    assert settings.namespaces == ["ml", "serving"]
    assert settings.prometheus_url == "http://127.0.0.1:9999"
    assert settings.metrics_port == 9100
    assert settings.metrics_address == "127.0.0.1"


def test_a_bad_setting_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHKNEE_METRICS_PORT", "lots")
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics_port" in err


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        # (was: accepted; every reading then failed with `InvalidURL` or `MissingSchema`)
        ("BATCHKNEE_PROMETHEUS_URL", "localhost:9090", ["prometheus_url", "http(s)://host"]),
        ("BATCHKNEE_PROMETHEUS_URL", "http://", ["prometheus_url", "http(s)://host"]),
        ("BATCHKNEE_PROMETHEUS_ALLOWED_URLS", "*,prom:9090", ["prometheus_allowed_urls", "entry 2"]),
        # (was: accepted; a query deadline of 1e10 s broke every reading, a cache of inf never refreshed)
        ("BATCHKNEE_PROMETHEUS_TIMEOUT_SECONDS", "1e10", ["prometheus_timeout_seconds", "300"]),
        ("BATCHKNEE_PROMETHEUS_CACHE_SECONDS", "inf", ["prometheus_cache_seconds", "300"]),
        # (was: `[]`, which watches every namespace: garbage widened the watch)
        ("BATCHKNEE_NAMESPACES", ",,,", ["namespaces", "names no namespace"]),
        ("BATCHKNEE_NAMESPACES", "ml,Bad_NS!", ["namespaces", "'Bad_NS!' is not a namespace name"]),
        ("BATCHKNEE_PEERING_NAME", "", ["peering_name", "not an object name"]),
        ("BATCHKNEE_METRICS_ADDRESS", "999.1.1.1", ["metrics_address", "neither an IP address nor a host"]),
        ("BATCHKNEE_METRICS_PORT", "8080", ["health_port", "8080 is the metrics port too"]),
        ("BATCHKNEE_PEERING_PRIORITY", "99999999999999999999999", ["peering_priority"]),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    words: list[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Value error" not in err, err
    for word in words:
        assert word in err, err


def test_namespace_flags_may_carry_commas_as_the_environment_does() -> None:
    args = build_parser().parse_args(["operator", "--namespace", "ml,serving", "--namespace", "batch"])
    assert settings_from(args).namespaces == ["ml", "serving", "batch"]


@pytest.mark.parametrize(
    ("metrics", "health", "refused"),
    [("127.0.0.1", "127.0.0.1", True), ("0.0.0.0", "127.0.0.1", True), ("10.0.0.5", "127.0.0.1", False)],
)
def test_one_port_for_both_endpoints_is_refused_where_the_addresses_overlap(
    monkeypatch: pytest.MonkeyPatch, metrics: str, health: str, refused: bool
) -> None:
    for variable, value in (
        ("METRICS_ADDRESS", metrics),
        ("HEALTH_ADDRESS", health),
        ("METRICS_PORT", "8080"),
    ):
        monkeypatch.setenv(f"BATCHKNEE_{variable}", value)
    args = build_parser().parse_args(["operator"])
    if refused:
        with pytest.raises(UsageError, match="8080 is the metrics port too"):
            settings_from(args)
    else:
        assert settings_from(args).health_port == 8080


@pytest.mark.parametrize("kubeconfig", ["apiVersion: v1\nclusters: [\n", "just text"])
def test_a_kubeconfig_that_does_not_load_is_one_line(tmp_path: Path, kubeconfig: str) -> None:
    """(Was: a YAML parser's or a TypeError's traceback.)"""
    path = tmp_path / "config"
    path.write_text(kubeconfig)
    done = subprocess.run(
        [sys.executable, "-m", "batchknee", "operator"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
            "KUBECONFIG": str(path),
        },
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("batchknee operator: error: the kubeconfig does not load")
