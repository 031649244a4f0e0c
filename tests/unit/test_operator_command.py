"""`batchknee operator` without a cluster: help, configuration from the environment and flags."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.parse
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


@pytest.mark.parametrize(
    ("address", "port", "endpoint", "host"),
    [
        ("0.0.0.0", 8080, "http://0.0.0.0:8080/healthz", "0.0.0.0"),
        ("::", 8080, "http://[::]:8080/healthz", "::"),  # IPv6-only clusters (the chart's listenAddress)
        ("fd00::1", 9000, "http://[fd00::1]:9000/healthz", "fd00::1"),
        ("127.0.0.1", 0, None, None),  # off
    ],
)
def test_the_liveness_endpoint_kopf_is_given_names_the_address_it_binds(
    monkeypatch: pytest.MonkeyPatch, address: str, port: int, endpoint: str | None, host: str | None
) -> None:
    """kopf reads the host to bind with urlsplit: an IPv6 address must come in brackets (unbracketed,
    `http://:::8080/healthz` has no host and no port: kopf's liveness server failed to start)."""
    monkeypatch.setenv("BATCHKNEE_HEALTH_ADDRESS", address)
    monkeypatch.setenv("BATCHKNEE_HEALTH_PORT", str(port))
    monkeypatch.setenv("BATCHKNEE_METRICS_PORT", "8081")
    url = settings_from(build_parser().parse_args(["operator"])).liveness_endpoint()
    assert url == endpoint
    if url is not None:
        parts = urllib.parse.urlsplit(url)
        assert (parts.hostname, parts.port) == (host, port)


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
        # (was: accepted; every query failed with `InvalidURL`, or went to `…?x=1#f/api/v1/query`)
        ("BATCHKNEE_PROMETHEUS_URL", "http://prom:abc", ["prometheus_url", "port is not a number"]),
        (
            "BATCHKNEE_PROMETHEUS_URL",
            "http://u:s3cret@prom:99999",
            ["prometheus_url", "port is not a number"],
        ),
        ("BATCHKNEE_PROMETHEUS_URL", "http://prom 9090", ["prometheus_url", "holds whitespace"]),
        ("BATCHKNEE_PROMETHEUS_URL", "http://prom:9090/?x=1#f", ["prometheus_url", "a query or a fragment"]),
        ("BATCHKNEE_PROMETHEUS_ALLOWED_URLS", "http://prom:", ["prometheus_allowed_urls", "port"]),
        # (was: accepted; every reading too thin for ever, every query past its deadline at once)
        ("BATCHKNEE_PROMETHEUS_MIN_SAMPLES", "999999999999", ["prometheus_min_samples", "3600"]),
        ("BATCHKNEE_PROMETHEUS_TIMEOUT_SECONDS", "1e-300", ["prometheus_timeout_seconds", "0.1"]),
        # (was: accepted; every engine Deployment made with no image, its pods never starting)
        ("BATCHKNEE_VLLM_IMAGE", "", ["vllm_image", "not an image reference"]),
        ("BATCHKNEE_SGLANG_IMAGE", "not an image!", ["sglang_image", "not an image reference"]),
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
    assert "s3cret" not in err  # a URL's credentials are never shown
    for word in words:
        assert word in err, err


@pytest.fixture
def ca_bundle(tmp_path: Path) -> Path:
    from batchknee.devcluster.pki import ClusterPKI

    return ClusterPKI(tmp_path / "pki").ca.cert


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot be read (FileNotFoundError)"),
        (b"\n", "is empty"),
        (b"abc def\n", "holds whitespace"),  # a header of two words, or one the file split
        (b"abc\r\nX-Injected: 1", "holds whitespace"),
        (b"x" * (17 * 1024), "is over 16 KiB"),
    ],
)
def test_a_bearer_token_file_that_cannot_work_is_refused_at_start_never_shown(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    content: bytes | None,
    words: str,
) -> None:
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_bytes(content)
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE", str(token_file))
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prometheus_bearer_token_file" in err and words in err, err
    assert "abc" not in err and "Injected" not in err


