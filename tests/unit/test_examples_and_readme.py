"""What people copy: the manifests under examples/ (production timings, valid against the API), the
demo's own manifests (package data, demo timings), and the README's pasted `batchknee plan` and
`batchknee simulate` outputs, which must be what the commands print today."""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import run

from batchknee.api.models import Engine, LLMServingSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DEMO_MANIFESTS = sorted(Path(str(resources.files("batchknee.demo") / "manifests")).glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_llmservings_with_production_timings(path: Path) -> None:
    [doc] = documents(path)
    assert doc["apiVersion"] == "batchknee.io/v1alpha1" and doc["kind"] == "LLMServing"
    spec = LLMServingSpec.model_validate(doc["spec"])
    assert spec.tuning.window_seconds == 300
    assert spec.tuning.cooldown_seconds == 600
    assert spec.tuning.max_rollouts_per_hour == 4


def test_examples_cover_every_engine() -> None:
    engines = {LLMServingSpec.model_validate(documents(p)[0]["spec"]).engine for p in EXAMPLES}
    assert engines == set(Engine)


@pytest.mark.parametrize("path", DEMO_MANIFESTS, ids=lambda p: p.name)
def test_the_demo_manifests_are_valid_and_demo_timed(path: Path) -> None:
    [doc] = documents(path)
    spec = LLMServingSpec.model_validate(doc["spec"])
    assert spec.tuning.window_seconds < 300  # the emulators run 20× faster than real time


def pasted_commands(readme: str, command: str) -> list[tuple[list[str], str]]:
    """Each indented `batchknee <command> …` line (with `\\` continuations) in the README and the
    fenced block that follows it: (argv, pasted output)."""
    found = []
    pattern = re.compile(
        rf"^    (batchknee {command} (?:[^\n]*\\\n)*[^\n]*)\n+```\n(.*?)```", re.MULTILINE | re.DOTALL
    )
    for match in pattern.finditer(readme):
        argv = shlex.split(match.group(1).replace("\\\n", " "))[1:]
        found.append((argv, match.group(2)))
    return found


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_the_readme_shows_what_the_command_prints(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    pasted = pasted_commands((ROOT / "README.md").read_text(), command)
    assert pasted, f"no `batchknee {command}` example with its output in the README"
    for argv, output in pasted:
        status, out, err = run(capsys, *argv)
        assert status == 0, err
        assert out.rstrip("\n").splitlines() == output.rstrip("\n").splitlines(), (
            f"README.md's `batchknee {' '.join(argv)}` output is stale: paste the command's output"
        )
