"""The metric contracts the tests compare against: the pinned vLLM and SGLang wheels (read with
`extract`), TensorRT-LLM's collector pinned by commit (a JSON of what it registers), and what the
emulator exports for each engine version it claims.

    python tests/contract/contracts.py vllm|sglang|trtllm   # print name, type, labels, source
"""

from __future__ import annotations

import functools
import io
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from extract import Contract, Metric, dataclass_fields, extract, family_name, wheel_sources
from wheels import PINNED, wheel_path

HERE = Path(__file__).parent

# vLLM's metric helper classes (spec decoding, perf, KV connectors) take `labelnames` as a parameter:
# the stat logger that builds them passes its own list.
VLLM_LOGGERS = "vllm/v1/metrics/loggers.py"
VLLM_PARAM_BINDINGS = {"labelnames": (VLLM_LOGGERS, "PrometheusStatLogger.__init__", "labelnames")}
# cache_config_info carries one label per CacheConfig field (CacheConfig.metrics_info() is
# `self.__dict__`), plus `engine`; its labels are read from the class, not the registration.
VLLM_CACHE_CONFIG = ("vllm/config/cache.py", "CacheConfig")
VLLM_CACHE_INFO = "vllm:cache_config_info"

# TensorRT-LLM's wheel is not on the package index (PyPI has a stub sdist only), so its collector
# is pinned by commit: see the file's "provenance".
TRTLLM_PINNED = HERE / "trtllm_collector_050f80d.json"


@functools.cache
def vllm_sources(version: str = PINNED["vllm"]) -> dict[str, str]:
    return wheel_sources(wheel_path("vllm", version), "vllm")


@functools.cache
def vllm_contract(version: str = PINNED["vllm"]) -> Contract:
    return extract(vllm_sources(version), param_bindings=VLLM_PARAM_BINDINGS)


@functools.cache
def vllm_cache_config_labels(version: str = PINNED["vllm"]) -> frozenset[str]:
    path, cls = VLLM_CACHE_CONFIG
    return frozenset(dataclass_fields(vllm_sources(version)[path], cls) | {"engine"})


@functools.cache
def sglang_sources(version: str = PINNED["sglang"]) -> dict[str, str]:
    return wheel_sources(wheel_path("sglang", version), "sglang")


# An environment variable a release reads: by os.environ / os.getenv / its own env helpers, or as a
# key of its environment table (vllm/envs.py's `environment_variables`).
_ENV_READ = re.compile(
    r"""(?:environ\.get|getenv|environ\[|environ\.setdefault|get_(?:int|bool|str)_env_var)\(?\s*["']([A-Z][A-Z0-9_]*)["']"""
)
_ENV_TABLE_KEY = re.compile(r"""^\s*["']([A-Z][A-Z0-9_]*)["']\s*:""", re.M)


def environment_variables_read(sources: dict[str, str]) -> dict[str, str]:
    """Every environment variable the release's code reads (name → the first file reading it)."""
    found: dict[str, str] = {}
    for path, text in sorted(sources.items()):
        names = [m.group(1) for m in _ENV_READ.finditer(text)]
        if path.endswith("/envs.py"):
            names += [m.group(1) for m in _ENV_TABLE_KEY.finditer(text)]
        for name in names:
            found.setdefault(name, path)
    return found


@functools.cache
def sglang_contract(version: str = PINNED["sglang"]) -> Contract:
    return extract(sglang_sources(version))


@functools.cache
def trtllm_contract() -> Contract:
    document = json.loads(TRTLLM_PINNED.read_text())
    where = "{repository}@{commit}:{path}".format(**document["provenance"])
    contract = Contract()
    for row in document["metrics"]:
        name = family_name(row["name"], row["type"])
        contract.add(Metric(name, row["type"], tuple(row["labels"]), where))
    return contract


def trtllm_provenance() -> dict[str, str]:
    provenance: dict[str, str] = json.loads(TRTLLM_PINNED.read_text())["provenance"]
    return provenance


# --- the emulator ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exported:
    type: str
    labels: frozenset[str]


def emulator_exposition(argv: Sequence[str]) -> dict[str, Exported]:
    """Family → type and label names, as `batchknee emulate ARGV` writes `/metrics` (the text
    format's `# TYPE` lines and the samples' labels; `le` is the histogram's own)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchknee.emulator.engine_args import parse_emulator_args
    from batchknee.emulator.server import EmulatorServer

    settings = parse_emulator_args(
        ["--host", "127.0.0.1", "--port", "0", "--startup-delay-s", "0", *argv], environ={}
    )
    server = EmulatorServer(settings, log=io.StringIO(), out=io.StringIO())
    text = generate_latest(server.registry).decode()
    exported: dict[str, Exported] = {}
    for family in text_string_to_metric_families(text):
        labels = frozenset(label for sample in family.samples for label in sample.labels) - {"le"}
        exported[family_name(family.name, family.type)] = Exported(family.type, labels)
    return exported


def main(argv: list[str]) -> int:
    contracts = {"vllm": vllm_contract, "sglang": sglang_contract, "trtllm": trtllm_contract}
    if len(argv) != 1 or argv[0] not in contracts:
        print(__doc__, file=sys.stderr)
        return 2
    contract = contracts[argv[0]]()
    for name in sorted(contract.metrics):
        for metric in contract.metrics[name]:
            print(f"{metric.type:10} {name:60} {','.join(metric.labels):50} {metric.source}")
    for line in contract.unresolved:
        print(f"unresolved {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