@pytest.mark.parametrize(
    ("url", "ca", "words"),
    [
        ("https://prometheus:9090", b"not a certificate", "holds no PEM certificate"),
        ("https://prometheus:9090", None, "cannot be read (FileNotFoundError)"),
        ("http://user:s3cret@prometheus:9090", "bundle", "http://prometheus:9090 is not https"),
    ],
)
def test_a_ca_file_that_cannot_work_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    ca_bundle: Path,
    url: str,
    ca: bytes | str | None,
    words: str,
) -> None:
    ca_file = ca_bundle if ca == "bundle" else tmp_path / "ca.crt"
    if isinstance(ca, bytes):
        ca_file.write_bytes(ca)
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", url)
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_CA_FILE", str(ca_file))
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prometheus_ca_file" in err and words in err, err
    assert "s3cret" not in err


@pytest.mark.parametrize(
    ("url", "words"),
    [
        # the operator's ServiceAccount token may patch Deployments cluster-wide: never in clear text
        ("http://kube-prometheus-stack-prometheus.monitoring.svc:9090", "goes over HTTPS only"),
        # requests would send the URL's Basic credentials in place of the token
        ("https://reader:pw@thanos:9091", "a user and password too"),
    ],
)
def test_a_bearer_token_that_would_not_go_as_meant_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, url: str, words: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", url)
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE", str(token_file))
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "eyJ" not in err and ":pw" not in err, err
    assert "(BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE)" in err  # no flag to name: there is none


@pytest.mark.parametrize(
    ("url", "headers", "words"),
    [
        ("http://mimir:8080", "X-Scope-OrgID: s3cret-team", "not a JSON object of header names to values"),
        ("http://mimir:8080", '["s3cret-team"]', "not a JSON object of header names to values"),
        ("http://mimir:8080", "[" * 60_000 + "s3cret", "not a JSON object of header names to values"),
        (
            "http://mimir:8080",
            '{"X-Scope-OrgID": 7}',
            "header 'X-Scope-OrgID': give its value as a JSON string",
        ),
        ("http://mimir:8080", '{"X-Scope-OrgID": "s3cret\\r\\nX-Injected: 1"}', "control or non-ASCII"),
        ("http://mimir:8080", '{"X-Scope-OrgID": "s3cret\\u0000"}', "control or non-ASCII"),
        ("http://mimir:8080", '{"X-Scope-OrgID": "s3cret\\u007f"}', "control or non-ASCII"),
        ("http://mimir:8080", '{"X-Scope-OrgID": "s3cret-\\u00e9quipe"}', "control or non-ASCII"),
        ("http://mimir:8080", '{"X-Scope-OrgID": " s3cret"}', "starts or ends with whitespace"),
        ("http://mimir:8080", '{"X Scope": "s3cret"}', "header 1's name is not an HTTP header name"),
        ("http://mimir:8080", '{"Host": "s3cret.example"}', "header 'Host' frames the request"),
        ("http://mimir:8080", '{"x-scope-orgid": "a", "X-Scope-OrgID": "s3cret"}', "given twice"),
        # credentials in clear text to every hop, as a bearer token would be
        ("http://mimir:8080", '{"Authorization": "Basic s3cret"}', "goes over HTTPS only"),
        ("https://u:pw@mimir", '{"Authorization": "Basic s3cret"}', "a user and password too"),
    ],
)
def test_prometheus_headers_that_would_not_go_as_meant_are_refused_at_start_never_shown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], url: str, headers: str, words: str
) -> None:
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", url)
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_HEADERS", headers)
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "(BATCHKNEE_PROMETHEUS_HEADERS)" in err, err
    assert "s3cret" not in err and "Injected" not in err and ":pw" not in err


def test_prometheus_headers_and_a_bearer_token_both_setting_authorization_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", "https://mimir:8080")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_HEADERS", '{"authorization": "Basic s3cret"}')
    assert main(["operator"]) == 2
    err = capsys.readouterr().err
    assert "Authorization is the bearer token file's header too: give one of the two" in err, err
    assert "s3cret" not in err and "eyJ" not in err


