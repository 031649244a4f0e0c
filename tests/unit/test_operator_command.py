"""`batchknee operator` without a cluster: help, configuration from the environment and flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchknee.cli import build_parser, main
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
