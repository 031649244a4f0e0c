"""constraints.txt read as distribution name → pinned version (the set `make lock` resolved)."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"


def pins() -> dict[NormalizedName, Version]:
    found: dict[NormalizedName, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement = Requirement(line)
        [specifier] = requirement.specifier
        assert specifier.operator == "==" and not requirement.marker, f"an exact pin: {line}"
        name = canonicalize_name(requirement.name)
        assert name not in found, f"pinned twice: {name}"
        found[name] = Version(specifier.version)
    return found