def test_prometheus_headers_that_work_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", "http://mimir-query-frontend.mimir.svc:8080/prometheus")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_HEADERS", '{"X-Scope-OrgID": "team-a|team-b"}')
    settings = settings_from(build_parser().parse_args(["operator"]))
    assert settings.prometheus_headers == {"X-Scope-OrgID": "team-a|team-b"}
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_HEADERS", "")  # as the chart leaves it: none
    assert settings_from(build_parser().parse_args(["operator"])).prometheus_headers == {}


def test_the_kubelets_service_links_are_not_warned_of() -> None:
    """`helm install batchknee` makes a Service `batchknee-metrics`; where service links are on, the
    kubelet names its variables after it (the chart turns them off; other installs may not)."""
    from batchknee.settings import unknown_variables

    links = {
        "BATCHKNEE_METRICS_SERVICE_HOST": "10.0.0.1",
        "BATCHKNEE_METRICS_SERVICE_PORT": "8081",
        "BATCHKNEE_METRICS_SERVICE_PORT_METRICS": "8081",
        "BATCHKNEE_METRICS_PORT_8081_TCP": "tcp://10.0.0.1:8081",
        "BATCHKNEE_METRICS_PORT_8081_TCP_PROTO": "tcp",
        "BATCHKNEE_METRICS_PORT_8081_TCP_PORT": "8081",
        "BATCHKNEE_METRICS_PORT_8081_TCP_ADDR": "10.0.0.1",
        "BATCHKNEE_OTHER_PORT": "tcp://10.0.0.2:80",  # a bare _PORT beside its _SERVICE_HOST
        "BATCHKNEE_OTHER_SERVICE_HOST": "10.0.0.2",
    }
    assert unknown_variables(links) == []
    assert unknown_variables({"BATCHKNEE_HEALTHZ_PORT": "8080"}) == [
        ("BATCHKNEE_HEALTHZ_PORT", "BATCHKNEE_HEALTH_PORT")
    ]


def test_a_token_file_and_a_ca_that_work_are_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ca_bundle: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl\n")  # as a projected token ends: a newline
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_URL", "https://thanos-querier.openshift-monitoring.svc:9091")
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_BEARER_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("BATCHKNEE_PROMETHEUS_CA_FILE", str(ca_bundle))
    settings = settings_from(build_parser().parse_args(["operator"]))
    assert settings.prometheus_bearer_token_file == str(token_file)
    assert settings.prometheus_ca_file == str(ca_bundle)


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


