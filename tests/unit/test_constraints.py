"""constraints.txt pins every Python distribution the project installs (`make venv`, the wheelhouse and
the image's build stage install with -c): each requirement pyproject.toml names, in the base and in
every extra, has a pin its specifier accepts, and this environment (the one the tests run in) holds
exactly the pinned versions, so a green run vouches for the set the image ships."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from pinned import pins

ROOT = Path(__file__).resolve().parents[2]


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [text for texts in project["optional-dependencies"].values() for text in texts]
    return [Requirement(text) for text in [*project["dependencies"], *extras]]


def installed_version(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def test_every_requirement_is_pinned_at_a_version_its_specifier_accepts() -> None:
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {name}=={pinned[name]}, which pyproject.toml's {requirement} "
            "refuses: run `make lock`"
        )


def test_the_tests_run_with_exactly_the_pinned_versions() -> None:
    pinned = pins()
    assert {"kopf", "kubernetes", "pydantic", "prometheus-api-client", "setuptools"} <= pinned.keys()
    differing = {
        name: f"pinned {version}, installed {installed_version(name) or 'nothing'}"
        for name, version in pinned.items()
        if installed_version(name) != version
    }
    assert not differing, f"{differing}: `make venv` installs the pins (`make lock` re-pins)"