@pytest.fixture
def stopped_at_the_cluster_check(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """`batchknee operator` up to its cluster check (which refuses), in an environment of no BATCHKNEE_*."""
    for name in list(os.environ):
        if name.upper().startswith("BATCHKNEE_"):
            monkeypatch.delenv(name)

    def no_cluster() -> None:
        raise UsageError("no cluster here")

    monkeypatch.setattr("batchknee.commands.operator.check_cluster_config", no_cluster)
    return monkeypatch


def test_a_misspelt_setting_is_one_warning_naming_the_setting_meant(
    stopped_at_the_cluster_check: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(Was: silently ignored, so the operator ran with the 5-second default.)"""
    stopped_at_the_cluster_check.setenv("BATCHKNEE_PROMETHEUS_TIMEOUT", "s3cret-77")
    with caplog.at_level("WARNING"):
        assert main(["operator"]) == 2
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == [
        "environment variable BATCHKNEE_PROMETHEUS_TIMEOUT is not an operator setting and is ignored; "
        "did you mean BATCHKNEE_PROMETHEUS_TIMEOUT_SECONDS?"
    ]
    # the value is never written: it may be a secret
    assert "s3cret" not in caplog.text and "s3cret" not in "".join(capsys.readouterr())


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("BATCHKNEE_TOOLS_BIN", "/opt/bin"),  # devcluster's, not the operator's
        ("BATCHKNEE_MAX_NUM_SEQS", "64"),  # the operator writes it into adopted workloads
        ("BATCHKNEE_PROMETHEUS_TIMEOUT_SECONDS", "7"),  # a setting
        ("batchknee_metrics_port", "9100"),  # a setting too (pydantic-settings reads any case)
        ("PROMETHEUS_TIMEOUT", "7"),  # not ours at all
    ],
)
def test_a_variable_something_reads_is_not_warned_of(
    stopped_at_the_cluster_check: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    variable: str,
    value: str,
) -> None:
    stopped_at_the_cluster_check.setenv("BATCHKNEE_FOO", "s3cret-77")  # the witness: warnings are on
    stopped_at_the_cluster_check.setenv(variable, value)
    with caplog.at_level("WARNING"):
        assert main(["operator"]) == 2
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == ["environment variable BATCHKNEE_FOO is not an operator setting and is ignored"]


def test_a_name_close_to_no_setting_is_warned_of_without_a_guess(
    stopped_at_the_cluster_check: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # (the shared prefix alone must not make every name look like some setting)
    stopped_at_the_cluster_check.setenv("BATCHKNEE_FOO", "1")
    with caplog.at_level("WARNING"):
        assert main(["operator"]) == 2
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == ["environment variable BATCHKNEE_FOO is not an operator setting and is ignored"]


def test_every_batchknee_variable_of_the_project_is_a_setting_or_known() -> None:
    """A BATCHKNEE_* variable added to the project's code must be a setting or in OTHER_VARIABLES:
    else the operator warns of it."""
    from batchknee.settings import unknown_variables

    root = Path(__file__).resolve().parents[2]
    paths = [root / name for name in ("Makefile", "Dockerfile", "README.md")]
    for folder in ("operator", "tests", "tools", "charts", ".ci", "docs", "crds", "examples"):
        paths += (root / folder).rglob("*")
    found: set[str] = set()
    for path in paths:
        parts = path.relative_to(root).parts
        if (
            not path.is_file()
            or parts[:2] == ("tests", "unit")  # tests here name misspelt ones
            or any(part == "__pycache__" or part.endswith(".egg-info") for part in parts)
        ):
            continue
        found |= set(re.findall(r"\bBATCHKNEE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="ignore")))
    assert "BATCHKNEE_TOOLS_BIN" in found and "BATCHKNEE_PROMETHEUS_URL" in found  # the scan sees them
    assert unknown_variables(dict.fromkeys(found, "")) == []


def test_the_readmes_settings_reference_is_every_setting_as_the_operator_reads_it() -> None:
    """The table is generated from the settings model: one row per variable the operator reads,
    and the README's copy is current (`make chart-docs` writes it)."""
    from settings_doc import replaced, table

    from batchknee.settings import setting_variables

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert replaced(readme) == readme, (
        "the README's operator settings reference is stale: run `make chart-docs`"
    )
    listed = set(re.findall(r"^\| `(BATCHKNEE_[A-Z0-9_]+)` \|", table(), re.MULTILINE))
    assert listed == setting_variables() and "BATCHKNEE_PROMETHEUS_CA_FILE" in listed


def test_the_default_engine_images_are_the_releases_the_contracts_are_pinned_to() -> None:
    import yaml

    from batchknee.engines import sglang, trtllm, vllm
    from batchknee.settings import OperatorSettings

    defaults = OperatorSettings.model_fields
    pinned = {"vllm": vllm.VERSION, "tensorrtLlm": trtllm.VERSION, "sglang": sglang.VERSION}
    values = Path(__file__).resolve().parents[2] / "charts/batchknee/values.yaml"
    chart = yaml.safe_load(values.read_text())["operator"]["engineImages"]
    images = {"vllm": "vllm_image", "tensorrtLlm": "trtllm_image", "sglang": "sglang_image"}
    for engine, field in images.items():
        default = defaults[field].default
        assert default.rsplit(":", 1)[1].removeprefix("v") == pinned[engine], default
        assert chart[engine] == default, f"charts/batchknee/values.yaml operator.engineImages.{engine}"


def test_a_flag_that_cannot_work_is_named_as_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """(was: `peering_priority: … (BATCHKNEE_PEERING_PRIORITY or its flag)` for --priority)"""
    assert main(["operator", "--priority", "99999999999"]) == 2
    err = capsys.readouterr().err
    assert "operator: error: --priority: " in err and "BATCHKNEE_" not in err, err
    assert main(["operator", "--metrics-port", "70000"]) == 2
    assert "error: --metrics-port: " in capsys.readouterr().err
